"""Choosing the frontend's transport (ring.transport): auto picks shm for the ring's own file on
this host, tcp otherwise (no RDMA device here); an explicit choice that cannot work is a clear error."""

from __future__ import annotations

import os

import pytest

from blink.config import BlinkConfig, ConfigError
from blink.dpu import ring_link
from blink.dpu.ring_link import RingLinkError, maps_ring_file, open_link
from blink.protocol.agent_auth import new_secret
from blink.protocol.ring_agent import start_agent_process
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import ShmTransport

SECRET = new_secret()


@pytest.fixture
def agent():
    name = f"blink-test-link-{os.getpid()}"
    ring = ShmTransport.create(name, RingGeometry(4, 256, 16))
    proc, addr = start_agent_process(name, secret=SECRET)
    yield name, addr
    proc.terminate()
    proc.wait(10)
    ring.close()
    ring.unlink()


def test_auto_maps_the_rings_own_file_on_its_host(agent):
    name, addr = agent
    link = open_link(None, addr, "auto", secret=SECRET)
    assert link.kind == "shm" and "the same file" in link.why
    assert maps_ring_file(os.getpid(), name)
    link.transport.close()


def test_auto_takes_tcp_when_the_file_is_not_the_agents(agent, monkeypatch):
    name, addr = agent
    monkeypatch.setattr(ring_link, "file_id", lambda path: "0:0")  # another /dev/shm (see test_e2e_openai)
    link = open_link(None, addr, "auto", secret=SECRET)
    assert link.kind == "tcp" and "auto: the GPU host has no RDMA device" in link.why
    assert link.transport.load_u64(0) == ShmTransport.open(name).load_u64(0)
    link.transport.close()
    with pytest.raises(RingLinkError, match="not this host's"):
        open_link(None, addr, "shm", secret=SECRET)


def test_explicit_choices(agent):
    name, addr = agent
    link = open_link(None, addr, "tcp", secret=SECRET)
    assert link.kind == "tcp" and "asked for" in link.why
    link.transport.close()
    with pytest.raises(RingLinkError, match="rdma: .*(python3-pyverbs|no RDMA device)"):
        open_link(None, addr, "rdma", secret=SECRET)
    with pytest.raises(RingLinkError, match="needs a ring agent"):
        open_link(name, None, "tcp")
    assert open_link(name, None, "auto").kind == "shm"
    with pytest.raises(RingLinkError, match="cannot reach the ring agent"):
        open_link(None, "127.0.0.1:1", "auto", secret=SECRET)


def test_ring_transport_config():
    c = BlinkConfig().replace(ring={"transport": "tcp", "listen": "0.0.0.0:0"})
    assert c.ring.transport == "tcp" and c.ring.listen == "0.0.0.0:0"
    for bad in (
        {"transport": "udp"},
        {"address": "nohost"},
        {"address": "h:0"},
        {"listen": "h:99999"},
        {"address": "h:1", "listen": "h:2"},
    ):
        with pytest.raises(ConfigError, match="ring\\."):
            BlinkConfig().replace(ring=bad)


def test_serve_with_rdma_and_no_device_is_a_clear_error():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "blink.cli", "serve", "--device", "emulated", "--model", "random:tiny-llama"]
    r = subprocess.run([*cmd, "--port", "0", "--transport", "rdma"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "ring.transport = rdma" in r.stderr and ("python3-pyverbs" in r.stderr or "no RDMA device" in r.stderr)
    assert "Traceback" not in r.stderr
