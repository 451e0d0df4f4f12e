"""Float64 naive reference forward and a paged-batch driver, for tests and engine diffing.

`reference_logits` recomputes a whole sequence from the canonical weights with no cache, one
head at a time: the definition the numpy engine (and the CUDA engine) are checked against.
`PagedDriver` plays the scheduler's part for tests and benchmarks: it hands out KV blocks
(optionally shuffled) and packs chunks of several sequences into one StepBatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from blink.models.config import ModelConfig, rope_inv_freq
from blink.models.weights import Weights
from blink.protocol.step import StepBatch


def _rms64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope64(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    # x (n, D): rotate-half RoPE, dim i paired with i + D/2.
    ang = positions[:, None] * inv_freq[None, :]
    c, s = np.cos(ang), np.sin(ang)
    h = x.shape[-1] // 2
    return np.concatenate([x[:, :h] * c - x[:, h:] * s, x[:, h:] * c + x[:, :h] * s], axis=-1)


def _mlp64(W: Weights, p: str, h: np.ndarray) -> np.ndarray:
    g, u = h @ W[p + "gate_proj.weight"].T, h @ W[p + "up_proj.weight"].T
    return (g / (1 + np.exp(-g)) * u) @ W[p + "down_proj.weight"].T


def _moe64(c: ModelConfig, W: Weights, p: str, h: np.ndarray) -> np.ndarray:
    # Token by token: softmax over all experts, the k largest (renormalised if norm_topk_prob), their MLPs summed.
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        z = h[t] @ W[p + "gate.weight"].T
        prob = np.exp(z - z.max())
        prob /= prob.sum()
        top = np.argsort(-prob)[: c.num_experts_per_tok]
        wt = prob[top] / (prob[top].sum() if c.norm_topk_prob else 1.0)
        for e, we in zip(top, wt, strict=True):
            out[t] += we * _mlp64(W, f"{p}experts.{e}.", h[t : t + 1])[0]
    return out


def reference_logits(config: ModelConfig, weights: Weights, ids: Sequence[int]) -> np.ndarray:
    """(n, vocab) float64 logits of every position of one sequence, computed from scratch."""
    c = config
    W = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    inv = rope_inv_freq(c)
    D, G = c.head_dim, c.num_heads // c.num_kv_heads
    causal = np.tril(np.ones((n, n), dtype=bool))
    x = W["model.embed_tokens.weight"][np.asarray(ids)]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = _rms64(x, W[p + "input_layernorm.weight"], c.rms_eps)
        q = h @ W[p + "self_attn.q_proj.weight"].T
        k = h @ W[p + "self_attn.k_proj.weight"].T
        v = h @ W[p + "self_attn.v_proj.weight"].T
        if c.attn_bias:
            q = q + W[p + "self_attn.q_proj.bias"]
            k = k + W[p + "self_attn.k_proj.bias"]
            v = v + W[p + "self_attn.v_proj.bias"]
        heads = []
        for hd in range(c.num_heads):
            kv = hd // G  # GQA: query head hd reads kv head hd // group
            qh, kh, vh = q[:, hd * D : (hd + 1) * D], k[:, kv * D : (kv + 1) * D], v[:, kv * D : (kv + 1) * D]
            if c.qk_norm:
                qh = _rms64(qh, W[p + "self_attn.q_norm.weight"], c.rms_eps)
                kh = _rms64(kh, W[p + "self_attn.k_norm.weight"], c.rms_eps)
            qh, kh = _rope64(qh, pos, inv), _rope64(kh, pos, inv)
            s = np.where(causal, qh @ kh.T / np.sqrt(D), -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            heads.append((s / s.sum(axis=1, keepdims=True)) @ vh)
        x = x + np.concatenate(heads, axis=1) @ W[p + "self_attn.o_proj.weight"].T
        h = _rms64(x, W[p + "post_attention_layernorm.weight"], c.rms_eps)
        if c.layer_is_moe(i):
            x = x + _moe64(c, W, p + "mlp.", h)
        else:
            x = x + _mlp64(W, p + "mlp.", h)
    head = W["model.embed_tokens.weight"] if c.tie_word_embeddings else W["lm_head.weight"]
    return _rms64(x, W["model.norm.weight"], c.rms_eps) @ head.T


class PagedDriver:
    """Allocates KV blocks to sequences and packs chunks into StepBatches (a test-side scheduler).

    Blocks come from a (optionally shuffled) free list, so logical block order differs from
    physical order; unused block-table entries are -1."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_seq: int, shuffle_seed: int | None = 0) -> None:
        self.block_size = block_size
        self.width = max_blocks_per_seq
        free = np.arange(num_blocks)
        if shuffle_seed is not None:
            free = np.random.default_rng(shuffle_seed).permutation(free)
        self.free = [int(b) for b in free]
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.sampled: dict[int, int] = {}

    def release(self, seq: int) -> None:
        self.free.extend(self.tables.pop(seq, []))
        self.lens.pop(seq, None)
        self.sampled.pop(seq, None)

    def step(
        self,
        chunks: Sequence[tuple[int, Sequence[int]]],
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> StepBatch:
        """Batch of (seq id, next tokens of that sequence) chunks, appended after its cached tokens.
        sample_pos counts the steps a sequence has been in, so it is the generated-token index only
        when each prompt is prefilled in one step (as the tests and benchmarks here do)."""
        ids: list[int] = []
        positions: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        tables = np.full((len(chunks), self.width), -1, dtype=np.int32)
        ks: list[int] = []
        for r, (seq, toks) in enumerate(chunks):
            start = self.lens.get(seq, 0)
            end = start + len(toks)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            if len(table) > self.width:
                raise ValueError(f"sequence {seq} needs {len(table)} blocks > {self.width}")
            tables[r, : len(table)] = table
            ids += list(toks)
            positions += range(start, end)
            cu.append(len(ids))
            seq_lens.append(end)
            ks.append(self.sampled.get(seq, 0))
            self.sampled[seq] = ks[-1] + 1
            self.lens[seq] = end
        S = len(chunks)
        return StepBatch(
            input_ids=np.asarray(ids, dtype=np.int32),
            positions=np.asarray(positions, dtype=np.int32),
            cu_q_lens=np.asarray(cu, dtype=np.int32),
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            block_tables=tables,
            temperature=np.full(S, temperature, dtype=np.float32),
            top_p=np.full(S, top_p, dtype=np.float32),
            top_k=np.full(S, top_k, dtype=np.int32),
            seed=np.full(S, seed, dtype=np.uint64),
            sample_pos=np.asarray(ks, dtype=np.uint32),
        )
