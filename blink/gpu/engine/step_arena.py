"""Step inputs of the CUDA engine: one device arena of every step field (`blink.protocol.step`;
one H2D copy per host-launched step) with its pinned host mirror, and the engine's size limits (Dims)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blink.protocol.step import STEP_FIELDS, field_count


@dataclass(frozen=True)
class Dims:
    max_seqs: int
    max_num_batched_tokens: int
    max_blocks_per_seq: int
    block_size: int
    num_blocks: int
    max_context: int


def arena_layout(d: Dims) -> tuple[dict[str, tuple[int, int]], int]:
    """Byte offset and element count of every step field in the arena (in STEP_FIELDS order, each
    on 16 bytes; block_tables last, see StepArena.upload), and the arena's size."""
    out: dict[str, tuple[int, int]] = {}
    off = 0
    for f in STEP_FIELDS:
        off = (off + 15) // 16 * 16
        out[f.name] = off, field_count(f, d.max_seqs, d.max_num_batched_tokens, d.max_blocks_per_seq)
        off += out[f.name][1] * f.dtype.itemsize
    return out, off


def host_views(buf: np.ndarray, layout: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    """A typed view of every step field over the arena's bytes."""
    return {f.name: buf[o : o + n * f.dtype.itemsize].view(f.dtype) for f in STEP_FIELDS for o, n in [layout[f.name]]}


class StepArena:
    """Step inputs: a device arena and its pinned host mirror, field views on both."""

    def __init__(self, d: Dims) -> None:
        import cupy as cp

        layout, self.nbytes = arena_layout(d)
        self.offsets = {name: off for name, (off, _) in layout.items()}
        self.dev = cp.zeros(self.nbytes, dtype=cp.uint8)
        self._pinned = cp.cuda.alloc_pinned_memory(self.nbytes)
        self.host_bytes = np.frombuffer(self._pinned, dtype=np.uint8, count=self.nbytes)
        self.host_bytes[:] = 0
        self.host = host_views(self.host_bytes, layout)
        self.ptr = {name: int(self.dev.data.ptr) + off for name, off in self.offsets.items()}
        self.table_width = d.max_blocks_per_seq

    def upload(self, stream: int, num_seqs: int) -> None:
        import cupy as cp

        end = self.offsets["block_tables"] + num_seqs * self.table_width * 4
        cp.cuda.runtime.memcpyAsync(int(self.dev.data.ptr), self.host_bytes.ctypes.data, end, 1, stream)
