"""Data-parallel scale-out through the HTTP endpoint: the same ShareGPT load on 1 replica, then 2.

Each point is a fresh deployment (blink.actors.deploy: GPU actors one per GPU, deploy.frontends
frontend actors on one HTTP port; --frontends 0 = one per replica), driven through HTTP by
`blink bench serve` (blink/benchmark.py, in this process), then stopped. Each point runs two phases:
  closed loop: --concurrency streams, each sending its next request when the last one ends: the
      capacity (output tok/s). Every stream's first request leaves at t=0, so the p99 TTFT over all
      requests includes the time to prefill that burst.
  open loop (--rate > 0): Poisson arrivals at --rate requests/s: TTFT under a fixed offered load.
With --per-replica, --requests, --concurrency, --rate and --open-requests are per replica: N
replicas get N copies of one replica's requests (the same prompts and lengths), interleaved, at N
times the rate, so every point carries the same work per replica (independent draws would differ
in their heavy tails). CPU use of the frontends and engines over each phase is recorded (cores).

    # without a GPU: 2 emulated replicas on CPU (one BLAS thread each), short random prompts
    python -m bench.serving.scaleout --device emulated --model default --dataset random --input-len 64 \
        --output-len 32 --requests 16 --concurrency 4 --per-replica --max-batch 8 --num-kv-blocks 256
    # 2x H200, replicas placed by Ray (pip install -e '.[ray]')
    python -m bench.serving.scaleout --device cuda --model random:llama3-8b --max-batch 256 --n-slots 512 \
        --per-replica --requests 384 --concurrency 128 --rate 16 --open-requests 480
    # ... without Ray: the same rings, router and ingress as processes
    python -m bench.serving.scaleout --launcher procs ...

Datasets as `blink bench serve` has them: ShareGPT V3 (default; its prompts, its replies' lengths,
pairs over --max-model-len left out) or random text of --input-len -> --output-len tokens. Outputs
are forced to their length (ignore_eos), so every run does the same work.
Writes bench/results/scaleout-<device>-<commit>.json (date, GPUs, commit, command, per-point stats).
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
from pathlib import Path

from bench.common import add_commit_arg, cpu_seconds, git_commit, metadata, smi_gpu_name, smi_gpu_names
from blink import bench_datasets, benchmark
from blink.actors import deploy
from blink.actors.config import DeployConfig, from_mapping
from blink.actors.frontend_actor import wait_http

ROOT = Path(__file__).resolve().parents[2]

NAMESPACE = f"blink-bench-{os.getpid()}"  # ring names include it: concurrent runs stay apart
BLAS_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


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
    """The same pieces without Ray (for machines without Ray): one engine
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
        from blink.launch import create_ring, device_spec, start_device

        for i in range(cfg.deploy.replicas):
            name = cfg.ring_name(i)
            if os.path.exists(f"/dev/shm/{name}"):  # left by a crashed run: replace, as a GPU actor does
                os.unlink(f"/dev/shm/{name}")
            t = create_ring(name, cfg.serving.ring)
            self._rings.append(t)
            spec = device_spec(cfg.serving, name)
            self._device = spec.kind
            self._engines.append(start_device(spec, env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(i))))
        for e, t in zip(self._engines, self._rings, strict=True):
            e.wait_ready(t, timeout=cfg.deploy.start_timeout_s)
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
        for e, t in zip(self._engines, self._rings, strict=True):
            e.stop(t, timeout=30.0)
        for t in self._rings:
            t.unlink()
            t.close()
        self._engines, self._rings, self._frontends = [], [], []

    def close(self) -> None:
        pass


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
    ap.add_argument("--dataset", choices=("sharegpt", "random"), default="sharegpt")
    ap.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="random: output tokens")
    ap.add_argument("--max-model-len", type=int, default=2048, help="sharegpt: longest prompt + output kept")
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
    add_commit_arg(ap)
    ap.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="BLAS threads per process (emulated replicas: 1 = one core per replica, the CPU analogue of one GPU each)",
    )
    ap.add_argument("--out", default="", help="JSON path (default bench/results/scaleout-<device>-<commit>.json)")
    a = ap.parse_args(argv)
    counts = [int(x) for x in a.replicas.split(",")]

    launcher = (RayLauncher if a.launcher == "ray" else ProcLauncher)(a, max(counts))
    runs = []
    try:
        for n in counts:
            k = n if a.per_replica else 1
            cfg = config(a, n)
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            url = launcher.up(cfg)
            try:
                wait_http(url, cfg.deploy.start_timeout_s)
                start_s = time.perf_counter() - t0
                watch = launcher.pids()
                reqs = asyncio.run(_dataset(url, a, a.requests, a.seed))
                _phase(url, a, reqs[: max(4, a.concurrency)], k, 0.0, {})  # warm-up
                res = _phase(url, a, reqs, k, 0.0, watch)
                if a.rate:
                    open_reqs = asyncio.run(_dataset(url, a, a.open_requests or a.requests, a.seed + 1000))
                    res["poisson"] = _phase(url, a, open_reqs, k, a.rate, watch)
                devices, routed = launcher.status()
                res.update(replicas=n, deploy_s=start_s, loadavg_1m_start=load0, devices=devices, routed=routed)
            finally:
                launcher.down()
            runs.append(res)
            for r in (res, res.get("poisson")):
                if r:
                    print(
                        f"replicas={n} [{r['mode']}]: {r['output_throughput']:8.1f} out tok/s  "
                        f"{r['request_throughput']:6.2f} req/s  TTFT p50 {r['ttft_ms']['median']:7.1f} ms "
                        f"p99 {r['ttft_ms']['p99']:7.1f} ms  TPOT p50 {r['tpot_ms']['median']:6.2f} ms  "
                        f"failed {r['failed']}  cpu {r['cpu_cores_used']}  routed {res['routed']}",
                        flush=True,
                    )
    finally:
        launcher.close()
    base = runs[0]["output_throughput"]
    for r in runs:
        r["speedup_vs_first"] = r["output_throughput"] / base if base else 0.0
        if r.get("poisson") and runs[0].get("poisson"):
            p, p0 = r["poisson"], runs[0]["poisson"]
            p["speedup_vs_first"] = p["output_throughput"] / p0["output_throughput"]
            p["ttft_p99_vs_first"] = p["ttft_ms"]["p99"] / p0["ttft_ms"]["p99"]
    out = {
        "bench": "scaleout",
        # the replicas own the GPUs: their names from nvidia-smi, not CUDA in this process
        **metadata(a.commit or git_commit(), [Path(sys.executable).name, *sys.argv], gpu=smi_gpu_name()),
        "gpus": smi_gpu_names() or ["none: emulated replicas on CPU"],
        "cpus": os.cpu_count(),
        "loadavg_1m_end": os.getloadavg()[0],  # other work on the machine skews CPU-replica numbers
        "args": vars(a),
        "load": {"dataset": a.dataset, "load_generator": "blink bench serve (blink/benchmark.py)"},
        "runs": runs,
    }
    if a.per_replica:
        out["per_replica_load"] = {"requests": a.requests, "concurrency": a.concurrency, "rate": a.rate}
    path = Path(a.out or ROOT / "bench" / "results" / f"scaleout-{a.device}-{out['commit']}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, allow_nan=False))
    print(f"wrote {path}")
    phases = runs + [r["poisson"] for r in runs if r.get("poisson")]
    return 0 if all(r["failed"] == 0 for r in phases) else 1


def _bench_args(url: str, a: argparse.Namespace, n: int, seed: int, *extra: str) -> argparse.Namespace:
    argv = ["--base-url", url, "--num-prompts", str(n), "--seed", str(seed), "--metric-percentiles", "50,90,99"]
    if a.dataset == "random":
        argv += [
            "--dataset",
            "random",
            "--random-input-len",
            str(a.input_len),
            "--random-output-len",
            str(a.output_len),
        ]
    else:
        argv += ["--dataset", "sharegpt", "--max-model-len", str(a.max_model_len)]
    return benchmark.parse_args([*argv, *extra])


async def _dataset(url: str, a: argparse.Namespace, n: int, seed: int) -> list[tuple[list[int], int]]:
    """n requests of one replica's load (the server tokenizes the prompts)."""
    import aiohttp

    args = _bench_args(url, a, n, seed)
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        return await bench_datasets.load_dataset(session, url, model, args)


def _phase(url: str, a: argparse.Namespace, reqs: list, k: int, rate: float, watch: dict[str, list[int]]) -> dict:
    """One phase on k copies of `reqs` (interleaved): closed loop with k x --concurrency streams
    (rate 0) or Poisson arrivals at k x rate. `watch` maps a role to pids whose CPU use (cores) over
    the phase is recorded."""
    load = [r for r in reqs for _ in range(k)]
    extra = ["--max-concurrency", str(a.concurrency * k)] if not rate else ["--request-rate", str(rate * k)]
    args = _bench_args(url, a, len(load), a.seed, *extra)
    cpu0 = {role: [cpu_seconds(p) for p in pids] for role, pids in watch.items()}
    t0 = time.monotonic()
    res = asyncio.run(benchmark.run(args, reqs=load))
    dt = time.monotonic() - t0
    res["cpu_cores_used"] = {
        role: [round((cpu_seconds(p) - c) / dt, 3) for p, c in zip(pids, cpu0[role], strict=True)]
        for role, pids in watch.items()
    }
    res["mode"] = f"closed loop, {a.concurrency * k} streams" if not rate else f"poisson {rate * k:g} req/s"
    del res["timeline"]
    return res


if __name__ == "__main__":
    raise SystemExit(main())
