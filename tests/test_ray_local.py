"""Blink on an embedded local Ray: placement, data parallelism, Ray off the token path, lifecycle.

One Ray cluster for the module (init ~3 s), fresh temp dir, RAY_AUTH_MODE=disabled. Two
deployments share it: `dp` (2 emulated replicas, fixed port, tiny random model) and `kill`
(2 replicas with max_batch 1, so a replica holds several long requests in flight when its GPU
actor is killed).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from structured_schemas import SCHEMAS

ray = pytest.importorskip("ray")

from blink.actors import deploy, raycount  # noqa: E402
from blink.actors.cli import format_status  # noqa: E402
from blink.actors.config import DeployConfig, from_mapping  # noqa: E402
from blink.actors.frontend_actor import wait_http  # noqa: E402
from blink.protocol.transport import shm_path  # noqa: E402

pytestmark = pytest.mark.timeout(180)
MODEL = "tiny-llama"
NS = f"blink-test-{os.getpid()}"  # ring names include it: concurrent runs on one host stay apart


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(
    name: str, port: int, max_batch: int = 8, replicas: int = 2, frontends: int = 1, transport: str = "auto"
) -> DeployConfig:
    return from_mapping(
        {
            "deploy": {
                "name": name,
                "namespace": NS,
                "replicas": replicas,
                "gpu_actor_cpus": 1.0,
                "frontends": frontends,
            },
            "device": {"kind": "emulated", "num_kv_blocks": 512, "max_batch": max_batch, "max_num_batched_tokens": 128},
            "model": {"spec": f"random:{MODEL}"},
            "ring": {"n_slots": 8, "prompt_arena_tokens": 8192, "output_capacity": 64, "transport": transport},
            "server": {"port": port, "heartbeat_timeout_s": 1.0},
        }
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=tmp, namespace=NS, log_to_driver=False)
    raycount.install()  # count this driver's Ray calls too
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old


@pytest.fixture(scope="module")
def dp(cluster) -> Iterator[deploy.Deployment]:
    cfg = _cfg("dp", _free_port())
    d = deploy.deploy(cfg, detached=False)
    wait_http(d.url, 30)
    try:
        yield d
    finally:
        deploy.stop(cfg)


def _post(url: str, body: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _complete(url: str, n: int, prompt: str = "hello") -> dict[str, Any]:
    return _post(url, {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})


def _stream(url: str, n: int, prompt: str = "hi") -> list[dict[str, Any]]:
    """SSE events of a streamed completion, up to [DONE] (or the connection's end)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    events = []
    try:
        r = urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:  # failed before the first token: an HTTP error, not SSE
        return [{"http_status": e.code, **json.loads(e.read())}]
    with r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                break
            events.append(json.loads(line[6:]))
    return events


def _get(url: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + path, timeout=10) as r:
        return json.loads(r.read())


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _fe_replicas(d: deploy.Deployment) -> list[dict[str, Any]]:
    return ray.get(d.frontend.status.remote(), timeout=10)["replicas"]


def test_two_replicas_one_ingress(dp: deploy.Deployment) -> None:
    models = _get(dp.url, "/v1/models")["data"]
    assert [m["id"] for m in models] == [MODEL]  # listed once for two replicas
    before = [r["requests"] for r in _fe_replicas(dp)]
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: _complete(dp.url, 16, f"p{i}"), range(8)))
    assert all(o["usage"]["completion_tokens"] == 16 for o in outs)
    after = [r["requests"] for r in _fe_replicas(dp)]
    routed = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(routed) == 8 and min(routed) >= 2, routed
    st = [ray.get(a.status.remote(), timeout=10) for a in dp.gpu_actors]
    assert [s["state"] for s in st] == ["READY", "READY"]
    assert all(s["tokens_generated"] > 0 for s in st)
    assert dp.rings[0]["ring"] != dp.rings[1]["ring"] and all(os.path.exists(r["path"]) for r in dp.rings)


def test_structured_output_and_required_tool_calls_through_the_ray_frontend(dp: deploy.Deployment) -> None:
    """The frontend actor enforces grammars as `blink serve` does: a json_schema answer validates on each
    replica (ties rotate, so two requests reach both), and tool_choice required returns a parsed call."""
    client = openai.OpenAI(base_url=dp.url + "/v1", api_key="-", max_retries=0, timeout=120)
    schema = SCHEMAS[4]  # a bounded string and a bounded integer, both required
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "a name and an age"}]
    before = [r["requests"] for r in _fe_replicas(dp)]
    for seed in range(2):
        r = client.chat.completions.create(model=MODEL, messages=msgs, response_format=fmt, max_tokens=64, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert [a - b for a, b in zip((r["requests"] for r in _fe_replicas(dp)), before, strict=True)] == [1, 1]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=96
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    assert c.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), schema)


def test_three_replicas(cluster) -> None:
    cfg = _cfg("tri", 0, replicas=3)
    d = deploy.deploy(cfg, detached=False)
    try:
        assert len(d.gpu_actors) == 3 and len(d.plan.bundles) == 4
        assert [m["id"] for m in _get(d.url, "/v1/models")["data"]] == [MODEL]
        with cf.ThreadPoolExecutor(9) as pool:
            outs = list(pool.map(lambda i: _complete(d.url, 8, f"t{i}"), range(9)))
        assert all(o["usage"]["completion_tokens"] == 8 for o in outs)
        assert all(r["requests"] >= 1 for r in _fe_replicas(d)), _fe_replicas(d)
    finally:
        deploy.stop(cfg)


def test_two_frontends_share_one_port(cluster) -> None:
    """deploy.frontends = 2: two frontend actors listen on one port (SO_REUSEPORT) and each serves
    both replicas from its own share of every ring's slots."""
    cfg = _cfg("fe2", 0, frontends=2)
    d = deploy.deploy(cfg, detached=False)
    try:
        assert len(d.frontends) == 2 and d.frontends[0] == d.frontend
        ports = {i["port"] for i in d.frontends_info}
        assert len(ports) == 1 and d.url.endswith(f":{ports.pop()}")
        assert len({i["pid"] for i in d.frontends_info}) == 2
        # each actor process froze its start-up heap (Ray's worker included) out of full collections
        assert all(i["gc_frozen"] > 20_000 for i in d.frontends_info), d.frontends_info
        # one connection per request (urllib): the kernel spreads them over both listeners
        with cf.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: _complete(d.url, 6, f"f{i}"), range(32)))
        assert all(o["usage"]["completion_tokens"] == 6 for o in outs)
        st = deploy.status(cfg)
        per_fe = [sum(r["requests"] for r in fe["replicas"]) for fe in st["frontends"]]
        assert sum(per_fe) == 32 and min(per_fe) > 0, per_fe  # both frontends took requests
        for fe in st["frontends"]:
            assert [r["up"] for r in fe["replicas"]] == [True, True]
            assert all(r["free_slots"] == 4 for r in fe["replicas"])  # 8 slots per ring, half each
        assert "frontend 1:" in format_status(st)
        # /metrics counts both frontends, whichever one the connection lands on (they publish
        # their counters about once a second)
        time.sleep(1.5)
        for _ in range(6):  # a new connection each: the kernel spreads them over both listeners
            text = urllib.request.urlopen(d.url + "/metrics", timeout=10).read().decode()
            assert 'blink_requests_total{endpoint="completions",outcome="ok"} 32' in text, text
    finally:
        stopped = deploy.stop(cfg)
    assert stopped["frontends"] == 2 and stopped["replicas"] == 2
    t_end = time.monotonic() + 10  # ray.kill is asynchronous: the names go once the actors are dead
    while deploy.find_all(cfg) != ([], []):
        assert time.monotonic() < t_end, deploy.find_all(cfg)
        time.sleep(0.05)


def test_deploy_again_reuses_placement_group_and_actors(dp: deploy.Deployment) -> None:
    from ray.util import placement_group_table

    pids = [ray.get(a.pid.remote()) for a in dp.gpu_actors]
    again = deploy.deploy(dp.cfg, detached=False)
    assert [ray.get(a.pid.remote()) for a in again.gpu_actors] == pids
    assert again.url == dp.url
    named = [p for p in placement_group_table().values() if p["name"] == dp.cfg.placement_group_name]
    assert len([p for p in named if p["state"] != "REMOVED"]) == 1
    # no dpu node: beside the GPU actors; ring.transport auto lets the bundles spread over hosts (PACK)
    assert dp.plan.strategy == "PACK" and not dp.plan.use_dpu


def _all_counts(d: deploy.Deployment) -> dict[str, dict[str, int]]:
    out = {"driver": raycount.counts()}
    out["frontend"] = ray.get(d.frontend.ray_counts.remote())
    for i, a in enumerate(d.gpu_actors):
        out[f"gpu{i}"] = ray.get(a.ray_counts.remote())
    return out


def _delta(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {p: {k: b[p].get(k, 0) - a[p].get(k, 0) for k in set(a[p]) | set(b[p])} for p in b}


def test_no_ray_call_per_token(dp: deploy.Deployment) -> None:
    """Ray calls in every process (driver, frontend, GPU actors) over a run of N tokens do not grow with N."""
    deltas, tokens = [], []
    c_prev = _all_counts(dp)
    for n in (4, 4, 400):
        with cf.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i, n=n: _complete(dp.url, n, f"x{i}"), range(4)))
        tokens.append(sum(o["usage"]["completion_tokens"] for o in outs))
        c = _all_counts(dp)
        deltas.append(_delta(c_prev, c))
        c_prev = c
    assert tokens == [16, 16, 1600]
    # The counters do count: reading them is itself a Ray call from the driver, seen every round.
    assert deltas[0]["driver"]["actor_method_call"] == 1 + len(dp.gpu_actors) > 0
    assert deltas[0]["driver"]["get"] > 0
    assert deltas[0] == deltas[1] == deltas[2], deltas
    for proc in ("frontend", "gpu0", "gpu1"):
        calls = {k: v for k, v in deltas[2][proc].items() if not k.startswith("in:ray_counts")}
        assert not any(calls.values()), (proc, calls)


def test_killed_frontend_restarts_and_reattaches(dp: deploy.Deployment) -> None:
    gpu_pids = [ray.get(a.pid.remote()) for a in dp.gpu_actors]
    inodes = [os.stat(shm_path(dp.cfg.ring_name(i))).st_ino for i in range(2)]
    fe_pid = ray.get(dp.frontend.pid.remote())
    # Streams in flight when the frontend dies leave claimed slots behind; the new frontend reclaims them.
    with cf.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(_stream, dp.url, 1000, f"k{i}") for i in range(8)]
        t_end = time.monotonic() + 10
        while sum(r.get("busy_slots", 0) for r in _fe_replicas(dp)) < 4:
            assert time.monotonic() < t_end
            time.sleep(0.005)
        ray.kill(dp.frontend, no_restart=False)
        cf.wait(futs, timeout=30)  # cut off mid-stream or finished just before: either is fine here
        assert all(f.done() for f in futs)
    t_end = time.monotonic() + 60
    while True:
        try:
            st = ray.get(dp.frontend.status.remote(), timeout=5)
            if st["pid"] != fe_pid and st["state"] == "SERVING":
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # restarting
        assert time.monotonic() < t_end, "frontend not restarted"
        time.sleep(0.1)
    assert st["restarted"] is True
    wait_http(dp.url, 30)
    assert _complete(dp.url, 8)["usage"]["completion_tokens"] == 8
    # GPU actors untouched, same rings.
    assert [ray.get(a.pid.remote()) for a in dp.gpu_actors] == gpu_pids
    assert [os.stat(shm_path(dp.cfg.ring_name(i))).st_ino for i in range(2)] == inodes
    t_end = time.monotonic() + 10
    while sum(r["free_slots"] for r in _fe_replicas(dp)) != 16:
        assert time.monotonic() < t_end, _fe_replicas(dp)
        time.sleep(0.05)


def test_crashed_engine_takes_its_actor_down_and_comes_back(dp: deploy.Deployment) -> None:
    info = ray.get(dp.gpu_actors[0].ring_info.remote())
    os.kill(info["engine_pid"], 9)  # the engine process dies on its own (not the actor)
    t_end = time.monotonic() + 60
    while True:
        try:
            new = ray.get(dp.gpu_actors[0].ring_info.remote(), timeout=5)
            if new["pid"] != info["pid"] and _fe_replicas(dp)[0]["up"] and new["engine_pid"]:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # the actor is restarting
        assert time.monotonic() < t_end, "replica 0 did not come back"
        time.sleep(0.1)
    assert new["incarnation"] != info["incarnation"]
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: _complete(dp.url, 6, f"c{i}"), range(4)))
    assert all(o["usage"]["completion_tokens"] == 6 for o in outs)


def test_killed_gpu_actor_marks_replica_down_and_restarts(cluster) -> None:
    cfg = _cfg("kill", _free_port(), max_batch=1)
    d = deploy.deploy(cfg, detached=False)
    try:
        wait_http(d.url, 30)
        victim = 1
        info = ray.get(d.gpu_actors[victim].ring_info.remote())
        old_pid, engine_pid = info["pid"], info["engine_pid"]
        assert engine_pid and engine_pid != old_pid  # the engine is a child process of the actor
        assert info["gc_frozen"] > 20_000  # the actor's start-up heap, out of full collections
        old_inode = os.stat(shm_path(cfg.ring_name(victim))).st_ino
        with cf.ThreadPoolExecutor(12) as pool:
            futs = [pool.submit(_stream, d.url, 1000, f"s{i}") for i in range(12)]
            t_end = time.monotonic() + 10
            while min(r.get("busy_slots", 0) for r in _fe_replicas(d)) < 4:
                assert time.monotonic() < t_end
                time.sleep(0.01)
            ray.kill(d.gpu_actors[victim], no_restart=False)
            results = [f.result(timeout=60) for f in futs]
        errors = [ev["error"] for evs in results for ev in evs if "error" in ev]
        finished = [evs for evs in results if evs and evs[-1].get("choices", [{}])[0].get("finish_reason") == "length"]
        assert errors, "no in-flight request of the killed replica ended with an error event"
        assert all(any(w in e["message"] for w in ("heartbeat", "replaced", "unavailable")) for e in errors), errors
        assert len(errors) + len(finished) == 12  # nothing hangs, nothing ends silently
        # Routing skips the dead replica until it is back.
        t_end = time.monotonic() + 60
        while True:
            reps = _fe_replicas(d)
            if not reps[victim]["up"]:
                assert _complete(d.url, 4)["usage"]["completion_tokens"] == 4  # served by the other one
            elif reps[victim]["attaches"] == 2:
                break
            assert time.monotonic() < t_end, reps
            time.sleep(0.05)
        hist = reps[victim]["history"]
        assert hist[0] == "up" and hist[1].startswith("down") and hist[2] == "up", hist
        # The down window may close before the first look; routing around a dead
        # replica is pinned down deterministically in test_actors_router.
        st = ray.get(d.gpu_actors[victim].status.remote(), timeout=10)
        assert st["pid"] != old_pid and st["state"] == "READY"
        assert os.stat(shm_path(cfg.ring_name(victim))).st_ino != old_inode  # a fresh ring
        assert not _running(engine_pid)  # the old engine died with its actor (PR_SET_PDEATHSIG)
        before = reps[victim]["requests"]
        with cf.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: _complete(d.url, 4, f"after{i}"), range(4)))
        assert _fe_replicas(d)[victim]["requests"] > before  # routed to again
    finally:
        deploy.stop(cfg)


def test_frontend_over_tcp_reconnects_after_either_side_restarts(cluster) -> None:
    """ring.transport = tcp: the frontend reaches each ring through its GPU actor's ring agent (as
    from another host). A killed GPU actor ends its requests with an error event and is reached
    again at its new agent; a killed frontend, restarted by Ray, connects again."""
    cfg = _cfg("tcp", _free_port(), max_batch=1, transport="tcp")
    d = deploy.deploy(cfg, detached=False)
    try:
        wait_http(d.url, 30)
        reps = _fe_replicas(d)
        assert all(r["link"].startswith("tcp: ") for r in reps), reps
        agents = [ray.get(a.ring_info.remote())["agent"] for a in d.gpu_actors]
        assert all(a for a in agents)
        assert _complete(d.url, 8)["usage"]["completion_tokens"] == 8
        fe_pid = ray.get(d.frontend.pid.remote())
        with open(f"/proc/{fe_pid}/maps") as f:  # the frontend process never mapped a ring
            assert not [ln for ln in f if "/dev/shm/" + cfg.ring_name(0)[:-1] in ln]
        # the GPU actor dies mid-stream: error events, then the replica is attached again over tcp
        victim = 0
        with cf.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(_stream, d.url, 1000, f"t{i}") for i in range(6)]
            t_end = time.monotonic() + 10
            while _fe_replicas(d)[victim].get("busy_slots", 0) < 2:
                assert time.monotonic() < t_end
                time.sleep(0.01)
            ray.kill(d.gpu_actors[victim], no_restart=False)
            results = [f.result(timeout=60) for f in futs]
        errors = [ev["error"] for evs in results for ev in evs if "error" in ev]
        assert errors and all("unreachable" in e["message"] or "heartbeat" in e["message"] for e in errors), errors
        t_end = time.monotonic() + 60
        while (r := _fe_replicas(d)[victim])["attaches"] < 2 or not r["up"]:
            assert time.monotonic() < t_end, r
            time.sleep(0.05)
        assert r["link"].startswith("tcp: ")
        assert ray.get(d.gpu_actors[victim].ring_info.remote())["agent"] != agents[victim]
        # the frontend dies: Ray restarts it and it connects to both agents again
        ray.kill(d.frontend, no_restart=False)
        t_end = time.monotonic() + 60
        while True:
            try:
                st = ray.get(d.frontend.status.remote(), timeout=5)
                if st["pid"] != fe_pid and st["state"] == "SERVING" and all(x["up"] for x in st["replicas"]):
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # restarting
            assert time.monotonic() < t_end, "frontend not back"
            time.sleep(0.1)
        assert all(x["link"].startswith("tcp: ") for x in st["replicas"])
        wait_http(d.url, 30)
        with cf.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i: _complete(d.url, 4, f"u{i}"), range(4)))
        assert all(o["usage"]["completion_tokens"] == 4 for o in outs)
    finally:
        deploy.stop(cfg)


def test_start_failure_and_start_timeout_are_reported_and_cleaned_up(cluster) -> None:
    from ray.util import placement_group_table

    bad = from_mapping({**json.loads(_cfg("bad", 0).to_json()), "model": {"spec": "random:no-such-preset"}})
    with pytest.raises(deploy.StartError, match="no-such-preset"):
        deploy.deploy(bad, detached=False)
    assert deploy.find_all(bad) == ([], [])  # killed, not left restarting forever
    deploy.stop(bad)
    slow = from_mapping({**json.loads(_cfg("slow", 0).to_json()), "deploy": {"name": "slow", "start_timeout_s": 0.01}})
    with pytest.raises(TimeoutError, match="did not finish|not ready after"):  # either stage may be the one
        deploy.deploy(slow, detached=False)
    assert deploy.find_all(slow) == ([], [])
    assert deploy.stop(slow)["placement_group"] is True
    live = [
        p for p in placement_group_table().values() if p["name"] in ("bad-pg", "slow-pg") and p["state"] != "REMOVED"
    ]
    assert live == []
    for c in (bad, slow):  # rings of actors killed mid-start are removed too
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(c.ring_name(0)[:-1])]
