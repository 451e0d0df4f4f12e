"""The frontend on another host, for real: two network + mount namespaces (tests/netns.py) joined by
a veth pair. The GPU host holds the ring in its own /dev/shm, the device and the ring agent; the DPU
host runs `blink serve --ring-address` (transport auto) and its HTTP clients. Nothing is shared but
the link, so the frontend can only work over TCP, and killing the agent or the link must end the
requests in flight with an error event and turn /health to 503, without hanging; once the link is
back the frontend connects again by itself."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Host, available, link, set_link

pytestmark = [
    pytest.mark.skipif(not available(), reason="needs root (network and mount namespaces)"),
    pytest.mark.timeout(300),
]
CLIENT = str(Path(__file__).with_name("crosshost_client.py"))
TINY = ["--device", "emulated", "--model", "random:tiny-llama", "--num-kv-blocks", "256", "--n-slots", "8"]
# SmolLM2 on the emulated device: slow enough (tens of ms a token here) that a stream is still
# running when the link or the agent goes away
SMOL = ["--device", "emulated", "--model", "default", "--num-kv-blocks", "600", "--n-slots", "4", "--max-batch", "4"]


class Proc:
    """A process in a host; its stderr lines collected, a line matching `ready` awaited."""

    def __init__(self, host: Host, argv: list[str], ready: str, timeout: float = 120.0):
        self.p = host.python(*argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.log: list[str] = []
        self.match: re.Match | None = None
        got = threading.Event()

        def drain() -> None:
            for line in self.p.stderr:
                self.log.append(line)
                if self.match is None and (m := re.search(ready, line)):
                    self.match = m
                    got.set()
            got.set()

        threading.Thread(target=drain, daemon=True).start()
        if not got.wait(timeout) or self.match is None:
            self.stop()
            raise RuntimeError("did not start:\n" + "".join(self.log))

    def stop(self) -> int:
        self.p.terminate()
        try:
            return self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()


@pytest.fixture
def hosts(tmp_path) -> Iterator[tuple[Host, Host]]:
    gpu, dpu = Host("gpu"), Host("dpu")
    gpu.secret_file = dpu.secret_file = str(tmp_path / "ring.secret")  # made by the GPU host, copied by hand in life
    try:
        link(gpu, dpu)
        yield gpu, dpu
    finally:
        dpu.close()
        gpu.close()


def _start(gpu: Host, dpu: Host, model: list[str] = TINY) -> tuple[Proc, Proc, str]:
    model = [*model, "--ring-secret-file", gpu.secret_file]
    g = Proc(gpu, ["-m", "blink.cli", "serve", *model, "--port", "0", "--ring-listen", f"{gpu.address}:0"],
             r"ring agent for /dev/shm/(\S+) listening on (\S+)")  # fmt: skip
    try:
        f = Proc(dpu, ["-m", "blink.cli", "serve", *model, "--port", "0", "--ring-address", g.match.group(2)],
                 r"serving \S+ on (http://\S+)/v1")  # fmt: skip
    except BaseException:
        g.stop()
        raise
    return g, f, f.match.group(1)


def _client(dpu: Host, *args: str, timeout: float = 60) -> str:
    r = subprocess.run(dpu.cmd([sys.executable, CLIENT, *args]), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _stream_until_cut(dpu: Host, url: str, cut) -> tuple[list, float]:
    """Start a long stream in the DPU host, call `cut()` after its first tokens, return every event
    and how long the stream took to end after the cut."""
    p = subprocess.Popen(
        dpu.cmd([sys.executable, CLIENT, "stream", url, "8000", "SmolLM2-135M-Instruct"]),
        stdout=subprocess.PIPE,
        text=True,
    )
    events = []
    t_cut = None
    for line in p.stdout:
        events.append(line.strip() if line.strip() == "[DONE]" else json.loads(line))
        if len(events) == 3:
            cut()
            t_cut = time.monotonic()
    assert p.wait(30) == 0
    return events, time.monotonic() - t_cut


def test_frontend_on_another_host_serves_over_tcp(hosts):
    gpu, dpu = hosts
    g, f, url = _start(gpu, dpu)
    try:
        assert any("ring transport tcp" in ln and "auto: the GPU host has no RDMA device" in ln for ln in f.log)
        out = json.loads(_client(dpu, "complete", url, "16", "tiny-llama"))
        assert out["usage"]["completion_tokens"] == 16
        assert _client(dpu, "health", url).strip() == "200"
        ring = g.match.group(1)
        assert gpu.run(["ls", "/dev/shm"]).stdout.split() == [ring]  # the ring lives on the GPU host only
        assert dpu.run(["ls", "/dev/shm"]).stdout.split() == []
        with open(f"/proc/{f.p.pid}/maps") as m:
            assert not [ln for ln in m if "/dev/shm" in ln]
    finally:
        assert f.stop() == 0
        assert g.stop() == 0


def test_cutting_the_link_ends_the_stream_with_an_error_and_health_503(hosts):
    gpu, dpu = hosts
    g, f, url = _start(gpu, dpu, SMOL)
    try:
        events, took = _stream_until_cut(dpu, url, lambda: set_link(gpu, up=False))
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert "unreachable" in err["message"] and err["type"] == "server_error"
        assert took < 15  # the transport's 5 s deadline, not TCP's minutes of retransmission
        assert _client(dpu, "health", url).strip() == "503"
        # the link comes back: the frontend connects again by itself and serves
        set_link(gpu, up=True)
        t_end = time.monotonic() + 30
        while _client(dpu, "health", url).strip() != "200":
            assert time.monotonic() < t_end, "".join(f.log[-20:])
            time.sleep(0.5)
        out = json.loads(_client(dpu, "complete", url, "5", "SmolLM2-135M-Instruct"))
        assert out["usage"]["completion_tokens"] == 5
        # logged once the old link is closed, which may come after the new one serves
        t_end = time.monotonic() + 30
        while not any("ring reachable again" in ln for ln in f.log):
            assert time.monotonic() < t_end, "".join(f.log[-20:])
            time.sleep(0.1)
    finally:
        set_link(gpu, up=True)
        f.stop()
        g.stop()


def test_killing_the_ring_agent_ends_the_stream_with_an_error_and_health_503(hosts):
    gpu, dpu = hosts
    g, f, url = _start(gpu, dpu, SMOL)
    try:
        agents = [int(c) for c in open(f"/proc/{g.p.pid}/task/{g.p.pid}/children").read().split()]

        def kill_agent() -> None:
            for pid in agents:
                cmd = open(f"/proc/{pid}/cmdline").read()
                if "blink.protocol.ring_agent" in cmd:
                    subprocess.run(["kill", "-9", str(pid)], check=True)

        events, took = _stream_until_cut(dpu, url, kill_agent)
        assert events[-1] == "[DONE]" and "unreachable" in events[-2]["error"]["message"]
        assert took < 5
        assert _client(dpu, "health", url).strip() == "503"
    finally:
        f.stop()
        g.stop()
