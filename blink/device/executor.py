"""The executor interface: one model step over a packed batch, KV cache held by the executor.

The Python ring interpreter (`blink.device.ring_device`) owns scheduling and the KV block
tables; an executor owns weights and the KV pool and runs one step. Two executors exist:
`blink.device.numpy_executor` (the emulated device) and `blink.gpu.engine.host_executor` (CUDA graphs
launched from the host: the baseline of the scheduler ablation). The GPU-resident scheduler
drives the same CUDA graphs through the same step fields (`blink.protocol.step`), written by the
GPU into the engine's step arena.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from blink.protocol.layout import LOGPROB_DTYPE
from blink.protocol.step import StepBatch


@dataclass
class SamplingExt:
    """Per-sequence logit_bias, penalties, min_p, token masks and logprob requests of a step, and the logprob
    records the executor writes back. S sequences, T packed tokens, B logit_bias entries."""

    slots: np.ndarray  # (S,) int32  the sequence's ring slot: the key of its penalty state
    fresh: np.ndarray  # (S,) bool  a new sequence on that slot: its penalty state starts empty
    emit: np.ndarray  # (S,) bool  the step's sample is published (a mid-prompt chunk's is not)
    penalized: np.ndarray  # (S,) bool  keeps a penalty state (any penalty or logit_bias set)
    presence: np.ndarray  # (S,) float32
    frequency: np.ndarray  # (S,) float32
    repetition: np.ndarray  # (S,) float32  1 = off
    min_p: np.ndarray  # (S,) float32  0 = off
    bias_cu: np.ndarray  # (S+1,) int32  prefix sums of logit_bias entries per sequence
    bias_ids: np.ndarray  # (B,) int32
    bias_vals: np.ndarray  # (B,) float32
    n_logprobs: np.ndarray  # (S,) int32  -1: no record for the sampled token; else alternatives
    targets: np.ndarray  # (T,) int32  the prompt token packed token i's logits score (-1: none)
    prompt_n: np.ndarray  # (S,) int32  alternatives of the sequence's prompt records
    mask_slot: np.ndarray = field(default=None)  # type: ignore[assignment]  (S,) int32  -1: unconstrained
    masks: np.ndarray | None = None  # (S, mask_words) uint32  allowed tokens of the masked rows (others ignored)
    # outputs (filled by execute)
    logprobs: np.ndarray = field(default=None)  # type: ignore[assignment]  (S,) LOGPROB_DTYPE
    prompt_logprobs: np.ndarray = field(default=None)  # type: ignore[assignment]  (T,) LOGPROB_DTYPE

    def __post_init__(self) -> None:
        if self.logprobs is None:
            self.logprobs = np.zeros(self.slots.shape[0], LOGPROB_DTYPE)
        if self.mask_slot is None:
            self.mask_slot = np.full(self.slots.shape[0], -1, np.int32)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = np.zeros(self.targets.shape[0], LOGPROB_DTYPE)


class Executor(Protocol):
    vocab_size: int
    max_context: int  # longest sequence (prompt + generated) the executor accepts
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in the pool
    max_batch: int  # sequences per step
    max_num_batched_tokens: int  # packed tokens per step
    features: int  # layout.DeviceFeatures: which parts of StepBatch.ext it implements

    def execute(self, batch: StepBatch) -> np.ndarray:
        """Run the step: write K/V of every token into its block, sample one token per sequence
        from the logits of its last token. Returns (S,) int32."""
        ...

    def close(self) -> None: ...


# An executor whose steps can run for seconds (the numpy one on a CPU) may also offer
# `set_progress(fn)`: it then calls fn at points inside a step (numpy: after every layer). The ring
# device beats its heartbeat there, as the GPU scheduler beats while it waits for a step's graph,
# so a long step is not taken for a dead device.
