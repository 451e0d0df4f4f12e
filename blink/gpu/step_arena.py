"""Step inputs of the CUDA engine: one device arena of every per-step field (one H2D copy per
host-launched step) with its pinned host mirror, and the engine's size limits (Dims)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Step input fields in one device arena (one H2D copy per host-launched step). block_tables goes
# last so a step copies only the prefix that holds its S rows.
STEP_FIELDS = (
    ("num_seqs", np.uint32, "one"),
    ("num_tokens", np.uint32, "one"),
    ("step_seq", np.uint64, "one"),
    ("input_ids", np.int32, "tokens"),
    ("positions", np.int32, "tokens"),
    ("cu_q_lens", np.int32, "seqs+1"),
    ("seq_lens", np.int32, "seqs"),
    ("temperature", np.float32, "seqs"),
    ("top_p", np.float32, "seqs"),
    ("top_k", np.int32, "seqs"),
    ("seeds", np.uint64, "seqs"),
    ("sample_pos", np.uint32, "seqs"),
    ("block_tables", np.int32, "table"),
)


@dataclass(frozen=True)
class Dims:
    max_seqs: int
    max_tokens: int
    max_blocks_per_seq: int
    block_size: int
    num_blocks: int
    max_context: int


class StepArena:
    """Step inputs: a device arena and its pinned host mirror, field views on both."""

    def __init__(self, d: Dims) -> None:
        import cupy as cp

        counts = {
            "one": 1,
            "tokens": d.max_tokens,
            "seqs": d.max_seqs,
            "seqs+1": d.max_seqs + 1,
            "table": d.max_seqs * d.max_blocks_per_seq,
        }
        self.offsets: dict[str, int] = {}
        off = 0
        layout = []
        for name, dt, kind in STEP_FIELDS:
            off = (off + 15) // 16 * 16
            n = counts[kind]
            self.offsets[name] = off
            layout.append((name, dt, n, off))
            off += n * np.dtype(dt).itemsize
        self.nbytes = off
        self.dev = cp.zeros(off, dtype=cp.uint8)
        self._pinned = cp.cuda.alloc_pinned_memory(off)
        self.host_bytes = np.frombuffer(self._pinned, dtype=np.uint8, count=off)
        self.host_bytes[:] = 0
        self.host: dict[str, np.ndarray] = {}
        self.ptr: dict[str, int] = {}
        for name, dt, n, o in layout:
            self.host[name] = self.host_bytes[o : o + n * np.dtype(dt).itemsize].view(dt)
            self.ptr[name] = int(self.dev.data.ptr) + o
        self.table_width = d.max_blocks_per_seq

    def upload(self, stream: int, num_seqs: int) -> None:
        import cupy as cp

        end = self.offsets["block_tables"] + num_seqs * self.table_width * 4
        cp.cuda.runtime.memcpyAsync(int(self.dev.data.ptr), self.host_bytes.ctypes.data, end, 1, stream)
