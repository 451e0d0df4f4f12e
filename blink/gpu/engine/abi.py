"""The engine ABI: what the GPU-resident scheduler reads to drive the model graphs.

One `ENGINE_DTYPE` record lives in device memory. The engine fills it once after capturing
its graphs; the scheduler kernel (and the host loop) read it. The C++ view,
`blink/gpu/engine/include/blink_engine.h`, is generated from this dtype (`python -m blink.gpu.engine.abi`)
with typed pointers and a `static_assert` on every offset.

A step is described entirely by device buffers, so graphs never bake in lengths: the record
points at every step field of `blink.protocol.step` (the one definition of their types and
extents), at the step's outputs and at the graph table.

Graph table: decode_execs[b][e] is exec e (of execs_per_shape) for batch bucket b;
prefill_execs[b][t][e] for (batch bucket b, token bucket t); 0 marks a shape not captured
(the driver falls back to the largest shape). batch_bucket_of[n] / token_bucket_of[n] map a
count to the smallest bucket that holds it (O(1) lookup). Every exec was instantiated with
cudaGraphInstantiateFlagDeviceLaunch and uploaded.
"""

from __future__ import annotations

import pathlib

import numpy as np

from blink.protocol.cgen import header_main, header_text, struct_lines
from blink.protocol.layout import MAX_LOGIT_BIAS, MAX_LOGPROBS
from blink.protocol.step import STEP_FIELDS

HEADER_PATH = pathlib.Path(__file__).resolve().parent / "include" / "blink_engine.h"

# fmt: off
_SCALARS = [
    ("max_seqs", "<u4", "rows of the largest graph"),
    ("max_num_batched_tokens", "<u4", "packed tokens of the largest graph"),
    ("max_blocks_per_seq", "<u4", "block table width W"),
    ("block_size", "<u4", "tokens per KV block"),
    ("num_kv_blocks", "<u4", "blocks in the pool (ids 0..num_kv_blocks-1)"),
    ("vocab_size", "<u4", ""),
    ("max_context", "<u4", "max_blocks_per_seq * block_size, capped by the model"),
    ("n_batch_buckets", "<u4", ""),
    ("n_token_buckets", "<u4", ""),
    ("execs_per_shape", "<u4", ">= 2: relaunching an exec right after its token can fail"),
    ("sampling_rows", "<u4", "penalty-state / logit_bias rows (one per ring slot); 0: no extension tables"),
    ("max_logit_bias", "<u4", "logit_bias entries per row of logit_bias_ids / logit_bias_vals (MAX_LOGIT_BIAS)"),
    ("max_logprobs", "<u4", "alternatives per row of top_ids / top_lps (MAX_LOGPROBS)"),
    ("mask_words", "<u4", "(vocab_size + 31) / 32 with the extension tables; 0: no token masks"),
]
# device buffers besides the step inputs: (name, element dtype, extent)
_BUFFERS = [
    ("out_tokens", "<i4", "[max_seqs] sampled token of each sequence (last token of its chunk)"),
    ("done_seq", "<u8", "the graph's last kernel stores *step_seq here (st.release.gpu)"),
    ("chosen_lp", "<f4", "[max_seqs] raw logprob of out_tokens (rows with logprobs >= 0, emitted)"),
    ("top_ids", "<i4", "[max_seqs][max_logprobs] the row's most likely ids (first logprobs[s] valid)"),
    ("top_lps", "<f4", "[max_seqs][max_logprobs] their raw logprobs"),
    ("plp_lp", "<f4", "[max_num_batched_tokens] prompt logprob of scored row j's target (plp_records)"),
    ("plp_ids", "<i4", "[max_num_batched_tokens][max_logprobs] row j's top ids (first plp_prompt_logprobs[j])"),
    ("plp_lps", "<f4", "[max_num_batched_tokens][max_logprobs] their logprobs"),
    ("pen_state", "<u4", "[sampling_rows][vocab_size] bit 31 seen, low bits output count (penalty_mark)"),
    ("logit_bias_n", "<i4", "[sampling_rows] logit_bias entries of the row's request (written at admission)"),
    ("logit_bias_ids", "<i4", "[sampling_rows][max_logit_bias]"),
    ("logit_bias_vals", "<f4", "[sampling_rows][max_logit_bias]"),
    ("mask_open", "<i4", "[max_seqs] the gate token_mask read for row s: 1 open, 0 closed (NO_TOKEN), -1 no mask"),
    ("batch_buckets", "<u4", "[n_batch_buckets] sizes, ascending"),
    ("token_buckets", "<u4", "[n_token_buckets] sizes, ascending"),
    ("batch_bucket_of", "<u2", "[max_seqs+1]"),
    ("token_bucket_of", "<u2", "[max_num_batched_tokens+1]"),
    ("decode_execs", "<u8", "[n_batch_buckets][execs_per_shape]"),
    ("prefill_execs", "<u8", "[n_batch_buckets][n_token_buckets][execs_per_shape]"),
]
# fmt: on
ENGINE_DTYPE = np.dtype(
    [(n, dt) for n, dt, _ in _SCALARS] + [(f.name, "<u8") for f in STEP_FIELDS] + [(n, "<u8") for n, _, _ in _BUFFERS],
    align=True,
)
POINTERS = {f.name: f.dtype for f in STEP_FIELDS} | {n: np.dtype(dt) for n, dt, _ in _BUFFERS}
_DOCS = {n: doc for n, _, doc in _SCALARS + _BUFFERS if doc}
_DOCS |= {f.name: f"[{f.extent}] {f.doc}" if f.extent != "1" else f.doc for f in STEP_FIELDS}


def bucket_of(buckets: tuple[int, ...], n_max: int) -> np.ndarray:
    """(n_max+1,) u16: index of the smallest bucket >= n, the O(1) lookup table of the ABI."""
    if list(buckets) != sorted(buckets) or buckets[-1] < n_max:
        raise ValueError(f"buckets {buckets} must ascend and reach {n_max}")
    return np.searchsorted(np.asarray(buckets), np.arange(n_max + 1), side="left").astype(np.uint16)


class AbiWriter:
    """The engine's ABI record in device memory: Engine (blink/gpu/engine/engine.py) fills it once after
    capture from its buckets, graph table, step arena and Forward's buffers."""

    def _write_abi(self) -> None:
        import cupy as cp

        bb = np.array(self.batch_buckets, np.uint32)
        tb = np.array(self.token_buckets, np.uint32)
        bof = bucket_of(self.batch_buckets, self.dims.max_seqs)
        tof = bucket_of(self.token_buckets, self.dims.max_num_batched_tokens)
        self._tables = {
            k: cp.asarray(v)
            for k, v in dict(
                batch_buckets=bb,
                token_buckets=tb,
                batch_bucket_of=bof,
                token_bucket_of=tof,
                decode_execs=self.decode_execs,
                prefill_execs=self.prefill_execs,
            ).items()
        }
        rec = np.zeros((), ENGINE_DTYPE)
        d, a = self.dims, self.arena.ptr
        rec["max_seqs"], rec["max_num_batched_tokens"] = d.max_seqs, d.max_num_batched_tokens
        rec["max_blocks_per_seq"], rec["block_size"] = d.max_blocks_per_seq, d.block_size
        rec["num_kv_blocks"], rec["vocab_size"], rec["max_context"] = (
            d.num_blocks,
            self.config.vocab_size,
            d.max_context,
        )
        rec["n_batch_buckets"], rec["n_token_buckets"] = len(bb), len(tb)
        rec["execs_per_shape"] = self.ecfg.execs_per_shape
        rec["sampling_rows"] = self.fwd.sampling_rows
        rec["max_logit_bias"], rec["max_logprobs"] = MAX_LOGIT_BIAS, MAX_LOGPROBS
        for f in STEP_FIELDS:
            rec[f.name] = a[f.name]
        for name in ("out_tokens", "done_seq", "chosen_lp", "top_ids", "top_lps", "plp_lp", "plp_ids", "plp_lps"):
            rec[name] = int(getattr(self.fwd, name).data.ptr)
        for name in ("pen_state", "logit_bias_n"):
            rec[name] = int(getattr(self.fwd, name).data.ptr)
        rec["logit_bias_ids"] = int(self.fwd.logit_bias_ids.data.ptr)
        rec["logit_bias_vals"] = int(self.fwd.logit_bias_vals.data.ptr)
        rec["mask_open"] = int(self.fwd.mask_open.data.ptr)
        rec["mask_words"] = self.fwd.mask_words if self.fwd.sampling_rows else 0
        for name, arr in self._tables.items():
            rec[name] = int(arr.data.ptr)  # type: ignore[attr-defined]
        self._abi_dev = cp.asarray(np.frombuffer(rec.tobytes(), np.uint8))

    @property
    def abi_ptr(self) -> int:
        if self._abi_dev is None:
            raise RuntimeError("capture() first: the ABI record lists the graph execs")
        return int(self._abi_dev.data.ptr)  # type: ignore[attr-defined]


def render() -> str:
    about = [
        "The engine ABI read by the GPU-resident scheduler (pointers are device addresses).",
        "Step extents: T packed tokens, S sequences, W = max_blocks_per_seq.",
    ]
    body = struct_lines("EngineABI", ENGINE_DTYPE, pointers=POINTERS, docs=_DOCS)
    return header_text("blink.gpu.engine.abi", "blink/gpu/engine/abi.py and blink/protocol/step.py", about, body)


def main(argv: list[str] | None = None) -> int:
    return header_main(HEADER_PATH, render, "blink.gpu.engine.abi", argv)


if __name__ == "__main__":
    raise SystemExit(main())
