"""`blink serve` (a child process, uvloop, the emulated device with a paced stand-in model: a step
every ~5 ms) as an operator stops it and as clients leave it: SIGINT stops accepting, lets requests
in flight finish within --shutdown-timeout, ends the rest with an error event and exits; a second
signal ends them at once; clients that go away mid-stream are one INFO line each, no traceback."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import pytest

from blink.testing import ServeProcess

ARGS = [
    "--device",
    "emulated",
    "--model",
    "random:tiny-llama",
    "--device-executor",
    "bench.serving.paced_executor:h200_llama3_8b",
    "--n-slots",
    "8",
]


class Stream:
    """One streamed completion read in a thread: its SSE data lines and when it ended."""

    def __init__(self, url: str, max_tokens: int):
        u = urlparse(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": max_tokens, "stream": True}
        self.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.events: list[str] = []
        self.ended: float | None = None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while line := self.resp.readline():
                if line.startswith(b"data: "):
                    self.events.append(line[6:].decode().strip())
                    self.first.set()
        except (OSError, ValueError, AttributeError):  # the test closed this client's socket under it
            pass
        self.ended = time.monotonic()
        self.first.set()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"

    @property
    def finish(self) -> str | None:
        for e in reversed(self.events):
            if e != "[DONE]":
                js = json.loads(e)
                return "error" if "error" in js else js["choices"][0]["finish_reason"]
        return None


def _wait_log(s: ServeProcess, text: str, timeout: float = 10) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        hits = [ln for ln in s.log if text in ln]
        if hits:
            return hits[0]
        time.sleep(0.05)
    raise AssertionError(f"no log line with {text!r}:\n{''.join(s.log[-20:])}")


def test_disconnects_are_info_lines_then_sigint_drains_and_aborts(tmp_path):
    with ServeProcess([*ARGS, "--shutdown-timeout", "1.5"], timeout=120, log_path=str(tmp_path / "log")) as s:
        u = urlparse(s.url)
        # 20 clients that go away mid-stream, half of them hard (RST), half with a FIN
        for i in range(20):
            st = Stream(s.url, 500)
            assert st.first.wait(30)
            sock = st.conn.sock
            if i % 2:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            sock.close()
            st.conn.close()
        t_end = time.monotonic() + 20  # each handler logs its line once it has seen its client go
        while len(gone := [ln for ln in s.log if " disconnected:" in ln]) < 20 and time.monotonic() < t_end:
            time.sleep(0.05)
        assert len(gone) == 20 and all(ln.startswith("INFO") for ln in gone)

        short, long_ = Stream(s.url, 40), Stream(s.url, 900)  # ~0.2 s and ~5 s of steps
        assert short.first.wait(30) and long_.first.wait(30)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        line = _wait_log(s, "shutting down:")
        assert "2 request(s) in flight" in line and "1.5 s" in line
        time.sleep(0.3)
        with pytest.raises(OSError):  # no longer accepting
            socket.create_connection((u.hostname, u.port), timeout=2).close()
        short.join(10)
        long_.join(10)
        assert short.finish == "length"  # finished within the drain
        assert long_.finish == "error" and "shutting down" in long_.events[-2] and long_.events[-1] == "[DONE]"
        assert 1.4 < long_.ended - t0 < 4, long_.ended - t0
        assert s.proc.wait(20) == 0
    log = "".join(s.log)
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    assert "ending 1 request(s) still in flight" in log


def test_second_signal_ends_requests_at_once():
    with ServeProcess([*ARGS, "--shutdown-timeout", "60"], timeout=120) as s:
        st = Stream(s.url, 900)
        assert st.first.wait(30)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        _wait_log(s, "shutting down:")
        time.sleep(0.3)
        assert st.ended is None  # still draining: 60 s allowed
        s.proc.send_signal(signal.SIGINT)
        st.join(10)
        assert st.finish == "error" and st.ended - t0 < 3
        assert s.proc.wait(20) == 0 and time.monotonic() - t0 < 15
