"""Model weights as `dict[name, np.ndarray]` in ONE naming: Hugging Face's, shapes as HF (out, in).

    model.embed_tokens.weight                       (vocab, hidden)
    model.layers.{i}.input_layernorm.weight         (hidden,)
    model.layers.{i}.self_attn.q_proj.weight        (heads*head_dim, hidden)
    model.layers.{i}.self_attn.k_proj.weight        (kv_heads*head_dim, hidden)
    model.layers.{i}.self_attn.v_proj.weight        (kv_heads*head_dim, hidden)
    model.layers.{i}.self_attn.{q,k,v}_proj.bias    (q_size,) / (kv_size,)   qwen2 only
    model.layers.{i}.self_attn.o_proj.weight        (hidden, heads*head_dim)
    model.layers.{i}.self_attn.q_norm.weight        (head_dim,)   qwen3 only
    model.layers.{i}.self_attn.k_norm.weight        (head_dim,)   qwen3 only
    model.layers.{i}.post_attention_layernorm.weight (hidden,)
    model.layers.{i}.mlp.gate_proj.weight           (intermediate, hidden)
    model.layers.{i}.mlp.up_proj.weight             (intermediate, hidden)
    model.layers.{i}.mlp.down_proj.weight           (hidden, intermediate)
    model.layers.{i}.mlp.gate.weight                (experts, hidden)                  MoE layers (qwen3_moe),
    model.layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight  (moe_intermediate, hidden) instead of the three
    model.layers.{i}.mlp.experts.{e}.down_proj.weight (hidden, moe_intermediate)       dense MLP tensors
    model.norm.weight                               (hidden,)
    lm_head.weight                                  (vocab, hidden)   absent when tied

Phi-3/Phi-4 checkpoints fuse `self_attn.qkv_proj` ([q; k; v] rows) and `mlp.gate_up_proj`
([gate; up] rows; llama.cpp: `attn_qkv`, and `ffn_up` holding both halves). The loaders split
them into the names above, so every engine sees one layout; the numpy and CUDA engines fuse
[q; k; v] and [gate; up] again for their single GEMMs, which gives back exactly the checkpoint's rows.

Loaders (blink.models.gguf_weights, blink.models.hf_weights): GGUF (dequantised to float32; llama.cpp's q/k row permutation undone so RoPE is the
HF rotate-half form; `qwen3moe`'s stacked ffn_{gate,up,down}_exps split per expert, ffn_gate_inp
the router), an HF directory (config.json + *.safetensors, bf16 widened to float32), and
`random_weights` for tests and benchmarks. FP8 checkpoints (blink.models.fp8_checkpoint): the float32
loader dequantizes each stored e4m3 tensor with its scale; the bf16 twin hands the projections on as
Fp8Weight (the CUDA device uploads the codes and scales as they are).

Each loader has a bf16 twin for the CUDA device (`gguf_bf16`, `hf_dir_bf16`, `random_bf16`): the
same canonical tensors as `Bf16Tensors`, an iterator of (name, uint16 bf16 bits) produced one
tensor at a time from the mapped file (bf16 sources as views of it, others rounded to nearest even
per tensor), so the host never holds more than a few copies of the largest tensor. The float32
dicts hold the whole model: ~2x a bf16 checkpoint, which a 64 GB model's host does not have. Both
give the same bits: a bf16 value widened to float32 rounds back to itself.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from blink.models.bf16 import f32_to_bf16_bits
from blink.models.config import ModelConfig
from blink.models.fp8 import Fp8Weight

Weights = dict[str, np.ndarray]
# The projections an FP8 checkpoint hands to the CUDA device as FP8 (GpuWeights' Fp8Linear rows)
FP8_PROJECTION_SUFFIXES = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))
# (canonical name, bf16 bits as uint16 of the canonical shape), each tensor once, in no fixed order
# (an FP8 checkpoint's projections come as blink.models.fp8.Fp8Weight: codes and per-row scales as stored)
Bf16Tensors = Iterator[tuple[str, np.ndarray]]


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of `config` and its shape, in load order."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        if c.attn_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        if c.layer_is_moe(i):
            shapes[p + "mlp.gate.weight"] = (c.num_experts, c.hidden_size)
            for e in range(c.num_experts):
                x = f"{p}mlp.experts.{e}."
                shapes[x + "gate_proj.weight"] = (c.moe_intermediate_size, c.hidden_size)
                shapes[x + "up_proj.weight"] = (c.moe_intermediate_size, c.hidden_size)
                shapes[x + "down_proj.weight"] = (c.hidden_size, c.moe_intermediate_size)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def fused_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Phi-3's fused checkpoint tensors and their shapes (empty for the other archs)."""
    c = config
    if c.arch != "phi3":
        return {}
    out: dict[str, tuple[int, ...]] = {}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = (c.q_size + 2 * c.kv_size, c.hidden_size)
        out[p + "mlp.gate_up_proj.weight"] = (2 * c.intermediate_size, c.hidden_size)
    return out


def fused_rows(config: ModelConfig, name: str) -> list[tuple[str, int, int]] | None:
    """The canonical pieces of a fused Phi-3 tensor as (name, first row, end row); None for any other tensor."""
    c = config
    if name.endswith("self_attn.qkv_proj.weight"):
        parts = {"q_proj": c.q_size, "k_proj": c.kv_size, "v_proj": c.kv_size}
    elif name.endswith("mlp.gate_up_proj.weight"):
        parts = {"gate_proj": c.intermediate_size, "up_proj": c.intermediate_size}
    else:
        return None
    base = name.rsplit(".", 2)[0]  # model.layers.{i}.self_attn | model.layers.{i}.mlp
    out, row = [], 0
    for piece, n in parts.items():
        out.append((f"{base}.{piece}.weight", row, row + n))
        row += n
    return out


def split_fused(config: ModelConfig, name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A fused Phi-3 tensor as its canonical pieces (row views); any other tensor as itself."""
    rows = fused_rows(config, name)
    if rows is None:
        return [(name, w)]
    if w.shape != (rows[-1][2], config.hidden_size):
        raise ValueError(f"{name}: shape {w.shape} != {(rows[-1][2], config.hidden_size)}")
    return [(piece, w[a:b]) for piece, a, b in rows]


def check_weights(config: ModelConfig, weights: Weights) -> None:
    """Raise ValueError unless `weights` holds exactly the canonical tensors with the right shapes."""
    check_shapes(config, {k: tuple(v.shape) for k, v in weights.items()})


def check_shapes(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ValueError unless `shapes` names exactly the canonical tensors with their shapes."""
    expected = weight_shapes(config)
    missing = [k for k in expected if k not in shapes]
    extra = [k for k in shapes if k not in expected]
    bad = [f"{k}: {shapes[k]} != {s}" for k, s in expected.items() if k in shapes and tuple(shapes[k]) != s]
    if missing or extra or bad:
        raise ValueError(f"weights do not match config: missing={missing[:5]} extra={extra[:5]} bad_shapes={bad[:5]}")


def _checked(config: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]]) -> Bf16Tensors:
    """`tensors` as Bf16Tensors, each checked as it passes (a canonical name, its shape, uint16, once)
    and none missing at the end: ValueError otherwise."""
    expected = weight_shapes(config)
    seen: set[str] = set()
    for name, bits in tensors:
        if name not in expected or name in seen:
            raise ValueError(f"{name}: {'given twice' if name in seen else 'not a tensor of ' + config.name}")
        if isinstance(bits, Fp8Weight) and bits.shape == expected[name]:  # an FP8 checkpoint's projection
            seen.add(name)
            yield name, bits
            continue
        if bits.dtype != np.uint16 or bits.shape != expected[name]:
            raise ValueError(f"{name}: {bits.dtype} {bits.shape}, expected uint16 (bf16 bits) {expected[name]}")
        seen.add(name)
        yield name, bits
    missing = [k for k in expected if k not in seen]
    if missing:
        raise ValueError(f"weights do not match config: missing={missing[:5]}")


def random_weights(config: ModelConfig, seed: int = 0, dtype: Any = np.float32) -> Weights:
    """Random weights that keep activations O(1): linears ~ N(0, 1/fan_in), embeddings ~ N(0, 1/hidden)
    (tied logits then have unit scale), norm gains ~ 1 + N(0, 0.1). Each tensor draws from its own
    stream keyed by (seed, name), so a GPU engine can generate any one tensor alone, identically."""
    out: Weights = {}
    for name, shape in weight_shapes(config).items():
        out[name] = random_tensor(name, shape, seed, dtype)
    return out


def random_bf16(config: ModelConfig, seed: int = 0) -> Bf16Tensors:
    """`random_weights` as Bf16Tensors, each tensor made when it is taken."""
    return _checked(
        config, ((n, f32_to_bf16_bits(random_tensor(n, s, seed))) for n, s in weight_shapes(config).items())
    )


def random_tensor(name: str, shape: tuple[int, ...], seed: int = 0, dtype: Any = np.float32) -> np.ndarray:
    """The tensor `random_weights` gives for `name` (see there)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith(".bias"):
        w = 0.5 * rng.standard_normal(shape, dtype=np.float32)
    elif len(shape) == 1:
        w = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    else:
        w = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))
    return w.astype(dtype, copy=False)
