"""A minimal ring client for the conformance suite, written against the Transport interface only.

Deliberately independent of blink.dpu (the frontend's slot tracker / token reader), so the suite
cross-checks the frontend's reading of the protocol as well as the device's. It follows the
frontend's side of the ownership rules in blink/protocol/layout.py: fill an EMPTY slot, then
publish state PREFILL_PENDING, then ring the submit doorbell; read tokens up to `generated`, then
store `consumed`; free a DECODE_COMPLETED slot (state EMPTY) after reading every token.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from blink.protocol.layout import (
    BLOCK_KEY_WORDS,
    HEADER_DTYPE,
    MAX_STOP_IDS,
    SLOT_DTYPE,
    UNLIMITED,
    DeviceFeatures,
    DeviceStatus,
    FinishReason,
    SlotError,
    SlotState,
)
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import Transport


def _hoff(name: str) -> int:
    return HEADER_DTYPE.fields[name][1]


def _soff(name: str) -> int:
    return SLOT_DTYPE.fields[name][1]


@dataclass
class Result:
    slot: int
    request_id: int
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason = FinishReason.NONE
    error: SlotError = SlotError.NONE
    t_submit_ns: int = 0
    t_admit_ns: int = 0
    t_first_ns: int = 0
    t_launch_ns: int = 0
    cached_tokens: int = 0
    done: bool = False


class RingClient:
    def __init__(self, transport: Transport, control: Transport | None = None):
        """control: where `shutdown` is stored (the launcher's own mapping of the ring: a ring agent
        does not let a frontend stop the device); default the same transport."""
        self.t = transport
        self.control = control or transport
        hdr = self.header()
        self.geo = RingGeometry.from_header(hdr)
        self.region = self.geo.prompt_arena_tokens // self.geo.n_slots  # prompt tokens per slot
        self.active: dict[int, Result] = {}
        self._next_id = 1
        self._last_stamp = 0
        self.describe(hdr)

    def describe(self, hdr: np.void | None = None) -> None:
        """Read what the device says of itself (call once it is READY)."""
        hdr = self.header() if hdr is None else hdr
        self.block_size = int(hdr["kv_block_size"])
        self.caching = bool(int(hdr["features"]) & DeviceFeatures.PREFIX_CACHING)

    def block_keys(self, tokens: np.ndarray, salt: bytes = b"") -> np.ndarray:
        """The chained keys of the prompt's full blocks (layout.py "Block keys"): blake2b-128 over the
        parent key and the block's tokens, written here apart from blink.dpu.prefix_keys on purpose.
        `salt` seeds the chain (two salts: two caches that never match each other)."""
        bs = self.block_size
        parent = hashlib.blake2b(b"conformance" + salt + struct.pack("<I", bs), digest_size=16).digest()
        keys = []
        for i in range(tokens.size // bs):
            parent = hashlib.blake2b(parent + tokens[i * bs : (i + 1) * bs].astype("<i4").tobytes(), digest_size=16)
            parent = parent.digest()
            keys.append(parent)
        return np.frombuffer(b"".join(keys), np.int32)

    # -- header -----------------------------------------------------------------
    def header(self) -> np.void:
        return self.t.read_into(0, np.zeros(1, HEADER_DTYPE))[0]

    def h(self, name: str) -> int:
        kind = HEADER_DTYPE.fields[name][0]
        return self.t.load_u64(_hoff(name)) if kind.itemsize == 8 else self.t.load_u32(_hoff(name))

    def h_at_least(self, name: str, value: int, timeout: float = 10.0) -> int:
        """Header counter `name` once it reaches `value`, and the header's other counters as recent
        (settled). A device writes its statistics after a step's tokens (the CUDA scheduler copies its
        counters to the header apart from them, one field per thread), so a client that has seen a token
        waits for the counts that include it."""
        t_end = time.monotonic() + timeout
        while (v := self.h(name)) < value:
            if time.monotonic() > t_end:
                raise TimeoutError(f"header {name} = {v} after {timeout} s, waited for {value}")
            time.sleep(0.001)
        self.settled(t_end)
        return v

    def settled(self, t_end: float | None = None) -> None:
        """Until the device has begun two more iterations of its loop (heartbeats): statistics written
        in the iteration whose counts were just read, by whichever thread, are in the header."""
        t_end = time.monotonic() + 10.0 if t_end is None else t_end
        beat = self.h("heartbeat")
        while self.h("heartbeat") < beat + 2:
            if time.monotonic() > t_end:
                raise TimeoutError("the device's heartbeat stopped")
            time.sleep(0.001)

    def wait_status(self, status: DeviceStatus, timeout: float = 60.0) -> None:
        t_end = time.monotonic() + timeout
        while self.h("device_status") != status:
            if time.monotonic() > t_end:
                raise TimeoutError(f"device status {self.h('device_status')}, waited for {status!r}")
            time.sleep(0.005)

    def shutdown(self, mode: int) -> None:
        self.control.store_u32(_hoff("shutdown"), mode)

    # -- slots ------------------------------------------------------------------
    def slot(self, i: int) -> np.void:
        return self.t.read_into(self.geo.slot_offset(i), np.zeros(1, SLOT_DTYPE))[0]

    def state(self, i: int) -> SlotState:
        return SlotState(self.t.load_u32(self.geo.slot_offset(i) + _soff("state")))

    def states(self) -> np.ndarray:
        slots = self.t.read_into(self.geo.slots_offset, np.zeros(self.geo.n_slots, SLOT_DTYPE))
        return slots["state"].copy()

    def _free_slot(self) -> int:
        states = self.states()
        for i in np.flatnonzero(states == SlotState.EMPTY):
            if int(i) not in self.active:
                return int(i)
        raise RuntimeError("no EMPTY slot")

    def submit(
        self,
        prompt: Iterable[int],
        *,
        max_new_tokens: int = 16,
        min_new_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop_ids: Iterable[int] = (),
        flags: int = 0,
        n_stop: int | None = None,
        prompt_offset: int | None = None,
        prompt_len: int | None = None,
        slot: int | None = None,
        cancel: bool = False,
        doorbell: bool = True,
        fields: dict | None = None,
        keys: bool | None = None,
        salt: bytes = b"",
    ) -> int:
        """Publish a request; returns its slot. prompt_offset / prompt_len / n_stop override the
        honest values (to build malformed requests); doorbell=False skips the submit_seq bump; `fields`
        sets further slot fields by name (the sampling extensions). keys: write the prompt's block
        keys at the end of the slot's region (None: when the device caches prefixes); salt: their seed."""
        i = self._free_slot() if slot is None else slot
        tokens = np.asarray(list(prompt), np.int32)
        if tokens.size > self.region:
            raise ValueError(f"prompt of {tokens.size} tokens exceeds the client's arena region {self.region}")
        off = i * self.region
        if tokens.size:
            self.t.write(self.geo.prompt_arena_offset + 4 * off, tokens)
        stops = list(stop_ids)[:MAX_STOP_IDS]
        rec = np.zeros(1, SLOT_DTYPE)  # (1,): a transport reads/writes whole arrays
        rec["state"] = SlotState.EMPTY
        rec["cancel"] = int(cancel)
        rec["request_id"] = self._next_id
        rec["prompt_offset"] = off if prompt_offset is None else prompt_offset
        rec["prompt_len"] = tokens.size if prompt_len is None else prompt_len
        rec["max_new_tokens"] = max_new_tokens
        rec["min_new_tokens"] = min_new_tokens
        rec["temperature"] = temperature
        rec["top_p"] = top_p
        rec["seed"] = seed
        rec["top_k"] = top_k
        rec["n_stop"] = len(stops) if n_stop is None else n_stop
        rec["stop_ids"][0, : len(stops)] = stops
        rec["flags"] = flags
        if self.caching if keys is None else keys:
            room = (self.region - tokens.size) // BLOCK_KEY_WORDS * BLOCK_KEY_WORDS  # keys only cache
            kw = self.block_keys(tokens, salt)[:room]  # the prefix they name: fewer is allowed
            if kw.size:
                koff = off + self.region - kw.size  # the end of the region: clear of every other part
                self.t.write(self.geo.prompt_arena_offset + 4 * koff, kw)
                rec["n_block_keys"] = kw.size // BLOCK_KEY_WORDS
                rec["block_keys_offset"] = koff
        for k, v in (fields or {}).items():
            rec[k] = v
        stamp = max(time.time_ns(), self._last_stamp + 1)  # strictly increasing: FCFS is by this clock
        self._last_stamp = stamp
        rec["t_submit_ns"] = stamp
        base = self.geo.slot_offset(i)
        self.t.write(base, rec)
        self.t.store_u32(base + _soff("state"), SlotState.PREFILL_PENDING)  # release: after every field
        if doorbell:
            self.doorbell()
        self.active[i] = Result(i, self._next_id, t_submit_ns=stamp)
        self._next_id += 1
        return i

    def doorbell(self) -> None:
        """Bump submit_seq: tells the device that slots became PREFILL_PENDING."""
        self.t.store_u64(_hoff("submit_seq"), self.t.load_u64(_hoff("submit_seq")) + 1)

    def reset_prefix_cache(self) -> None:
        """Bump reset_cache_seq: the device forgets every cached block's key."""
        self.t.store_u64(_hoff("reset_cache_seq"), self.t.load_u64(_hoff("reset_cache_seq")) + 1)

    def cancel(self, i: int) -> None:
        self.t.store_u32(self.geo.slot_offset(i) + _soff("cancel"), 1)
        self.t.store_u64(_hoff("cancel_seq"), self.t.load_u64(_hoff("cancel_seq")) + 1)

    def poll(self, i: int) -> Result:
        """Read new tokens of slot i (and store `consumed`); marks the result done on completion."""
        r = self.active[i]
        base = self.geo.slot_offset(i)
        state = self.t.load_u32(base + _soff("state"))  # acquire: state before generated
        gen = self.t.load_u32(base + _soff("generated"))
        have = len(r.tokens)
        if gen - have > self.geo.output_capacity:
            raise AssertionError(f"slot {i}: device published {gen} tokens, reader at {have}: output ring overrun")
        if gen > have:
            row = self.t.read_into(self.geo.output_offset(i, 0), np.zeros(self.geo.output_capacity, np.int32))
            r.tokens += [int(row[k % self.geo.output_capacity]) for k in range(have, gen)]
            self.t.store_u32(base + _soff("consumed"), gen)
        if state == SlotState.DECODE_COMPLETED:
            rec = self.slot(i)
            if int(rec["generated"]) != len(r.tokens):
                return r  # tokens published after our generated read: take them next poll
            r.finish = FinishReason(int(rec["finish_reason"]))
            r.error = SlotError(int(rec["error"]))
            r.t_admit_ns = int(rec["t_admit_ns"])
            r.t_first_ns = int(rec["t_first_ns"])
            r.t_launch_ns = int(rec["t_launch_ns"])
            r.cached_tokens = int(rec["cached_tokens"])
            if int(rec["request_id"]) != r.request_id:
                raise AssertionError(f"slot {i}: request_id {int(rec['request_id'])} != {r.request_id}")
            r.done = True
        return r

    def free(self, i: int) -> Result:
        r = self.active.pop(i)
        if not r.done:
            raise AssertionError(f"slot {i} freed before completion")
        base = self.geo.slot_offset(i)
        self.t.store_u32(base + _soff("state"), SlotState.EMPTY)
        self.t.store_u32(base + _soff("cancel"), 0)  # only while EMPTY (ownership rule)
        return r

    def wait(self, slots: Iterable[int], timeout: float = 30.0, free: bool = True) -> list[Result]:
        """Read every listed slot to completion (then free it); results in the order given."""
        slots = list(slots)
        pending = set(slots)
        t_end = time.monotonic() + timeout
        while pending:
            for i in list(pending):
                if self.poll(i).done:
                    pending.discard(i)
            if pending:
                if time.monotonic() > t_end:
                    states = {i: self.state(i).name for i in pending}
                    raise TimeoutError(f"slots not completed after {timeout} s: {states}")
                time.sleep(0.0005)
        out = [self.active[i] for i in slots]
        if free:
            for i in slots:
                self.free(i)
        return out

    def generate(self, prompt: Iterable[int], timeout: float = 30.0, **params) -> Result:
        return self.wait([self.submit(prompt, **params)], timeout)[0]

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until the device reports nothing running or waiting and every KV block free, and its
        counters are settled (they then include every step run)."""
        t_end = time.monotonic() + timeout
        while True:
            h = self.header()
            if int(h["running"]) == 0 and int(h["waiting"]) == 0 and h["kv_blocks_free"] == h["kv_blocks_total"]:
                self.settled(t_end)  # and the counters written with these
                return
            if time.monotonic() > t_end:
                raise AssertionError(
                    f"device not idle: running {int(h['running'])} waiting {int(h['waiting'])} "
                    f"kv free {int(h['kv_blocks_free'])}/{int(h['kv_blocks_total'])}"
                )
            time.sleep(0.002)


__all__ = ["RingClient", "Result", "UNLIMITED"]
