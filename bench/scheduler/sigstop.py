"""Proof of CPU freedom: the process that owns the CUDA context (and launched the scheduler) is
SIGSTOPped while a load generator in another process keeps submitting and reading through the
ring. Throughput while stopped vs an equal unstopped phase just before it.

    python -m bench.scheduler.sigstop --preset llama3-8b --phase 30 --out bench/results/sigstop_h200.json

Here this benchmark process is the device owner; the load generator child sends SIGSTOP to it.
"""

from __future__ import annotations

import argparse
import os

from bench.common import add_commit_arg, metadata, write_json
from bench.scheduler.harness import make_engine, serve_workload


def run(eng, phase_s: float = 30.0, concurrency: int = 64, prompt: int = 128, new: int = 128) -> dict:
    args = ["--sigstop-pid", str(os.getpid()), "--phase", str(phase_s), "--concurrency", str(concurrency)]
    args += ["--prompt", str(prompt), "--new", str(new)]
    r = serve_workload(
        eng, "gpu", args, 2 * concurrency, prompt, 2 * new, max_batch=concurrency, timeout_s=4 * phase_s + 120
    )
    print(
        f"sigstop {phase_s:.0f} s: running {r['running_tok_per_s']:.0f} tok/s, stopped {r['stopped_tok_per_s']:.0f} tok/s, "
        f"ratio {r['ratio']:.4f}",
        flush=True,
    )
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--phase", type=float, default=30.0)
    ap.add_argument("--out", default="")
    add_commit_arg(ap)
    a = ap.parse_args()
    eng = make_engine(a.preset, 64, 1024, 1024)
    res = {"bench": "sigstop", **metadata(a.commit, gpu_key="device"), "preset": a.preset, **run(eng, a.phase)}
    if a.out:
        write_json(a.out, res)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
