"""Scheduler overhead per step and slot-scan time, GPU-resident scheduler (H200).

    python -m bench.scheduler.overhead [--out bench/results/sched_overhead.json]

1. Graph time: the decode graph of batch B replayed back to back from the host (no scheduler).
2. The scheduler serving B long decodes through the ring: per busy iteration, the time the
   scheduler spends outside the graph (plan + launch call + publish) and the launch-to-completion
   wait, from the control block's counters. wait - graph time = launch latency + completion poll.
3. Scan: an idle 4096-slot ring scanned on every iteration (FLAG_ALWAYS_SCAN): scan_ns / scans.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from bench.common import add_commit_arg, metadata, write_json
from bench.scheduler.harness import fresh_ring
from bench.scheduler.ring_load import LoadGen, random_requests
from blink.protocol.layout import DeviceStatus
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import ShmTransport

if TYPE_CHECKING:
    from blink.gpu.scheduler.scheduler import GpuScheduler


def make_engine(preset_name: str, max_seqs: int, max_num_batched_tokens: int, kv_blocks: int):
    from blink.gpu.engine.engine import Engine, EngineConfig
    from blink.models.config import preset

    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_seqs)
    ecfg = EngineConfig(
        max_seqs=max_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_context=2048,
        num_kv_blocks=kv_blocks,
        batch_buckets=buckets,
        token_buckets=tuple(t for t in (16, 64, 256, 1024, 4096) if t <= max_num_batched_tokens),
        progress=False,
    )
    eng = Engine.create(preset(preset_name), ecfg)
    eng.capture()
    return eng


def graph_time_us(eng, batch: int, n: int = 2000) -> float:
    """Median-of-5 per-graph time of the decode graph, launched back to back from the host."""
    import cupy as cp

    from blink.device.executor import StepBatch

    d = eng.dims
    sb = StepBatch(
        input_ids=np.full(batch, 5, np.int32),
        positions=np.full(batch, 100, np.int32),
        cu_q_lens=np.arange(batch + 1, dtype=np.int32),
        seq_lens=np.full(batch, 101, np.int32),
        block_tables=np.arange(batch * d.max_blocks_per_seq, dtype=np.int32).reshape(batch, -1) % d.num_blocks,
        temperature=np.zeros(batch, np.float32),
        top_p=np.ones(batch, np.float32),
        top_k=np.zeros(batch, np.int32),
        seed=np.zeros(batch, np.uint64),
        sample_pos=np.zeros(batch, np.uint32),
    )
    eng.load_step(sb)
    eng.arena.upload(eng.s, batch)
    execs = [int(x) for x in eng.decode_execs[int(np.searchsorted(eng.batch_buckets, batch))]]
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    out = []
    for _ in range(5):
        e0.record(eng.stream)
        for i in range(n):
            eng.driver.graph_launch(execs[i % len(execs)], eng.s)
        e1.record(eng.stream)
        e1.synchronize()
        out.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / n)
    return float(np.median(out))


@contextlib.contextmanager
def serve(eng, n_slots: int, **cfg) -> Iterator[tuple[ShmTransport, GpuScheduler]]:
    """The GPU-resident scheduler on a fresh ring of n_slots slots, once it reports READY."""
    from blink.gpu.scheduler.scheduler import GpuScheduler, GpuSchedulerConfig

    with fresh_ring(RingGeometry(n_slots, n_slots * 64, 4096)) as (_, t, view):
        s = GpuScheduler(eng, view, GpuSchedulerConfig(**cfg))
        s.start()
        while int(view.header["device_status"]) != DeviceStatus.READY:
            time.sleep(0.001)
        yield t, s


def decode_overhead(eng, batch: int, new_tokens: int) -> dict:
    with serve(eng, max(batch, 16)) as (t, s):
        gen = LoadGen(t)
        try:
            res = gen.run(random_requests(batch, 8, new_tokens, eng.config.vocab_size), timeout_s=120)
        finally:
            gen.close()
        assert res.tokens == batch * new_tokens, res
        s.stop()
        d = s.diagnostics()
    it = max(d["busy_iters"], 1)
    return {
        "batch": batch,
        "tokens": res.tokens,
        "tok_per_s": res.tok_per_s,
        "busy_iters": d["busy_iters"],
        "decode_steps": d["steps"],
        "sched_us_per_step": d["sched_ns_total"] / it / 1e3,
        "plan_us": d["plan_ns_total"] / it / 1e3,
        "launch_call_us": d["launch_ns_total"] / it / 1e3,
        "publish_us": d["publish_ns_total"] / it / 1e3,
        "wait_us": d["wait_ns_total"] / it / 1e3,
        "decode_step_wall_us": d["step_ns_total"] / max(d["steps"], 1) / 1e3,
        "relaunches": d["relaunches"],
        "retries": d["retries"],
        "max_retries": d["max_retries"],
        "launch_errors": d["launch_errors"],
    }


def scan_time(eng, n_slots: int = 4096, seconds: float = 0.5) -> dict:
    with serve(eng, n_slots, always_scan=True) as (_, s):
        time.sleep(seconds)
        s.stop()
        d = s.diagnostics()
    return {"n_slots": n_slots, "scans": d["scans"], "scan_us": d["scan_ns_total"] / max(d["scans"], 1) / 1e3}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--out", default="")
    add_commit_arg(ap)
    a = ap.parse_args()
    eng = make_engine(a.preset, 64, 256, 4096)
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        g = graph_time_us(eng, b)
        r = decode_overhead(eng, b, a.new_tokens)
        r["graph_us_host_replay"] = g
        r["launch_plus_poll_us"] = r["wait_us"] - g
        r["overhead_us_per_step"] = r["sched_us_per_step"] + r["launch_plus_poll_us"]
        rows.append(r)
    scan = scan_time(eng)
    out = {
        "bench": "sched_overhead",
        **metadata(a.commit, gpu_key="device"),
        "preset": a.preset,
        "decode": rows,
        "scan": scan,
    }
    print(
        f"{'batch':>5} {'graph us':>9} {'wait us':>8} {'sched us':>9} {'launch+poll':>11} {'overhead/step':>13} {'tok/s':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['graph_us_host_replay']:9.2f} {r['wait_us']:8.2f} {r['sched_us_per_step']:9.2f} "
            f"{r['launch_plus_poll_us']:11.2f} {r['overhead_us_per_step']:13.2f} {r['tok_per_s']:9.0f}"
        )
    print(f"scan of {scan['n_slots']} slots: {scan['scan_us']:.2f} us ({scan['scans']} scans)")
    if a.out:
        write_json(a.out, out)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
