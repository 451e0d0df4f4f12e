"""Every scheduler benchmark in one process on one engine (one build of the graphs):
throughput (256 x 256->128), the same under CPU stress, the Fig. 3 ablation, SIGSTOP.

    python -m bench.scheduler.suite --preset llama3-8b --out DIR [--phase 30] [--skip ablation,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import add_commit_arg, metadata
from bench.engine import throughput
from bench.scheduler import ablation, sigstop
from bench.scheduler.harness import make_engine


def stressed(fn, n_procs: int):
    """Run fn() with n busy-looping processes (one per core) competing for the CPUs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n_procs)]
    try:
        time.sleep(0.5)
        return fn()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", type=float, default=30.0)
    ap.add_argument("--skip", default="")
    ap.add_argument("--small", action="store_true", help="small sizes: checks the benchmarks themselves")
    ap.add_argument("--kv-blocks", type=int, default=0, help="KV pool in blocks (0: from free memory)")
    add_commit_arg(ap)
    ap.add_argument("--gemm-sm-reserve", type=int, default=-1, help="EngineConfig.gemm_sm_reserve (-1: its default)")
    a = ap.parse_args()
    skip = set(a.skip.split(",")) - {""}
    os.makedirs(a.out, exist_ok=True)
    eng = make_engine(
        a.preset,
        256,
        4096,
        2048,
        kv_blocks=a.kv_blocks or (8192 if a.small else 0),
        gemm_sm_reserve=a.gemm_sm_reserve,
    )
    tput = (lambda: throughput.run(eng, 64, 64, 32)) if a.small else (lambda: throughput.run(eng))
    meta = {**metadata(a.commit, gpu_key="device"), "preset": a.preset}
    meta["engine"] = {
        "kv_blocks": eng.dims.num_blocks,
        "graphs": eng.report.graphs,
        "capture_s": eng.report.seconds,
        "gemm_sm_reserve": eng.ecfg.gemm_sm_reserve,
    }
    summary = []

    def save(name: str, body: dict) -> None:
        with open(os.path.join(a.out, f"{name}.json"), "w") as f:
            json.dump({"bench": name, **meta, **body}, f, indent=1)

    if "throughput" not in skip:
        t = tput()
        cores = os.cpu_count() or 1
        t["stress"] = {"procs": cores, **stressed(tput, cores)}
        save("throughput", t)
        summary.append(f"throughput gpu {t['gpu']['tok_per_s']:.0f} tok/s, host {t['host']['tok_per_s']:.0f} tok/s")
        s = t["stress"]
        summary.append(
            f"under {cores} stress procs: gpu {s['gpu']['tok_per_s']:.0f} tok/s, host {s['host']['tok_per_s']:.0f} tok/s"
        )
    if "ablation" not in skip:
        rows = ablation.run(eng, (16,), workloads=ablation.SMALL) if a.small else ablation.run(eng)
        save("ablation", {"rows": rows})
        for r in rows:
            summary.append(
                f"ablation b{r['batch']:<3d} {r['workload']:28s} host/gpu {r['makespan_ratio_host_over_gpu']:.3f}"
            )
    if "sigstop" not in skip:
        r = sigstop.run(eng, a.phase)
        save("sigstop", r)
        summary.append(f"sigstop {a.phase:.0f} s: stopped/running throughput {r['ratio']:.4f}")
    eng.close()
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
