"""Paper Fig. 3 ablation: the same engine and graphs driven by the GPU-resident scheduler vs the
host-driven loop (blink.device.ring_device + blink.gpu.engine.host_executor), four workloads
(short/long prompt x short/long output) at batch 16 and 64; makespan ratio host / gpu.

    python -m bench.scheduler.ablation --preset llama3-8b --out bench/results/ablation_h200.json
"""

from __future__ import annotations

import argparse

from bench.common import add_commit_arg, metadata, write_json
from bench.scheduler.harness import make_engine, serve_workload

WORKLOADS = {  # name: (prompt tokens, output tokens)
    "short-prompt/short-output": (128, 32),
    "short-prompt/long-output": (128, 256),
    "long-prompt/short-output": (1024, 32),
    "long-prompt/long-output": (1024, 256),
}


SMALL = {k: (p // 8, o // 4) for k, (p, o) in WORKLOADS.items()}  # a quick check of the bench itself


def run(eng, batches=(16, 64), requests_per_batch: int = 2, out_cap: int = 512, workloads=None) -> list[dict]:
    rows = []
    for batch in batches:
        n = requests_per_batch * batch  # more requests than places: continuous batching admits as others finish
        for wl, (p, o) in (workloads or WORKLOADS).items():
            row = {"batch": batch, "workload": wl, "prompt": p, "output": o, "requests": n}
            for sched in ("gpu", "host"):
                args = ["--n", str(n), "--prompt", str(p), "--new", str(o), "--concurrency", str(n)]
                r = serve_workload(eng, sched, args, n, p, out_cap, max_batch=batch)
                assert r["tokens"] == n * o, r
                row[sched] = r
            row["makespan_ratio_host_over_gpu"] = row["host"]["makespan_s"] / row["gpu"]["makespan_s"]
            print(
                f"batch {batch:3d} {wl:28s} gpu {row['gpu']['makespan_s']:7.3f} s  host {row['host']['makespan_s']:7.3f} s"
                f"  ratio {row['makespan_ratio_host_over_gpu']:.3f}",
                flush=True,
            )
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--out", default="")
    add_commit_arg(ap)
    a = ap.parse_args()
    eng = make_engine(a.preset, 64, 4096, 2048)
    rows = run(eng)
    res = {"bench": "ablation", **metadata(a.commit, gpu_key="device"), "preset": a.preset, "rows": rows}
    if a.out:
        write_json(a.out, res)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
