"""Step loading of a host-launched step: a StepBatch into the host mirror of the step arena.

Engine (blink/gpu/engine/engine.py) captures and launches the graphs; this mixin owns writing one step's
fields: the batch (blink.protocol.step), the sampling extensions' fields (b.ext), the token masks'
ring addresses (map_ring: the ring the sampler reads) and the logit_bias tables of new requests. It
reads Engine's dims, step arena (arena.host), Forward (fwd: sampling_rows, the logit_bias tables),
stream (s) and the mapped ring (_ring).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from blink.protocol.layout import MAX_LOGIT_BIAS, MAX_LOGPROBS, SLOT_BYTES, SLOT_DTYPE
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.step import BATCH_FIELDS, StepBatch

_MASK_POSITION = SLOT_DTYPE.fields["mask_position"][1]  # byte offset in a slot


class StepLoader:
    def load_step(self, b: StepBatch, step_seq: int = 0) -> bool:
        """Write a StepBatch into the host mirror of the step arena; returns whether it is a decode step."""
        S, T, d = b.num_seqs, b.num_tokens, self.dims
        if S > d.max_seqs or T > d.max_num_batched_tokens or S == 0:
            raise ValueError(
                f"step of {S} sequences / {T} tokens exceeds the engine ({d.max_seqs}, {d.max_num_batched_tokens})"
            )
        if int(np.max(b.seq_lens)) > d.max_context:
            raise ValueError(f"sequence longer than max_context {d.max_context}")
        h = self.arena.host
        h["num_seqs"][0], h["num_tokens"][0], h["step_seq"][0] = S, T, step_seq
        for f in BATCH_FIELDS[:-1]:  # every field but block_tables, whose rows are clipped below
            h[f.name][: b.rows(f)] = getattr(b, f.name)
        bt = h["block_tables"].reshape(d.max_seqs, d.max_blocks_per_seq)
        w = min(b.block_tables.shape[1], d.max_blocks_per_seq)
        bt[:S, :w] = b.block_tables[:, :w]
        self._load_ext(b)
        return T == S

    def _load_ext(self, b: StepBatch) -> None:
        """The sampling extensions' step fields from b.ext (ext_on 0 when the step has none)."""
        h, x, S = self.arena.host, b.ext, b.num_seqs
        h["ext_on"][0] = 0 if x is None else 1
        if x is None:
            return
        rows, penalized = self.fwd.sampling_rows, x.penalized
        if penalized.any() and int(x.slots[penalized].max()) >= rows:
            raise ValueError(f"penalty state of slot {int(x.slots.max())}: the engine has {rows} sampling rows")
        h["pen_row"][:S] = np.where(penalized, x.slots, -1)
        h["fresh"][:S] = x.fresh
        h["emit"][:S] = x.emit
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            h[name][:S] = x.column(name)
        h["logprobs"][:S] = np.minimum(x.column("logprobs"), MAX_LOGPROBS)
        self._load_masks(x, S)
        scored = np.flatnonzero(x.targets >= 0)  # packed tokens whose logits score a prompt token
        P = scored.size
        h["plp_count"][0] = P
        if P:
            seq_of = np.repeat(np.arange(S), np.diff(b.cu_q_lens))
            h["plp_tok"][:P] = scored
            h["plp_target"][:P] = x.targets[scored]
            h["plp_prompt_logprobs"][:P] = np.clip(x.column("prompt_logprobs")[seq_of[scored]], 0, MAX_LOGPROBS)

    def map_ring(self, base: int | None, geo: RingGeometry | None = None) -> None:
        """The ring's device address (mapped host memory) and geometry: the sampler of a host-launched
        step reads each constrained row's gate and bits there (token_mask in sampling.cu). None: the
        ring is no longer mapped (a step with token masks is then refused)."""
        self._ring = None if base is None else (base, geo)

    def _load_masks(self, x: Any, S: int) -> None:
        """The token mask fields of the step's constrained rows (mask_slot >= 0): the device addresses
        of their slot's mask_position and of their bitmask in the ring."""
        h, masked = self.arena.host, x.mask_slot >= 0
        h["mask_on"][0] = int(masked.any())
        if not masked.any():
            return
        if self._ring is None:
            raise ValueError("a step with token masks needs the ring mapped (map_ring)")
        base, geo = self._ring  # uint64 throughout (numpy 1.x would take uint64 + a Python int to float64)
        u = np.uint64
        gate = u(base + geo.slots_offset + _MASK_POSITION) + x.slots.astype(u) * u(SLOT_BYTES)
        bits = u(base + geo.mask_arena_offset) + np.maximum(x.mask_slot, 0).astype(u) * u(4 * geo.mask_words)
        h["ring_mask_words"][0] = geo.mask_words
        h["mask_gate"][:S] = np.where(masked, gate, u(0))
        h["mask_bits"][:S] = np.where(masked, bits, u(0))

    def _upload_bias(self, b: StepBatch) -> list[np.ndarray]:
        """logit_bias of the step's new penalized requests into their rows' tables (once per request:
        their first step). Returns the host arrays the queued copies read from."""
        x, f, keep = b.ext, self.fwd, []
        if x is None:
            return keep
        import cupy as cp

        for s in np.flatnonzero(x.fresh & x.penalized):
            r = int(x.slots[s])
            ids, vals = x.logit_bias(s)
            n = np.array([ids.size], np.int32)
            keep += [n, ids, vals]
            copies = [(f.logit_bias_n, r * 4, n)]
            if ids.size:
                copies += [
                    (f.logit_bias_ids, r * MAX_LOGIT_BIAS * 4, ids),
                    (f.logit_bias_vals, r * MAX_LOGIT_BIAS * 4, vals),
                ]
            for dst, off, src in copies:
                cp.cuda.runtime.memcpyAsync(int(dst.data.ptr) + off, src.ctypes.data, src.nbytes, 1, self.s)
        return keep
