"""Inspect a model and generate greedily with the numpy engine, no ring involved.

    python -m blink.device.generate [--model SPEC] [--max-tokens N] "prompt" ["prompt" ...]

Prompts are wrapped in the chat template and decoded together as one batch.
"""

from __future__ import annotations

import argparse
import sys
import time

from blink.device.numpy_executor import NumpyExecutor
from blink.models.reference import PagedDriver
from blink.models.registry import resolve_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blink.device.generate", description=__doc__.splitlines()[0])
    ap.add_argument("prompts", nargs="+")
    ap.add_argument("--model", default="default", help="default | path.gguf | HF dir | random:<preset>")
    ap.add_argument("--cache-dir", default=None, help="model cache (default ~/.cache/blink/models)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    b = resolve_model(args.model, cache_dir=args.cache_dir, progress=True)
    c = b.config
    print(
        f"{b.name}: {c.arch}, {c.num_layers} layers, hidden {c.hidden_size}, heads {c.num_heads}/{c.num_kv_heads}, "
        f"vocab {c.vocab_size}, {c.num_params() / 1e6:.1f}M params (loaded in {time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
    )
    prompts = [b.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in args.prompts]
    block = 16
    width = -(-(max(map(len, prompts)) + args.max_tokens) // block)
    n = len(prompts)
    ex = NumpyExecutor(c, b.weights, n * width, block, n, sum(map(len, prompts)), max_blocks_per_seq=width)
    drv = PagedDriver(n * width, block, width, shuffle_seed=None)
    t1 = time.perf_counter()
    last = ex.execute(drv.step(list(enumerate(prompts)))).tolist()
    t2 = time.perf_counter()
    outs = [[t] for t in last]
    live = [t not in b.tokenizer.eos_token_ids and args.max_tokens > 1 for t in last]
    steps = 0
    while any(live):
        rows = [i for i in range(n) if live[i]]
        new = ex.execute(drv.step([(i, [outs[i][-1]]) for i in rows])).tolist()
        steps += 1
        for i, t in zip(rows, new, strict=True):
            outs[i].append(t)
            live[i] = t not in b.tokenizer.eos_token_ids and len(outs[i]) < args.max_tokens
    t3 = time.perf_counter()
    for p, o in zip(args.prompts, outs, strict=True):
        print(f"> {p}\n{b.tokenizer.decode(o)}\n")
    generated = sum(map(len, outs))
    print(
        f"prefill {sum(map(len, prompts))} tokens in {t2 - t1:.2f} s; decode {generated - n} tokens in "
        f"{steps} steps, {(generated - n) / max(t3 - t2, 1e-9):.1f} tok/s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
