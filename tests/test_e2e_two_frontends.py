"""README's two-host example, end to end: `blink serve --ring-listen` (device, ring, agent and a
frontend) serves a stream; while it is in flight a second `blink serve --ring-address` attaches
through the agent. The stream must end as it would have alone (every token, finish "length"):
the second frontend gets a partition of the slots of its own and never touches the first one's.
A frontend without the secret, or with another one, is refused and cancels nothing."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket

import pytest

from blink.protocol import agent_auth
from blink.protocol.layout import SlotState
from blink.protocol.transport import ShmTransport
from blink.testing import ServeProcess, child_pids

# the stream is held in flight by pausing the device (SIGSTOP) while the second frontend attaches
TINY = ["--device", "emulated", "--model", "random:tiny-llama", "--num-kv-blocks", "256", "--n-slots", "8"]
TOKENS = 1000  # tiny-llama's context is 1024


def _stream(url: str, model: str, tokens: int = TOKENS) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A stream whose reader takes its time: a small receive buffer, so that the server's writes
    (and then, through the ring's backpressure, the device) wait for the test to read."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.sock = socket.socket()
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.sock.settimeout(60)
    conn.sock.connect((host, int(port)))
    body = {
        "model": model,
        "prompt": "hello",
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _rest(resp: http.client.HTTPResponse) -> tuple[str | None, int]:
    finish, usage = None, 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for ch in chunk.get("choices") or []:
            finish = ch.get("finish_reason") or finish
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
    return finish, usage


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def test_a_second_frontend_attaching_leaves_the_first_ones_stream_alone(tmp_path):
    key = str(tmp_path / "ring.secret")
    held: list[http.client.HTTPConnection] = []
    stopped = False
    gpu = ServeProcess([*TINY, "--ring-listen", "127.0.0.1:0", "--ring-secret-file", key], timeout=180)
    try:
        assert os.stat(key).st_mode & 0o777 == 0o600  # made by the GPU host, readable by its owner only
        (device,) = [p for p in child_pids(gpu.proc.pid) if b"ring_agent" not in _cmdline(p)]
        conn, resp = _stream(gpu.url, gpu.model)
        held.append(conn)
        assert resp.readline()  # the stream runs
        os.kill(device, signal.SIGSTOP)  # and stays in flight (well within the heartbeat timeout)
        stopped = True
        wrong = tmp_path / "wrong.secret"
        agent_auth.ensure_secret_file(str(wrong))
        with pytest.raises(RuntimeError, match="does not hold this frontend's secret"):
            ServeProcess([*TINY, "--ring-address", gpu.agent, "--ring-secret-file", str(wrong)], timeout=60)
        # over tcp, so its requests pass the agent's checks (on this host `auto` would map the ring)
        fe = ServeProcess(
            [*TINY, "--ring-address", gpu.agent, "--ring-secret-file", key, "--transport", "tcp"], timeout=180
        )
        try:
            assert any("partition 1 of 2" in ln for ln in fe.log), "".join(fe.log)
            assert any("ring transport tcp" in ln for ln in fe.log), "".join(fe.log)
            ring = ShmTransport.open(gpu.ring)
            assert (ring.view().slots["state"] != SlotState.EMPTY).any()  # the stream was in flight meanwhile
            ring.close()
            os.kill(device, signal.SIGCONT)
            stopped = False
            finish, n = _rest(resp)
            assert (finish, n) == ("length", TOKENS), "".join(gpu.log[-20:])
            conn.close()
            conn, resp = _stream(fe.url, fe.model, 20)  # and the second frontend serves too
            held.append(conn)
            assert _rest(resp) == ("length", 20)
            conn.close()
        finally:
            for c in held:
                c.close()
            assert fe.stop() == 0
    finally:
        if stopped:
            os.kill(device, signal.SIGCONT)
        for c in held:
            c.close()
        assert gpu.stop() == 0
