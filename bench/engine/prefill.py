"""Prefill throughput of the CUDA engine: one prompt of 1k and of 4k tokens (Llama-3-8B shape,
all 32 layers, random bf16 weights), graph launched from the host, timed with CUDA events.

    python -m bench.engine.prefill --out bench/results/prefill_h200.json
    python -m bench.engine.prefill --lengths 16x256,1024 --breakdown --gemm-rows 256,4096

A length "SxL" is S prompts of L tokens packed into one step (what the scheduler's inline prefill
runs: 16 x 256 fills the 4096-token bucket). --breakdown also times each kernel category of the
step as a graph of its own (as bench/engine/decode.py does). --gemm-rows times each of a layer's GEMM
shapes at those row counts, as the engine calls it (cublasGemmEx, default algorithm) and, when
torch is importable, torch.matmul on the same GPU (cuBLASLt with its own heuristics): where a
prefill step's GEMM time stands against what the library can do.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.common import (
    CATEGORIES,
    add_commit_arg,
    category_times,
    load_synthetic,
    metadata,
    preset_config,
    print_breakdown,
    time_ms,
    write_json,
)
from blink.gpu.engine.engine import Engine, EngineConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=0, help="0 = the preset's")
    ap.add_argument("--lengths", default="1024,4096", help='prompt lengths; "SxL" = S prompts of L tokens in one step')
    ap.add_argument("--breakdown", action="store_true", help="time each kernel category on its own")
    ap.add_argument("--gemm-rows", default="", help="row counts at which each layer GEMM shape is timed alone")
    ap.add_argument("--iters", type=int, default=5)
    add_commit_arg(ap)
    ap.add_argument("--out", default="bench/results/prefill.json")
    a = ap.parse_args(argv)
    cfg = preset_config(a.model, a.layers)
    shapes = [(int(x.split("x")[0]), int(x.split("x")[1])) if "x" in x else (1, int(x)) for x in a.lengths.split(",")]
    bs = 16
    tmax = max(n * m for n, m in shapes)
    cmax = max(m for _, m in shapes)
    per_seq = -(-cmax // bs)
    ecfg = EngineConfig(
        max_seqs=max(n for n, _ in shapes),
        max_num_batched_tokens=tmax,
        max_context=cmax,
        block_size=bs,
        num_kv_blocks=max(n for n, _ in shapes) * per_seq,
        batch_buckets=tuple(sorted({n for n, _ in shapes})),
        token_buckets=tuple(sorted({n * m for n, m in shapes})),
    )
    eng = Engine.create(cfg, ecfg)
    rep = eng.capture(decode=False, prefill=True)
    rng = np.random.default_rng(0)
    rows = []
    breakdown: dict[str, dict[str, float]] = {}
    for S, m in shapes:
        n = S * m
        load_synthetic(eng, S, m, m, rng)  # S whole prompts of m tokens in one step
        label = f"{S}x{m}" if S > 1 else str(m)
        variants = {"fa2": lambda S=S, n=n: eng.driver.graph_launch(eng.pick_exec(S, n, False), eng.s)}
        for name, fn in variants.items():
            ms = time_ms(fn, eng.stream, iters=a.iters, warmup=2)
            flops = 2 * n * (eng.weights.bytes_per_step / 2) + 4 * S * m * m / 2 * cfg.q_size * cfg.num_layers
            rows.append(
                {
                    "prompt_tokens": n,
                    "prompts": S,
                    "shape": label,
                    "attention": name,
                    "ms": ms,
                    "tokens_per_s": n / ms * 1e3,
                    "TFLOPs": flops / ms / 1e9,
                }
            )
        if a.breakdown:  # each kernel category as a graph of its own (same launches as the step)
            breakdown[label] = category_times(eng, S, n, False, CATEGORIES, a.iters, warmup=2)
    gemm = gemm_compare(eng, cfg, [int(x) for x in a.gemm_rows.split(",") if x], a.iters) if a.gemm_rows else []
    res = {
        **metadata(a.commit, argv),
        "model": cfg.name,
        "layers": cfg.num_layers,
        "capture": {"graphs": rep.graphs, "seconds": rep.seconds},
        "rows": rows,
        "breakdown_ms": breakdown,
        "gemm": gemm,
    }
    write_json(a.out, res)
    print(f"\n{'prompt':>8} {'attention':>9} {'ms':>9} {'tok/s':>9} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['shape']:>8} {r['attention']:>9} {r['ms']:9.2f} {r['tokens_per_s']:9.0f} {r['TFLOPs']:8.1f}")
    print_breakdown("prefill", breakdown)
    for g in gemm:
        print(
            f"gemm rows {g['rows']:>5} {g['name']:>8} ({g['n_out']}x{g['k']}): engine {g['engine_ms']:.3f} ms "
            f"{g['engine_TFLOPs']:6.1f} TFLOP/s; torch {g.get('torch_ms', float('nan')):.3f} ms "
            f"{g.get('torch_TFLOPs', float('nan')):6.1f} TFLOP/s"
        )
    eng.close()
    return 0


def _bf16(shape: tuple[int, int], scale: float):
    """Random bf16 values (as uint16 bit patterns) on the GPU: the top half of float32 normals."""
    import cupy as cp

    f = cp.random.standard_normal(shape, dtype=cp.float32) * scale
    return (f.view(cp.uint32) >> 16).astype(cp.uint16)


def gemm_compare(eng, cfg, row_counts: list[int], iters: int) -> list[dict]:
    """Each GEMM shape of one layer at each row count: the engine's call (Cublas.linear, on the
    engine's stream and workspace) and torch.matmul (if torch imports), same shapes, bf16."""
    import cupy as cp

    H, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    layer = {"qkv": (q + 2 * kv, H), "o": (H, q), "gate_up": (2 * inter, H), "down": (H, inter)}
    try:
        import torch
    except ImportError:
        torch = None
    out = []
    for rows in row_counts:
        for name, (n_out, k) in layer.items():
            w, x = _bf16((n_out, k), 0.02), _bf16((rows, k), 1.0)
            y = cp.empty((rows, n_out), cp.uint16)
            args = (int(x.data.ptr), int(w.data.ptr), int(y.data.ptr), rows, n_out, k)
            flops = 2 * rows * n_out * k
            ms = time_ms(lambda args=args: eng.cublas.linear(*args), eng.stream, iters=iters * 4)
            r = {"rows": rows, "name": name, "n_out": n_out, "k": k, "engine_ms": ms, "engine_TFLOPs": flops / ms / 1e9}
            if torch is not None:
                tw = torch.randn(n_out, k, device="cuda", dtype=torch.bfloat16) * 0.02
                tx = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                for _ in range(3):
                    tx @ tw.t()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(iters * 4):
                    tx @ tw.t()
                e1.record()
                e1.synchronize()
                tms = e0.elapsed_time(e1) / (iters * 4)
                r.update(torch_ms=tms, torch_TFLOPs=flops / tms / 1e9)
            out.append(r)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
