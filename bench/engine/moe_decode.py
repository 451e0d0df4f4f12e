"""Decode step time of Qwen3-30B-A3B on the CUDA engine (all 48 layers, random bf16 weights, context
1024) as a fraction of this GPU's copy bandwidth, counting only the bytes a step reads: attention,
router, the experts the step's tokens picked (k = 8 per layer at batch 1), final norm and LM head
(the embedding's gathered rows are not counted, as bench/engine/decode.py does not count them), and the
K/V of every sequence's context.

    python -m bench.engine.moe_decode --out bench/results/moe_decode_h200.json [--batches 1,8,32] [--layers 48]

--compare also times, at every batch, the same step with each other MoE expert path forced (rows
"pair", "gemv", "mma", "mma64": MoeLaunches' thresholds moved for that capture), to place the
thresholds (PAIR_MAX_TOKENS, MMA_MIN_TOKENS, BIG_TILE_MIN_TOKENS in blink/gpu/engine/moe_launch.py).

Experts read at batch b > 1: the distinct experts of the last MoE layer in the timed step
(topk_ids on the device after the step), taken for every layer. The per-category breakdown at
batch 1 times each kernel category's launches as a graph of their own ("moe": route, align, the two
expert GEMVs and the combine; the router projection too at batches of at most 4, moe_router_t<T>, above
that it is in "gemm").
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np

from bench.common import (
    CATEGORIES,
    add_commit_arg,
    alternate,
    category_times,
    copy_fraction,
    decode_engine,
    decode_engine_config,
    load_synthetic,
    metadata,
    preset_config,
    print_breakdown,
    step_launch,
    step_rates,
    time_ms,
    write_json,
)
from blink.gpu.engine.engine import Engine

PATHS = ("pair", "gemv", "mma", "mma64")


@contextlib.contextmanager
def forced(moe, path: str):
    """MoeLaunches with one expert path at every bucket while a variant is captured."""
    saved = (moe.pair_max_tokens, moe.mma_min_tokens, moe.big_tile_min_tokens)
    moe.pair_max_tokens = 1 << 30 if path == "pair" else 0
    moe.mma_min_tokens = 1 << 30 if path == "gemv" else 0
    moe.big_tile_min_tokens = 0 if path == "mma64" else 1 << 30
    try:
        yield
    finally:
        moe.pair_max_tokens, moe.mma_min_tokens, moe.big_tile_min_tokens = saved


def experts_hit(eng: Engine, batch: int) -> int:
    """Distinct experts of the last MoE layer in the last step (of `batch` one-token sequences)."""
    eng.stream.synchronize()  # type: ignore[attr-defined]
    k = eng.config.num_experts_per_tok
    return len(set(eng.fwd.moe.topk_ids[: batch * k].get().tolist()))  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=0, help="0 = the preset's")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--breakdown", default="1", help="batches whose kernel categories are timed one by one")
    ap.add_argument("--compare", action="store_true", help="also time every other MoE expert path at each batch")
    add_commit_arg(ap)
    ap.add_argument("--out", default="bench/results/moe_decode.json")
    a = ap.parse_args(argv)
    cfg = preset_config(a.model, a.layers)
    if not cfg.is_moe:
        raise SystemExit(f"{cfg.name} is not a mixture of experts (bench/engine/decode.py times dense models)")
    batches = [int(x) for x in a.batches.split(",")]
    ctx = a.context
    eng, rep, bw = decode_engine(cfg, decode_engine_config(batches, ctx))
    kv_per_token = cfg.num_layers * 2 * cfg.kv_size * 2
    rng = np.random.default_rng(0)
    rows, breakdown = [], {}
    for b in batches:
        load_synthetic(eng, b, 1, ctx, rng)
        ms = time_ms(step_launch(eng, b), eng.stream, iters=a.iters)
        hit = experts_hit(eng, b)
        moved = eng.weights.active_bytes_per_step(hit) + b * ctx * kv_per_token
        rows.append({"batch": b, "variant": "engine", "experts_read_per_layer": hit, **step_rates(b, ms, moved, bw)})
        if a.compare:
            for path in PATHS:
                with forced(eng.fwd.moe, path):
                    execs = eng.capture_variant(b, b, True)
                pms = time_ms(alternate(eng, execs), eng.stream, iters=a.iters)
                rows.append(
                    {"batch": b, "variant": path, "ms_per_step": pms, "frac_of_copy_bw": copy_fraction(moved, pms, bw)}
                )
        if str(b) in a.breakdown.split(","):
            breakdown[str(b)] = category_times(eng, b, b, True, [c for c in CATEGORIES if c != "swiglu"], a.iters)
    res = {
        **metadata(a.commit, argv),
        "model": cfg.name,
        "layers": cfg.num_layers,
        "context": ctx,
        "all_weight_bytes": eng.weights.nbytes,
        "active_weight_bytes_batch1": eng.weights.active_bytes_per_step(),
        "copy_bandwidth": bw,
        "capture": {"graphs": rep.graphs, "seconds": rep.seconds, "decode_graph_nodes_max": rep.nodes_decode_max},
        "rows": rows,
        "breakdown_ms": breakdown,
    }
    write_json(a.out, res)
    print(
        f"\n{cfg.name} x{cfg.num_layers} layers: weights {eng.weights.nbytes / 1e9:.1f} GB, read at batch 1 "
        f"{eng.weights.active_bytes_per_step() / 1e9:.2f} GB; copy bandwidth {bw['read_plus_write_GBps']:.0f} GB/s"
    )
    print(
        f"{'batch':>5} {'variant':>7} {'ms/step':>8} {'tok/s':>9} {'experts':>7} {'GB/step':>8} {'GB/s':>7} {'of copy':>7}"
    )
    for r in rows:
        if r["variant"] != "engine":
            print(
                f"{r['batch']:>5} {r['variant']:>7} {r['ms_per_step']:8.3f} {'':>9} {'':>7} {'':>8} {'':>7} {r['frac_of_copy_bw']:7.1%}"
            )
            continue
        print(
            f"{r['batch']:>5} {'engine':>7} {r['ms_per_step']:8.3f} {r['tokens_per_s']:9.0f} {r['experts_read_per_layer']:>7} "
            f"{r['bytes_per_step'] / 1e9:8.2f} {r['GBps']:7.0f} {r['frac_of_copy_bw']:7.1%}"
        )
    print_breakdown("batch", breakdown)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
