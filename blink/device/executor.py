"""The executor interface: one model step over a packed batch, KV cache held by the executor.

The Python ring interpreter (`blink.device.ring_device`) owns scheduling and the KV block
tables; an executor owns weights and the KV pool and runs one step. Two executors exist:
`blink.device.numpy_executor` (the emulated device) and `blink.gpu.engine.host_executor` (CUDA graphs
launched from the host: the baseline of the scheduler ablation). The GPU-resident scheduler
drives the same CUDA graphs through the same step fields (`blink.protocol.step`), written by the
GPU into the engine's step arena.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from blink.protocol.layout import LOGPROB_DTYPE
from blink.protocol.sampling_params import SamplingParams
from blink.protocol.step import FIELDS, NO_TOKEN, StepBatch

# The sampler's gate of a constrained row (blink/protocol/layout.py, mask arena): called as
# gate(slot, mask, k) when the row samples its token k, it returns the bits of mask `mask` when
# slot.mask_position says the frontend has published token k's mask (read before the bits), else
# None: the row gives NO_TOKEN this step.
MaskGate = Callable[[int, int, int], "np.ndarray | None"]


@dataclass
class SamplingExt:
    """A step's sampling extensions: the SamplingParams of each of its S sequences (the one record of
    a request's parameters: penalties, logit_bias, min_p, logprob requests), what the step adds to
    them (ring slot, first and published rows, scored prompt tokens, token masks), and the logprob
    records the executor writes back. T packed tokens. `column(name)` is a parameter as the step
    field of the same name (blink.protocol.step)."""

    params: Sequence[SamplingParams]  # (S,) the sequence's parameters
    slots: np.ndarray  # (S,) int32  the sequence's ring slot: the key of its penalty state
    # (S,) bool  a new sequence's chunk at position 0: its penalty state starts empty (a request that starts
    # from cached prompt blocks has no such chunk; a penalized one, the only kind that reads it, never does)
    fresh: np.ndarray
    emit: np.ndarray  # (S,) bool  the step's sample is published (a mid-prompt chunk's is not)
    targets: np.ndarray  # (T,) int32  the prompt token packed token i's logits score (-1: none)
    mask_slot: np.ndarray = field(default=None)  # type: ignore[assignment]  (S,) int32  -1: unconstrained
    mask_gate: MaskGate | None = None  # read at sampling for the rows with mask_slot >= 0 (a Python executor's)
    # outputs (filled by execute)
    logprobs: np.ndarray = field(default=None)  # type: ignore[assignment]  (S,) LOGPROB_DTYPE
    prompt_logprobs: np.ndarray = field(default=None)  # type: ignore[assignment]  (T,) LOGPROB_DTYPE

    def __post_init__(self) -> None:
        S = self.slots.shape[0]
        if len(self.params) != S:
            raise ValueError(f"SamplingExt: {len(self.params)} SamplingParams for {S} sequences")
        if self.logprobs is None:
            self.logprobs = np.zeros(S, LOGPROB_DTYPE)
        if self.mask_slot is None:
            self.mask_slot = np.full(S, -1, np.int32)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = np.zeros(self.targets.shape[0], LOGPROB_DTYPE)

    def column(self, name: str) -> np.ndarray:
        """SamplingParams field `name` of every sequence, (S,) in the dtype of the step field that
        carries it (the field of that name; prompt_logprobs: plp_prompt_logprobs)."""
        f = FIELDS.get(name) or FIELDS[f"plp_{name}"]
        return np.array([getattr(p, name) for p in self.params], f.dtype)

    def logit_bias(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence s's logit_bias as (token ids int32, biases float32); a repeated id adds up."""
        entries = self.params[s].logit_bias
        return np.array([i for i, _ in entries], np.int32), np.array([b for _, b in entries], np.float32)

    @property
    def penalized(self) -> np.ndarray:
        """(S,) bool: the sequence keeps a penalty state (SamplingParams.penalized)."""
        return np.array([p.penalized for p in self.params], bool)


def read_gates(x: SamplingExt, sample_pos: np.ndarray) -> dict[int, np.ndarray | None]:
    """At the sampling point of a step: the gate of each constrained row (mask_slot >= 0), row ->
    its mask's bits, or None when its mask is not published (the row's sample is then NO_TOKEN)."""
    rows = np.flatnonzero(x.mask_slot >= 0)
    if rows.size and x.mask_gate is None:
        raise ValueError("a step with token masks needs the ring's mask gate (SamplingExt.mask_gate)")
    return {int(s): x.mask_gate(int(x.slots[s]), int(x.mask_slot[s]), int(sample_pos[s])) for s in rows}  # type: ignore[misc]


def drop_late(toks: np.ndarray, gates: dict[int, np.ndarray | None]) -> np.ndarray:
    """NO_TOKEN for the rows whose gate was closed at sampling."""
    for s, bits in gates.items():
        if bits is None:
            toks[s] = NO_TOKEN
    return toks


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
        from the logits of its last token. Returns (S,) int32; NO_TOKEN for a constrained row whose
        mask was not published when it was sampled (ext.mask_gate, or the ring read on the device)."""
        ...

    def close(self) -> None: ...


# An executor whose steps can run for seconds (the numpy one on a CPU) may also offer
# `set_progress(fn)`: it then calls fn at points inside a step (numpy: after every layer). The ring
# device beats its heartbeat there, as the GPU scheduler beats while it waits for a step's graph,
# so a long step is not taken for a dead device.
# An executor that samples on a device reading the ring itself (the CUDA host executor) offers
# `map_ring(view)` and `unmap_ring()`: the ring device maps the ring when it starts serving and
# releases it when it stops; in between the device reads each constrained row's gate and bits from
# the ring at sampling (StepBatch mask fields) instead of calling mask_gate.
