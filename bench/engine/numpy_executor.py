"""Throughput of the emulated device's NumpyExecutor (prefill and batched greedy decode).

    python -m bench.engine.numpy_executor [--model default] [--batch 1 4 16] [--prompt 64] [--steps 32]

Prints a table and writes bench/results/numpy_executor.json. Each cell is the best of --repeat
runs (the CI box is shared; the best run is the least disturbed one); the median is kept too.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import numpy as np

from bench.common import RESULTS, add_commit_arg, git_commit, metadata
from blink.device.numpy_executor import NumpyExecutor
from blink.models.reference import PagedDriver
from blink.models.registry import resolve_model


def run_once(ex: NumpyExecutor, batch: int, prompt: int, steps: int, seed: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) for `batch` sequences of `prompt` tokens then `steps` steps."""
    width = ex.num_blocks // batch
    drv = PagedDriver(ex.num_blocks, ex.block_size, width, shuffle_seed=seed)
    rng = np.random.default_rng(seed)
    chunks = [(i, rng.integers(3, ex.vocab_size, prompt).tolist()) for i in range(batch)]
    t0 = time.perf_counter()
    out = ex.execute(drv.step(chunks))
    t1 = time.perf_counter()
    for _ in range(steps):
        out = ex.execute(drv.step([(i, [int(t)]) for i, t in enumerate(out)]))
    t2 = time.perf_counter()
    return batch * prompt / (t1 - t0), batch * steps / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "numpy_executor.json"))
    add_commit_arg(ap)
    args = ap.parse_args()

    bundle = resolve_model(args.model, progress=True)
    max_b = max(args.batch)
    per_seq_blocks = -(-(args.prompt + args.steps) // 16) + 1
    ex = NumpyExecutor(
        bundle.config,
        bundle.weights,
        num_blocks=max_b * per_seq_blocks,
        block_size=16,
        max_batch=max_b,
        max_num_batched_tokens=max_b * args.prompt,
    )
    run_once(ex, 1, 8, 2, seed=0)  # warm up: page in weights, BLAS threads
    rows = []
    print(
        f"{bundle.name} on {os.cpu_count()} cores, prompt {args.prompt}, {args.steps} decode steps (best of {args.repeat})"
    )
    print(f"{'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode median':>14}")
    for b in args.batch:
        runs = [run_once(ex, b, args.prompt, args.steps, seed=r) for r in range(args.repeat)]
        pre, dec = [r[0] for r in runs], [r[1] for r in runs]
        rows.append(
            dict(
                batch=b,
                prefill_tok_s=max(pre),
                decode_tok_s=max(dec),
                decode_tok_s_median=statistics.median(dec),
                prefill_tok_s_median=statistics.median(pre),
            )
        )
        print(f"{b:>5} {max(pre):>14.1f} {max(dec):>13.1f} {statistics.median(dec):>14.1f}")
    result = dict(
        **metadata(args.commit or git_commit()),
        model=bundle.name,
        machine=f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
        prompt=args.prompt,
        steps=args.steps,
        repeat=args.repeat,
        load_avg=os.getloadavg()[0],
        rows=rows,
    )
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
