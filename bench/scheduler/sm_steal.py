"""What the resident GPU scheduler costs the step graphs: the same decode and prefill graphs timed
from the host with the scheduler kernel idle on the GPU (one block of 256 threads, polling an empty
ring) and without it (A-B-A). The scheduler's block holds registers and shared memory on one SM
for as long as it runs; a kernel whose blocks need a whole SM (cuBLAS's GEMMs) then has one SM less.

    python -m bench.scheduler.sm_steal --commit X --out bench/results/sm_steal.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import add_commit_arg, load_synthetic, metadata, time_ms, write_json
from bench.scheduler.harness import fresh_ring, make_engine


def measure(eng, iters: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    out = {}
    for name, (load, shape, decode) in {
        "decode_b256_ctx320": (lambda: load_synthetic(eng, 256, 1, 320, rng), (256, 256), True),
        "decode_b128_ctx320": (lambda: load_synthetic(eng, 128, 1, 320, rng), (128, 128), True),
        "prefill_16x256": (lambda: load_synthetic(eng, 16, 256, 256, rng), (16, 4096), False),
    }.items():
        load()
        ex = eng.pick_exec(shape[0], shape[1], decode)
        out[name] = time_ms(lambda ex=ex: eng.driver.graph_launch(ex, eng.s), eng.stream, iters=iters, warmup=3)
    return out


def main() -> int:
    from blink.gpu.scheduler.scheduler import GpuScheduler
    from blink.protocol.layout import DeviceStatus
    from blink.protocol.ring_geometry import RingGeometry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sm-reserves", default="0,1", help="EngineConfig.gemm_sm_reserve values, one engine each")
    add_commit_arg(ap)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    runs, summary = [], {}
    for reserve in [int(x) for x in a.sm_reserves.split(",")]:
        # a fixed KV pool: the first engine's memory may not be back when the second sizes its pool
        eng = make_engine(a.preset, 256, 4096, 2048, kv_blocks=8192, gemm_sm_reserve=reserve)
        mine = []
        for phase in ("alone", "scheduler_idle", "alone", "scheduler_idle"):
            if phase == "alone":
                mine.append({"gemm_sm_reserve": reserve, "phase": phase, **measure(eng, a.iters)})
                continue
            with fresh_ring(RingGeometry(64, 64 * 256, 256)) as (_, _, view):
                s = GpuScheduler(eng, view)
                s.start()
                try:
                    time.sleep(0.3)
                    assert s.status() == DeviceStatus.READY, s.status()
                    mine.append({"gemm_sm_reserve": reserve, "phase": phase, **measure(eng, a.iters)})
                    assert s.status() == DeviceStatus.READY, s.status()
                finally:
                    s.stop()
        eng.close()
        del eng
        runs += mine
        for k in [k for k in mine[0] if k not in ("phase", "gemm_sm_reserve")]:
            alone = np.mean([r[k] for r in mine if r["phase"] == "alone"])
            busy = np.mean([r[k] for r in mine if r["phase"] != "alone"])
            summary[f"reserve{reserve}_{k}"] = {
                "alone_ms": float(alone),
                "scheduler_idle_ms": float(busy),
                "ratio": float(busy / alone),
            }
            print(
                f"gemm_sm_reserve {reserve} {k:>20}: alone {alone:8.3f} ms, scheduler resident {busy:8.3f} ms, "
                f"x{busy / alone:.3f}",
                flush=True,
            )
    write_json(
        a.out,
        {
            "bench": "sm_steal",
            **metadata(a.commit, gpu_key="device"),
            "runs": runs,
            "summary": summary,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
