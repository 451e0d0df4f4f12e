"""What one ring agent client may write and read: the ownership table of layout.py, per slot partition.

A client is a frontend that owns the slots s with s % owners == owner (its partition, granted at
attach, see ring_agent.py). The agent applies each write only if the table gives it to a frontend,
for a slot of that partition, in the slot's current state:

    slot record, slot EMPTY         the whole record (the frontend writes a request there); a store
                                    of `state` may only say EMPTY or PREFILL_PENDING
    slot record, slot in use        `cancel` (1 only), `consumed`, `t_read_ns`, `mask_position`;
                                    `state` = EMPTY only from DECODE_COMPLETED (the release)
    prompt arena, slot EMPTY        the slot's own region (prompt_arena_tokens // n_slots words)
    publish (state := PREFILL_PENDING)  only if the record's prompt (prompt_offset, prompt_len,
                                    logit bias, prompt logprob records at prompt_logprobs_offset,
                                    block keys at block_keys_offset) lies in the slot's own region:
                                    the device reads and writes there
    mask arena                      the bitmasks m of the partition (m % owners == owner, as the
                                    frontend's MaskArena takes them); a publish names one of those
                                    in `mask_slot` (or none)
    header                          the doorbells (submit_seq, cancel_seq, reset_cache_seq),
                                    8-byte stores of a value that is this partition's
                                    (seq * owners + owner, see layout.py)

The word lists come from layout.py (FRONTEND_SLOT_WORDS, FRONTEND_DOORBELLS). reset_cache_seq makes
the device forget its prefix cache's keys, every partition's: no request's data is read or changed
(blocks in use keep their KV), only later hits are lost. Resetting is an operator action that the
server gates (POST /reset_prefix_cache answers 403 without --allow-reset-prefix-cache); a client
holding the ring secret is a frontend the operator started, so the agent takes the doorbell from it
like submit_seq.

Everything else (device words, `shutdown`, the output and logprob arenas, another partition's
slots) is refused: the batch fails and the connection closes. Reads return the ring's bytes where
the client may see them and zeros elsewhere: the header (geometry, device status and counters: no
request data), the partition's slot records, and a partition slot's prompt region, output row and
logprob row while that slot holds a request (not EMPTY). A request that ended is therefore not
readable through the agent, whichever client asks (the frontend also zeroes its prompt region when
it releases the slot, see slot_tracker.py).
"""

from __future__ import annotations

import numpy as np

from .layout import (
    BLOCK_KEY_WORDS,
    FRONTEND_DOORBELLS,
    FRONTEND_SLOT_WORDS,
    HEADER_BYTES,
    HEADER_DTYPE,
    LOGPROB_DTYPE,
    SLOT_BYTES,
    SLOT_DTYPE,
    SlotFlags,
    SlotState,
    prompt_logprob_record,
)
from .ring_geometry import RingView


class AccessDenied(ValueError):
    """A write the ownership table does not give to this client."""


def _field(name: str) -> tuple[int, int]:
    dt, off = SLOT_DTYPE.fields[name][:2]
    return off, off + dt.itemsize


_STATE = _field("state")
_CANCEL = _field("cancel")
_BUSY_WORDS = {_field(name) for name in FRONTEND_SLOT_WORDS}
_DOORBELLS = tuple(HEADER_DTYPE.fields[f][1] for f in FRONTEND_DOORBELLS)
_EMPTY, _PENDING, _COMPLETED = int(SlotState.EMPTY), int(SlotState.PREFILL_PENDING), int(SlotState.DECODE_COMPLETED)


class RingAccess:
    """The allow-list of one client (partition `owner` of `owners`) on the ring `view`."""

    def __init__(self, view: RingView, owner: int, owners: int):
        g = view.geo
        if not 0 <= owner < owners <= g.n_slots:
            raise ValueError(f"partition {owner} of {owners} on a ring of {g.n_slots} slots")
        self.view, self.geo = view, g
        self.owner, self.owners = owner, owners
        self.owned = np.arange(g.n_slots) % owners == owner
        self._owned = self.owned.tolist()  # (per-access lookups: a list is faster than numpy scalars)
        self._records = (g.slots_offset, g.slots_offset + g.n_slots * SLOT_BYTES)
        self.region_bytes = 4 * (g.prompt_arena_tokens // g.n_slots)
        self._states = view.slots["state"]  # live view of every slot's state word
        # (base, stride) of the per-slot regions that follow the records
        self._arenas = (
            (g.prompt_arena_offset, self.region_bytes),
            (g.output_arena_offset, 4 * g.output_capacity),
            (g.logprob_arena_offset, LOGPROB_DTYPE.itemsize * g.output_capacity),
        )
        # (base, stride, end, live only) of every per-slot unit kind, for the one-unit fast path
        self._units = tuple(
            (base, stride, base + stride * g.n_slots, live)
            for (base, stride), live in zip(
                ((g.slots_offset, SLOT_BYTES), *self._arenas), (False, True, True, True), strict=True
            )
        )

    # -- writes -------------------------------------------------------------------------
    def check_write(self, off: int, data: bytes) -> None:
        """Raise AccessDenied unless this client may store `data` at `off` now (in batch order)."""
        n = len(data)
        end = off + n
        r0, r1 = self._records
        if r0 <= off and end <= r1:  # the common case: a slot record's word
            s, a = divmod(off - r0, SLOT_BYTES)
            if a + n > SLOT_BYTES:
                raise AccessDenied(f"write [{off}, {end}) spans two slot records")
            self._check_record(self._own(s), a, data)
            return
        g = self.geo
        if end <= HEADER_BYTES:
            if n == 8 and off in _DOORBELLS and off % 8 == 0:
                if int.from_bytes(data, "little") % self.owners == self.owner:
                    return
                raise AccessDenied(f"doorbell value not of partition {self.owner} of {self.owners}")
            raise AccessDenied(f"header bytes [{off}, {end}) belong to the device")
        base, stride = self._arenas[0]
        if base <= off and end <= base + stride * g.n_slots:
            s, a = divmod(off - base, stride)
            if a + n > stride:
                raise AccessDenied(f"write [{off}, {end}) spans two slots' prompt regions")
            if int(self._states[self._own(s)]) != _EMPTY:
                raise AccessDenied(f"slot {s}'s prompt region is the device's while the slot holds a request")
            return
        stride = 4 * g.mask_words
        if g.n_masks and g.mask_arena_offset <= off and end <= g.mask_arena_offset + stride * g.n_masks:
            m, a = divmod(off - g.mask_arena_offset, stride)
            if a + n > stride or m % self.owners != self.owner:
                raise AccessDenied(f"write [{off}, {end}) is not within a bitmask of partition {self.owner}")
            return
        raise AccessDenied(f"ring bytes [{off}, {end}) are not a frontend's to write")

    def _own(self, s: int) -> int:
        if not self._owned[s]:
            raise AccessDenied(f"slot {s} is not in partition {self.owner} of {self.owners}")
        return s

    def _check_record(self, s: int, a: int, data: bytes) -> None:
        state = int(self._states[s])
        b = a + len(data)
        covers_state = a < _STATE[1] and _STATE[0] < b
        new_state = int.from_bytes(data[_STATE[0] - a : _STATE[1] - a], "little") if covers_state else None
        if covers_state and (a > _STATE[0] or b < _STATE[1]):
            raise AccessDenied(f"slot {s}: a partial store of the state word")
        if state == _EMPTY:
            if new_state is not None and new_state not in (_EMPTY, _PENDING):
                raise AccessDenied(f"slot {s}: EMPTY -> {new_state} is the device's transition")
            if new_state == _PENDING:
                rec = self.view.slots[s].copy()
                rec.reshape(1).view(np.uint8)[a:b] = np.frombuffer(data, np.uint8)
                self._check_publish(s, rec)
            return
        # in use: only the frontend's own words, each stored whole
        if (a, b) not in _BUSY_WORDS:
            raise AccessDenied(f"slot {s} holds a request: bytes [{a}, {b}) of its record are not the frontend's")
        if new_state is not None and not (new_state == _EMPTY and state == _COMPLETED):
            raise AccessDenied(f"slot {s}: state {state} -> {new_state} is not a frontend's transition")
        if (a, b) == _CANCEL and int.from_bytes(data, "little") != 1:
            raise AccessDenied(f"slot {s}: cancel is cleared only while the slot is EMPTY")

    def _check_publish(self, s: int, rec: np.ndarray) -> None:
        words = self.region_bytes // 4
        lo, hi = s * words, (s + 1) * words
        n, bias = int(rec["prompt_len"]), int(rec["n_logit_bias"])
        first = int(rec["prompt_offset"])
        if not (lo <= first and first + n + 2 * bias <= hi):
            raise AccessDenied(f"slot {s}: the prompt is outside the slot's region of the prompt arena")
        keys, at = int(rec["n_block_keys"]), int(rec["block_keys_offset"])
        if keys and not (lo <= at and at + keys * BLOCK_KEY_WORDS <= hi):
            raise AccessDenied(f"slot {s}: the block keys are outside the slot's region of the prompt arena")
        mask = int(rec["mask_slot"])
        if mask and not (mask <= self.geo.n_masks and (mask - 1) % self.owners == self.owner):
            raise AccessDenied(f"slot {s}: mask_slot {mask} is not a bitmask of partition {self.owner}")
        if int(rec["flags"]) & SlotFlags.PROMPT_LOGPROBS:
            at = int(rec["prompt_logprobs_offset"])
            rec_words = prompt_logprob_record(min(int(rec["n_logprobs"]), 64)).itemsize // 4
            if not (lo <= at and at + n * rec_words <= hi):
                raise AccessDenied(f"slot {s}: prompt logprob records outside the slot's region")

    # -- reads --------------------------------------------------------------------------
    def mask_read(self, off: int, out: np.ndarray) -> None:
        """Zero the bytes of `out` (ring bytes [off, off + out.size)) this client may not see."""
        g = self.geo
        end = off + out.size
        if end <= HEADER_BYTES:
            return
        # the common reads (a token window, a record, a slot's logprobs) lie in one slot's unit
        for base, stride, stop, live in self._units:
            if base <= off and end <= stop:
                s = (off - base) // stride
                if s == (end - 1 - base) // stride:
                    if not self._owned[s] or (live and self._states[s] == _EMPTY):
                        out[:] = 0
                    return
                break
        lo, hi = max(off, HEADER_BYTES), min(end, g.slots_offset)
        if lo < hi:
            out[lo - off : hi - off] = 0  # between the header's bytes and the first record (none today)
        self._mask_units(off, out, g.slots_offset, SLOT_BYTES, self.owned)
        active = self.owned & (self._states != _EMPTY)
        for base, stride in self._arenas:
            self._mask_units(off, out, base, stride, active)
        # gaps: alignment padding after each arena's slot regions, and after the last arena
        ends = [
            (g.slots_offset + g.n_slots * SLOT_BYTES, g.prompt_arena_offset),
            (g.prompt_arena_offset + self.region_bytes * g.n_slots, g.output_arena_offset),
            (g.output_arena_offset + 4 * g.output_capacity * g.n_slots, g.logprob_arena_offset),
            (g.logprob_arena_offset + self._arenas[2][1] * g.n_slots, g.total_bytes),
        ]
        for a, b in ends:
            lo, hi = max(off, a), min(end, b)
            if lo < hi:
                out[lo - off : hi - off] = 0

    def _mask_units(self, off: int, out: np.ndarray, base: int, stride: int, allowed: np.ndarray) -> None:
        """Zero the parts of `out` that fall in per-slot units (base + s * stride, stride bytes) of
        slots not `allowed`."""
        end = off + out.size
        lo, hi = max(off, base), min(end, base + stride * len(allowed))
        if lo >= hi:
            return
        s0, s1 = (lo - base) // stride, (hi - 1 - base) // stride
        hidden = ~allowed[s0 : s1 + 1]
        if not hidden.any():
            return
        if lo == base + s0 * stride and hi == base + (s1 + 1) * stride:  # whole units: one vector store
            out[lo - off : hi - off].reshape(-1, stride)[hidden] = 0
            return
        for s in np.flatnonzero(hidden).tolist():
            u = base + (s0 + s) * stride
            a, b = max(lo, u), min(hi, u + stride)
            out[a - off : b - off] = 0
