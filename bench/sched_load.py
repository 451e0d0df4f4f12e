"""A fast ring load generator for the scheduler benchmarks (frontend side of layout.py's rules).

Vectorised over the slots with numpy, so one Python process keeps thousands of requests in flight:
fill EMPTY slots (prompt into the slot's arena region, fields, then state PREFILL_PENDING, then
the submit doorbell), advance `consumed` to `generated` (the output ring never fills), and free
DECODE_COMPLETED slots after counting their tokens. It imports blink.protocol only (no msgspec),
so it runs on the GPU machine as it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from blink.protocol.layout import DeviceStatus, RingView, SlotState


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
    t_first: list[float] = field(default_factory=list)  # seconds from submit to first token (device clocks)
    finish: dict[int, int] = field(default_factory=dict)  # FinishReason -> count
    outputs: dict[int, list[int]] = field(default_factory=dict)  # request index -> tokens (keep_tokens)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (t, tokens read so far)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s else 0.0


class LoadGen:
    def __init__(self, view: RingView):
        self.v = view
        g = view.geo
        self.region = g.prompt_arena_tokens // g.n_slots
        self.slots = view.slots
        self.hdr = view.header
        self.req_of = np.full(g.n_slots, -1, np.int64)  # request index held by each slot
        self.read = np.zeros(g.n_slots, np.int64)  # tokens read of each slot's request
        self._stamp = 0

    def _submit(self, slot: int, idx: int, r: Request) -> None:
        n = int(r.prompt.size)
        if n > self.region:
            raise ValueError(f"prompt of {n} tokens exceeds the per-slot arena region {self.region}")
        off = slot * self.region
        self.v.prompt_arena[off : off + n] = r.prompt
        s = self.slots[slot]
        s["cancel"] = 0
        s["request_id"] = idx + 1
        s["prompt_offset"], s["prompt_len"] = off, n
        s["max_new_tokens"], s["min_new_tokens"] = r.max_new_tokens, 0
        s["temperature"], s["top_p"], s["top_k"], s["seed"] = r.temperature, 1.0, 0, r.seed
        s["n_stop"], s["flags"], s["generated"], s["consumed"] = 0, 0, 0, 0
        self._stamp = max(time.time_ns(), self._stamp + 1)
        s["t_submit_ns"] = self._stamp
        self.slots["state"][slot] = SlotState.PREFILL_PENDING  # x86-64 TSO: after every field
        self.req_of[slot] = idx

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
        res = LoadResult()
        st, gen = self.slots["state"], self.slots["generated"]
        cap = self.v.geo.output_capacity
        limit = concurrency or self.v.geo.n_slots
        nxt = 0
        t0 = time.perf_counter()
        t_sample = t0
        while deadline_s or res.completed < len(requests):
            busy = self.req_of >= 0
            free = np.flatnonzero(~busy & (st == SlotState.EMPTY))
            left = len(free) if deadline_s else len(requests) - nxt
            n_new = min(len(free), limit - int(busy.sum()), left)
            for slot in free[: max(n_new, 0)]:
                self._submit(int(slot), nxt, requests[nxt % len(requests)])
                self.read[slot] = 0
                nxt += 1
                res.submitted += 1
            if n_new > 0:
                self.hdr["submit_seq"] = int(self.hdr["submit_seq"]) + 1
            act = np.flatnonzero(self.req_of >= 0)
            if act.size:
                states = st[act].copy()  # state before generated (acquire order on x86-64)
                g = gen[act].astype(np.int64)
                if keep_tokens:
                    for j, slot in enumerate(act):
                        k0, k1 = int(self.read[slot]), int(g[j])
                        if k1 > k0:
                            out = res.outputs.setdefault(int(self.req_of[slot]), [])
                            row = self.v.output_arena[slot]
                            out += [int(row[k % cap]) for k in range(k0, k1)]
                res.tokens += int((g - self.read[act]).sum())
                self.read[act] = g
                self.slots["consumed"][act] = g.astype(np.uint32)
                done = act[states == SlotState.DECODE_COMPLETED]
                for slot in done:
                    if int(gen[slot]) != self.read[slot]:
                        continue  # its last tokens arrive with the next poll
                    rec = self.slots[slot]
                    f = int(rec["finish_reason"])
                    res.finish[f] = res.finish.get(f, 0) + 1
                    if int(rec["t_first_ns"]):
                        res.t_first.append((int(rec["t_first_ns"]) - int(rec["t_submit_ns"])) * 1e-9)
                    self.req_of[slot] = -1
                    st[slot] = SlotState.EMPTY
                    res.completed += 1
            now = time.perf_counter()
            if sample_every_s and now - t_sample >= sample_every_s:
                res.timeline.append((now - t0, res.tokens))
                t_sample = now
            if deadline_s and now - t0 >= deadline_s:
                break
            if now - t0 > timeout_s:
                raise TimeoutError(f"{res.completed}/{len(requests)} requests done after {timeout_s} s")
        res.makespan_s = time.perf_counter() - t0
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
    """python bench/sched_load.py --ring NAME ...: one workload against a running device; prints JSON."""
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
    if a.sigstop_pid:
        conc = a.concurrency or a.n
        gen = LoadGen(view)
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
        res = LoadGen(view).run(reqs, concurrency=a.concurrency or None)
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
    if a.shutdown:
        view.header["shutdown"] = a.shutdown
    print(json.dumps(out))
    del view
    t.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
