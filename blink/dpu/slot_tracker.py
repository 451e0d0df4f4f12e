"""Slot tracker: finds free ring slots and publishes requests into them (paper §4.4).

The tracker never scans the ring per submission. It keeps a local availability cache: a slot
is free when its last-seen ring state is EMPTY and this frontend does not hold it. The cache
is refreshed by one bulk read of all slot records (`refresh`, done by the token reader every
poll cycle, which reads the records anyway). A hint-based circular scan starting after the
last claimed slot finds a free one in O(1) amortized time: claims sweep the ring in order, so
the slots right after the hint are the ones released longest ago.

Publishing a request follows the ring's single-writer rules (blink/protocol/layout.py): while
the slot is EMPTY the frontend owns the whole record, so it writes the prompt into the slot's
region of the prompt arena and the record fields (state still EMPTY), then stores state =
PREFILL_PENDING (the release store that hands the slot to the device), then rings submit_seq.

Every access goes through the Transport in batches (blink/protocol/transport.py): a refresh is
one read of every record (plus whatever the token reader reads in the same round trip), a claim
is one posted batch (prompt, logit bias, record, state word, doorbell, in that order), a cancel one
posted batch (flag, doorbell). Over TCP or RDMA a submission therefore costs no round trip of its own.

A request's prompt does not outlive it: the release (DECODE_COMPLETED -> EMPTY) is followed, in
the same posted batch, by zeros over the slot's prompt region as far as the request used it (its
prompt, logit bias and prompt logprob records; the whole region for a slot adopted from a previous
frontend). While the slot is EMPTY that region is the frontend's (layout.py). The output and
logprob rows are the device's; through the ring agent nobody reads them once the slot is EMPTY
(blink/protocol/ring_access.py).

Several frontend processes can share one ring (deploy.frontends > 1: more cores for HTTP and
detokenization): frontend `owner` of `owners` only ever claims, reads and releases the slots s
with s % owners == owner, so every slot word still has one host writer. The doorbells are the
words they share; each rings them with values unique to it (seq * owners + owner, see
blink/protocol/layout.py).
"""

from __future__ import annotations

import time

import numpy as np

from blink.protocol.layout import (
    BLOCK_KEY_WORDS,
    HEADER_DTYPE,
    SLOT_DTYPE,
    TOKEN_DTYPE,
    DeviceFeatures,
    DeviceStatus,
    SlotState,
    prompt_region_words,
)
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import Read, Transport, Write
from blink.protocol.wire import SubmitRequest

from .prefix_keys import block_keys, chain_root
from .token_masks import Constraint

_STATE = SLOT_DTYPE.fields["state"][1]
_CANCEL = SLOT_DTYPE.fields["cancel"][1]
_CONSUMED = SLOT_DTYPE.fields["consumed"][1]
_T_READ = SLOT_DTYPE.fields["t_read_ns"][1]
_SUBMIT_SEQ = HEADER_DTYPE.fields["submit_seq"][1]
_CANCEL_SEQ = HEADER_DTYPE.fields["cancel_seq"][1]
_RESET_SEQ = HEADER_DTYPE.fields["reset_cache_seq"][1]


def _u32(offset: int, value: int) -> Write:
    return offset, np.array([value], "<u4")


def read_header(transport: Transport) -> np.ndarray:
    """One read of the ring header -> a 0-d HEADER_DTYPE array (a private copy)."""
    out = np.zeros((), HEADER_DTYPE)
    transport.read_into(0, out.reshape(1).view(np.uint8)[: HEADER_DTYPE.itemsize])
    return out


def attach_geometry(transport: Transport) -> RingGeometry:
    hdr = read_header(transport)
    return RingGeometry.from_header(hdr)


def region_words(req: SubmitRequest) -> int:
    """int32 words of prompt arena the request needs (prompt, logit_bias, prompt logprob records)."""
    sp = req.sampling
    n_lp = max(sp.logprobs, sp.prompt_logprobs, 0) if sp.prompt_logprobs >= 0 else None
    return prompt_region_words(len(req.prompt_ids), len(sp.logit_bias), n_lp)


class SlotTracker:
    """Local cache of slot availability plus the frontend's writes into slots."""

    def __init__(self, transport: Transport, geometry: RingGeometry, owner: int = 0, owners: int = 1):
        if not 0 <= owner < owners:
            raise ValueError(f"frontend index {owner} out of range for {owners} frontends")
        if owners > geometry.n_slots:
            raise ValueError(f"{owners} frontends cannot share {geometry.n_slots} slots")
        self.t = transport
        self.geo = geometry
        self.owner, self.owners = owner, owners
        n = geometry.n_slots
        self.owned = np.arange(n) % owners == owner  # the slots this frontend may claim
        self.n_owned = int(self.owned.sum())
        self.prompt_capacity = geometry.prompt_arena_tokens // n  # tokens of prompt arena per slot
        self.records = np.zeros(n, SLOT_DTYPE)  # last bulk read of the slot records
        self.held = np.zeros(n, bool)  # slots this frontend claimed and has not released
        self.used = np.zeros(n, np.int64)  # prompt-arena words each held slot's request used (zeroed at release)
        self._free = np.zeros(n, bool)  # cache: ring state EMPTY, not held, owned
        self._hint = 0
        hdr = read_header(transport)
        self.describe(hdr)
        self._reset_seq = int(hdr["reset_cache_seq"]) // owners + 1
        # Doorbell sequence numbers continue above whatever any frontend rang last (a restarted
        # frontend must not repeat a value the device may hold as its last seen).
        self._submit_seq = int(hdr["submit_seq"]) // owners + 1
        self._cancel_seq = int(hdr["cancel_seq"]) // owners + 1
        self.refresh()

    def describe(self, hdr: np.ndarray) -> None:
        """Take what the device says of its prefix cache from a header read: block keys are written
        only for a device that is READY and matches them (DeviceFeatures.PREFIX_CACHING)."""
        self.described = int(hdr["device_status"]) == DeviceStatus.READY
        self.key_block = 0  # tokens per keyed block; 0: no block keys
        self._key_root = b""
        if self.described and int(hdr["features"]) & DeviceFeatures.PREFIX_CACHING and int(hdr["kv_block_size"]):
            self.key_block = int(hdr["kv_block_size"])
            self._key_root = chain_root(int(hdr["kv_cache_key"]), self.key_block)

    # -- cache ------------------------------------------------------------------------
    def refresh(self, reads: list[Read] | tuple[Read, ...] = ()) -> np.ndarray:
        """One bulk read of every slot record, and `reads` after it in the same round trip (the record
        read comes first: it is the acquire for the others); updates the availability cache.
        Returns the records."""
        self.t.transact((), [(self.geo.slots_offset, self.records), *reads])
        self._free = (self.records["state"] == SlotState.EMPTY) & ~self.held & self.owned
        return self.records

    @property
    def n_free(self) -> int:
        return int(self._free.sum())

    @property
    def n_held(self) -> int:
        return int(self.held.sum())

    @property
    def n_busy_ring(self) -> int:
        """Slots in use on the whole ring, by every frontend sharing it: not EMPTY as of the last
        bulk read, or claimed by this frontend since. The load a router compares across replicas.
        Through a ring agent the other partitions' records read as EMPTY (blink/protocol/ring_access.py):
        there it counts this frontend's slots only."""
        return int(((self.records["state"] != SlotState.EMPTY) | self.held).sum())

    def find_free(self) -> int | None:
        """Circular scan from the hint over the cache; no ring access. O(1) when the slot at the hint
        is free, which is the steady state (slots are released roughly in the order claimed)."""
        free = self._free
        h = self._hint
        if free[h]:  # the common case: claims sweep the ring, the slot after the last one is free
            return h
        # Otherwise scan [h, n) then [0, h) in C (a numpy call each) rather than slot by slot.
        idx = np.flatnonzero(free[h:])
        if idx.size:
            return h + int(idx[0])
        idx = np.flatnonzero(free[:h])
        if idx.size:
            return int(idx[0])
        return None

    # -- frontend writes ----------------------------------------------------------------
    def claim(self, req: SubmitRequest, slot: int | None = None, constraint: Constraint | None = None) -> int | None:
        """Publish `req` into a free slot; returns the slot, or None when the cache shows none free.
        constraint: a structured-output request's bitmask, whose mask for token 0 goes out with the
        request (before the state word)."""
        words = region_words(req)
        if words > self.prompt_capacity:
            raise ValueError(f"request needs {words} words of prompt arena, a slot has {self.prompt_capacity}")
        if slot is None:
            slot = self.find_free()
            if slot is None:
                return None
        elif not self._free[slot]:
            raise ValueError(f"slot {slot} is not free")
        off = slot * self.prompt_capacity
        n = len(req.prompt_ids)
        writes: list[Write] = [(self.geo.prompt_arena_offset + 4 * off, np.asarray(req.prompt_ids, dtype=TOKEN_DTYPE))]
        if req.sampling.logit_bias:
            writes.append((self.geo.prompt_arena_offset + 4 * (off + n), req.sampling.bias_words().view(np.uint8)))
        rec = np.zeros((), SLOT_DTYPE)
        rec["state"] = SlotState.EMPTY
        rec["request_id"] = req.request_id
        rec["prompt_offset"] = off
        rec["prompt_len"] = len(req.prompt_ids)
        rec["max_new_tokens"] = req.max_new_tokens
        rec["min_new_tokens"] = req.min_new_tokens
        rec["n_stop"] = len(req.stop_ids)
        rec["stop_ids"][: len(req.stop_ids)] = req.stop_ids
        req.sampling.write_slot(rec)
        rec["group"] = req.group
        rec["prompt_logprobs_offset"] = self.prompt_logprobs_offset(slot, req)
        writes += self._key_writes(req, off, words, rec)
        used = words + BLOCK_KEY_WORDS * int(rec["n_block_keys"])  # the release zeroes the keys too
        rec["t_submit_ns"] = time.time_ns()
        base = self.geo.slot_offset(slot)
        if constraint is not None:
            rec["mask_slot"] = constraint.mask + 1
            writes += constraint.writes(slot, 0)[:1]  # the bits; the record carries mask_position 1
            rec["mask_position"] = 1
        # In order, in one posted batch: the prompt (and logit bias) and the record (state still
        # EMPTY), then the state word (the release that hands the slot to the device), then the doorbell.
        writes += [
            (base, rec.reshape(1).view(np.uint8)),
            _u32(base + _STATE, SlotState.PREFILL_PENDING),
            self._doorbell(_SUBMIT_SEQ, self._submit_seq),
        ]
        self.t.post(writes)
        self._submit_seq += 1
        self.held[slot] = True
        self.used[slot] = used
        self._free[slot] = False
        self._hint = (slot + 1) % self.geo.n_slots
        return slot

    def _key_writes(self, req: SubmitRequest, off: int, words: int, rec: np.ndarray) -> list[Write]:
        """The prompt's block keys after the rest of its region, as many as the region has room for
        (fewer keys only cache less); sets the record's n_block_keys and block_keys_offset."""
        if not self.key_block:
            return []
        room = (self.prompt_capacity - words) // BLOCK_KEY_WORDS
        n = min(len(req.prompt_ids) // self.key_block, room)
        if n <= 0:
            return []
        keys = block_keys(req.prompt_ids[: n * self.key_block], self.key_block, self._key_root)
        rec["n_block_keys"] = n
        rec["block_keys_offset"] = off + words
        return [(self.geo.prompt_arena_offset + 4 * (off + words), np.frombuffer(keys, np.uint8))]

    def reset_prefix_cache(self) -> None:
        """Ring the device's reset_cache_seq doorbell: it forgets every cached block's key."""
        self.t.post([self._doorbell(_RESET_SEQ, self._reset_seq)])
        self._reset_seq += 1

    def prompt_logprobs_offset(self, slot: int, req: SubmitRequest) -> int:
        """int32 word of the request's prompt logprob record 0 (after its prompt and logit_bias)."""
        return slot * self.prompt_capacity + len(req.prompt_ids) + 2 * len(req.sampling.logit_bias)

    def consumed_write(self, slot: int, consumed: int) -> Write:
        """The store of a slot's `consumed` counter (the token reader batches these)."""
        return _u32(self.geo.slot_offset(slot) + _CONSUMED, consumed & 0xFFFFFFFF)

    def read_ns_write(self, slot: int, t_ns: int) -> Write:
        """The store stamping the first token's read into the slot (a frontend-owned word: the
        TTFT trace; the token reader batches it with the consumed counters)."""
        return (self.geo.slot_offset(slot) + _T_READ, np.array([t_ns], "<u8"))

    def cancel(self, slot: int) -> None:
        """Set the slot's cancel flag and ring the cancel doorbell; the device finishes it CANCELLED."""
        self.t.post([_u32(self.geo.slot_offset(slot) + _CANCEL, 1), self._doorbell(_CANCEL_SEQ, self._cancel_seq)])
        self._cancel_seq += 1

    def _doorbell(self, offset: int, seq: int) -> Write:
        return offset, np.array([seq * self.owners + self.owner], "<u8")

    def release_writes(self, slot: int) -> list[Write]:
        """DECODE_COMPLETED -> EMPTY, after every token was read, then zeros over the prompt region the
        request used: the stores, to be posted by the caller (after its token reads completed). The
        slot is free again locally at once; a claim of it posts its writes after these, so the
        device sees them in that order."""
        assert self.owned[slot], f"slot {slot} belongs to another frontend"
        self.held[slot] = False
        self._free[slot] = True
        words = min(int(self.used[slot]), self.prompt_capacity)
        self.used[slot] = 0
        base = self.geo.prompt_arena_offset + 4 * slot * self.prompt_capacity
        return [_u32(self.geo.slot_offset(slot) + _STATE, SlotState.EMPTY), (base, np.zeros(4 * words, np.uint8))]

    def release(self, slot: int) -> None:
        self.t.post(self.release_writes(slot))

    def orphans(self) -> list[int]:
        """Slots left non-EMPTY by a previous frontend (on (re)attach): not held by us, not EMPTY."""
        self.refresh()
        left = (self.records["state"] != SlotState.EMPTY) & ~self.held & self.owned
        return [int(s) for s in np.flatnonzero(left)]

    def adopt(self, slot: int) -> None:
        """Take over an orphan slot so that the token reader drains and releases it."""
        self.held[slot] = True
        self.used[slot] = self.prompt_capacity  # what its request used is unknown: clear the whole region
        self._free[slot] = False
