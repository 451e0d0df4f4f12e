"""End-to-end throughput through the ring: 256 requests x (256 prompt -> 128 output) on a random
Llama-3-8B (bf16), GPU-resident scheduler (and the host-driven loop for comparison).

    python bench/throughput.py --out bench/results/throughput_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sched_common import device_name, make_engine, serve_workload  # noqa: E402


def run(eng, n: int = 256, prompt: int = 256, new: int = 128, schedulers=("gpu", "host")) -> dict:
    out = {"requests": n, "prompt": prompt, "output": new}
    for sched in schedulers:
        args = ["--n", str(n), "--prompt", str(prompt), "--new", str(new), "--concurrency", str(n)]
        r = serve_workload(eng, sched, args, n, prompt, 2 * new)
        assert r["tokens"] == n * new, r
        out[sched] = r
        print(f"throughput {sched}: {r['tok_per_s']:9.0f} output tok/s (makespan {r['makespan_s']:.3f} s)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    eng = make_engine(a.preset, 256, 4096, 2048)
    res = {"bench": "throughput", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": device_name(),
           "preset": a.preset, "command": " ".join(sys.argv), **run(eng)}  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
