"""Data-parallel scale-out through the HTTP endpoint: the same ShareGPT-like load on 1 replica, then 2.

Each point is a fresh deployment (blink.actors.deploy: GPU actors one per GPU, deploy.frontends
frontend actors on one HTTP port; --frontends 0 = one per replica), driven through HTTP by a
load generator of several processes (one per 32 streams, so the client is never the bottleneck),
then stopped. Each point runs two phases:
  closed loop: --concurrency streams, each sending its next request when the last one ends: the
      capacity (output tok/s). Every stream's first request leaves at t=0, so the p99 TTFT over all
      requests is the time to prefill that burst; "ttft_p99_steady_s" leaves the first wave out.
  open loop (--rate > 0): Poisson arrivals at --rate requests/s: TTFT under a fixed offered load.
With --per-replica, --requests, --concurrency, --rate and --open-requests are per replica: N
replicas get N copies of one replica's requests (the same lengths, fresh prompt ids), interleaved,
and N independent Poisson streams (the first one exactly the 1-replica arrivals), so every point
carries the same work per replica; independent draws would differ in their heavy tails. CPU use of the frontends, engines and clients over
each phase is recorded (cores).

    # here (no GPU): 2 emulated replicas on CPU (one BLAS thread each), lengths scaled down
    python bench/scaleout.py --device emulated --model default --scale 0.25 --requests 16 \
        --concurrency 4 --per-replica --max-batch 8 --num-kv-blocks 256
    # 2x H200 (bench/scaleout_gpu.sh carries Ray there and runs this with both launchers)
    python bench/scaleout.py --device cuda --model random:llama3-8b --max-batch 256 --n-slots 512 \
        --per-replica --requests 384 --concurrency 128 --rate 16 --open-requests 480
    # ... without Ray: the same rings, router and ingress as processes
    python bench/scaleout.py --launcher procs ...

ShareGPT-like: prompt and output lengths are drawn from log-normal fits of ShareGPT
conversations (prompt median ~180 tokens, output median ~200, long tails; no dataset download),
clipped to the model's context. Prompts are random token ids (the completions endpoint takes
ids), outputs are forced to their drawn length (ignore_eos), so every run does the same work.
Writes bench/results/scaleout-<device>-<date>.json (date, GPUs, commit, command, per-point stats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blink.actors import deploy  # noqa: E402
from blink.actors.config import DeployConfig, from_mapping  # noqa: E402
from blink.actors.frontend_actor import wait_http  # noqa: E402
from blink.treedigest import tree_digest  # noqa: E402

NAMESPACE = f"blink-bench-{os.getpid()}"  # ring names include it: concurrent runs stay apart
BLAS_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# log-normal (mu, sigma) of token counts, fitted to ShareGPT-V3 first turns (approximate).
PROMPT_LN = (5.2, 1.0)
OUTPUT_LN = (5.3, 0.8)


def sharegpt_like(
    n: int, vocab: int, max_context: int, scale: float, seed: int, copies: int = 1
) -> list[tuple[list[int], int]]:
    """n requests (prompt ids, output length), then `copies` - 1 more sets with the same lengths
    and fresh prompt ids, interleaved: with one copy per replica, every point of a scale-out run
    carries exactly the same work per replica (independent draws would differ in their tails)."""
    rng = np.random.default_rng(seed)
    p_len = np.clip((rng.lognormal(*PROMPT_LN, n) * scale).astype(int), 4, max_context // 2)
    o_len = np.clip((rng.lognormal(*OUTPUT_LN, n) * scale).astype(int), 4, max_context // 2 - 1)
    sets = [[(rng.integers(3, vocab, int(p)).tolist(), int(o)) for p, o in zip(p_len, o_len, strict=True)]]
    for j in range(1, copies):
        ids = np.random.default_rng([seed, j])
        sets.append([(ids.integers(3, vocab, len(pr)).tolist(), o) for pr, o in sets[0]])
    return [sets[j][i] for i in range(n) for j in range(copies)]


def poisson_offsets(n: int, rate: float, seed: int, copies: int = 1) -> np.ndarray:
    """Arrival times (s from the start) of the interleaved requests of sharegpt_like(n, copies=...):
    copy j arrives as its own Poisson stream at `rate`, copy 0 exactly as a single replica's."""
    out = np.empty(n * copies)
    for j in range(copies):
        gaps = np.random.default_rng(seed + 1 if j == 0 else [seed + 1, j]).exponential(1.0 / rate, n)
        out[j::copies] = np.cumsum(gaps) - gaps[0]
    return out


async def _one(session, url: str, model: str, prompt: list[int], n_out: int) -> dict:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True}
    # continuous_usage_stats: every token batch comes as a chunk with the count so far, so tokens are
    # timed even when they decode to no text (random-weight models emit many such tokens).
    body.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    t0 = time.monotonic()  # CLOCK_MONOTONIC: one clock for every client process of the machine
    t_first = None
    n_tok = 0
    async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=3600)) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {await r.text()}"}
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return {"error": ev["error"]["message"]}
            if ev.get("usage"):
                n_tok = ev["usage"]["completion_tokens"]
                if t_first is None and n_tok > 0:
                    t_first = time.monotonic()
    t1 = time.monotonic()
    ttft = (t_first or t1) - t0
    tpot = (t1 - t0 - ttft) / max(n_tok - 1, 1)
    return {"t_start": t0, "t_end": t1, "ttft": ttft, "e2e": t1 - t0, "tokens": n_tok, "tpot": tpot}


async def _drive_part(session, url: str, model: str, part: list, streams: int, t0: float) -> list:
    """One client process's share. streams > 0: closed loop, that many streams pulling from `part`
    in order; streams == 0: open loop, each request sent at t0 + its arrival offset (monotonic s)."""
    results: list[dict] = []

    async def send(i: int, prompt: list[int], n_out: int, first_wave: bool, due: float) -> None:
        r = await _one(session, url, model, prompt, n_out)
        lag = r["t_start"] - due if "t_start" in r else 0.0  # sent this late (event loop busy)
        results.append({**r, "i": i, "first_wave": first_wave, "lag": lag})

    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    if streams:
        queue = list(reversed(part))

        async def worker() -> None:
            first = True
            while queue:
                i, prompt, n_out, _ = queue.pop()
                await send(i, prompt, n_out, first, time.monotonic())
                first = False

        await asyncio.gather(*(worker() for _ in range(streams)))
    else:
        tasks = []
        for i, prompt, n_out, off in part:
            delay = t0 + off - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(send(i, prompt, n_out, False, t0 + off)))
        await asyncio.gather(*tasks)
    return results


async def _client(conn, url: str, model: str, part: list, streams: int) -> list:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams)) as session:
        # Warm up before the start signal: imports, the session, a connection and one request and
        # response, so that no client process is still starting while the others already send
        # (a late process would send its first requests in a burst and read their tokens late).
        async with session.get(url + "/v1/models") as r:
            await r.read()
        conn.send_bytes(b"ready")
        t0 = float(conn.recv_bytes())  # every client waits here; nothing else runs on this loop yet
        return await _drive_part(session, url, model, part, streams, t0)


def _client_main(conn, url: str, model: str, part: list, streams: int) -> None:
    """Entry point of a client process: warm up, wait for the common start, drive its share, send
    back the per-request records."""
    import resource

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    res = asyncio.run(_client(conn, url, model, part, streams))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    conn.send_bytes(json.dumps({"results": res, "cpu_s": ru.ru_utime + ru.ru_stime}).encode())
    conn.close()


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a live process (Linux /proc), seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(
    url: str,
    model: str,
    reqs: list[tuple[list[int], int]],
    concurrency: int,
    procs: int,
    arrivals: np.ndarray | None = None,
    watch: dict[str, list[int]] | None = None,
    rate: float = 0.0,
) -> dict:
    """Send `reqs` from `procs` client processes. arrivals None: closed loop with `concurrency`
    streams in all; else open loop, request i sent at arrivals[i] s (concurrency unbounded).
    `watch` maps a role to pids whose CPU use over the phase is reported (frontend, engines)."""
    import multiprocessing as mp

    procs = max(1, min(procs, len(reqs), concurrency if arrivals is None else len(reqs)))
    ctx = mp.get_context("spawn")  # no forked event loops or Ray state in the clients
    offsets = arrivals if arrivals is not None else np.zeros(len(reqs))
    streams = (
        [0] * procs
        if arrivals is not None
        else [concurrency // procs + (k < concurrency % procs) for k in range(procs)]
    )
    tagged = [(i, p, n, float(off)) for i, ((p, n), off) in enumerate(zip(reqs, offsets, strict=True))]
    # open loop: each process sends its share in arrival order (the copies' streams interleave)
    parts = [sorted(tagged[k::procs], key=lambda x: x[3]) for k in range(procs)]
    pipes, children = [], []
    for k in range(procs):
        ours, theirs = ctx.Pipe(duplex=True)
        c = ctx.Process(target=_client_main, args=(theirs, url, model, parts[k], streams[k]), daemon=True)
        c.start()
        theirs.close()
        pipes.append(ours)
        children.append(c)
    for rx in pipes:  # every client warmed up and waiting: start them together
        if rx.recv_bytes() != b"ready":
            raise RuntimeError("client process did not report ready")
    t0 = time.monotonic() + 0.05
    for rx in pipes:
        rx.send_bytes(repr(t0).encode())
    watch = watch or {}
    cpu0 = {role: [_proc_cpu_s(p) for p in pids] for role, pids in watch.items()}
    w0 = time.monotonic()
    records, client_cpu = [], 0.0
    for rx, c in zip(pipes, children, strict=True):
        got = json.loads(rx.recv_bytes())
        records += got["results"]
        client_cpu += got["cpu_s"]
        c.join(30)
    w1 = time.monotonic()
    cpu_use = {}
    for role, pids in watch.items():
        used = [
            None if a is None or b is None else round((b - a) / (w1 - w0), 3)
            for a, b in zip(cpu0[role], [_proc_cpu_s(p) for p in pids], strict=True)
        ]
        cpu_use[role] = used
    ok = [r for r in records if "error" not in r]
    errors = [r["error"] for r in records if "error" in r]
    tok = sum(r["tokens"] for r in ok)
    t_first = min((r["t_start"] for r in ok), default=t0)
    wall = max((r["t_end"] for r in ok), default=t0) - (t_first if arrivals is None else t0)
    steady = [r for r in ok if not r["first_wave"]]

    def pct(rs: list[dict], key: str, q: float) -> float:
        return float(np.percentile([r[key] for r in rs], q)) if rs else float("nan")

    by_i = sorted(ok, key=lambda r: r["i"])
    return {
        "mode": f"closed loop, {concurrency} streams" if arrivals is None else f"poisson {rate:g} req/s",
        "client_procs": procs,
        "requests": len(records),
        "errors": len(errors),
        "first_errors": errors[:3],
        "output_tokens": tok,
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "wall_s": wall,
        "output_tok_per_s": tok / wall if wall > 0 else float("nan"),
        "requests_per_s": len(ok) / wall if wall > 0 else float("nan"),
        "ttft_p50_s": pct(ok, "ttft", 50),
        "ttft_p90_s": pct(ok, "ttft", 90),
        "ttft_p99_s": pct(ok, "ttft", 99),
        # closed loop: every stream's first request is sent at t=0, all at once; the p99 over all
        # requests is then the time to prefill that burst. "steady" leaves the first wave out.
        "ttft_p99_steady_s": pct(steady, "ttft", 99) if arrivals is None else pct(ok, "ttft", 99),
        # how late the clients sent (open loop: after the arrival time; should stay ~0)
        "send_lag_p99_ms": pct(ok, "lag", 99) * 1e3,
        "send_lag_max_ms": max((r["lag"] for r in ok), default=0.0) * 1e3,
        "tpot_p50_s": pct(ok, "tpot", 50),
        "tpot_p99_s": pct(ok, "tpot", 99),
        "e2e_p50_s": pct(ok, "e2e", 50),
        "cpu_cores_used": {**cpu_use, "clients_total": round(client_cpu / (w1 - w0), 3)},
        # per request, in request order: [prompt tokens, output tokens, TTFT ms, end-to-end s,
        # sent at (s after the start), client process]
        "per_request": [
            [
                len(reqs[r["i"]][0]),
                r["tokens"],
                round(r["ttft"] * 1e3, 2),
                round(r["e2e"], 3),
                round(r["t_start"] - t0, 4),
                r["i"] % procs,
            ]
            for r in by_i
        ],
    }


def config(a: argparse.Namespace, replicas: int) -> DeployConfig:
    dev = {"kind": a.device, "max_batch": a.max_batch}
    if a.num_kv_blocks:
        dev["num_kv_blocks"] = a.num_kv_blocks
    return from_mapping(
        {
            "deploy": {
                "name": f"scaleout{replicas}",
                "namespace": NAMESPACE,
                "replicas": replicas,
                "frontends": a.frontends,
            },
            "device": dev,
            "model": {"spec": a.model},
            "ring": {"n_slots": a.n_slots},
            "server": {"port": 0},
        }
    )


class RayLauncher:
    """The deployment as `blink deploy` places it: GPU actors one per GPU, the frontend actor(s)."""

    def __init__(self, a: argparse.Namespace, max_replicas: int):
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # edge of a benchmark script
        init = {"address": a.address, "namespace": NAMESPACE, "include_dashboard": False, "log_to_driver": False}
        threads = str(a.blas_threads)
        init["runtime_env"] = {"env_vars": {k: threads for k in BLAS_VARS}}
        if a.address == "local":
            init["num_cpus"] = max(
                os.cpu_count() or 1, 2 * max_replicas + 1
            )  # logical: one frontend per replica at most
        ray.init(**init)
        self._cfg: DeployConfig | None = None
        self._deployment: deploy.Deployment | None = None

    def up(self, cfg: DeployConfig) -> str:
        self._cfg = cfg
        # Keep the handles: Ray reclaims non-detached actors once their handles are gone.
        self._deployment = deploy.deploy(cfg, detached=False)
        return self._deployment.url

    def status(self) -> tuple[list, list]:
        st = deploy.status(self._cfg)
        routed = [sum(fe["replicas"][i]["requests"] for fe in st["frontends"]) for i in range(len(st["replicas"]))]
        return [r.get("device") for r in st["replicas"]], routed

    def pids(self) -> dict[str, list[int]]:
        d = self._deployment
        return {"frontends": [i["pid"] for i in d.frontends_info], "engines": [r["engine_pid"] for r in d.rings]}

    def down(self) -> None:
        deploy.stop(self._cfg)
        self._deployment = None

    def close(self) -> None:
        import ray

        ray.shutdown()


class ProcLauncher:
    """The same pieces without Ray (for machines without it, e.g. the lent GPU hosts): one engine
    process per replica pinned with CUDA_VISIBLE_DEVICES, the frontend roles in deploy.frontends
    processes (python -m blink.actors.frontend_actor) on one port, the same rings, router and ingress."""

    def __init__(self, a: argparse.Namespace, max_replicas: int):
        for k in BLAS_VARS:
            os.environ[k] = str(a.blas_threads)  # inherited by the engine processes
        self._engines: list = []
        self._rings: list = []
        self._frontends: list[subprocess.Popen] = []
        self._device = ""

    def up(self, cfg: DeployConfig) -> str:
        from blink.actors import engines
        from blink.actors.gpu_actor import GpuActor, resolve_device
        from blink.protocol.layout import RingGeometry
        from blink.protocol.transport import ShmTransport

        self._device = resolve_device(cfg.serving.device.kind)
        rc = cfg.serving.ring
        for i in range(cfg.deploy.replicas):
            name = cfg.ring_name(i)
            if os.path.exists(f"/dev/shm/{name}"):  # left by a crashed run: replace, as a GPU actor does
                os.unlink(f"/dev/shm/{name}")
            t = ShmTransport.create(name, RingGeometry(rc.n_slots, rc.prompt_arena_tokens, rc.output_capacity))
            self._rings.append(t)
            start = engines.start_cuda if self._device == "cuda" else engines.start_emulated
            old = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = str(i)  # read when the engine process is spawned
            try:
                self._engines.append(start(cfg, name, lambda rc: None))
            finally:
                if old is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES")
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = old
        for e, t in zip(self._engines, self._rings, strict=True):
            GpuActor._wait_ready(e, t)
        n_fe = cfg.frontend_count(cfg.deploy.replicas)
        port = None
        for k in range(n_fe):  # frontend 0 binds the configured port, the others share the port it bound
            cmd = [sys.executable, "-m", "blink.actors.frontend_actor", "--config-json", cfg.to_json()]
            cmd += ["--replicas", str(cfg.deploy.replicas), "--index", str(k), "--count", str(n_fe)]
            cmd += ["--port", str(port)] if port is not None else []
            fe = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
            self._frontends.append(fe)
            for line in fe.stderr:
                if "serving on " in line:
                    url = line.rsplit("serving on ", 1)[1].strip()
                    port = int(url.rsplit(":", 1)[1])
                    break
            else:
                raise RuntimeError(f"frontend {k} exited with {fe.wait()}")
            # keep reading its stderr, or a full pipe would block the frontend's logging
            threading.Thread(target=fe.stderr.read, daemon=True).start()
        return url

    def status(self) -> tuple[list, list]:
        return [self._device] * len(self._engines), []

    def pids(self) -> dict[str, list[int]]:
        return {"frontends": [f.pid for f in self._frontends], "engines": [e.pid for e in self._engines]}

    def down(self) -> None:
        for fe in self._frontends:
            fe.terminate()
        for fe in self._frontends:
            fe.wait(30)
        for e in self._engines:
            e.stop(30.0)
        for t in self._rings:
            t.unlink()
            t.close()
        self._engines, self._rings, self._frontends = [], [], []

    def close(self) -> None:
        pass


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def gpu_names() -> list[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
    except FileNotFoundError:
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=("auto", "emulated", "cuda"))
    ap.add_argument("--model", default="default")
    ap.add_argument("--replicas", default="1,2", help="comma-separated replica counts, one deployment each")
    ap.add_argument("--requests", type=int, default=64, help="closed-loop requests (per replica with --per-replica)")
    ap.add_argument(
        "--concurrency", type=int, default=16, help="closed-loop client streams (per replica with --per-replica)"
    )
    ap.add_argument(
        "--per-replica",
        action="store_true",
        help="--requests, --concurrency and --rate are per replica: N replicas get N times the load",
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="also run an open-loop phase: Poisson arrivals at this many requests/s (0: closed loop only)",
    )
    ap.add_argument("--open-requests", type=int, default=0, help="open-loop requests (per replica with --per-replica)")
    ap.add_argument(
        "--frontends",
        type=int,
        default=0,
        help="frontend processes per deployment (deploy.frontends; 0: one per replica)",
    )
    ap.add_argument(
        "--client-procs", type=int, default=0, help="load-generator processes (0: one per 32 streams, at most 8)"
    )
    ap.add_argument("--scale", type=float, default=1.0, help="multiply ShareGPT lengths (CPU runs: < 1)")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--n-slots", type=int, default=64)
    ap.add_argument("--num-kv-blocks", type=int, default=0)
    ap.add_argument("--address", default="local", help="Ray address: local (embedded) or a running cluster")
    ap.add_argument(
        "--launcher",
        default="ray",
        choices=("ray", "procs"),
        help="ray: GPU/frontend actors; procs: same pieces, no Ray",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default="", help="git commit of the tree (machines without .git)")
    ap.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="BLAS threads per process (emulated replicas: 1 = one core per replica, the CPU analogue of one GPU each)",
    )
    ap.add_argument("--out", default="", help="JSON path (default bench/results/scaleout-<device>-<date>.json)")
    a = ap.parse_args(argv)
    counts = [int(x) for x in a.replicas.split(",")]

    launcher = (RayLauncher if a.launcher == "ray" else ProcLauncher)(a, max(counts))
    runs = []
    try:
        for n in counts:
            k = n if a.per_replica else 1
            streams = a.concurrency * k
            procs = a.client_procs or max(1, min(8, -(-streams // 32)))
            cfg = config(a, n)
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            url = launcher.up(cfg)
            try:
                wait_http(url, cfg.deploy.start_timeout_s)
                start_s = time.perf_counter() - t0
                with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                    card = json.loads(r.read())["data"][0]
                vocab, ctx = _vocab(a.model), card["max_model_len"]
                # --per-replica: k copies of one replica's load (same lengths, fresh prompt ids)
                reqs = sharegpt_like(a.requests, vocab, ctx, a.scale, a.seed, copies=k)
                watch = launcher.pids()
                drive(url, card["id"], reqs[: max(4, streams)], streams, procs)  # warm-up
                res = drive(url, card["id"], reqs, streams, procs, watch=watch)
                if a.rate:
                    n_open = a.open_requests or a.requests
                    open_reqs = sharegpt_like(n_open, vocab, ctx, a.scale, a.seed + 1000, copies=k)
                    arrivals = poisson_offsets(n_open, a.rate, a.seed, copies=k)
                    res["poisson"] = drive(url, card["id"], open_reqs, streams, procs, arrivals, watch, a.rate * k)
                devices, routed = launcher.status()
                res.update(replicas=n, deploy_s=start_s, loadavg_1m_start=load0, devices=devices, routed=routed)
            finally:
                launcher.down()
            runs.append(res)
            for r in (res, res.get("poisson")):
                if r:
                    print(
                        f"replicas={n} [{r['mode']}]: {r['output_tok_per_s']:8.1f} out tok/s  "
                        f"{r['requests_per_s']:6.2f} req/s  TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} ms "
                        f"p99 {r['ttft_p99_s'] * 1e3:7.1f} ms (steady {r['ttft_p99_steady_s'] * 1e3:7.1f})  "
                        f"TPOT p50 {r['tpot_p50_s'] * 1e3:6.2f} ms  errors {r['errors']}  "
                        f"cpu {r['cpu_cores_used']}  routed {res['routed']}",
                        flush=True,
                    )
    finally:
        launcher.close()
    base = runs[0]["output_tok_per_s"]
    for r in runs:
        r["speedup_vs_first"] = r["output_tok_per_s"] / base if base else float("nan")
        if r.get("poisson") and runs[0].get("poisson"):
            p, p0 = r["poisson"], runs[0]["poisson"]
            p["speedup_vs_first"] = p["output_tok_per_s"] / p0["output_tok_per_s"]
            p["ttft_p99_vs_first"] = p["ttft_p99_s"] / p0["ttft_p99_s"]
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = {
        "bench": "scaleout",
        "date": date,
        "gpus": gpu_names() or ["none: emulated replicas on CPU"],
        "cpus": os.cpu_count(),
        "loadavg_1m_end": os.getloadavg()[0],  # other work on the machine skews CPU-replica numbers
        "commit": a.commit
        or _git("rev-parse", "HEAD") + ("-dirty" if _git("status", "--porcelain", "--", "blink", "bench") else ""),
        "tree_sha256": tree_digest(),  # check against `python -m blink.treedigest --commit <commit>`
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": vars(a),
        "load": {"kind": "sharegpt-like lognormal", "prompt_ln": PROMPT_LN, "output_ln": OUTPUT_LN},
        "runs": runs,
    }
    if a.per_replica:
        out["per_replica_load"] = {"requests": a.requests, "concurrency": a.concurrency, "rate": a.rate}
    path = Path(a.out or ROOT / "bench" / "results" / f"scaleout-{a.device}-{date[:10]}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    phases = runs + [r["poisson"] for r in runs if r.get("poisson")]
    return 0 if all(r["errors"] == 0 for r in phases) else 1


def _vocab(spec: str) -> int:
    from blink.dpu.tokenizer import load_tokenizer

    return load_tokenizer(spec).info.vocab_size


if __name__ == "__main__":
    raise SystemExit(main())
