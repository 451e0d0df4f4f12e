"""Token masks in the ring: the frontend's side of structured output (blink/protocol/layout.py, the
mask arena). A constrained request takes one of the arena's bitmasks for its life; the token reader
advances the request's matcher by each token it reads and posts the mask of the next position: the
bits, then slot.mask_position = next token index + 1 (the release the device acquires before it
samples that token). Both go out in the reader's one posted batch per cycle, so the mask costs no
round trip of its own on a remote transport.

MaskBatch advances every constrained slot that read tokens in one cycle together: the matchers
consume their tokens (one by one: consuming a token costs ~1 us, and the executor's parallel consume
costs more in hand-offs, ~5 us a matcher for 32), then the engine's parallel executor fills all their
masks at once (32 masks of a 128k vocabulary: ~190 us against ~400 us one by one, on two cores),
straight into the rows of one array whose rows are the ring writes (no copy). A cycle with one such
slot, and a frontend with fewer than two threads for the executor (the engine's default is 80 % of
the CPUs: one on a 2-core box, where its hand-offs cost more than they save), take the single-matcher
path (Constraint.advance, one by one on the reader's thread); the masks still go out in one post.
"""

from __future__ import annotations

import os

import numpy as np

from blink.protocol.layout import SLOT_DTYPE
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import Write

from .structured import Matcher, executor

_MASK_POSITION = SLOT_DTYPE.fields["mask_position"][1]


class MaskArena:
    """Which of the ring's bitmasks this frontend holds (owner of `owners` frontends sharing the ring
    takes the masks m with m % owners == owner, as with slots)."""

    def __init__(self, geo: RingGeometry, owner: int = 0, owners: int = 1):
        self.geo = geo
        self.free = [m for m in range(geo.n_masks - 1, -1, -1) if m % owners == owner]
        self.n_owned = len(self.free)

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def give(self, m: int) -> None:
        self.free.append(m)


class Constraint:
    """One constrained request in a slot: its matcher and its bitmask of the arena."""

    __slots__ = ("matcher", "mask", "geo", "buf", "failed")

    def __init__(self, matcher: Matcher, mask: int, geo: RingGeometry):
        self.matcher = matcher
        self.mask = mask
        self.geo = geo
        self.buf = np.zeros(geo.mask_words, "<u4")
        self.failed = False

    def writes(self, slot: int, k: int) -> list[Write]:
        """The bitmask for generated token k, then the position word that publishes it."""
        self.matcher.fill_mask(self.buf)
        return self.publish(slot, k, self.buf.copy())

    def publish(self, slot: int, k: int, bits: np.ndarray) -> list[Write]:
        """The writes of `bits` as the mask of generated token k: the bits, then the position word."""
        return [
            (self.geo.mask_offset(self.mask), bits),
            (self.geo.slot_offset(slot) + _MASK_POSITION, np.array([k + 1], "<u4")),
        ]

    def consume(self, ids: list[int]) -> None:
        """Advance the matcher by tokens read. A token the grammar did not allow (only a device that
        ignored the mask emits one), or the engine giving up, leaves it in error (`failed`); its mask
        then allows nothing but what the engine allows in error (EOS)."""
        if not self.matcher.advance(ids):
            self.failed = True

    def advance(self, slot: int, ids: list[int], k: int) -> list[Write]:
        """After reading tokens `ids` (the last one is token k - 1): the mask of token k."""
        self.consume(ids)
        return self.writes(slot, k)


class MaskBatch:
    """The masks of one reader cycle's constrained slots, computed together (module doc)."""

    def __init__(self, threads: int | None = None):
        # the executor's threads; None: the engine's default (80 % of the CPUs, at most 32)
        self.threads = threads if threads is not None else min(32, int(0.8 * len(os.sched_getaffinity(0))))
        self._executor = None  # made at the first cycle with two constrained slots

    def advance(self, items: list[tuple[int, Constraint, list[int], int]]) -> list[Write]:
        """items: (slot, its constraint, the tokens read, generated). The writes that publish each
        slot's mask of token `generated`: the bits of all, then the positions (_bits_first). Only
        the vocabulary's words are written: the words past it stay as the request's first mask
        (Constraint.writes, whole) left them, cleared."""
        if len(items) == 1 or self.threads < 2:
            return _bits_first([w for slot, c, ids, k in items for w in c.advance(slot, ids, k)])
        if self._executor is None:
            self._executor = executor(self.threads)
        for _, c, ids, _ in items:  # one by one: a parallel consume costs more than it saves (module doc)
            c.consume(ids)
        words = items[0][1].matcher.words  # the vocabulary's (one tokenizer per frontend)
        bits = np.empty((len(items), words), "<u4")  # each row is one write's data
        self._executor.unsafe_compute_mask_ptr(
            [(c.matcher.m, i) for i, (_, c, _, _) in enumerate(items)], bits.ctypes.data, 4 * words, len(items)
        )
        return _bits_first([w for i, (slot, c, _, k) in enumerate(items) for w in c.publish(slot, k, bits[i])])


def _bits_first(pairs: list[Write]) -> list[Write]:
    """(bits, position) pairs as every slot's bits, then every position word: a device polling the ring
    sees the cycle's masks published within a few word stores, not one at a time behind each mask's
    copy (where it would launch a step with some of the slots and leave the rest a step behind)."""
    return pairs[0::2] + pairs[1::2]
