"""Where the makespan of the 256 x (256 -> 128) throughput run goes: the host-driven loop over the
same engine and graphs as the GPU-resident scheduler, with every step timed (host wall around
Engine.step, which uploads the step, launches its graph and waits for the tokens), by kind and
bucket. What the steps do not cover is the loop's own work between steps (planning, ring reads
and writes) and the time before the first step.

    python -m bench.scheduler.step_profile --commit X --out bench/results/step_profile.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import add_commit_arg, metadata, write_json
from bench.scheduler.harness import make_engine, serve_workload
from blink.gpu.engine.host_executor import HostExecutor


class TimedExecutor(HostExecutor):
    """HostExecutor that records (start, end, sequences, tokens) of every step."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.steps: list[tuple[float, float, int, int]] = []

    def execute(self, batch):
        t0 = time.perf_counter()
        out = super().execute(batch)
        self.steps.append((t0, time.perf_counter(), batch.num_seqs, batch.num_tokens))
        return out


def summarize(steps: list[tuple[float, float, int, int]], makespan_s: float) -> dict:
    a = np.array(steps, dtype=float)
    dur = a[:, 1] - a[:, 0]
    gaps = a[1:, 0] - a[:-1, 1]
    prefill = a[:, 3] > a[:, 2]  # a step with more tokens than sequences holds prompt tokens
    out = {
        "makespan_s": makespan_s,
        "steps": len(a),
        "first_to_last_step_s": float(a[-1, 1] - a[0, 0]),
        "in_steps_s": float(dur.sum()),
        "between_steps_s": float(gaps.sum()),
        "between_steps_max_ms": float(gaps.max() * 1e3) if gaps.size else 0.0,
        "prefill": {"steps": int(prefill.sum()), "s": float(dur[prefill].sum()), "tokens": int(a[prefill, 3].sum())},
        "decode": {"steps": int((~prefill).sum()), "s": float(dur[~prefill].sum())},
    }
    by_batch: dict[str, list[float]] = {}
    for (t0, t1, s, _t), p in zip(steps, prefill, strict=True):
        if not p:
            by_batch.setdefault(str(s), []).append((t1 - t0) * 1e3)
    out["decode_ms_by_batch"] = {
        k: {"n": len(v), "mean": float(np.mean(v))} for k, v in sorted(by_batch.items(), key=lambda kv: int(kv[0]))
    }
    out["prefill_ms"] = [round((t1 - t0) * 1e3, 2) for (t0, t1, s, t), p in zip(steps, prefill, strict=True) if p]
    out["prefill_shapes"] = [(int(s), int(t)) for (t0, t1, s, t), p in zip(steps, prefill, strict=True) if p]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096, help="the engine's tokens per step")
    add_commit_arg(ap)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    eng = make_engine(a.preset, 256, a.max_num_batched_tokens, 2048)
    ex = TimedExecutor(eng)
    n = a.requests
    args = ["--n", str(n), "--prompt", str(a.prompt), "--new", str(a.new), "--concurrency", str(n)]
    r = serve_workload(eng, "host", args, n, a.prompt, 2 * a.new, executor=ex)
    prof = summarize(ex.steps, r["makespan_s"])
    res = {
        "bench": "step_profile",
        **metadata(a.commit, gpu_key="device"),
        "tok_per_s": r["tok_per_s"],
        "ttft_p50_ms": r.get("ttft_p50_ms"),
        **prof,
    }
    write_json(a.out, res)
    print(
        f"makespan {prof['makespan_s']:.3f} s, {r['tok_per_s']:.0f} tok/s; {prof['steps']} steps, first to last "
        f"{prof['first_to_last_step_s']:.3f} s: in steps {prof['in_steps_s']:.3f} s (prefill {prof['prefill']['steps']} "
        f"steps {prof['prefill']['s']:.3f} s, decode {prof['decode']['steps']} steps {prof['decode']['s']:.3f} s), "
        f"between steps {prof['between_steps_s']:.3f} s (max {prof['between_steps_max_ms']:.1f} ms)"
    )
    print("prefill steps (ms):", prof["prefill_ms"])
    print("prefill shapes (S, T):", prof["prefill_shapes"])
    print("decode ms by batch:", {k: round(v["mean"], 2) for k, v in prof["decode_ms_by_batch"].items()})
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
