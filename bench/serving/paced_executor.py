"""A stand-in model whose steps take a modeled time (asleep), for measuring the frontend on a CPU.

    blink serve --device emulated --device-executor bench.serving.paced_executor:h200_llama3_8b --model random:llama3-8b

The emulated device's ring interpreter (blink/device/ring_device.py: the real scheduler, KV block
tables, publication order) runs with this executor in place of the numpy model: a step sleeps for

    base_s + per_seq_s * sequences + per_token_s * prefill tokens (tokens beyond one per sequence)

and samples uniform token ids. The device process then costs almost no CPU, so a 2-core machine
can drive the frontend (token reader, detokenizer, SSE) at the H200's request rates and step
cadence, and what the frontend adds to TTFT is measured apart from a CPU-bound numpy device.
`h200_llama3_8b` is fitted to bench/results/ttft_breakdown_mixed0-h200-6822f2b.log (random
Llama-3-8B bf16 on the H200): a 256-token prefill alone 8.45 ms, a decode step at batch 15.6
5.29 ms. Not on the serving path; tokens are not a model's (the frontend only sees ids).
"""

from __future__ import annotations

import time

import numpy as np

from blink.device.executor import drop_late, read_gates
from blink.models.config import preset
from blink.protocol.layout import DeviceFeatures
from blink.protocol.step import StepBatch


class PacedExecutor:
    # token masks (structured output): a masked row draws uniformly among its allowed ids; no
    # logprobs, penalties or logit_bias: requests asking for them get a 400
    features = DeviceFeatures.TOKEN_MASK

    def __init__(
        self,
        vocab_size: int,
        *,
        base_s: float,
        per_seq_s: float,
        per_token_s: float,
        num_blocks: int,
        block_size: int,
        max_batch: int,
        max_num_batched_tokens: int,
        max_context: int,
        seed: int = 0,
    ):
        self.vocab_size = vocab_size
        self.base_s, self.per_seq_s, self.per_token_s = base_s, per_seq_s, per_token_s
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_context = max_context
        self.rng = np.random.default_rng(seed)

    def step_s(self, num_seqs: int, num_tokens: int) -> float:
        return self.base_s + self.per_seq_s * num_seqs + self.per_token_s * (num_tokens - num_seqs)

    def execute(self, batch: StepBatch) -> np.ndarray:
        S, T = batch.num_seqs, batch.num_tokens
        if S > self.max_batch or T > self.max_num_batched_tokens:
            raise ValueError(f"step of {S} seqs / {T} tokens exceeds {self.max_batch} / {self.max_num_batched_tokens}")
        end = time.perf_counter() + self.step_s(S, T)
        while (left := end - time.perf_counter()) > 0:
            time.sleep(left)
        toks = self.rng.integers(3, self.vocab_size, S, dtype=np.int32)  # 0..2: BOS/EOS-like ids of presets
        x = batch.ext
        if x is not None:
            gates = read_gates(x, batch.sample_pos)  # at the end of the step, as the GPU sampler reads them
            for s, bits in gates.items():
                if bits is not None:
                    toks[s] = self._draw_allowed(bits)
            drop_late(toks, gates)
        return toks

    def _draw_allowed(self, mask: np.ndarray) -> int:
        """A uniform draw among the ids a bitmask allows (0 when it allows none, as the sampler's argmax),
        cheap on the CPU for dense and sparse masks alike: a few random ids tried first (rejection),
        then the allowed ids of the mask's nonzero words only."""
        for t in self.rng.integers(0, self.vocab_size, 8).tolist():
            if t >> 5 < mask.size and (int(mask[t >> 5]) >> (t & 31)) & 1:
                return t
        words = np.flatnonzero(mask[: (self.vocab_size + 31) // 32])
        bits = np.unpackbits(np.ascontiguousarray(mask[words], "<u4").view(np.uint8), bitorder="little")
        ids = (words[:, None] * 32 + np.arange(32))[bits.reshape(-1, 32).astype(bool)]
        ids = ids[ids < self.vocab_size]
        return int(self.rng.choice(ids)) if ids.size else 0

    def close(self) -> None:
        pass


def h200_llama3_8b(
    model: str,
    num_blocks: int,
    block_size: int,
    max_batch: int,
    max_num_batched_tokens: int,
    max_blocks_per_seq: int | None = None,
) -> PacedExecutor:
    """Random Llama-3-8B bf16 on one H200 (see the module docstring): decode 5.0 ms + 18 us per
    sequence; a prompt's tokens 13 us each (256 tokens alone: 8.3 ms)."""
    cfg = preset(model.removeprefix("random:")) if model.startswith("random:") else preset("llama3-8b")
    ctx = cfg.max_position if max_blocks_per_seq is None else max_blocks_per_seq * block_size
    return PacedExecutor(
        cfg.vocab_size,
        base_s=5.0e-3,
        per_seq_s=18e-6,
        per_token_s=13e-6,
        num_blocks=num_blocks,
        block_size=block_size,
        max_batch=max_batch,
        max_num_batched_tokens=max_num_batched_tokens,
        max_context=ctx,
    )
