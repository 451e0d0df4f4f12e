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

Loaders: GGUF (dequantised to float32; llama.cpp's q/k row permutation undone so RoPE is the
HF rotate-half form; `qwen3moe`'s stacked ffn_{gate,up,down}_exps split per expert, ffn_gate_inp
the router), an HF directory (config.json + *.safetensors, bf16 widened to float32), and
`random_weights` for tests and benchmarks.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from blink.models.checkpoint_config import from_gguf_metadata, from_hf_config
from blink.models.config import ModelConfig, RopeScaling, UnsupportedModelError, rope_inv_freq
from blink.models.gguf_file import GGUFFile
from blink.models.progress import ProgressFn, make_progress

Weights = dict[str, np.ndarray]

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


def split_fused(config: ModelConfig, name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A fused Phi-3 tensor as its canonical pieces (row views); any other tensor as itself."""
    c = config
    if name.endswith("self_attn.qkv_proj.weight"):
        parts = {"q_proj": c.q_size, "k_proj": c.kv_size, "v_proj": c.kv_size}
    elif name.endswith("mlp.gate_up_proj.weight"):
        parts = {"gate_proj": c.intermediate_size, "up_proj": c.intermediate_size}
    else:
        return [(name, w)]
    if w.shape != (sum(parts.values()), c.hidden_size):
        raise ValueError(f"{name}: shape {w.shape} != {(sum(parts.values()), c.hidden_size)}")
    base = name.rsplit(".", 2)[0]  # model.layers.{i}.self_attn | model.layers.{i}.mlp
    out, row = [], 0
    for piece, n in parts.items():
        out.append((f"{base}.{piece}.weight", w[row : row + n]))
        row += n
    return out


def check_weights(config: ModelConfig, weights: Weights) -> None:
    """Raise ValueError unless `weights` holds exactly the canonical tensors with the right shapes."""
    expected = weight_shapes(config)
    missing = [k for k in expected if k not in weights]
    extra = [k for k in weights if k not in expected]
    bad = [f"{k}: {weights[k].shape} != {s}" for k, s in expected.items() if k in weights and weights[k].shape != s]
    if missing or extra or bad:
        raise ValueError(f"weights do not match config: missing={missing[:5]} extra={extra[:5]} bad_shapes={bad[:5]}")


def random_weights(config: ModelConfig, seed: int = 0, dtype: Any = np.float32) -> Weights:
    """Random weights that keep activations O(1): linears ~ N(0, 1/fan_in), embeddings ~ N(0, 1/hidden)
    (tied logits then have unit scale), norm gains ~ 1 + N(0, 0.1). Each tensor draws from its own
    stream keyed by (seed, name), so a GPU engine can generate any one tensor alone, identically."""
    out: Weights = {}
    for name, shape in weight_shapes(config).items():
        out[name] = random_tensor(name, shape, seed, dtype)
    return out


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


# ---------------------------------------------------------------- GGUF


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
    from gguf import GGMLQuantizationType, quants

    qt = GGMLQuantizationType(tensor.tensor_type)
    # np.asarray drops a memmap subclass, whose per-slice bookkeeping dominates dequantisation.
    data = np.asarray(tensor.data)
    if qt == GGMLQuantizationType.F32:
        return np.array(data, dtype=np.float32)
    if qt == GGMLQuantizationType.F16:
        return data.astype(np.float32)
    return quants.dequantize(data, qt).astype(np.float32, copy=False)


def load_gguf_weights(
    reader: Any, config: ModelConfig, progress: bool | ProgressFn | None = None, dtype: Any = np.float32
) -> Weights:
    """Dequantise every tensor of an open GGUFFile (or gguf.GGUFReader) into canonical names."""
    report = make_progress(progress, "loading weights", "B")
    total = sum(int(t.n_bytes) for t in reader.tensors)
    done = 0
    out: Weights = {}
    for t in reader.tensors:
        w = _dequant(t)
        if t.name == "rope_freqs.weight":
            _check_rope_freqs(config, w)
        else:
            m = _GGUF_BLK.match(t.name)
            if m and m.group(2) in _GGUF_EXPERTS:
                out.update(_split_experts(config, int(m.group(1)), _GGUF_EXPERTS[m.group(2)], w, dtype))
                done += int(t.n_bytes)
                if report:
                    report(done, total)
                continue
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
            for piece, pw in split_fused(config, name, w):
                out[piece] = pw.astype(dtype, copy=False)
        done += int(t.n_bytes)
        if report:
            report(done, total)
    check_weights(config, out)
    return out


def _split_experts(config: ModelConfig, layer: int, proj: str, w: np.ndarray, dtype: Any) -> Weights:
    """A stacked (experts, out, in) GGUF expert tensor as the canonical per-expert tensors (views when
    `dtype` is float32: no copy)."""
    if w.ndim != 3 or w.shape[0] != config.num_experts:
        raise ValueError(f"layer {layer} {proj} experts: shape {w.shape}, expected ({config.num_experts}, out, in)")
    p = f"model.layers.{layer}.mlp.experts."
    return {f"{p}{e}.{proj}.weight": w[e].astype(dtype, copy=False) for e in range(config.num_experts)}


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
    reader = GGUFFile(path)
    meta = reader.metadata
    config = from_gguf_metadata(meta, {t.name for t in reader.tensors}, name=pathlib.Path(path).stem)
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        config = config.replace(rope_scaling=llama3_scaling_from_factors(config, _dequant(rope_freqs)))
    return config, load_gguf_weights(reader, config, progress), meta


# ---------------------------------------------------------------- HF directory

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32}


def _safetensors_header(path: pathlib.Path) -> tuple[dict[str, Any], int]:
    """(tensor table, byte offset of the data section) of a .safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_safetensors(path: pathlib.Path, wanted: Any) -> Iterator[tuple[str, np.ndarray | None, int]]:
    """(name, float32 tensor or None when not wanted, bytes) for each tensor of one file; bf16 is
    widened by a 16-bit shift (numpy has no bf16, so safetensors.numpy cannot read it)."""
    from safetensors import safe_open

    header, data_start = _safetensors_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    with safe_open(os.fspath(path), "np") as sf:
        for name, info in header.items():
            a, b = info["data_offsets"]
            if name not in wanted:
                yield name, None, b - a
            elif info["dtype"] == "BF16":
                bits = raw[data_start + a : data_start + b].view(np.uint16).reshape(info["shape"])
                yield name, (bits.astype(np.uint32) << 16).view(np.float32), b - a
            elif info["dtype"] in _ST_DTYPES:
                yield name, sf.get_tensor(name).astype(np.float32, copy=False), b - a
            else:
                raise UnsupportedModelError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")


def load_hf_dir(path: str | os.PathLike[str], progress: bool | ProgressFn | None = None) -> tuple[ModelConfig, Weights]:
    """(config, weights) of an HF model directory (config.json + *.safetensors)."""
    root = pathlib.Path(path)
    config = from_hf_config(json.loads((root / "config.json").read_text()), name=root.name)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {root}")
    report = make_progress(progress, "loading weights", "B")
    total = sum(b - a for f in files for a, b in (t["data_offsets"] for t in _safetensors_header(f)[0].values()))
    done = 0
    # Anything else (rotary inv_freq buffers, a duplicate tied lm_head) is skipped unread.
    expected = weight_shapes(config) | fused_shapes(config)
    out: Weights = {}
    for f in files:
        for name, w, nbytes in _read_safetensors(f, expected):
            if w is not None:
                out.update(split_fused(config, name, w))
            done += nbytes
            if report:
                report(done, total)
    check_weights(config, out)
    return config, out
