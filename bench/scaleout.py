"""Data-parallel scale-out through the HTTP endpoint: the same ShareGPT-like load on 1 replica, then 2.

Each point is a fresh deployment (blink.actors.deploy: GPU actors one per GPU, deploy.frontends
frontend actors on one HTTP port; --frontends 0 = one per replica), driven through HTTP by the
load generator of bench/loadgen.py (one client process per 32 streams: never the bottleneck),
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
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen import OUTPUT_LN, PROMPT_LN, drive, poisson_offsets, sharegpt_like  # noqa: E402

from blink.actors import deploy  # noqa: E402
from blink.actors.config import DeployConfig, from_mapping  # noqa: E402
from blink.actors.frontend_actor import wait_http  # noqa: E402
from blink.treedigest import tree_digest  # noqa: E402

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
