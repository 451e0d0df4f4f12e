"""Prefill throughput of the CUDA engine: one prompt of 1k and of 4k tokens (Llama-3-8B shape,
all 32 layers, random bf16 weights), graph launched from the host, timed with CUDA events.

    python bench/prefill.py --out bench/results/prefill_h200.json
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from blink.gpu.benchutil import metadata, time_ms, write_json
from blink.gpu.engine import Engine, EngineConfig
from blink.models.config import preset


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=0, help="0 = the preset's")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default="bench/results/prefill.json")
    a = ap.parse_args(argv)
    cfg = preset(a.model)
    if a.layers:
        cfg = cfg.replace(num_layers=a.layers)
    lengths = [int(x) for x in a.lengths.split(",")]
    tmax, bs = max(lengths), 16
    ecfg = EngineConfig(
        max_seqs=1,
        max_tokens=tmax,
        max_context=tmax,
        block_size=bs,
        num_kv_blocks=tmax // bs,
        batch_buckets=(1,),
        token_buckets=tuple(lengths),
    )
    eng = Engine.create(cfg, ecfg)
    rep = eng.capture(decode=False, prefill=True)
    rng = np.random.default_rng(0)
    h = eng.arena.host
    rows = []
    for n in lengths:
        h["num_seqs"][0], h["num_tokens"][0] = 1, n
        h["input_ids"][:n] = rng.integers(0, cfg.vocab_size, n)
        h["positions"][:n] = np.arange(n)
        h["cu_q_lens"][:2] = (0, n)
        h["seq_lens"][0] = n
        h["temperature"][0] = 0.0
        h["block_tables"][: tmax // bs] = np.arange(tmax // bs)
        eng.arena.upload(eng.s, 1)
        variants = {ecfg.prefill_attention: lambda n=n: eng.driver.graph_launch(eng.pick_exec(1, n, False), eng.s)}
        for other in ("smem", "rego"):
            if other != ecfg.prefill_attention:
                eng.fwd.set_prefill_attention(other)
                execs = eng.capture_variant(1, n, False)
                eng.fwd.set_prefill_attention(ecfg.prefill_attention)
                it = iter(range(10**9))
                variants[other] = lambda execs=execs, it=it: eng.driver.graph_launch(execs[next(it) % 2], eng.s)
        for name, fn in variants.items():
            ms = time_ms(fn, eng.stream, iters=a.iters, warmup=2)
            flops = 2 * n * (eng.weights.bytes_per_step / 2) + 4 * n * n / 2 * cfg.q_size * cfg.num_layers
            rows.append(
                {
                    "prompt_tokens": n,
                    "attention": name,
                    "ms": ms,
                    "tokens_per_s": n / ms * 1e3,
                    "TFLOPs": flops / ms / 1e9,
                }
            )
    res = {
        **metadata(a.commit, argv if argv is not None else sys.argv),
        "model": cfg.name,
        "layers": cfg.num_layers,
        "capture": {"graphs": rep.graphs, "seconds": rep.seconds},
        "rows": rows,
    }
    write_json(a.out, res)
    print(f"\n{'prompt':>7} {'attention':>9} {'ms':>9} {'tok/s':>9} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['attention']:>9} {r['ms']:9.2f} {r['tokens_per_s']:9.0f} {r['TFLOPs']:8.1f}")
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
