"""Where a first token's time goes, GPU scheduler vs host loop, under open-loop load.

    python -m bench.serving.ttft_breakdown [--schedulers gpu,host] [--rate 24] [--num-prompts 480]
        [--model random:llama3-8b] [--max-num-seqs 256] [--out bench/results/ttft_breakdown.json]

For each scheduler: a fresh `blink serve --device cuda --scheduler S`; `blink bench serve`'s open-loop
Poisson load (random prompts, 256 -> 128 tokens) from this process; and meanwhile a tap on the
server's ring (/dev/shm/<ring>, read only) that reads every slot each 0.2 ms and keeps, per request,
the first token's path as the slot records it:

    t_submit   frontend: slot published (request written, then PREFILL_PENDING, then the doorbell)
    t_admit    device:   slot claimed
    t_launch   device:   launch of the step that sampled the first token
    t_first    device:   first token published in the output arena
    t_read     frontend: its token reader read the first token

plus, from /metrics (exact means: histogram sums over counts), HTTP request -> slot published and
token read -> first SSE byte written. Stages per scheduler: p50 / p90 / p99 / mean in ms. Also the
frontend's (the server process's) CPU time over the load, per output token.

Clocks: every stamp is this host's time.time_ns(), except the GPU scheduler's (t_admit, t_launch,
t_first), which are %globaltimer + an offset calibrated when the scheduler starts
(blink.gpu.scheduler.scheduler.GpuScheduler._clock_offset: the upper bound of host - device over 20 bracketed
reads of %globaltimer, so a device stamp never precedes the host stamp of the same instant; its
error is at most the shortest bracket, a few microseconds).

Then, the load over and the server idle, `--alone` requests of the same prompt length (one output
token, 0.2 s apart) time the prefill of one prompt alone (t_first - t_launch on the ring), and the
ring header's decode-step counters over the load phase give the mean decode step at the running
batch (the tap samples header.running): the TTFT bound p50 <= prefill alone + one decode
step + 2 ms.

Prints the bench report, the stage table and the targets (ITL p99 <= 1.5 x ITL p50; TTFT p50 and p99
of the GPU scheduler <= the host loop's; the bound above), and writes one JSON with both schedulers.
`--mixed-step-tokens N` passes the server its mixed-step token budget (-1: the server's default).
On a CPU, `--device emulated --device-executor bench.serving.paced_executor:h200_llama3_8b --model
random:llama3-8b` measures the frontend against the H200's step times (the device process sleeps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

import numpy as np

from bench.common import RESULTS, add_commit_arg, metadata, smi_gpu_name
from blink import bench_report, benchmark
from blink.protocol.transport import ShmTransport
from blink.testing import ServeProcess

STAMPS = ("t_submit_ns", "t_admit_ns", "t_launch_ns", "t_first_ns", "t_read_ns")
STAGES = (  # (name, from, to) over STAMPS
    ("queue_to_claim", 0, 1),
    ("claim_to_launch", 1, 2),
    ("launch_to_first", 2, 3),
    ("first_to_read", 3, 4),
    ("submit_to_read", 0, 4),
)
METRIC_STAGES = {
    "http_to_submit": "blink_first_token_submit_seconds",
    "read_to_write": "blink_first_token_write_seconds",
}


def start_server(scheduler: str, args: argparse.Namespace) -> ServeProcess:
    argv = ["--device", args.device, "--scheduler", scheduler, "--model", args.model]
    argv += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.mixed_step_tokens >= 0:
        argv += ["--mixed-step-tokens", str(args.mixed_step_tokens)]
    if args.device_executor:
        argv += ["--device-executor", args.device_executor]
    srv = ServeProcess(argv, timeout=args.start_timeout)
    if not srv.ring:
        srv.stop()
        raise RuntimeError("the server named no ring:\n" + "".join(srv.log[-40:]))
    return srv


class RingTap(threading.Thread):
    """Reads every slot's first-token stamps each `period_s`; one record per request id, taken once
    the token reader has stamped t_read (every earlier stamp is written before it).

    It shares the load generator's process (and GIL): a sample costs one copy of the slot records
    and vector compares, and Python work only for the slots holding a request not yet recorded, so
    that the tap does not delay the client's event loop (a per-slot Python loop over 256 slots
    every 0.2 ms held the GIL most of the time and inflated the client's TTFT)."""

    def __init__(self, ring: str, period_s: float = 2e-4):
        super().__init__(daemon=True)
        self.t = ShmTransport.open(ring)
        view = self.t.view()
        self.slots = view.slots
        self.header = view.header
        self.running: list[int] = []  # header.running at each sample where something ran
        self.period_s = period_s
        self.seen: dict[int, tuple[int, ...]] = {}
        # per slot, the request last recorded there; at start the earlier requests' (their stamps
        # stay in freed slots)
        self.recorded = self.slots["request_id"].copy()
        self.stop_flag = threading.Event()

    def run(self) -> None:
        slots = self.slots
        rid_of, t_read_of, t_submit_of = slots["request_id"], slots["t_read_ns"], slots["t_submit_ns"]
        while not self.stop_flag.is_set():
            if run := int(self.header["running"]):
                self.running.append(run)
            new = (t_read_of != 0) & (t_read_of >= t_submit_of) & (rid_of != self.recorded)
            for i in np.flatnonzero(new).tolist():
                r = slots[i].copy()  # the slot may have gone to the next request since
                if r["t_read_ns"] != 0 and r["t_read_ns"] >= r["t_submit_ns"]:
                    self.recorded[i] = r["request_id"]
                    self.seen.setdefault(int(r["request_id"]), tuple(int(r[k]) for k in STAMPS))
            time.sleep(self.period_s)

    def finish(self) -> np.ndarray:
        self.stop_flag.set()
        self.join(5)
        return np.array(list(self.seen.values()), np.int64).reshape(-1, len(STAMPS))


def quantiles_ms(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {}
    ms = x / 1e6
    return {
        "p50": float(np.percentile(ms, 50)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
        "mean": float(ms.mean()),
    }


def metric_mean_ms(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    s = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    return s / n * 1e3 if n else None


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def header_counts(ring: str) -> dict[str, int]:
    t = ShmTransport.open(ring)
    h = t.view().header
    out = {k: int(h[k]) for k in ("steps", "step_ns_total", "prefill_steps", "launches", "prompt_tokens")}
    del h
    t.close()
    return out


def measure(scheduler: str, args: argparse.Namespace) -> dict:
    srv = start_server(scheduler, args)
    try:
        bp = argparse.ArgumentParser()
        benchmark.add_arguments(bp)  # blink bench serve's own defaults for everything not set here
        bargs = bp.parse_args(
            ["--base-url", srv.url, "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
             "--random-output-len", str(args.output_len),
             "--request-rate", str(args.rate), "--seed", str(args.seed), "--metric-percentiles", "50,90,99"]
        )  # fmt: skip
        warm = argparse.Namespace(**{**vars(bargs), "num_prompts": 16, "request_rate": float("inf")})
        asyncio.run(benchmark.run(warm))  # first graph launches, allocator, tokenizer caches
        m0 = srv.metrics()
        h0 = header_counts(srv.ring)
        tap = RingTap(srv.ring)
        tap.start()
        c0 = cpu_s(srv.proc.pid)
        res = asyncio.run(benchmark.run(bargs))
        frontend_cpu_s = cpu_s(srv.proc.pid) - c0  # the server process: the frontend (the device is a child)
        stamps = tap.finish()
        h1 = header_counts(srv.ring)
        m1 = srv.metrics()
        # the same prompt length alone on the idle server: its prefill step, launch to first token
        alone_args = argparse.Namespace(
            **{**vars(bargs), "num_prompts": args.alone, "request_rate": 5.0, "random_output_len": 1, "seed": 1}
        )
        alone_tap = RingTap(srv.ring)
        alone_tap.start()
        asyncio.run(benchmark.run(alone_args))
        alone = alone_tap.finish()
    finally:
        srv.stop()
    res.pop("requests", None)
    stages = {name: quantiles_ms(stamps[:, b] - stamps[:, a]) for name, a, b in STAGES}
    for name, metric in METRIC_STAGES.items():
        stages[name] = {"mean": metric_mean_ms(m0, m1, metric)}
    steps = h1["steps"] - h0["steps"]
    bound = {
        "prefill_alone_ms": quantiles_ms(alone[:, 3] - alone[:, 2]),  # t_first - t_launch
        "alone_requests": int(alone.shape[0]),
        "decode_step_ms_mean": (h1["step_ns_total"] - h0["step_ns_total"]) / steps / 1e6 if steps else None,
        "decode_steps": steps,
        "mixed_or_prefill_launches": h1["prefill_steps"] - h0["prefill_steps"],
        "running_mean": float(np.mean(tap.running)) if tap.running else 0.0,
    }
    return {
        "scheduler": scheduler,
        "bench": res,
        "stages": stages,
        "traced_requests": int(stamps.shape[0]),
        "frontend_cpu": {
            "cpu_s": frontend_cpu_s,
            "share_of_a_core": frontend_cpu_s / res["duration_s"],
            "us_per_output_token": frontend_cpu_s / max(1, res["total_output_tokens"]) * 1e6,
        },
        "ttft_bound": bound,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedulers", default="gpu,host")
    ap.add_argument("--rate", type=float, default=24.0, help="Poisson arrivals per second")
    ap.add_argument("--num-prompts", type=int, default=480)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--device", default="cuda", help="cuda; emulated runs the script on a CPU (its own test)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=0, help="0: the server's default (the model's limit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alone", type=int, default=8, help="requests timed alone after the load (prefill alone)")
    ap.add_argument(
        "--mixed-step-tokens", type=int, default=-1, help="the server's --mixed-step-tokens (-1: its default)"
    )
    ap.add_argument(
        "--device-executor",
        default="",
        metavar="MODULE:FUNCTION",
        help="emulated: a stand-in model (bench.serving.paced_executor:h200_llama3_8b sleeps the H200's step times)",
    )
    ap.add_argument("--start-timeout", type=float, default=420.0)
    ap.add_argument("--out", default=str(RESULTS / "ttft_breakdown.json"))
    add_commit_arg(ap)
    args = ap.parse_args(argv)
    command = [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]
    meta = metadata(args.commit, command, gpu=smi_gpu_name())  # the servers own the GPU: no CUDA here
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    runs = []
    for s in args.schedulers.split(","):
        r = measure(s, args)
        runs.append(r)
        with open(args.out, "w") as f:  # after each scheduler: a run cut short keeps what it measured
            json.dump({**meta, "args": vars(args), "runs": runs}, f, indent=1)
        print(f"\n### scheduler {s} ({r['traced_requests']} requests traced)")
        print(bench_report.report(r["bench"]))
        fc = r["frontend_cpu"]
        print(
            f"frontend CPU: {fc['share_of_a_core']:.0%} of a core, {fc['us_per_output_token']:.0f} us per output token"
        )
        print(f"{'stage (ms)':<18}" + "".join(f"{k:>9}" for k in ("p50", "p90", "p99", "mean")))
        for name, q in r["stages"].items():
            cells = (f"{q[k]:9.3f}" if q.get(k) is not None else f"{'-':>9}" for k in ("p50", "p90", "p99", "mean"))
            print(f"{name:<18}" + "".join(cells), flush=True)
    ok = True
    for r in runs:
        itl = r["bench"]["itl_ms"]
        good = itl["p99"] <= 1.5 * itl["median"]
        ok &= good
        print(
            f"target ITL p99 <= 1.5 x p50 [{r['scheduler']}]: {itl['p99']:.2f} vs {itl['median']:.2f} ms: {'OK' if good else 'MISSED'}"
        )
    for r in runs:
        b = r["ttft_bound"]
        if not b["prefill_alone_ms"] or b["decode_step_ms_mean"] is None:
            print(f"TTFT bound [{r['scheduler']}]: not measured ({b})")
            continue
        lim = b["prefill_alone_ms"]["p50"] + b["decode_step_ms_mean"] + 2.0
        ttft = r["bench"]["ttft_ms"]["median"]
        good = ttft <= lim
        ok &= good
        print(
            f"target TTFT p50 <= prefill alone + decode step + 2 ms [{r['scheduler']}]: {ttft:.2f} vs "
            f"{b['prefill_alone_ms']['p50']:.2f} + {b['decode_step_ms_mean']:.2f} (mean batch "
            f"{b['running_mean']:.1f}) + 2 = {lim:.2f} ms: {'OK' if good else 'MISSED'}"
        )
    by = {r["scheduler"]: r["bench"]["ttft_ms"] for r in runs}
    if "gpu" in by and "host" in by:
        for q in ("median", "p99"):
            good = by["gpu"][q] <= by["host"][q]
            ok &= good
            print(
                f"target TTFT {q} gpu <= host: {by['gpu'][q]:.2f} vs {by['host'][q]:.2f} ms: {'OK' if good else 'MISSED'}"
            )
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
