"""GGUF checkpoints as canonical weights (see blink.models.weights): dequantised to float32, llama.cpp's
q/k row permutation undone, `qwen3moe`'s stacked experts split per expert, and the bf16 twin `gguf_bf16`."""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from blink.models.bf16 import f32_to_bf16_bits
from blink.models.checkpoint_config import from_gguf_metadata
from blink.models.config import ModelConfig, RopeScaling, UnsupportedModelError, rope_inv_freq
from blink.models.gguf_file import GGUFFile
from blink.models.progress import ProgressFn, make_progress
from blink.models.weights import Bf16Tensors, Weights, _checked, check_weights, split_fused

_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# llama.cpp stacks a MoE layer's experts: ffn_{gate,up,down}_exps (experts, out, in) -> one canonical tensor each
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """Decoded key/value metadata of an open `GGUFFile` or `gguf.GGUFReader`."""
    if isinstance(reader, GGUFFile):
        return reader.metadata
    return {k: f.contents() for k, f in reader.fields.items()}


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's convert script interleaves each head's rows (pairs) for its rotate-adjacent RoPE;
    # invert it to recover the HF rotate-half layout.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequant(tensor: Any) -> np.ndarray:
    return _dequant_data(tensor.data, tensor.tensor_type)


def _dequant_data(data: Any, tensor_type: int) -> np.ndarray:
    """float32 values of a GGUF tensor's raw view (or of a leading-axis slice of it)."""
    from gguf import GGMLQuantizationType, quants

    qt = GGMLQuantizationType(tensor_type)
    # np.asarray drops a memmap subclass, whose per-slice bookkeeping dominates dequantisation.
    data = np.asarray(data)
    if qt == GGMLQuantizationType.F32:
        return np.array(data, dtype=np.float32)
    if qt == GGMLQuantizationType.F16:
        return data.astype(np.float32)
    return quants.dequantize(data, qt).astype(np.float32, copy=False)


def load_gguf_weights(
    reader: Any, config: ModelConfig, progress: bool | ProgressFn | None = None, dtype: Any = np.float32
) -> Weights:
    """Dequantise every tensor of an open GGUFFile (or gguf.GGUFReader) into canonical names."""
    out = {name: w.astype(dtype, copy=False) for name, w in _gguf_tensors(reader, config, progress)}
    check_weights(config, out)
    return out


def _gguf_tensors(
    reader: Any, config: ModelConfig, progress: bool | ProgressFn | None
) -> Iterator[tuple[str, np.ndarray]]:
    """(canonical name, float32 tensor) of each GGUF tensor in file order, dequantised one at a time
    (a stacked expert tensor one expert at a time, a fused one as its row views)."""
    report = make_progress(progress, "loading weights", "B")
    total = sum(int(t.n_bytes) for t in reader.tensors)
    done = 0
    for t in reader.tensors:
        m = _GGUF_BLK.match(t.name)
        if t.name == "rope_freqs.weight":
            _check_rope_freqs(config, _dequant(t))
        elif m and m.group(2) in _GGUF_EXPERTS:
            yield from _split_experts(config, int(m.group(1)), _GGUF_EXPERTS[m.group(2)], t)
        else:
            w = _dequant(t)
            if m and m.group(2) in _GGUF_LAYER:
                name = f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.{m.group(3)}"
            elif t.name in _GGUF_GLOBAL:
                name = _GGUF_GLOBAL[t.name]
            else:
                raise UnsupportedModelError(f"unexpected GGUF tensor {t.name!r}")
            if config.arch == "llama" and name.endswith("q_proj.weight"):
                w = _unpermute_rope_rows(w, config.num_heads)
            elif config.arch == "llama" and name.endswith("k_proj.weight"):
                w = _unpermute_rope_rows(w, config.num_kv_heads)
            elif config.arch == "phi3" and name.endswith("mlp.up_proj.weight"):
                name = name.replace("up_proj", "gate_up_proj")  # llama.cpp's phi3 ffn_up is [gate; up]
            yield from split_fused(config, name, w)
        done += int(t.n_bytes)
        if report:
            report(done, total)


def _split_experts(config: ModelConfig, layer: int, proj: str, t: Any) -> Iterator[tuple[str, np.ndarray]]:
    """A stacked (experts, out, in) GGUF expert tensor as the canonical per-expert tensors, each
    dequantised alone (a 30B-A3B layer's stack is ~0.8 GB in float32)."""
    data = t.data  # (experts, out, in) elements, or (experts, out, bytes per row) when quantised
    if data.ndim != 3 or data.shape[0] != config.num_experts:
        raise ValueError(
            f"layer {layer} {proj} experts: raw shape {data.shape}, expected ({config.num_experts}, out, in)"
        )
    p = f"model.layers.{layer}.mlp.experts."
    for e in range(config.num_experts):
        yield f"{p}{e}.{proj}.weight", _dequant_data(data[e], t.tensor_type)


def _base_inv_freq(config: ModelConfig) -> np.ndarray:
    d = config.head_dim
    return 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))


def _check_rope_freqs(config: ModelConfig, factors: np.ndarray) -> None:
    ours = _base_inv_freq(config) / rope_inv_freq(config)
    if factors.shape != ours.shape or not np.allclose(factors, ours, rtol=1e-4):
        raise UnsupportedModelError(f"GGUF rope_freqs do not follow Llama-3 scaling ({config.rope_scaling})")


def llama3_scaling_from_factors(config: ModelConfig, factors: np.ndarray) -> RopeScaling:
    """Llama-3 scaling parameters that reproduce llama.cpp's rope_freqs divisors (low/high freq
    factors 1 and 4 as in every Llama 3.x; `factor` is the largest divisor; the original
    context comes from a divisor in the smoothed band, or the band edge when there is none)."""
    factors = np.asarray(factors, dtype=np.float64)
    factor = float(factors.max())
    if factor <= 1.0:
        return RopeScaling()
    low, high = 1.0, 4.0
    wavelen = 2 * np.pi / _base_inv_freq(config)
    medium = np.flatnonzero((factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4)))
    if medium.size:
        i = int(medium[0])
        smooth = (1 / factors[i] - 1 / factor) / (1 - 1 / factor)
        orig = wavelen[i] * (smooth * (high - low) + low)
    else:  # no smoothed band: any context between the two edges reproduces the divisors
        unscaled = np.flatnonzero(factors <= 1 + 1e-4)
        if not unscaled.size:
            raise UnsupportedModelError("GGUF rope_freqs scale every frequency: not Llama-3 scaling")
        orig = high * wavelen[int(unscaled.max())]
    scaling = RopeScaling("llama3", factor, low, high, int(round(orig)))
    _check_rope_freqs(config.replace(rope_scaling=scaling), factors)
    return scaling


def load_gguf(
    path: str | os.PathLike[str], progress: bool | ProgressFn | None = None
) -> tuple[ModelConfig, Weights, dict[str, Any]]:
    """(config, weights, metadata) of a GGUF file; metadata feeds `blink.models.tokenizer.from_gguf_metadata`."""
    reader, config = _open_gguf(path)
    return config, load_gguf_weights(reader, config, progress), reader.metadata


def gguf_bf16(
    path: str | os.PathLike[str], progress: bool | ProgressFn | None = None
) -> tuple[ModelConfig, Bf16Tensors, dict[str, Any]]:
    """`load_gguf` with the weights as Bf16Tensors: each tensor (each expert of a stacked expert
    tensor) dequantised to float32 and rounded to bf16 when taken."""
    reader, config = _open_gguf(path)
    tensors = ((n, f32_to_bf16_bits(w)) for n, w in _gguf_tensors(reader, config, progress))
    return config, _checked(config, tensors), reader.metadata


def _open_gguf(path: str | os.PathLike[str]) -> tuple[GGUFFile, ModelConfig]:
    reader = GGUFFile(path)
    config = from_gguf_metadata(reader.metadata, {t.name for t in reader.tensors}, name=pathlib.Path(path).stem)
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        config = config.replace(rope_scaling=llama3_scaling_from_factors(config, _dequant(rope_freqs)))
    return reader, config
