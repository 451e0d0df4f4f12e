"""Data-parallel scale-out through the HTTP endpoint: the same ShareGPT-like load on 1 replica, then 2.

Each point is a fresh deployment (blink.actors.deploy: GPU actors one per GPU, one frontend
actor with the HTTP ingress), driven by a closed-loop streaming client, then stopped.

    # here (no GPU): 2 emulated replicas on CPU (one BLAS thread each), lengths scaled down
    python bench/scaleout.py --device emulated --model default --scale 0.25 --requests 32 \
        --concurrency 8 --max-batch 8 --num-kv-blocks 256
    # 2x H200: the same load on real GPUs
    python bench/scaleout.py --device cuda --model default --requests 1000 --concurrency 256
    # ... on a host without Ray (the lent GPU machines have none): same rings, router and ingress
    python bench/scaleout.py --launcher procs --device cuda --model default --requests 1000 --concurrency 256

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
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blink.actors import deploy  # noqa: E402
from blink.actors.config import DeployConfig, from_mapping  # noqa: E402
from blink.actors.frontend_actor import wait_http  # noqa: E402

NAMESPACE = f"blink-bench-{os.getpid()}"  # ring names include it: concurrent runs stay apart
BLAS_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# log-normal (mu, sigma) of token counts, fitted to ShareGPT-V3 first turns (approximate).
PROMPT_LN = (5.2, 1.0)
OUTPUT_LN = (5.3, 0.8)


def sharegpt_like(n: int, vocab: int, max_context: int, scale: float, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    p_len = np.clip((rng.lognormal(*PROMPT_LN, n) * scale).astype(int), 4, max_context // 2)
    o_len = np.clip((rng.lognormal(*OUTPUT_LN, n) * scale).astype(int), 4, max_context // 2 - 1)
    return [(rng.integers(3, vocab, int(p)).tolist(), int(o)) for p, o in zip(p_len, o_len, strict=True)]


async def _one(session, url: str, model: str, prompt: list[int], n_out: int) -> dict:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True}
    # continuous_usage_stats: every token batch comes as a chunk with the count so far, so tokens are
    # timed even when they decode to no text (random-weight models emit many such tokens).
    body.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    t0 = time.perf_counter()
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
                    t_first = time.perf_counter()
    t1 = time.perf_counter()
    ttft = (t_first or t1) - t0
    return {"ttft": ttft, "e2e": t1 - t0, "tokens": n_tok, "tpot": (t1 - t0 - ttft) / max(n_tok - 1, 1)}


async def drive(url: str, model: str, reqs: list[tuple[list[int], int]], concurrency: int) -> dict:
    import aiohttp

    queue = list(reversed(reqs))
    results: list[dict] = []

    async def worker(session) -> None:
        while queue:
            prompt, n_out = queue.pop()
            results.append(await _one(session, url, model, prompt, n_out))

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tok = sum(r["tokens"] for r in ok)

    def pct(key: str, q: float) -> float:
        return float(np.percentile([r[key] for r in ok], q)) if ok else float("nan")

    return {
        "requests": len(results),
        "errors": len(errors),
        "first_errors": errors[:3],
        "output_tokens": tok,
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "wall_s": wall,
        "output_tok_per_s": tok / wall,
        "requests_per_s": len(ok) / wall,
        "ttft_p50_s": pct("ttft", 50),
        "ttft_p99_s": pct("ttft", 99),
        "tpot_p50_s": pct("tpot", 50),
        "tpot_p99_s": pct("tpot", 99),
        "e2e_p50_s": pct("e2e", 50),
    }


def config(a: argparse.Namespace, replicas: int) -> DeployConfig:
    dev = {"kind": a.device, "max_batch": a.max_batch}
    if a.num_kv_blocks:
        dev["num_kv_blocks"] = a.num_kv_blocks
    return from_mapping(
        {
            "deploy": {"name": f"scaleout{replicas}", "namespace": NAMESPACE, "replicas": replicas},
            "device": dev,
            "model": {"spec": a.model},
            "ring": {"n_slots": a.n_slots},
            "server": {"port": 0},
        }
    )


class RayLauncher:
    """The deployment as `blink deploy` places it: GPU actors one per GPU, one frontend actor."""

    def __init__(self, a: argparse.Namespace, max_replicas: int):
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # edge of a benchmark script
        init = {"address": a.address, "namespace": NAMESPACE, "include_dashboard": False, "log_to_driver": False}
        threads = str(a.blas_threads)
        init["runtime_env"] = {"env_vars": {k: threads for k in BLAS_VARS}}
        if a.address == "local":
            init["num_cpus"] = max(os.cpu_count() or 1, 1 + max_replicas)
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
        return [r.get("device") for r in st["replicas"]], [r["requests"] for r in st["frontend"]["replicas"]]

    def down(self) -> None:
        deploy.stop(self._cfg)
        self._deployment = None

    def close(self) -> None:
        import ray

        ray.shutdown()


class ProcLauncher:
    """The same pieces without Ray (for machines without it, e.g. the lent GPU hosts): one engine
    process per replica pinned with CUDA_VISIBLE_DEVICES, the frontend roles in one process
    (python -m blink.actors.frontend_actor), the same rings, router and HTTP ingress."""

    def __init__(self, a: argparse.Namespace, max_replicas: int):
        for k in BLAS_VARS:
            os.environ[k] = str(a.blas_threads)  # inherited by the engine processes
        self._engines: list = []
        self._rings: list = []
        self._frontend: subprocess.Popen | None = None
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
        cmd = [sys.executable, "-m", "blink.actors.frontend_actor", "--config-json", cfg.to_json()]
        cmd += ["--replicas", str(cfg.deploy.replicas)]
        self._frontend = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        for line in self._frontend.stderr:
            if "serving on " in line:
                return line.rsplit("serving on ", 1)[1].strip()
        raise RuntimeError(f"frontend exited with {self._frontend.wait()}")

    def status(self) -> tuple[list, list]:
        return [self._device] * len(self._engines), []

    def down(self) -> None:
        if self._frontend is not None:
            self._frontend.terminate()
            self._frontend.wait(30)
        for e in self._engines:
            e.stop(30.0)
        for t in self._rings:
            t.unlink()
            t.close()
        self._engines, self._rings, self._frontend = [], [], None

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
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="client streams in flight")
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
            cfg = config(a, n)
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            url = launcher.up(cfg)
            try:
                wait_http(url, cfg.deploy.start_timeout_s)
                start_s = time.perf_counter() - t0
                with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                    card = json.loads(r.read())["data"][0]
                reqs = sharegpt_like(a.requests, _vocab(a.model), card["max_model_len"], a.scale, a.seed)
                asyncio.run(drive(url, card["id"], reqs[: max(4, a.concurrency)], a.concurrency))  # warm-up
                res = asyncio.run(drive(url, card["id"], reqs, a.concurrency))
                devices, routed = launcher.status()
                res.update(replicas=n, deploy_s=start_s, loadavg_1m_start=load0, devices=devices, routed=routed)
            finally:
                launcher.down()
            runs.append(res)
            print(
                f"replicas={n}: {res['output_tok_per_s']:8.1f} out tok/s  {res['requests_per_s']:6.2f} req/s  "
                f"TTFT p50 {res['ttft_p50_s'] * 1e3:7.1f} ms p99 {res['ttft_p99_s'] * 1e3:7.1f} ms  "
                f"TPOT p50 {res['tpot_p50_s'] * 1e3:6.2f} ms  errors {res['errors']}  routed {res['routed']}",
                flush=True,
            )
    finally:
        launcher.close()
    base = runs[0]["output_tok_per_s"]
    for r in runs:
        r["speedup_vs_first"] = r["output_tok_per_s"] / base if base else float("nan")
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = {
        "bench": "scaleout",
        "date": date,
        "gpus": gpu_names() or ["none: emulated replicas on CPU"],
        "cpus": os.cpu_count(),
        "loadavg_1m_end": os.getloadavg()[0],  # other work on the machine skews CPU-replica numbers
        "commit": a.commit or _git("rev-parse", "HEAD")
        + ("-dirty" if _git("status", "--porcelain", "--", "blink", "bench") else ""),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": vars(a),
        "load": {"kind": "sharegpt-like lognormal", "prompt_ln": PROMPT_LN, "output_ln": OUTPUT_LN},
        "runs": runs,
    }
    path = Path(a.out or ROOT / "bench" / "results" / f"scaleout-{a.device}-{date[:10]}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["errors"] == 0 for r in runs) else 1


def _vocab(spec: str) -> int:
    from blink.dpu.tokenizer import load_tokenizer

    return load_tokenizer(spec).info.vocab_size


if __name__ == "__main__":
    raise SystemExit(main())
