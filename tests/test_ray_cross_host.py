"""`blink deploy` on a two-node Ray cluster whose nodes are two "hosts" (tests/netns.py): the head,
with the GPU actor, in one network + mount namespace; the `dpu` node in another, with its own
/dev/shm and its own address, joined by a veth pair. The frontend is placed on the `dpu` node, where
the ring's file does not exist, so it must reach the ring over TCP through the GPU actor's ring agent.
The driver runs on the GPU host; HTTP clients run on both hosts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Host, available, link

pytest.importorskip("ray")
pytestmark = [
    pytest.mark.skipif(not available(), reason="needs root (network and mount namespaces)"),
    pytest.mark.timeout(400),
]
RAY = str(Path(sys.executable).with_name("ray"))
CLIENT = str(Path(__file__).with_name("crosshost_client.py"))
NS = f"blink-xhost-{os.getpid()}"
PORT = 8123  # the frontend's HTTP port on the dpu host (its own network namespace: no clash)


def _env() -> dict[str, str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")) if p
    )
    return env


def _kill_sessions(sids: set[int]) -> None:
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        out = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True).stdout
        pids = [int(p) for p, s in (ln.split() for ln in out.splitlines()) if int(s) in sids]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass  # exited between ps and kill
        time.sleep(grace if pids else 0)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Host, Host, str]]:
    gpu, dpu = Host("gpu"), Host("dpu")
    tmp = tempfile.mkdtemp(prefix="rayx", dir="/tmp")
    sids: set[int] = set()
    try:
        link(gpu, dpu)
        address = f"{gpu.address}:6390"
        common = ["--disable-usage-stats", "--object-store-memory=100000000"]
        head = gpu.popen(
            [RAY, "start", "--head", "--port=6390", f"--node-ip-address={gpu.address}", "--num-cpus=4"]
            + ["--num-gpus=1", "--include-dashboard=false", f"--temp-dir={tmp}/a", *common],
            env=_env(),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        sids.add(head.pid)
        out = head.communicate(timeout=120)[0].decode()
        assert head.returncode == 0, out
        worker = dpu.popen(
            [RAY, "start", f"--address={address}", f"--node-ip-address={dpu.address}", "--num-cpus=2"]
            + ['--resources={"dpu": 2}', f"--temp-dir={tmp}/b", *common],
            env=_env(),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        sids.add(worker.pid)
        out = worker.communicate(timeout=120)[0].decode()
        assert worker.returncode == 0, out
        yield gpu, dpu, address
    finally:
        _kill_sessions(sids)
        dpu.close()
        gpu.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _blink(host: Host, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        host.cmd([sys.executable, "-m", "blink.cli", *args]),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_frontend_on_the_dpu_host_reaches_the_ring_over_tcp(cluster, tmp_path: Path) -> None:
    gpu, dpu, address = cluster
    conf = tmp_path / "blink.toml"
    conf.write_text(
        f"""
[deploy]
ray_auth = "off"  # this test's cluster runs without Ray's token authentication (test_ray_cluster checks it)
name = "xh"
namespace = "{NS}"
replicas = 1
dpu = "require"
[device]
kind = "auto"  # the head reports a (logical) GPU: the GPU bundle goes there; no real one: emulated
num_kv_blocks = 256
max_batch = 8
[model]
spec = "random:tiny-llama"
[ring]
n_slots = 8
prompt_arena_tokens = 8192
output_capacity = 64
[server]
host = "0.0.0.0"
port = {PORT}
heartbeat_timeout_s = 5.0
"""
    )
    r = _blink(gpu, "deploy", "--config", str(conf), "--address", address)
    assert r.returncode == 0, r.stdout + r.stderr
    url = f"http://{dpu.address}:{PORT}"
    assert url in r.stdout, r.stdout
    try:
        for host in (dpu, gpu):  # a client on the frontend's host, and one across the link
            out = subprocess.run(
                host.cmd([sys.executable, CLIENT, "complete", url, "12", "tiny-llama"]),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["usage"]["completion_tokens"] == 12
        st = json.loads(_blink(gpu, "status", "--config", str(conf), "--address", address, "--json").stdout)
        fe = st["frontend"]
        assert fe["state"] == "SERVING" and fe["node_ip"] == dpu.address
        assert st["replicas"][0]["state"] == "READY"
        (route,) = fe["replicas"]
        assert route["up"] and route["link"].startswith("tcp: "), route
        assert f"ring agent at {gpu.address}:" in route["link"]
        # the ring exists on the GPU host only (ring names carry the namespace)
        gpu_rings = [f for f in gpu.run(["ls", "/dev/shm"]).stdout.split() if NS in f]
        dpu_rings = [f for f in dpu.run(["ls", "/dev/shm"]).stdout.split() if NS in f]
        assert len(gpu_rings) == 1 and dpu_rings == [], (gpu_rings, dpu_rings)
        with open(f"/proc/{fe['pid']}/maps") as m:
            assert not [ln for ln in m if gpu_rings[0] in ln]
    finally:
        r = _blink(gpu, "stop", "--config", str(conf), "--address", address)
        assert r.returncode == 0, r.stdout + r.stderr
