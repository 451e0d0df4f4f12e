"""`blink deploy | status | stop` against a two-node Ray cluster started on this machine.

The head node reports 2 (logical) GPUs and the config asks for one replica per GPU, so the plan
makes 2 GPU actors, each in a GPU bundle on the head; `device.kind = auto` then falls back to the
emulated device inside the actor (no usable GPU here). The second node carries the custom `dpu`
resource, so the frontend must land on it. Both nodes share this machine's /dev/shm, which the
shared-memory rings need. The nodes are started with `ray start` as process groups of their own
and torn down by killing exactly those processes (never `ray stop`, which would stop every Ray
cluster on the machine).

The first cluster runs without Ray's token authentication (RAY_AUTH_MODE=disabled): `blink deploy`
refuses it unless the config says deploy.ray_auth = "off". The second runs as cluster.yaml starts
one: RAY_AUTH_MODE=token on every node with one shared token file (here in the cluster's own temp
dir, RAY_AUTH_TOKEN_PATH, not ~/.ray): `blink deploy` with the token deploys and serves; a driver
without it, or with another token, is refused and can run nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
NS = f"blink-cluster-test-{os.getpid()}"  # ring names include it: concurrent runs on one host stay apart


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The ports `ray start` gives its other components when no flag names them: the dashboard, its
# agent's HTTP server and the workers' range. A head --port equal to one of them is refused
# ("trying to use a port number ... that is used by other components").
RAY_DEFAULT_PORTS = frozenset({8265, 52365, *range(10002, 20000)})


def _head_port() -> int:
    """A free port that Ray accepts as the head's --port."""
    while (port := _free_port()) in RAY_DEFAULT_PORTS:
        pass
    return port


def _env(token_path: str | None = None) -> dict[str, str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_AUTH_TOKEN", None)
    if token_path is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _session_pids(sids: set[int]) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True, check=True).stdout
    return [int(p) for p, s in (line.split() for line in out.splitlines()) if int(s) in sids]


def _kill_sessions(sids: set[int]) -> None:
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        for pid in _session_pids(sids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass  # exited between ps and kill
        t_end = time.monotonic() + grace
        while time.monotonic() < t_end and _session_pids(sids):
            time.sleep(0.1)


def _start_cluster(tmp: str, env: dict[str, str]) -> tuple[str, set[int]]:
    """A head (2 logical GPUs) and a `dpu` node; returns (address, their session ids)."""
    port = _head_port()
    address = f"127.0.0.1:{port}"
    common = ["--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    sids: set[int] = set()
    for argv in (
        ["--head", f"--port={port}", "--num-cpus=4", "--num-gpus=2", f"--temp-dir={tmp}", "--include-dashboard=false"],
        [f"--address={address}", "--num-cpus=2", '--resources={"dpu": 2}'],
    ):
        p = subprocess.Popen(
            [RAY, "start", *argv, *common],
            env=env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        sids.add(p.pid)
        out = p.communicate(timeout=60)[0].decode()
        if p.returncode != 0:
            _kill_sessions(sids)
            raise RuntimeError(out)
    return address, sids


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    tmp = tempfile.mkdtemp(prefix="rayc", dir="/tmp")
    try:
        address, sids = _start_cluster(tmp, _env())
        try:
            yield address
        finally:
            _kill_sessions(sids)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture  # one test uses it: gone before the next cluster starts (two clusters overload a small box)
def token_cluster() -> Iterator[tuple[str, str]]:
    """A two-node cluster with Ray's token authentication; yields (address, token file)."""
    tmp = tempfile.mkdtemp(prefix="rayt", dir="/tmp")
    token = os.path.join(tmp, "auth_token")
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    try:
        address, sids = _start_cluster(tmp, _env(token))
        try:
            yield address, token
        finally:
            _kill_sessions(sids)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _blink(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "blink.cli", *args],
        env=env or _env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _toml(name: str, port: int, extra: str = "") -> str:
    return f"""
[deploy]
name = "{name}"
namespace = "{NS}"
replicas = 0  # one per GPU: the head reports 2
{extra}
[device]
kind = "auto"
num_kv_blocks = 256
max_batch = 8
[model]
spec = "random:tiny-llama"
[ring]
n_slots = 8
prompt_arena_tokens = 8192
output_capacity = 64
[server]
port = {port}
heartbeat_timeout_s = 2.0
"""


def _complete(url: str) -> int:
    body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["usage"]["completion_tokens"]


def test_deploy_needs_ray_token_authentication(token_cluster: tuple[str, str], tmp_path: Path) -> None:
    address, token = token_cluster
    port = _free_port()
    conf = tmp_path / "blink.toml"
    conf.write_text(_toml("auth", port))
    (tmp_path / "other").write_text(secrets.token_hex(32))
    for env in (_env(), _env(str(tmp_path / "other"))):  # no token, another token
        # Ray retries a refused driver, once a second, 20 times (and reconnects for 60 s): 3 is enough here
        env.update(RAY_gcs_rpc_server_reconnect_timeout_s="3", RAY_gcs_server_port_wait_time_s="3")
        r = _blink("deploy", "--config", str(conf), "--address", address, env=env)
        assert r.returncode == 1 and "token" in r.stderr, r.stdout + r.stderr
        assert "Authentication token is missing or incorrect" in r.stderr  # refused for the token, not unreachable
        assert "Traceback" not in r.stderr and "deployed" not in r.stdout
    code = f"import ray; ray.init(address='{address}'); print(ray.get(ray.remote(lambda: 'ran').remote()))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode != 0 and "ran" not in r.stdout  # no code runs without the token
    r = _blink("deploy", "--config", str(conf), "--address", address, env=_env(token))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _complete(f"http://127.0.0.1:{port}") == 12
    r = _blink("stop", "--config", str(conf), "--address", address, env=_env(token))
    assert r.returncode == 0, r.stderr


def test_deploy_status_stop_on_two_node_cluster(cluster: str, tmp_path: Path) -> None:
    port = _free_port()
    conf = tmp_path / "blink.toml"
    conf.write_text(_toml("cl", port))
    r = _blink("deploy", "--config", str(conf), "--address", cluster)
    assert r.returncode == 1 and "without Ray's token authentication" in r.stderr, r.stdout + r.stderr
    conf.write_text(_toml("cl", port, 'ray_auth = "off"  # this cluster runs without Ray\'s token authentication'))
    r = _blink("deploy", "--config", str(conf), "--address", cluster)
    assert r.returncode == 0, r.stdout + r.stderr
    url = f"http://127.0.0.1:{port}"
    assert url in r.stdout
    assert _complete(url) == 12

    r = _blink("status", "--config", str(conf), "--address", cluster, "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert [x["state"] for x in st["replicas"]] == ["READY", "READY"]
    assert [x["device"] for x in st["replicas"]] == ["emulated", "emulated"]
    assert st["frontend"]["state"] == "SERVING" and st["frontend"]["url"] == url
    r = _blink("status", "--config", str(conf), "--address", cluster)
    assert r.returncode == 0 and f"frontend: SERVING {url}" in r.stdout, r.stdout
    assert "replica 0: READY device=emulated" in r.stdout and "route 1: up" in r.stdout, r.stdout

    # Placement: the frontend sits on the `dpu` node, the GPU actors do not.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address=cluster, namespace=NS, log_to_driver=False)
    try:
        dpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("dpu")}
        assert len(dpu_nodes) == 1
        assert st["frontend"]["node_id"] in dpu_nodes
        gpu_nodes = {ray.get(ray.get_actor(f"cl-gpu-{i}").ring_info.remote())["node_id"] for i in range(2)}
        assert not gpu_nodes & dpu_nodes
    finally:
        ray.shutdown()

    # A second deploy finds the running deployment (same placement group, same actors).
    r = _blink("deploy", "--config", str(conf), "--address", cluster)
    assert r.returncode == 0, r.stderr
    r2 = json.loads(_blink("status", "--config", str(conf), "--address", cluster, "--json").stdout)
    assert [x["pid"] for x in r2["replicas"]] == [x["pid"] for x in st["replicas"]]

    r = _blink("stop", "--config", str(conf), "--address", cluster)
    assert r.returncode == 0, r.stderr
    assert "replicas=2" in r.stdout and "pg=True" in r.stdout
    r = _blink("status", "--config", str(conf), "--address", cluster)
    assert r.returncode == 3 and "not running" in r.stdout


def test_unknown_config_key_is_an_error(tmp_path: Path) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text("[deploy]\nreplicaz = 2\n")
    r = _blink("deploy", "--config", str(conf), "--address", "127.0.0.1:1")
    assert r.returncode == 2 and "unknown key deploy.replicaz" in r.stderr


def test_ray_refuses_a_head_port_it_keeps_for_a_default() -> None:
    """Why the cluster's port is not any free port: Ray's dashboard agent listens on 52365 unless
    told otherwise, and `ray start --head --port=52365` stops before starting anything."""
    tmp = tempfile.mkdtemp(prefix="rayp", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    argv = ["--head", "--port=52365", f"--temp-dir={tmp}", "--include-dashboard=false"]
    p = subprocess.Popen(
        [RAY, "start", *argv, "--node-ip-address=127.0.0.1", "--disable-usage-stats"],
        env=_env(),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out = p.communicate(timeout=60)[0].decode()
    finally:
        _kill_sessions({p.pid})  # whatever it started, were it to start
        shutil.rmtree(tmp, ignore_errors=True)
    assert p.returncode != 0 and "used by other components" in out, out


def test_the_head_port_is_never_one_ray_keeps_for_a_default(monkeypatch: pytest.MonkeyPatch) -> None:
    picks = iter([52365, 8265, 10002, 19999, 40123])
    monkeypatch.setattr(sys.modules[__name__], "_free_port", lambda: next(picks))
    assert _head_port() == 40123
