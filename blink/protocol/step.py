"""The step batch: what one model step reads, the second layout shared by Python and CUDA (the
first is the ring, `layout.py`).

A step packs S sequences and T tokens (decode: one token per sequence, T == S). Every field is
defined here, once, with its element type and extent:

- `StepBatch` carries the per-step arrays from a scheduler (the Python ring interpreter's
  `build_batch`, test packers) to an executor (numpy, or the CUDA engine's `load_step`);
- the CUDA engine keeps one device arena of these fields in this order (`blink/gpu/engine/step_arena.py`)
  and publishes a typed pointer to each in its ABI record (`blink/gpu/engine/abi.py` ->
  `blink/gpu/engine/include/blink_engine.h`, generated with `static_assert`s), which the GPU-resident
  scheduler fills directly (scheduler_plan.cuh) and the model kernels read.

A sampling field is named as the request's parameter it carries (blink.protocol.sampling_params.
SamplingParams: temperature, top_p, top_k, seed, min_p, the three penalties, logprobs; the plp_*
fields are indexed by scored prompt row, so plp_prompt_logprobs[j] is that row's prompt_logprobs).

Extents: "1" a scalar of the step; "T" one per packed token; "S" one per sequence; "S+1" prefix
sums; "S,W" a row of W = max_blocks_per_seq block ids per sequence. block_tables goes last so a
host-launched step copies only the prefix of the arena that holds its S rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class StepField(NamedTuple):
    name: str
    dtype: np.dtype
    extent: str  # "1" | "T" | "S" | "S+1" | "S,W"
    doc: str
    ext: bool = False  # a sampling-extension field: filled from StepBatch.ext, not a StepBatch array


def _f(name: str, dtype: str, extent: str, doc: str, ext: bool = False) -> StepField:
    return StepField(name, np.dtype(dtype), extent, doc, ext)


# fmt: off
STEP_FIELDS: tuple[StepField, ...] = (
    _f("num_seqs", "<u4", "1", "live sequences S of this step (<= the graph's batch bucket)"),
    _f("num_tokens", "<u4", "1", "packed tokens T of this step (<= the graph's token bucket)"),
    _f("step_seq", "<u8", "1", "written by the driver before the launch; the graph's last kernel stores it in *done_seq"),
    _f("input_ids", "<i4", "T", "packed token ids"),
    _f("positions", "<i4", "T", "position of each token in its sequence"),
    _f("cu_q_lens", "<i4", "S+1", "prefix sums of the tokens per sequence (decode: 0, 1, 2, ...)"),
    _f("seq_lens", "<i4", "S", "context length of each sequence after this step"),
    _f("temperature", "<f4", "S", "sampling temperature (0 = greedy)"),
    _f("top_p", "<f4", "S", "nucleus mass, (0, 1]"),
    _f("top_k", "<i4", "S", "0 = off"),
    _f("seed", "<u8", "S", "the counter-based sampling stream"),
    _f("sample_pos", "<u4", "S", "index k of the token being sampled (the RNG counter)"),
    # sampling extensions (blink.device.sampling steps 0-2, 5, 10; kernels in sampling.cu)
    _f("ext_on", "<u4", "1", "nonzero: some row uses an extension; else the extension kernels return at once and "
       "the fields below are not read", ext=True),
    _f("pen_row", "<i4", "S", "penalty-state / logit_bias row (the ring slot), -1: sampled from the raw logits",
       ext=True),
    _f("fresh", "<i4", "S", "1: a new request on that row: its penalty state is cleared first", ext=True),
    _f("emit", "<i4", "S", "1: the row's sample is published (a mid-prompt chunk's is not)", ext=True),
    _f("presence_penalty", "<f4", "S", "in [-2, 2]", ext=True),
    _f("frequency_penalty", "<f4", "S", "in [-2, 2]", ext=True),
    _f("repetition_penalty", "<f4", "S", "> 0; 1 = off", ext=True),
    _f("min_p", "<f4", "S", "min_p (0 = off)", ext=True),
    _f("logprobs", "<i4", "S", "-1: no logprob record; else alternatives in the record (<= MAX_LOGPROBS)",
       ext=True),
    # prompt logprobs (SlotFlags.PROMPT_LOGPROBS; kernels plp_* in sampling.cu): scored row j < plp_count is
    # packed token plp_tok[j], whose logits score the prompt token plp_target[j]
    _f("plp_count", "<u4", "1", "scored rows of the step (read only when ext_on; 0: the plp kernels return at once)",
       ext=True),
    _f("plp_tok", "<i4", "T", "packed token of scored row j", ext=True),
    _f("plp_target", "<i4", "T", "prompt token id scored row j's logits score", ext=True),
    _f("plp_prompt_logprobs", "<i4", "T", "prompt_logprobs of scored row j's sequence: alternatives in its record "
       "(<= MAX_LOGPROBS)", ext=True),
    # token masks (structured output; kernel token_mask in sampling.cu): the sampler reads the ring itself, gate
    # (slot.mask_position, acquire) then bits; a row whose gate is closed gets out_tokens[s] = NO_TOKEN
    _f("mask_on", "<u4", "1", "nonzero: some row samples under a token mask (read only when ext_on)", ext=True),
    _f("ring_mask_words", "<u4", "1", "uint32 words of a mask in the ring (tokens past them are not allowed)",
       ext=True),
    _f("mask_gate", "<u8", "S", "device address of the row's slot.mask_position in the ring; 0: no token mask",
       ext=True),
    _f("mask_bits", "<u8", "S", "device address of the row's bitmask in the ring's mask arena", ext=True),
    _f("block_tables", "<i4", "S,W", "physical KV block of each logical block"),
)
# fmt: on
NO_TOKEN = -1  # out_tokens of a row whose token mask was not published when it was sampled: no token this step
assert STEP_FIELDS[-1].name == "block_tables"  # a host-launched step copies the arena's prefix
FIELDS = {f.name: f for f in STEP_FIELDS}
# The arrays of a StepBatch: the per-token and per-sequence fields (S and T are their lengths;
# step_seq belongs to whoever launches the step). The extension fields come from StepBatch.ext.
BATCH_FIELDS = tuple(f for f in STEP_FIELDS if f.extent != "1" and not f.ext)
EXT_FIELDS = tuple(f for f in STEP_FIELDS if f.ext)


class StepBatch:
    """One step's inputs: an array per BATCH_FIELDS entry, by keyword, converted to its dtype.
    `ext`: the step's sampling extensions (blink.device.executor.SamplingExt: each sequence's
    SamplingParams, for penalties, logit_bias, min_p and logprob requests), None when no sequence
    uses one; the CUDA engine loads its per-row values into the EXT_FIELDS of the step layout."""

    __slots__ = (*(f.name for f in BATCH_FIELDS), "ext")

    def __init__(self, ext: Any = None, **arrays: object) -> None:
        names = {f.name for f in BATCH_FIELDS}
        if set(arrays) != names:
            raise TypeError(f"StepBatch: missing {sorted(names - set(arrays))}, unknown {sorted(set(arrays) - names)}")
        for f in BATCH_FIELDS:
            setattr(self, f.name, np.asarray(arrays[f.name], f.dtype))
        self.ext = ext

    def __getattr__(self, name: str) -> np.ndarray:  # the slots above, for type checkers
        raise AttributeError(name)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def rows(self, f: StepField) -> int:
        """How many rows of field f this step fills (S, S+1 or T)."""
        return {"T": self.num_tokens, "S": self.num_seqs, "S+1": self.num_seqs + 1}[f.extent]


def field_count(f: StepField, max_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int) -> int:
    """Elements of field f in an arena sized for (max_seqs, max_num_batched_tokens, max_blocks_per_seq)."""
    return {
        "1": 1,
        "T": max_num_batched_tokens,
        "S": max_seqs,
        "S+1": max_seqs + 1,
        "S,W": max_seqs * max_blocks_per_seq,
    }[f.extent]
