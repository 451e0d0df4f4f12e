"""The emulated device's executor: `blink.models.llama_numpy` over a numpy KV pool + reference sampling.

Implements `blink.device.executor.Executor`: the ring interpreter hands it a packed StepBatch
(block tables already assigned); it writes K/V into the pool, samples one token per sequence
from the logits of that sequence's last token, and returns them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from blink.device.executor import SamplingExt, StepBatch, drop_late, read_gates
from blink.device.sampling import PenaltyState, apply_token_mask, logprob_record, process_logits, sample
from blink.models.config import ModelConfig
from blink.models.fp8 import FP8_LM_HEAD
from blink.models.llama_numpy import LlamaNumpy
from blink.models.weights import Weights
from blink.protocol.layout import DeviceFeatures


class NumpyExecutor:
    """KV pool: k_cache, v_cache (layers, num_blocks, block_size, kv_heads, head_dim) float32.
    Penalty state: one PenaltyState per ring slot whose sequence uses penalties or logit_bias."""

    features = (
        DeviceFeatures.LOGPROBS | DeviceFeatures.PROMPT_LOGPROBS | DeviceFeatures.PENALTIES | DeviceFeatures.TOKEN_MASK
    )

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        num_blocks: int,
        block_size: int,
        max_batch: int,
        max_num_batched_tokens: int,
        max_blocks_per_seq: int | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        fp8_lm_head: bool = FP8_LM_HEAD,
    ) -> None:
        if min(num_blocks, block_size, max_batch, max_num_batched_tokens) <= 0:
            raise ValueError("num_blocks, block_size, max_batch and max_num_batched_tokens must be positive")
        self.config = config
        self.model = LlamaNumpy(config, weights, quantization, kv_cache_dtype=kv_cache_dtype, fp8_lm_head=fp8_lm_head)
        self.vocab_size = config.vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        width = num_blocks if max_blocks_per_seq is None else max_blocks_per_seq
        self.max_context = min(config.max_position, width * block_size)
        shape = self.model.kv_cache_shape(num_blocks, block_size)
        # Zeroed, not empty: masked-out slots are still multiplied by 0 in softmax @ V.
        self.k_cache = np.zeros(shape, dtype=np.float32)
        self.v_cache = np.zeros(shape, dtype=np.float32)
        self.penalty_states: dict[int, PenaltyState] = {}
        self._progress: Callable[[], None] | None = None

    def set_progress(self, fn: Callable[[], None] | None) -> None:
        """Call fn after every layer of a step (blink.device.executor: the optional progress hook)."""
        self._progress = fn

    @classmethod
    def from_model(
        cls,
        spec: str | None,
        num_blocks: int,
        block_size: int,
        max_batch: int,
        max_num_batched_tokens: int,
        max_blocks_per_seq: int | None = None,
        progress: bool | Callable[[int, int], None] = False,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        fp8_lm_head: bool = FP8_LM_HEAD,
        **resolve_kwargs: Any,
    ) -> NumpyExecutor:
        """Executor for a model spec as `blink.models.registry.resolve_model` accepts it
        (None/"default", a .gguf path, an HF directory, "random:<preset>"); `quantization` "fp8":
        the linear layers' weights in FP8 (blink.models.fp8); `kv_cache_dtype` "fp8": K/V rounded as an FP8
        cache stores them (blink.models.fp8.kv_round); `fp8_lm_head`: with FP8 weights, the LM head too."""
        from blink.models.registry import resolve_model

        bundle = resolve_model(spec, progress=progress, **resolve_kwargs)
        return cls(
            bundle.config,
            bundle.weights,
            num_blocks,
            block_size,
            max_batch,
            max_num_batched_tokens,
            max_blocks_per_seq,
            quantization,
            kv_cache_dtype,
            fp8_lm_head,
        )

    def _check(self, batch: StepBatch) -> None:
        S, T = batch.num_seqs, batch.num_tokens
        if S > self.max_batch or T > self.max_num_batched_tokens:
            raise ValueError(
                f"step of {S} seqs / {T} tokens exceeds max_batch {self.max_batch} / {self.max_num_batched_tokens}"
            )
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
            progress=self._progress,
        )

    def execute(self, batch: StepBatch) -> np.ndarray:
        if batch.num_seqs == 0:
            return np.empty(0, dtype=np.int32)
        x = batch.ext
        if x is None:
            logits = self.forward_logits(batch)
            return sample(logits, batch.temperature, batch.top_p, batch.top_k, batch.seed, batch.sample_pos)
        return self._execute_ext(batch, x)

    def _execute_ext(self, batch: StepBatch, x: SamplingExt) -> np.ndarray:
        """A step with sampling extensions: the definition of blink.device.sampling, row by row."""
        self._check(batch)
        cu = batch.cu_q_lens
        last = cu[1:] - 1
        scored = np.flatnonzero(x.targets >= 0)  # packed rows whose logits score a prompt token
        rows = np.concatenate([last, scored])
        all_logits = self.model.forward(
            batch.input_ids, batch.positions, cu, batch.block_tables, self.k_cache, self.v_cache, logits_rows=rows
        )
        S = batch.num_seqs
        seq_of = np.repeat(np.arange(S), np.diff(cu))
        for j, i in enumerate(scored.tolist()):
            n = x.params[seq_of[i]].prompt_logprobs
            rec = logprob_record(all_logits[S + j], int(x.targets[i]), n)
            _put(x.prompt_logprobs[i], *rec)
        logits = all_logits[:S]
        processed = np.empty_like(logits)
        states: list[PenaltyState | None] = []
        for s, p in enumerate(x.params):
            st = None
            if p.penalized:
                slot = int(x.slots[s])
                if x.fresh[s] or slot not in self.penalty_states:
                    self.penalty_states[slot] = PenaltyState(self.vocab_size)
                st = self.penalty_states[slot]
                st.mark(batch.input_ids[cu[s] : cu[s + 1]])
            logit_bias_ids, logit_bias_vals = x.logit_bias(s)
            processed[s] = process_logits(
                logits[s],
                logit_bias_ids,
                logit_bias_vals,
                st,
                p.presence_penalty,
                p.frequency_penalty,
                p.repetition_penalty,
            )
            states.append(st)
        gates = read_gates(x, batch.sample_pos)  # the sampling point: the row's logits are final but for the mask
        for s, bits in gates.items():
            if bits is not None:
                apply_token_mask(processed[s], bits)
        toks = sample(
            processed, batch.temperature, batch.top_p, batch.top_k, batch.seed, batch.sample_pos, x.column("min_p")
        )
        for s in range(S):
            if not x.emit[s] or (s in gates and gates[s] is None):
                continue  # no token this step: nothing counts it
            st = states[s]
            if st is not None:
                st.add(int(toks[s]))
            n = x.params[s].logprobs
            if n >= 0:
                _put(x.logprobs[s], *logprob_record(logits[s], int(toks[s]), n))
        return drop_late(toks, gates)

    def close(self) -> None:
        # Drop the pool so a closed executor frees its memory at once.
        self.k_cache = self.v_cache = np.zeros((0,), dtype=np.float32)
        self.penalty_states.clear()


def _put(rec: np.void, lp: float, ids: np.ndarray, lps: np.ndarray) -> None:
    """Fill a LOGPROB_DTYPE record (alternatives beyond len(ids) are left as they are)."""
    rec["logprob"] = lp
    rec["top_ids"][: ids.size] = ids
    rec["top_logprobs"][: ids.size] = lps
