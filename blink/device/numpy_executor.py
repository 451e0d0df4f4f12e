"""The emulated device's executor: `blink.models.llama_numpy` over a numpy KV pool + reference sampling.

Implements `blink.device.executor.Executor`: the ring interpreter hands it a packed StepBatch
(block tables already assigned); it writes K/V into the pool, samples one token per sequence
from the logits of that sequence's last token, and returns them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from blink.device.executor import StepBatch
from blink.device.sampling import sample
from blink.models.config import ModelConfig
from blink.models.llama_numpy import LlamaNumpy
from blink.models.weights import Weights


class NumpyExecutor:
    """KV pool: k_cache, v_cache (layers, num_blocks, block_size, kv_heads, head_dim) float32."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        num_blocks: int,
        block_size: int,
        max_batch: int,
        max_tokens: int,
        max_blocks_per_seq: int | None = None,
    ) -> None:
        if min(num_blocks, block_size, max_batch, max_tokens) <= 0:
            raise ValueError("num_blocks, block_size, max_batch and max_tokens must be positive")
        self.config = config
        self.model = LlamaNumpy(config, weights)
        self.vocab_size = config.vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        width = num_blocks if max_blocks_per_seq is None else max_blocks_per_seq
        self.max_context = min(config.max_position, width * block_size)
        shape = self.model.kv_cache_shape(num_blocks, block_size)
        # Zeroed, not empty: masked-out slots are still multiplied by 0 in softmax @ V.
        self.k_cache = np.zeros(shape, dtype=np.float32)
        self.v_cache = np.zeros(shape, dtype=np.float32)

    @classmethod
    def from_model(
        cls,
        spec: str | None,
        num_blocks: int,
        block_size: int,
        max_batch: int,
        max_tokens: int,
        max_blocks_per_seq: int | None = None,
        progress: bool = False,
        **resolve_kwargs: Any,
    ) -> NumpyExecutor:
        """Executor for a model spec as `blink.models.registry.resolve_model` accepts it
        (None/"default", a .gguf path, an HF directory, "random:<preset>")."""
        from blink.models.registry import resolve_model

        bundle = resolve_model(spec, progress=progress, **resolve_kwargs)
        return cls(bundle.config, bundle.weights, num_blocks, block_size, max_batch, max_tokens, max_blocks_per_seq)

    def _check(self, batch: StepBatch) -> None:
        S, T = batch.num_seqs, batch.num_tokens
        if S > self.max_batch or T > self.max_tokens:
            raise ValueError(f"step of {S} seqs / {T} tokens exceeds max_batch {self.max_batch} / {self.max_tokens}")
        if batch.cu_q_lens.shape != (S + 1,) or int(batch.cu_q_lens[-1]) != T or int(batch.cu_q_lens[0]) != 0:
            raise ValueError("cu_q_lens must be (S+1,) prefix sums from 0 to num_tokens")
        if S and int(np.diff(batch.cu_q_lens).min()) < 1:
            raise ValueError("every sequence of a step needs at least one token")
        if S and not np.array_equal(batch.positions[batch.cu_q_lens[1:] - 1], batch.seq_lens - 1):
            raise ValueError("the last token of each sequence must sit at position seq_len - 1")
        if S and int(batch.seq_lens.max()) > self.max_context:
            raise ValueError(f"sequence longer than max_context {self.max_context}")
        if T and (int(batch.input_ids.min()) < 0 or int(batch.input_ids.max()) >= self.vocab_size):
            raise ValueError("token id out of range")

    def forward_logits(self, batch: StepBatch, all_tokens: bool = False) -> np.ndarray:
        """Run the step (K/V written) and return float32 logits: (S, vocab) of each sequence's last
        token, or (T, vocab) of every packed token when `all_tokens`."""
        self._check(batch)
        rows = np.arange(batch.num_tokens) if all_tokens else None
        return self.model.forward(
            batch.input_ids,
            batch.positions,
            batch.cu_q_lens,
            batch.block_tables,
            self.k_cache,
            self.v_cache,
            logits_rows=rows,
        )

    def execute(self, batch: StepBatch) -> np.ndarray:
        if batch.num_seqs == 0:
            return np.empty(0, dtype=np.int32)
        logits = self.forward_logits(batch)
        return sample(logits, batch.temperature, batch.top_p, batch.top_k, batch.seeds, batch.sample_pos)

    def close(self) -> None:
        # Drop the pool so a closed executor frees its memory at once.
        self.k_cache = self.v_cache = np.zeros((0,), dtype=np.float32)
