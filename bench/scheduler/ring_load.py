"""Ring-level load for the scheduler benchmarks: blink's own frontend roles, without HTTP.

Requests go through blink.dpu.RequestTracker (the slot tracker and token reader `blink serve`
runs), on an event loop in a thread of its own, so a benchmark can run timed phases back to back
(and SIGSTOP the device between them) while requests stay in flight: what a phase leaves running
the next one reads on, and counts. Used where a benchmark owns the device in its own process
(bench/scheduler/harness.py, bench/scheduler/overhead.py, tests/gpu/test_sigstop.py); a served endpoint is
loaded with `blink bench serve` (blink/benchmark.py) instead.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from blink.dpu.request_tracker import RequestTracker
from blink.protocol.layout import DeviceStatus
from blink.protocol.sampling_params import SamplingParams
from blink.protocol.transport import Transport
from blink.protocol.wire import SubmitRequest


@dataclass
class Request:
    prompt: np.ndarray  # int32
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0


@dataclass
class LoadResult:
    submitted: int = 0
    completed: int = 0
    tokens: int = 0
    makespan_s: float = 0.0
    t_first: list[float] = field(default_factory=list)  # seconds from slot published to first token in the ring
    finish: dict[int, int] = field(default_factory=dict)  # FinishReason -> count
    outputs: dict[int, list[int]] = field(default_factory=dict)  # request index -> tokens (keep_tokens)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (t, tokens read so far)
    left_in_flight: int = 0  # requests still running when the run returned (a deadline's carry-over)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s else 0.0


class LoadGen:
    """Load on the ring behind `transport` (its device READY). Counters are totals over the
    LoadGen's life; each run() reports the change over its own time."""

    def __init__(self, transport: Transport):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sched-load", daemon=True)
        self._thread.start()
        self.tracker = RequestTracker(transport, max_queue=1 << 20)
        self._call(self.tracker.start())
        self.n_slots = self.tracker.slots.n_owned
        self.tokens = 0
        self.completed = 0
        self.in_flight = 0
        self.finish: collections.Counter[int] = collections.Counter()
        self.t_first: list[float] = []
        self._changed: asyncio.Event | None = None

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        """Stop reading (requests still in flight end with an error event) and the thread."""
        self._call(self.tracker.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def run(
        self,
        requests: list[Request],
        concurrency: int | None = None,
        keep_tokens: bool = False,
        timeout_s: float = 600.0,
        sample_every_s: float = 0.0,
        deadline_s: float = 0.0,
    ) -> LoadResult:
        """Submit every request (at most `concurrency` in flight), read all tokens; returns counts.
        With deadline_s, cycle through `requests` for that long instead (in-flight requests are
        left running: a later run on the same LoadGen reads them on)."""
        return self._call(self._run(requests, concurrency, keep_tokens, timeout_s, sample_every_s, deadline_s))

    async def _one(self, idx: int, r: Request, out: dict[int, list[int]] | None) -> None:
        try:
            req = SubmitRequest(
                request_id=self.tracker.new_request_id(),
                prompt_ids=r.prompt.tolist(),
                max_new_tokens=r.max_new_tokens,
                sampling=SamplingParams(temperature=r.temperature, seed=r.seed),
            )
            h = await self.tracker.submit(req)
            async for ev in h:
                self.tokens += len(ev.token_ids)
                if out is not None:
                    out.setdefault(idx, []).extend(ev.token_ids)
                if ev.finished:
                    self.finish[int(ev.finish_reason)] += 1
            if len(h.timing) >= 3 and h.timing[2]:
                self.t_first.append((h.timing[2] - h.timing[0]) * 1e-9)
        finally:
            self.in_flight -= 1
            self.completed += 1
            assert self._changed is not None
            self._changed.set()

    async def _run(self, requests, concurrency, keep_tokens, timeout_s, sample_every_s, deadline_s) -> LoadResult:
        if self._changed is None:
            self._changed = asyncio.Event()
        res = LoadResult()
        limit = concurrency or self.n_slots
        tok0, done0, t_first0, finish0 = self.tokens, self.completed, len(self.t_first), self.finish.copy()
        out = res.outputs if keep_tokens else None
        tasks: list[asyncio.Task] = []
        nxt = 0
        t0 = time.perf_counter()
        t_sample = t0
        while True:
            while self.in_flight < limit and (deadline_s or nxt < len(requests)):
                self.in_flight += 1
                tasks.append(asyncio.ensure_future(self._one(nxt, requests[nxt % len(requests)], out)))
                nxt += 1
            now = time.perf_counter()
            if sample_every_s and now - t_sample >= sample_every_s:
                res.timeline.append((now - t0, self.tokens - tok0))
                t_sample = now
            if deadline_s and now - t0 >= deadline_s:
                break
            if not deadline_s and nxt == len(requests) and all(t.done() for t in tasks):
                break
            if now - t0 > timeout_s:
                raise TimeoutError(f"{self.completed - done0}/{len(requests)} requests done after {timeout_s} s")
            self._changed.clear()
            wait = min(x for x in (0.05, sample_every_s or 1.0, (deadline_s or 1e9) - (now - t0)) if x > 0)
            try:
                await asyncio.wait_for(self._changed.wait(), max(wait, 1e-4))
            except TimeoutError:
                pass
        for t in tasks:  # a failed request (device down, bad prompt) fails the run
            if t.done() and t.exception() is not None:
                raise t.exception()
        res.makespan_s = time.perf_counter() - t0
        res.left_in_flight = self.in_flight  # read here: the event loop thread runs on after we return
        res.submitted = nxt
        res.tokens = self.tokens - tok0
        res.completed = self.completed - done0
        res.t_first = self.t_first[t_first0:]
        res.finish = dict(self.finish - finish0)
        return res


def random_requests(n: int, prompt_len: int, max_new: int, vocab: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(3, vocab, prompt_len, dtype=np.int32), max_new) for _ in range(n)]


def steady(
    gen: LoadGen, prompt_len: int, max_new: int, concurrency: int, seconds: float, vocab: int, seed: int = 0
) -> LoadResult:
    """Closed loop: keep `concurrency` requests in flight for `seconds` (tokens counted as read).
    Requests still in flight at the deadline stay on the ring; the next phase reads them on."""
    reqs = random_requests(256, prompt_len, max_new, vocab, seed)  # cycled until the deadline
    return gen.run(reqs, concurrency=concurrency, deadline_s=seconds, sample_every_s=0.25)


def main(argv: list[str] | None = None) -> int:
    """python -m bench.scheduler.ring_load --ring NAME ...: one workload against a running device; prints JSON."""
    import argparse
    import json
    import os
    import signal

    from blink.protocol.transport import ShmTransport

    ap = argparse.ArgumentParser()
    ap.add_argument("--ring", required=True)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shutdown", type=int, default=0, help="store header.shutdown=N when done")
    ap.add_argument("--sigstop-pid", type=int, default=0, help="SIGSTOP this pid for --phase seconds")
    ap.add_argument("--phase", type=float, default=10.0, help="seconds per phase (sigstop mode)")
    a = ap.parse_args(argv)
    t = ShmTransport.open(a.ring)
    view = t.view()
    t_end = time.monotonic() + 120
    while int(view.header["device_status"]) != DeviceStatus.READY:  # the description comes with READY
        if time.monotonic() > t_end:
            raise TimeoutError("device not READY")
        time.sleep(0.001)
    vocab = int(view.header["vocab_size"])
    out: dict = {}
    gen = LoadGen(t)
    if a.sigstop_pid:
        conc = a.concurrency or a.n
        warm = steady(gen, a.prompt, a.new, conc, 2.0, vocab, a.seed)
        base = steady(gen, a.prompt, a.new, conc, a.phase, vocab, a.seed + 1)
        os.kill(a.sigstop_pid, signal.SIGSTOP)
        try:
            stopped = steady(gen, a.prompt, a.new, conc, a.phase, vocab, a.seed + 2)
        finally:
            os.kill(a.sigstop_pid, signal.SIGCONT)
        out = {
            "phase_s": a.phase,
            "warmup_tokens": warm.tokens,
            "running_tok_per_s": base.tokens / a.phase,
            "stopped_tok_per_s": stopped.tokens / a.phase,
            "running_timeline": base.timeline,
            "stopped_timeline": stopped.timeline,
        }
        out["ratio"] = out["stopped_tok_per_s"] / max(out["running_tok_per_s"], 1e-9)
    else:
        reqs = random_requests(a.n, a.prompt, a.new, vocab, a.seed)
        res = gen.run(reqs, concurrency=a.concurrency or None)
        tf = sorted(res.t_first)
        out = {
            "n": a.n,
            "prompt": a.prompt,
            "new": a.new,
            "concurrency": a.concurrency or min(a.n, view.geo.n_slots),
            "makespan_s": res.makespan_s,
            "tokens": res.tokens,
            "tok_per_s": res.tok_per_s,
            "ttft_p50_ms": 1e3 * tf[len(tf) // 2] if tf else None,
            "finish": res.finish,
        }
    gen.close()
    if a.shutdown:
        view.header["shutdown"] = a.shutdown
    print(json.dumps(out))
    del view
    t.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
