"""Ring geometry: the byte offsets of a ring of given sizes (RingGeometry) and numpy views over its
bytes (RingView); the dtypes, constants and the memory map they follow are in blink.protocol.layout."""

from __future__ import annotations

import numpy as np

from .layout import (
    ALIGN,
    HEADER_BYTES,
    HEADER_DTYPE,
    LOGPROB_DTYPE,
    MAX_LOGPROBS,
    RING_MAGIC,
    RING_VERSION,
    SLOT_BYTES,
    SLOT_DTYPE,
    TOKEN_DTYPE,
    DeviceStatus,
)


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class RingGeometry:
    """Byte offsets of a ring with the given sizes (pure arithmetic, no memory)."""

    __slots__ = (
        "n_slots",
        "prompt_arena_tokens",
        "output_capacity",
        "slots_offset",
        "prompt_arena_offset",
        "output_arena_offset",
        "logprob_arena_offset",
        "n_masks",
        "mask_words",
        "mask_arena_offset",
        "total_bytes",
    )

    def __init__(
        self, n_slots: int, prompt_arena_tokens: int, output_capacity: int, n_masks: int = 0, mask_vocab: int = 0
    ):
        """n_masks bitmasks of mask_vocab tokens (rounded up to 32) for structured output; 0: none."""
        if not 1 <= n_slots <= 1 << 20:
            raise ValueError(f"n_slots must be in [1, 2^20], got {n_slots}")
        if prompt_arena_tokens < 1 or output_capacity < 1:
            raise ValueError("arena sizes must be positive")
        if n_masks < 0 or mask_vocab < 0 or (n_masks > 0) != (mask_vocab > 0):
            raise ValueError(f"n_masks ({n_masks}) and mask_vocab ({mask_vocab}) must both be 0 or both positive")
        self.n_slots = n_slots
        self.prompt_arena_tokens = prompt_arena_tokens
        self.output_capacity = output_capacity
        self.slots_offset = HEADER_BYTES
        self.prompt_arena_offset = _round_up(HEADER_BYTES + n_slots * SLOT_BYTES, ALIGN)
        self.output_arena_offset = _round_up(self.prompt_arena_offset + 4 * prompt_arena_tokens, ALIGN)
        self.logprob_arena_offset = _round_up(self.output_arena_offset + 4 * n_slots * output_capacity, ALIGN)
        self.n_masks = n_masks
        self.mask_words = (mask_vocab + 31) // 32
        self.mask_arena_offset = _round_up(
            self.logprob_arena_offset + LOGPROB_DTYPE.itemsize * n_slots * output_capacity, ALIGN
        )
        self.total_bytes = _round_up(self.mask_arena_offset + 4 * n_masks * self.mask_words, ALIGN)

    @classmethod
    def from_header(cls, hdr: np.ndarray) -> RingGeometry:
        g = cls(
            int(hdr["n_slots"]),
            int(hdr["prompt_arena_tokens"]),
            int(hdr["output_capacity"]),
            int(hdr["n_masks"]),
            32 * int(hdr["mask_words"]),
        )
        fields = ("slots_offset", "prompt_arena_offset", "output_arena_offset", "logprob_arena_offset")
        for f in (*fields, "mask_arena_offset", "total_bytes"):
            if int(hdr[f]) != getattr(g, f):
                raise ValueError(f"ring header field {f}={int(hdr[f])} disagrees with geometry {getattr(g, f)}")
        return g

    def slot_offset(self, i: int) -> int:
        return self.slots_offset + i * SLOT_BYTES

    def output_offset(self, slot: int, k: int) -> int:
        """Byte offset of generated token k of a slot (the output ring wraps)."""
        return self.output_arena_offset + 4 * (slot * self.output_capacity + k % self.output_capacity)

    def logprob_offset(self, slot: int, k: int) -> int:
        """Byte offset of the logprob record of generated token k of a slot (wraps like the tokens)."""
        return self.logprob_arena_offset + LOGPROB_DTYPE.itemsize * (
            slot * self.output_capacity + k % self.output_capacity
        )

    def mask_offset(self, m: int) -> int:
        """Byte offset of bitmask m of the mask arena."""
        return self.mask_arena_offset + 4 * m * self.mask_words

    def init_header(self, hdr: np.ndarray) -> None:
        """Fill the geometry fields of a zeroed header (magic last)."""
        hdr["version"] = RING_VERSION
        hdr["header_bytes"] = HEADER_BYTES
        hdr["n_slots"] = self.n_slots
        hdr["slot_bytes"] = SLOT_BYTES
        hdr["prompt_arena_tokens"] = self.prompt_arena_tokens
        hdr["output_capacity"] = self.output_capacity
        hdr["slots_offset"] = self.slots_offset
        hdr["prompt_arena_offset"] = self.prompt_arena_offset
        hdr["output_arena_offset"] = self.output_arena_offset
        hdr["logprob_arena_offset"] = self.logprob_arena_offset
        hdr["logprob_top"] = MAX_LOGPROBS
        hdr["mask_arena_offset"] = self.mask_arena_offset
        hdr["n_masks"] = self.n_masks
        hdr["mask_words"] = self.mask_words
        hdr["total_bytes"] = self.total_bytes
        hdr["device_status"] = DeviceStatus.STARTING
        hdr["magic"] = RING_MAGIC


class RingView:
    """numpy views over a ring's bytes (any writable buffer: mmap, bytearray, pinned memory).

    This is the local (load/store) access path used by the emulated device and by the
    shared-memory transport. Remote transports (RDMA) move the same byte ranges.
    """

    def __init__(self, buf, geometry: RingGeometry | None = None):
        self.buf = memoryview(buf).cast("B")
        self.header = np.ndarray((), HEADER_DTYPE, self.buf, 0)
        if geometry is None:
            if int(self.header["magic"]) != RING_MAGIC:
                raise ValueError("not a Blink ring (bad magic)")
            if int(self.header["version"]) != RING_VERSION:
                raise ValueError(f"ring version {int(self.header['version'])}, expected {RING_VERSION}")
            geometry = RingGeometry.from_header(self.header)
        self.geo = geometry
        if len(self.buf) < geometry.total_bytes:
            raise ValueError(f"buffer of {len(self.buf)} B is smaller than the ring ({geometry.total_bytes} B)")
        g = geometry
        self.slots = np.ndarray((g.n_slots,), SLOT_DTYPE, self.buf, g.slots_offset)
        self.prompt_arena = np.ndarray((g.prompt_arena_tokens,), TOKEN_DTYPE, self.buf, g.prompt_arena_offset)
        self.output_arena = np.ndarray((g.n_slots, g.output_capacity), TOKEN_DTYPE, self.buf, g.output_arena_offset)
        self.logprob_arena = np.ndarray((g.n_slots, g.output_capacity), LOGPROB_DTYPE, self.buf, g.logprob_arena_offset)
        self.mask_arena = np.ndarray((g.n_masks, g.mask_words), "<u4", self.buf, g.mask_arena_offset)

    @classmethod
    def create(cls, buf, geometry: RingGeometry) -> RingView:
        view = cls(buf, geometry)
        np.frombuffer(view.buf, np.uint8, geometry.total_bytes).fill(0)
        geometry.init_header(view.header)
        return view
