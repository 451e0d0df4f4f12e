"""Float32 numpy forward of the Llama family (Llama 3.x, SmolLM2, Qwen2/3, Phi-4, Qwen3-MoE) over a paged KV cache.

One call runs a packed varlen batch: T tokens of S sequences (prefill chunks and decode rows
mixed), every token at its own position. Per layer:

    h = rmsnorm(x) @ W_qkv                      one GEMM for all T rows (q, k, v fused at load)
    q, k = qk_norm(q, k) (qwen3); rope(q, k)    HF rotate-half form, llama3 frequency scaling
    K/V of every token -> cache[block_tables[s, pos // bs], pos % bs]
    attention: each query at position p sees cached keys 0..p of its own sequence (GQA groups)
    x += attn @ W_o;  x += silu(g) * u @ W_down with [g|u] = rmsnorm(x) @ W_gate_up
    MoE layers instead: p = softmax(h @ W_router) with h = rmsnorm(x); each token's top-k experts, their
    p renormalised (norm_topk_prob); x += sum_e p_e * silu(g_e) * u_e @ W_down[e], one GEMM per hit expert
    over the rows routed to it (sorted by expert, as a grouped GEMM would see them)

`quantization="fp8"`: every linear layer's weight (q/k/v/o, gate/up/down, the experts' too) is
FP8 e4m3 with per-output-channel scales (blink.models.fp8), applied dequantized; norms, embeddings and the
router are as without it; the LM head too unless `fp8_lm_head` (default blink.models.fp8.FP8_LM_HEAD): then
it is FP8 per vocabulary row, weight-only in every step (a tied head: an FP8 copy of the embedding). Every step but a decode step of at most `fp8_gemv_max_tokens`
sequences also quantizes each linear layer's input per token (W8A8, blink.models.fp8.uses_w8a8), as the
CUDA engine's FP8 GEMM does; those decode steps keep the activations in float32 (the FP8-weight GEMV). `fp8_gemv_max_tokens=None`:
weight-only at every size (the CUDA engine's dequantize fallback). The MoE experts are weight-only in every
step (W8A16: the CUDA engine's FP8 expert kernels read bf16 activations; moe.cu's _fp8 kernels).

`kv_cache_dtype="fp8"`: K and V are rounded as an fp8 KV cache stores them (blink.models.fp8.kv_round)
when written, so attention reads them back dequantized, as the CUDA kernels do.

Writing K/V before attending makes a chunk see itself causally and earlier chunks through the
cache, so prefill, chunked prefill and decode are the same code. Decode rows (one query each)
attend in one batched matmul over their gathered blocks; longer chunks go one sequence at a time.

KV pool layout (the Executor contract): k_cache, v_cache (layers, num_blocks, block_size, kv_heads, head_dim).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from blink.models.config import ModelConfig, rope_inv_freq
from blink.models.fp8 import (
    FP8_GEMV_MAX_TOKENS,
    FP8_LM_HEAD,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    as_device_weight,
    fake_quantize_activations,
    kv_round,
    quantize,
    uses_w8a8,
)
from blink.models.weights import Weights, check_weights

_Q_CHUNK = 256  # query rows per attention block in prefill (bounds the score matrix)


@dataclass
class _Layer:
    ln1: np.ndarray  # (hidden,)
    w_qkv: np.ndarray  # (q_size + 2*kv_size, hidden)   HF (out, in); applied as x @ w.T
    b_qkv: np.ndarray | None  # (q_size + 2*kv_size,)  qwen2
    q_norm: np.ndarray | None  # (head_dim,)  qwen3
    k_norm: np.ndarray | None  # (head_dim,)
    w_o: np.ndarray  # (hidden, q_size)
    ln2: np.ndarray  # (hidden,)
    w_gate_up: np.ndarray  # (2*intermediate, hidden); MoE: (experts, 2*moe_intermediate, hidden)
    w_down: np.ndarray  # (hidden, intermediate); MoE: (experts, hidden, moe_intermediate)
    w_router: np.ndarray | None = None  # (experts, hidden)  MoE layers only


def fp8_linear(w: np.ndarray) -> np.ndarray:
    """w (out, in) or stacked (..., out, in) as FP8 with per-output-channel scales (blink.models.fp8),
    dequantized to float32: of the weight's bf16 values, the values the quantized device computes with."""
    rows = np.asarray(w).reshape(-1, w.shape[-1])
    return quantize(as_device_weight(rows)).dequantize().reshape(w.shape)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return x * (1.0 / np.sqrt(ms + np.float32(eps))) * w


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x (T, heads, D); cos/sin (T, 1, D/2); rotate-half pairs dim i with i + D/2.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _swiglu(gu: np.ndarray) -> np.ndarray:
    # [g | u] (rows, 2n) -> silu(g) * u (rows, n)
    n = gu.shape[-1] // 2
    g, u = gu[:, :n], gu[:, n:]
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-g)) * u


def _softmax_rows(s: np.ndarray) -> np.ndarray:
    s = s - s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


class LlamaNumpy:
    """Weights fused and transposed once; `forward` runs one packed step against a KV pool."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        quantization: str | None = None,
        fp8_gemv_max_tokens: int | None = FP8_GEMV_MAX_TOKENS,
        kv_cache_dtype: str = "auto",
        fp8_lm_head: bool = FP8_LM_HEAD,
    ) -> None:
        check_weights(config, weights)
        if quantization not in (None, "", *QUANTIZATIONS):
            raise ValueError(f"quantization {quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
        self.kv_cache_dtype = kv_cache_dtype
        c = config
        self.config = c
        # An FP8 checkpoint's weights are FP8 values already (dequantized with their stored scales).
        self.quantization = quantization or c.quantization or None
        requantize = self.quantization is not None and not c.quantization
        self.fp8_gemv_max_tokens = fp8_gemv_max_tokens

        def f32(a: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(a, dtype=np.float32)

        def lin(a: np.ndarray) -> np.ndarray:
            # A linear layer's weight (out, in), or experts stacked (E, out, in): as the device computes with it.
            return fp8_linear(a) if requantize else f32(a)

        self.embed = f32(weights["model.embed_tokens.weight"])  # (vocab, hidden)
        # Tied: the head is the embedding; x @ embed.T is a transposed GEMM, no copy.
        self.lm_head = self.embed if c.tie_word_embeddings else f32(weights["lm_head.weight"])  # (vocab, hidden)
        self.fp8_lm_head = self.quantization is not None and fp8_lm_head
        if self.fp8_lm_head:  # its own FP8 copy (a tied embedding stays as it is for the lookup)
            self.lm_head = fp8_linear(self.lm_head)
        self.norm = f32(weights["model.norm.weight"])
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = np.concatenate([weights[a + n + "_proj.weight"] for n in "qkv"], axis=0)
            router = None
            if c.layer_is_moe(i):
                ex = [f"{p}mlp.experts.{e}." for e in range(c.num_experts)]
                gu = np.stack(
                    [np.concatenate([weights[x + "gate_proj.weight"], weights[x + "up_proj.weight"]]) for x in ex]
                )
                down = np.stack([weights[x + "down_proj.weight"] for x in ex])
                router = f32(weights[p + "mlp.gate.weight"])
            else:
                gu = np.concatenate([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]], axis=0)
                down = weights[p + "mlp.down_proj.weight"]
            self.layers.append(
                _Layer(
                    ln1=f32(weights[p + "input_layernorm.weight"]),
                    w_qkv=lin(qkv),
                    b_qkv=f32(np.concatenate([weights[a + n + "_proj.bias"] for n in "qkv"])) if c.attn_bias else None,
                    q_norm=f32(weights[a + "q_norm.weight"]) if c.qk_norm else None,
                    k_norm=f32(weights[a + "k_norm.weight"]) if c.qk_norm else None,
                    w_o=lin(weights[a + "o_proj.weight"]),
                    ln2=f32(weights[p + "post_attention_layernorm.weight"]),
                    w_gate_up=lin(gu),
                    w_down=lin(down),
                    w_router=router,
                )
            )
        self.inv_freq = rope_inv_freq(c)  # (head_dim/2,) float64

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        c = self.config
        return (c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def forward(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        cu_q_lens: np.ndarray,
        block_tables: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        logits_rows: np.ndarray | None = None,
        progress: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """Run one step; writes K/V into the caches. Returns logits (R, vocab) float32 of the packed
        rows `logits_rows` (default: the last token of each sequence). `progress` is called after
        every layer (the emulated device beats its heartbeat there)."""
        c = self.config
        ids = np.asarray(input_ids, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        cu = np.asarray(cu_q_lens, dtype=np.int64)
        T, S = ids.shape[0], cu.shape[0] - 1
        q_lens = np.diff(cu)
        seq_of_tok = np.repeat(np.arange(S), q_lens)
        bs = k_cache.shape[2]
        blk = np.asarray(block_tables, dtype=np.int64)[seq_of_tok, pos // bs]
        off = pos % bs

        ang = pos[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]

        # Decode rows (q_len 1) attend together; their context is seq length = pos + 1.
        dec_seqs = np.flatnonzero(q_lens == 1)
        long_seqs = np.flatnonzero(q_lens > 1)
        dec_tok = cu[dec_seqs]
        bt = np.asarray(block_tables, dtype=np.int64)

        rows = cu[1:] - 1 if logits_rows is None else np.asarray(logits_rows, dtype=np.int64)
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        scale = np.float32(1.0 / np.sqrt(D))
        aq = self._activation_quantizer(T, bool((q_lens == 1).all()))
        x = self.embed[ids]  # (T, hidden)
        for li, L in enumerate(self.layers):
            h = aq(rmsnorm(x, L.ln1, c.rms_eps)) @ L.w_qkv.T
            if L.b_qkv is not None:
                h = h + L.b_qkv
            q = h[:, : c.q_size].reshape(T, H, D)
            k = h[:, c.q_size : c.q_size + c.kv_size].reshape(T, KVH, D)
            v = h[:, c.q_size + c.kv_size :].reshape(T, KVH, D)
            if L.q_norm is not None:
                q = rmsnorm(q, L.q_norm, c.rms_eps)
                k = rmsnorm(k, L.k_norm, c.rms_eps)
            q = _rope(q, cos, sin) * scale
            k = _rope(k, cos, sin)
            kc, vc = k_cache[li], v_cache[li]
            if self.kv_cache_dtype == "fp8":
                k, v = kv_round(k), kv_round(v)
            kc[blk, off] = k
            vc[blk, off] = v

            attn = np.empty((T, H, D), dtype=np.float32)
            if dec_seqs.size:
                attn[dec_tok] = self._attend_decode(q[dec_tok], pos[dec_tok], bt[dec_seqs], kc, vc)
            for s in long_seqs:
                a, b = int(cu[s]), int(cu[s + 1])
                attn[a:b] = self._attend_seq(q[a:b], pos[a:b], bt[s], kc, vc)
            attn = attn.reshape(T, c.q_size)
            if li == len(self.layers) - 1:  # only the logits rows matter past the last attention
                x, attn = x[rows], attn[rows]
            x = x + aq(attn) @ L.w_o.T

            h = rmsnorm(x, L.ln2, c.rms_eps)
            x = x + (aq(_swiglu(aq(h) @ L.w_gate_up.T)) @ L.w_down.T if L.w_router is None else self._moe(h, L))
            if progress is not None:
                progress()

        return rmsnorm(x, self.norm, c.rms_eps) @ self.lm_head.T

    def _activation_quantizer(self, T: int, decode: bool) -> Callable[[np.ndarray], np.ndarray]:
        """What a linear layer's input goes through in a step of T tokens (`decode`: one per sequence):
        per-token FP8 (W8A8 steps of an fp8 model) or nothing."""
        m = self.fp8_gemv_max_tokens
        if self.quantization is None or m is None or not uses_w8a8(T, decode, m):
            return lambda a: a
        return fake_quantize_activations

    def _moe(self, h: np.ndarray, L: _Layer) -> np.ndarray:
        """Routed experts of h (T, hidden): top-k of the router's softmax, each hit expert once over its rows.
        FP8 experts are weight-only (their inputs are not quantized), whatever the step's size."""
        c = self.config
        k, E = c.num_experts_per_tok, c.num_experts
        probs = _softmax_rows(h @ L.w_router.T)  # (T, E)
        top = np.argpartition(-probs, k - 1, axis=-1)[:, :k]  # (T, k), unordered: the sum does not care
        w = np.take_along_axis(probs, top, axis=-1)
        if c.norm_topk_prob:
            w /= w.sum(axis=-1, keepdims=True)
        flat = top.ravel()
        order = np.argsort(flat, kind="stable")  # (token, slot) pairs grouped by expert
        bounds = np.searchsorted(flat[order], np.arange(E + 1))
        out = np.zeros_like(h)
        for e in np.flatnonzero(np.diff(bounds)):
            pairs = order[bounds[e] : bounds[e + 1]]
            rows = pairs // k  # a token picks an expert at most once: rows are distinct
            y = _swiglu(h[rows] @ L.w_gate_up[e].T) @ L.w_down[e].T
            out[rows] += y * w.ravel()[pairs, None]
        return out

    # Attention loops over kv heads and hands numpy strided 2-D views (row stride KVH*D): each
    # product is then one BLAS call with no transposed copy of the gathered keys/values, which
    # measured 3-6x faster than transposing into (KVH, ...) layouts for numpy's batched matmul.

    def _attend_decode(
        self, q: np.ndarray, pos: np.ndarray, bt: np.ndarray, kc: np.ndarray, vc: np.ndarray
    ) -> np.ndarray:
        # q (S, H, D) already scaled; each row sees keys 0..pos of its sequence.
        c = self.config
        S, KVH, D = q.shape[0], c.num_kv_heads, c.head_dim
        G = c.num_heads // KVH
        bs = kc.shape[1]
        nb = int(pos.max()) // bs + 1
        L = nb * bs
        # Rows shorter than the longest may carry padding ids past their blocks; clip, then mask.
        bt = np.clip(bt[:, :nb], 0, kc.shape[0] - 1)
        keys = kc[bt].reshape(S, L, KVH, D)
        vals = vc[bt].reshape(S, L, KVH, D)
        bias = np.where(np.arange(L)[None, :] > pos[:, None], -np.inf, 0.0).astype(np.float32)[:, None, :]  # (S, 1, L)
        out = np.empty((S, KVH, G, D), dtype=np.float32)
        qg = q.reshape(S, KVH, G, D)
        for k in range(KVH):
            sc = qg[:, k] @ keys[:, :, k, :].transpose(0, 2, 1)  # (S, G, L)
            sc += bias
            out[:, k] = _softmax_rows(sc) @ vals[:, :, k, :]  # (S, G, D)
        return out.reshape(S, c.num_heads, D)

    def _attend_seq(self, q: np.ndarray, pos: np.ndarray, bt: np.ndarray, kc: np.ndarray, vc: np.ndarray) -> np.ndarray:
        # q (n, H, D) of one sequence, scaled; key j visible to query i iff j <= pos[i].
        c = self.config
        n, KVH, D = q.shape[0], c.num_kv_heads, c.head_dim
        G = c.num_heads // KVH
        bs = kc.shape[1]
        ctx = int(pos.max()) + 1
        nb = (ctx + bs - 1) // bs
        keys = kc[bt[:nb]].reshape(nb * bs, KVH, D)
        vals = vc[bt[:nb]].reshape(nb * bs, KVH, D)
        out = np.empty((n, KVH, G, D), dtype=np.float32)
        qg = q.reshape(n, KVH, G, D)
        for a in range(0, n, _Q_CHUNK):
            b = min(n, a + _Q_CHUNK)
            m = b - a
            kv_len = int(pos[a:b].max()) + 1  # causal: this chunk sees no key past its last query
            bias = np.where(np.arange(kv_len)[None, :] > pos[a:b, None], -np.inf, 0.0).astype(np.float32)
            for k in range(KVH):
                # Rows are (query, group head) pairs of this kv head.
                sc = qg[a:b, k].reshape(m * G, D) @ keys[:kv_len, k, :].T  # (m*G, kv_len)
                sc = sc.reshape(m, G, kv_len)
                sc += bias[:, None, :]
                out[a:b, k] = (_softmax_rows(sc).reshape(m * G, kv_len) @ vals[:kv_len, k, :]).reshape(m, G, D)
        return out.reshape(n, c.num_heads, D)
