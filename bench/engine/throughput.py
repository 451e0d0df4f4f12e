"""End-to-end throughput through the ring: 256 requests x (256 prompt -> 128 output) on random bf16
weights of a preset's real shape, GPU-resident scheduler (and the host-driven loop for comparison).

    python -m bench.engine.throughput --out bench/results/throughput_h200.json            # Llama-3-8B, both schedulers

With --presets, each model runs in its own process (one model's weights on the GPU at a time, its
memory given back when the process ends), and each also reports its batch-1 decode step against this
GPU's copy bandwidth (bytes read per step as common.decode_bytes counts them: for a MoE model only
the experts a step routes to). A model the CUDA engine refuses is recorded as skipped with the reason.

    python -m bench.engine.throughput --presets llama3-8b,phi-4,qwen3-32b,qwen3-30b-a3b --schedulers gpu \\
        --commit $(git rev-parse --short HEAD) --out bench/results/models-h200-<commit>.json

--quantization fp8: the dense projections in FP8 (EngineConfig.quantization); the batch-1 step's bytes
are then the engine's own count (1-byte codes, fp32 scales, the rest bf16). MoE presets are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from bench.common import (
    add_commit_arg,
    copy_bandwidth,
    decode_bytes,
    gpu_name,
    load_synthetic,
    metadata,
    time_ms,
    write_json,
)
from bench.scheduler.harness import make_engine, serve_workload

DECODE_CONTEXT = 1024  # bench/engine/decode.py's


def run(eng, n: int = 256, prompt: int = 256, new: int = 128, schedulers=("gpu", "host")) -> dict:
    out = {"requests": n, "prompt": prompt, "output": new}
    for sched in schedulers:
        args = ["--n", str(n), "--prompt", str(prompt), "--new", str(new), "--concurrency", str(n)]
        r = serve_workload(eng, sched, args, n, prompt, 2 * new)
        assert r["tokens"] == n * new, r
        out[sched] = r
        print(f"throughput {sched}: {r['tok_per_s']:9.0f} output tok/s (makespan {r['makespan_s']:.3f} s)", flush=True)
    return out


def decode_b1(eng, bandwidth: dict, context: int = DECODE_CONTEXT, iters: int = 50) -> dict:
    """One sequence at `context` tokens: ms per decode step (its captured graph launched back to back)
    and the bytes it reads against the copy bandwidth (read + write, as bench/engine/decode.py)."""
    import numpy as np

    cfg = eng.config
    moved = decode_bytes(cfg, 1, context)
    # one count of a step's bytes: the engine's own weights (MoE: the top-k experts of each layer) say the same
    rows = 2 * cfg.hidden_size * (not cfg.tie_word_embeddings)
    if eng.ecfg.quantization:  # FP8 projections: the engine's count (1-byte codes, fp32 scales, the rest bf16)
        moved["weights"] = eng.weights.active_bytes_per_step() + rows
        moved["total"] = moved["weights"] + moved["kv"]
    if eng.ecfg.kv_cache_dtype == "fp8":  # one byte a K/V value
        moved["kv"] //= 2
        moved["total"] = moved["weights"] + moved["kv"]
    assert moved["weights"] == eng.weights.active_bytes_per_step() + rows, (moved, eng.weights.active_bytes_per_step())
    load_synthetic(eng, 1, 1, context, np.random.default_rng(0))
    ms = time_ms(lambda: eng.driver.graph_launch(eng.pick_exec(1, 1, True), eng.s), eng.stream, iters=iters)
    gbps = moved["total"] / ms / 1e6
    return {
        "context": context,
        "ms_per_step": ms,
        "tokens_per_s": 1e3 / ms,
        "bytes_per_step": moved,
        "GBps": gbps,
        "frac_of_copy_bw": gbps / bandwidth["read_plus_write_GBps"],
        "frac_of_read_bw": gbps / bandwidth["read_GBps"],
    }


def one_model(
    preset_name: str,
    layers: int,
    schedulers: tuple[str, ...],
    n: int,
    prompt: int,
    new: int,
    quantization: str = "",
    fp8_gemm: str = "",
    kv_cache_dtype: str = "auto",
    fp8_fast_accum: bool = False,
) -> dict:
    """Everything measured on one preset (in this process); `skipped` when the CUDA engine refuses it."""
    from blink.models.config import UnsupportedModelError, preset
    from blink.models.registry import check_device

    cfg = preset(preset_name)
    if layers:
        cfg = cfg.replace(num_layers=layers)
    res: dict = {
        "preset": preset_name,
        "quantization": quantization or "bf16",
        "kv_cache_dtype": kv_cache_dtype,
        "layers": cfg.num_layers,
        "decode_bytes_b1": decode_bytes(cfg, 1, DECODE_CONTEXT),
    }
    res["params"], res["active_params"] = cfg.num_params(), cfg.num_params(active=True)
    t0 = time.perf_counter()
    try:
        check_device(f"random:{preset_name}", "cuda")  # what `blink serve --device cuda` refuses, before any CUDA
        eng = make_engine(
            preset_name, 256, 4096, 2048, layers=layers, quantization=quantization, fp8_gemm=fp8_gemm,
            kv_cache_dtype=kv_cache_dtype, fp8_fast_accum=fp8_fast_accum,
        )  # fmt: skip
    except (UnsupportedModelError, ValueError) as e:  # ValueError: fp8 on a MoE model
        return {**res, "skipped": str(e)}
    build_s = time.perf_counter() - t0
    if eng.fwd.fp8:
        res["fp8_path"] = eng.fwd.fp8_path  # past the FP8 GEMV (EngineConfig.fp8_gemm)
        res["fp8_fast_accum"] = fp8_fast_accum
    import cupy as cp

    bw = copy_bandwidth(1 << 30)  # 2 x 1 GB: what the KV pool (85% of the free memory) leaves room for
    cp.get_default_memory_pool().free_all_blocks()
    res["device"] = gpu_name()
    res["copy_bandwidth"] = bw
    res["engine"] = {
        "build_s": build_s,
        "kv_blocks": eng.dims.num_blocks,
        "weight_bytes": eng.weights.nbytes,
        "graphs": eng.report.graphs,
        "capture_s": eng.report.seconds,
    }
    res["decode_b1"] = d = decode_b1(eng, bw)
    print(
        f"{preset_name}: batch-1 decode {d['ms_per_step']:.3f} ms/step, {d['GBps']:.0f} GB/s = "
        f"{d['frac_of_copy_bw']:.1%} of copy bandwidth",
        flush=True,
    )
    res["throughput"] = run(eng, n, prompt, new, schedulers)
    eng.close()
    res["total_s"] = time.perf_counter() - t0
    return res


def run_child(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit status or None on timeout, the tail of its stderr). The child and whatever it started (the
    load generator) form one process group, killed together at the timeout; stderr goes through a
    file, echoed here, so a grandchild holding it open cannot hang the wait."""
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stderr=err, start_new_session=True)
        try:
            rc: int | None = p.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the group's leftovers (or everything, at a timeout)
        p.wait()
        err.seek(0)
        text = err.read()
    sys.stderr.write(text)
    return rc, text[-2000:]


def all_models(a: argparse.Namespace, argv: list[str]) -> int:
    """One child process per preset, one after the other; the JSON gathers them and is rewritten after
    each model, so a run cut short still leaves the models it finished."""
    out = {"bench": "models", **metadata(a.commit, argv), "models": {}, "complete": False}
    out["device"] = out["gpu"]  # models-*.json have always had both (tests/test_bench_models.py reads "device")
    failed = 0
    t_start = time.perf_counter()
    for name in a.presets.split(","):
        left = a.budget_s - (time.perf_counter() - t_start) if a.budget_s else a.timeout
        if left < 20:
            out["models"][name] = {"not_run": f"--budget-s {a.budget_s:.0f} spent"}
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, "-m", "bench.engine.throughput", "--preset", name, "--json-out", tmp.name]
            cmd += ["--schedulers", a.schedulers, "--layers", str(a.layers)]
            cmd += ["--requests", str(a.requests), "--prompt", str(a.prompt), "--new", str(a.new)]
            cmd += ["--quantization", a.quantization, "--fp8-gemm", a.fp8_gemm, "--kv-cache-dtype", a.kv_cache_dtype]
            cmd += ["--fp8-fast-accum"] if a.fp8_fast_accum else []
            t0 = time.perf_counter()
            rc, err = run_child(cmd, min(a.timeout, left))
            if rc == 0 and os.path.getsize(tmp.name) > 0:
                res = json.load(open(tmp.name))
            elif rc is None:
                res = {"failed": f"timed out after {min(a.timeout, left):.0f} s: {err}"}
            else:
                res = {"failed": f"rc {rc}: {err}"}
            res["wall_s"] = time.perf_counter() - t0
        failed += "failed" in res
        out["models"][name] = res
        write_json(a.out, out)
    out["complete"] = True
    write_json(a.out, out)
    work = f"{a.requests} x ({a.prompt} -> {a.new})"
    print(
        f"\n{'model':>15} {'b1 ms/step':>10} {'GB/s':>6} {'of copy':>7} {'gpu tok/s':>10}  ({work}, {a.layers or 'all'} layers)"
    )
    for name, r in out["models"].items():
        if "decode_b1" in r:
            d, t = r["decode_b1"], r["throughput"].get("gpu", {}).get("tok_per_s", float("nan"))
            print(f"{name:>15} {d['ms_per_step']:10.3f} {d['GBps']:6.0f} {d['frac_of_copy_bw']:7.1%} {t:10.0f}")
        else:
            why = r.get("skipped") or r.get("not_run") or r.get("failed")
            print(f"{name:>15} {'skipped' if 'skipped' in r else 'not run' if 'not_run' in r else 'FAILED'}: {why}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--presets", default="", help="comma-separated: each in its own process, with batch-1 decode")
    ap.add_argument("--schedulers", default="gpu,host")
    ap.add_argument("--layers", type=int, default=0, help="0: the preset's (fewer: a quick check of the script)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per model (--presets)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="seconds for all models (--presets; 0: no limit)")
    add_commit_arg(ap)
    ap.add_argument("--json-out", default="", help="(the child of --presets) where one model's result goes")
    ap.add_argument("--out", default="")
    ap.add_argument("--quantization", default="", choices=("", "fp8"), help="fp8: FP8 dense projections")
    ap.add_argument(
        "--fp8-gemm", default="", choices=("", "auto", "outer", "epilogue", "dequant"), help="EngineConfig.fp8_gemm"
    )
    ap.add_argument("--fp8-fast-accum", action="store_true", help="EngineConfig.fp8_fast_accum")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="fp8: an FP8 e4m3 KV cache")
    a = ap.parse_args(argv[1:])
    schedulers = tuple(s for s in a.schedulers.split(",") if s)
    if a.presets:
        if not a.out:
            ap.error("--presets needs --out")
        return all_models(a, argv)
    if a.json_out:
        res = one_model(
            a.preset, a.layers, schedulers, a.requests, a.prompt, a.new, a.quantization, a.fp8_gemm, a.kv_cache_dtype,
            a.fp8_fast_accum,
        )  # fmt: skip
        with open(a.json_out, "w") as f:
            json.dump(res, f)
        return 0
    eng = make_engine(
        a.preset, 256, 4096, 2048, layers=a.layers, quantization=a.quantization, fp8_gemm=a.fp8_gemm,
        kv_cache_dtype=a.kv_cache_dtype, fp8_fast_accum=a.fp8_fast_accum,
    )  # fmt: skip
    res = {"bench": "throughput", **metadata(a.commit, argv, gpu_key="device"), "preset": a.preset,
           "quantization": a.quantization or "bf16", "kv_cache_dtype": a.kv_cache_dtype,
           **run(eng, a.requests, a.prompt, a.new, schedulers)}  # fmt: skip
    if a.out:
        write_json(a.out, res)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
