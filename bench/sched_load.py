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

from blink.protocol.layout import RingView, SlotState


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
    ) -> LoadResult:
        """Submit every request (at most `concurrency` in flight), read all tokens; returns counts."""
        res = LoadResult()
        st, gen = self.slots["state"], self.slots["generated"]
        cap = self.v.geo.output_capacity
        limit = concurrency or self.v.geo.n_slots
        nxt = 0
        t0 = time.perf_counter()
        t_sample = t0
        read = np.zeros(self.v.geo.n_slots, np.int64)
        while res.completed < len(requests):
            busy = self.req_of >= 0
            free = np.flatnonzero(~busy & (st == SlotState.EMPTY))
            n_new = min(len(free), limit - int(busy.sum()), len(requests) - nxt)
            for slot in free[: max(n_new, 0)]:
                self._submit(int(slot), nxt, requests[nxt])
                read[slot] = 0
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
                        k0, k1 = int(read[slot]), int(g[j])
                        if k1 > k0:
                            out = res.outputs.setdefault(int(self.req_of[slot]), [])
                            row = self.v.output_arena[slot]
                            out += [int(row[k % cap]) for k in range(k0, k1)]
                res.tokens += int((g - read[act]).sum())
                read[act] = g
                self.slots["consumed"][act] = g.astype(np.uint32)
                done = act[states == SlotState.DECODE_COMPLETED]
                for slot in done:
                    if int(gen[slot]) != read[slot]:
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
            if now - t0 > timeout_s:
                raise TimeoutError(f"{res.completed}/{len(requests)} requests done after {timeout_s} s")
        res.makespan_s = time.perf_counter() - t0
        return res


def random_requests(n: int, prompt_len: int, max_new: int, vocab: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(3, vocab, prompt_len, dtype=np.int32), max_new) for _ in range(n)]
