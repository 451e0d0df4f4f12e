"""ModelConfig from a checkpoint's own description: an HF `config.json` (read, and written back
for the checkpoints tests and benchmarks make) and GGUF key/value metadata. What a checkpoint asks
for that the engines do not implement is an UnsupportedModelError naming it, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .config import ModelConfig, RopeScaling, UnsupportedModelError
from .fp8_checkpoint import check_quantization

# HF `architectures` / `model_type` -> our arch.  Mistral-style models are plain Llama here.
_HF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_HF_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "qwen3_moe": "qwen3_moe",
}
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "qwen3moe": "qwen3_moe"}


def _rope_scaling_from_hf(d: Mapping[str, Any] | None) -> RopeScaling:
    if not d:
        return RopeScaling()
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "default":
        return RopeScaling()
    if kind != "llama3":
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (default, llama3)")
    return RopeScaling(
        type="llama3",
        factor=float(d["factor"]),
        low_freq_factor=float(d["low_freq_factor"]),
        high_freq_factor=float(d["high_freq_factor"]),
        original_max_position=int(d["original_max_position_embeddings"]),
    )


def _eos_tuple(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    return (int(v),)


def from_hf_config(d: Mapping[str, Any], name: str = "") -> ModelConfig:
    """ModelConfig from a parsed HF config.json."""
    archs = d.get("architectures") or []
    arch = next((_HF_ARCH[a] for a in archs if a in _HF_ARCH), None)
    if arch is None:
        arch = _HF_MODEL_TYPE.get(d.get("model_type", ""))
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or d.get('model_type')!r}; supported: {sorted(_HF_ARCH)}"
        )
    # transformers >= 5 writes rope_theta and the scaling into `rope_parameters`.
    rope_params = d.get("rope_parameters") or {}
    rope_theta = float(d.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
    scaling = d.get("rope_scaling") or (rope_params if "rope_type" in rope_params else None)
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    if (arch == "llama" and d.get("attention_bias")) or d.get("mlp_bias"):
        raise UnsupportedModelError("attention_bias / mlp_bias on a Llama-style model is not supported")
    if d.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention is not supported")
    quantization = check_quantization(d.get("quantization_config"))
    if arch == "phi3":
        _check_phi3(d, rope_params, scaling)
    moe: dict[str, Any] = {}
    if arch == "qwen3_moe":
        if d.get("shared_expert_intermediate_size"):
            raise UnsupportedModelError("a shared expert (Qwen2-MoE style) is not supported")
        moe = dict(
            num_experts=int(d.get("num_experts", d.get("num_local_experts", 0))),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(x) for x in d.get("mlp_only_layers") or ()),
        )
    return ModelConfig(
        arch=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling_from_hf(scaling),
        rms_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        attn_bias=arch == "qwen2",
        bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
        eos_token_ids=_eos_tuple(d.get("eos_token_id")),
        name=name or str(d.get("_name_or_path", "") or arch),
        quantization=quantization,
        **moe,
    )


_ARCH_TO_HF = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}  # fmt: skip


def to_hf_config(c: ModelConfig) -> dict[str, Any]:
    """The HF config.json of a ModelConfig, which from_hf_config reads back to an equal one (the
    checkpoints tests and benchmarks write). qk_norm and attn_bias have no key of their own there:
    they follow from the architecture, so a config where they do not cannot be written."""
    if c.qk_norm != (c.arch in ("qwen3", "qwen3_moe")) or c.attn_bias != (c.arch == "qwen2"):
        raise UnsupportedModelError(f"{c.name}: qk_norm / attn_bias other than {c.arch}'s have no HF config")
    d: dict[str, Any] = {
        "architectures": [_ARCH_TO_HF[c.arch]],
        "model_type": c.arch,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_eps,
        "max_position_embeddings": c.max_position,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids) or None,
        "_name_or_path": c.name,
    }
    rs = c.rope_scaling
    if rs.type == "llama3":
        d["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position,
        }
    if c.arch == "qwen3_moe":
        d |= {
            "num_experts": c.num_experts,
            "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size,
            "norm_topk_prob": c.norm_topk_prob,
            "decoder_sparse_step": c.decoder_sparse_step,
            "mlp_only_layers": list(c.mlp_only_layers),
        }
    return d


def _check_phi3(d: Mapping[str, Any], rope_params: Mapping[str, Any], scaling: Mapping[str, Any] | None) -> None:
    """Refuse what Phi-3.x checkpoints add over Phi-4's plain RoPE: LongRoPE (su/yarn/longrope, the
    128k models), partial rotary, a sliding window shorter than the context, another activation."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind != "default":
        raise UnsupportedModelError(f"Phi-3 rope scaling {kind!r} (LongRoPE) is not supported; only plain RoPE (Phi-4)")
    partial = float(d.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise UnsupportedModelError(f"Phi-3 partial_rotary_factor {partial} is not supported (only 1.0)")
    window = d.get("sliding_window")
    if window and int(window) < int(d.get("max_position_embeddings", 4096)):
        raise UnsupportedModelError(
            f"sliding-window attention (window {window} < context {d.get('max_position_embeddings')}) is not supported"
        )
    if d.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"Phi-3 hidden_act {d.get('hidden_act')!r} is not supported (silu)")


def from_gguf_metadata(meta: Mapping[str, Any], tensor_names: set[str], name: str = "") -> ModelConfig:
    """ModelConfig from GGUF key/value metadata (values already decoded) and the tensor names."""
    ga = str(meta.get("general.architecture", ""))
    arch = _GGUF_ARCH.get(ga)
    if arch is None:
        raise UnsupportedModelError(f"unsupported GGUF architecture {ga!r}; supported: {sorted(_GGUF_ARCH)}")

    def key(k: str, default: Any = None) -> Any:
        v = meta.get(f"{ga}.{k}", default)
        if v is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {ga}.{k}")
        return v

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(meta.get(f"{ga}.attention.key_length", 0) or meta.get(f"{ga}.rope.dimension_count", 0))
    head_dim = head_dim or hidden // heads
    vocab = meta.get(f"{ga}.vocab_size")
    if vocab is None:
        vocab = len(meta["tokenizer.ggml.tokens"])
    scaling = RopeScaling()
    stype = meta.get(f"{ga}.rope.scaling.type", "none")
    if stype != "none":
        raise UnsupportedModelError(f"GGUF rope scaling {stype!r} is not supported")
    if ga == "phi3":
        if head_dim != hidden // heads:  # llama.cpp writes rope.dimension_count = head_dim * partial_rotary_factor
            raise UnsupportedModelError(
                f"Phi-3 partial rotary (rope dims {head_dim} of {hidden // heads}) is not supported"
            )
        if "rope_factors_long.weight" in tensor_names or "rope_factors_short.weight" in tensor_names:
            raise UnsupportedModelError(
                "Phi-3 LongRoPE (rope_factors_long/short) is not supported; only plain RoPE (Phi-4)"
            )
        window = int(meta.get("phi3.attention.sliding_window", 0) or 0)
        if window and window < int(key("context_length")):
            raise UnsupportedModelError(f"sliding-window attention (window {window}) is not supported")
    if "rope_freqs.weight" in tensor_names:
        # llama.cpp stores Llama-3 scaling only as a rope_freqs tensor (per-frequency divisors):
        # Llama 3.1's parameters here; `gguf_weights.load_gguf` derives the exact ones from the tensor.
        scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    moe: dict[str, Any] = {}
    if ga == "qwen3moe":
        moe = _gguf_moe(meta, tensor_names, int(key("block_count")))
    # a qwen3moe file whose every layer is sparse need not carry the dense length (then unused)
    intermediate = (
        meta.get(f"{ga}.feed_forward_length") or moe.get("moe_intermediate_size") or key("feed_forward_length")
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    eos_ids = _eos_tuple(eos) + tuple(x for x in _eos_tuple(eot) if x not in _eos_tuple(eos))
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(intermediate),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{ga}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(meta.get(f"{ga}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_eps=float(np.float32(key("attention.layer_norm_rms_epsilon"))),
        max_position=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        attn_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None
        if meta.get("tokenizer.ggml.bos_token_id") is None
        else int(meta["tokenizer.ggml.bos_token_id"]),
        eos_token_ids=eos_ids,
        name=name or str(meta.get("general.name", ga)),
        **moe,
    )


def _gguf_moe(meta: Mapping[str, Any], tensor_names: set[str], num_layers: int) -> dict[str, Any]:
    """ModelConfig's MoE fields of a llama.cpp `qwen3moe` file. llama.cpp renormalises the top-k
    router weights for this arch unless `expert_weights_norm` says otherwise (Qwen3-MoE's
    norm_topk_prob is true); a block without `ffn_gate_inp` runs the dense MLP (mlp_only_layers)."""
    ga = "qwen3moe"
    for k in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
        if meta.get(f"{ga}.{k}") is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {ga}.{k}")
    if meta.get(f"{ga}.expert_shared_count") or meta.get(f"{ga}.expert_shared_feed_forward_length"):
        raise UnsupportedModelError("a shared expert (Qwen2-MoE style) is not supported")
    return dict(
        num_experts=int(meta[f"{ga}.expert_count"]),
        num_experts_per_tok=int(meta[f"{ga}.expert_used_count"]),
        moe_intermediate_size=int(meta[f"{ga}.expert_feed_forward_length"]),
        norm_topk_prob=bool(meta.get(f"{ga}.expert_weights_norm", True)),
        mlp_only_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names),
    )
