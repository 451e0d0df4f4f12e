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

import json
import mmap
import os
import pathlib
import re
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from blink.models.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from blink.models.checkpoint_config import from_gguf_metadata, from_hf_config
from blink.models.config import ModelConfig, RopeScaling, UnsupportedModelError, rope_inv_freq
from blink.models.fp8 import Fp8Weight
from blink.models.fp8_checkpoint import SCALE_SUFFIX, scale_name, stored_fp8
from blink.models.gguf_file import GGUFFile
from blink.models.progress import ProgressFn, make_progress

Weights = dict[str, np.ndarray]
# The projections an FP8 checkpoint hands to the CUDA device as FP8 (GpuWeights' Fp8Linear rows)
FP8_PROJECTION_SUFFIXES = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))
# (canonical name, bf16 bits as uint16 of the canonical shape), each tensor once, in no fixed order
# (an FP8 checkpoint's projections come as blink.models.fp8.Fp8Weight: codes and per-row scales as stored)
Bf16Tensors = Iterator[tuple[str, np.ndarray]]

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


# ---------------------------------------------------------------- HF directory

# safetensors dtype -> numpy (little-endian); BF16 read as its bits
_ST_DTYPES = {"BF16": "<u2", "F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8", "I32": "<i4", "F8_E4M3": "u1"}


def _safetensors_header(path: pathlib.Path) -> tuple[dict[str, Any], int]:
    """(tensor table, byte offset of the data section) of a .safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _open_hf_dir(path: str | os.PathLike[str]) -> tuple[ModelConfig, list[tuple[pathlib.Path, dict[str, Any], int]]]:
    """(config, [(file, tensor table, data offset)]) of an HF directory, its tensor names and shapes
    checked against the config before any data is read."""
    root = pathlib.Path(path)
    config = from_hf_config(json.loads((root / "config.json").read_text()), name=root.name)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {root}")
    tables = [(f, *_safetensors_header(f)) for f in files]
    wanted = weight_shapes(config) | fused_shapes(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for f, header, _ in tables:
        for name, info in header.items():
            if name not in wanted:
                continue  # rotary inv_freq buffers, a duplicate tied lm_head: skipped unread
            dt = info["dtype"]
            if dt not in _ST_DTYPES or (dt == "F8_E4M3" and config.quantization != "fp8"):  # FP8: with its config
                raise UnsupportedModelError(f"{f.name}: tensor {name} has unsupported dtype {dt}")
            rows = fused_rows(config, name)
            if rows is None:
                shapes[name] = tuple(info["shape"])
                continue
            if tuple(info["shape"]) != wanted[name]:
                raise ValueError(f"{name}: shape {tuple(info['shape'])} != {wanted[name]}")
            shapes.update((piece, (b - a, config.hidden_size)) for piece, a, b in rows)
    check_shapes(config, shapes)
    return config, tables


def _hf_tensors(
    config: ModelConfig, tables: list[tuple[pathlib.Path, dict[str, Any], int]], progress: bool | ProgressFn | None
) -> Iterator[tuple[str, np.ndarray]]:
    """(canonical name, tensor as stored: bf16 as uint16 bits, else its float dtype) one at a time,
    read-only views of the mapped files; progress counts every byte, skipped tensors included."""
    report = make_progress(progress, "loading weights", "B")
    total = sum(b - a for _, header, _ in tables for a, b in (t["data_offsets"] for t in header.values()))
    done = 0
    wanted = weight_shapes(config) | fused_shapes(config)
    scales = _fp8_scales(tables) if config.quantization == "fp8" else {}
    for f, header, data_start in tables:
        raw = _mapped(f)
        for name, info in header.items():
            a, b = info["data_offsets"]
            if name in wanted:
                w = raw[data_start + a : data_start + b].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
                if info["dtype"] == "F8_E4M3":
                    w = stored_fp8(name, w, scales.get(scale_name(name)))
                yield from split_fused(config, name, w)
            done += b - a
            if report:
                report(done, total)


def _mapped(f: pathlib.Path) -> np.ndarray:
    """The bytes of a file, mapped read-only."""
    with open(f, "rb") as fh:
        return np.frombuffer(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)


def _fp8_scales(tables: list[tuple[pathlib.Path, dict[str, Any], int]]) -> dict[str, np.ndarray]:
    """Every `<name>.weight_scale` of an FP8 checkpoint (small: one value, or one a row), by name."""
    out = {}
    for f, header, data_start in tables:
        names = [n for n in header if n.endswith(".weight" + SCALE_SUFFIX)]
        raw = _mapped(f) if names else None
        for n in names:
            info = header[n]
            a, b = info["data_offsets"]
            out[n] = np.array(raw[data_start + a : data_start + b].view(_ST_DTYPES[info["dtype"]]), dtype=np.float32)
    return out


def load_hf_dir(path: str | os.PathLike[str], progress: bool | ProgressFn | None = None) -> tuple[ModelConfig, Weights]:
    """(config, weights) of an HF model directory (config.json + *.safetensors), as float32
    (bf16 widened by a 16-bit shift)."""
    config, tables = _open_hf_dir(path)
    out: Weights = {}
    for name, w in _hf_tensors(config, tables, progress):
        if isinstance(w, Fp8Weight):
            out[name] = w.dequantize()
        else:
            out[name] = bf16_bits_to_f32(w) if w.dtype == np.uint16 else np.array(w, dtype=np.float32)
    return config, out


def hf_dir_bf16(
    path: str | os.PathLike[str], progress: bool | ProgressFn | None = None
) -> tuple[ModelConfig, Bf16Tensors]:
    """`load_hf_dir` with the weights as Bf16Tensors: bf16 tensors as views of the mapped files
    (no copy), float32/float16 ones rounded to bf16 one at a time."""
    config, tables = _open_hf_dir(path)
    return config, _checked(config, (_as_bf16(n, w) for n, w in _hf_tensors(config, tables, progress)))


def _as_bf16(name: str, w: Any) -> tuple[str, Any]:
    """A stored tensor as the CUDA device takes it: bf16 bits; an FP8 checkpoint's projection as its
    Fp8Weight, any other FP8 tensor (an MoE expert, a router) dequantized to bf16."""
    if isinstance(w, Fp8Weight):
        return name, w if name.endswith(FP8_PROJECTION_SUFFIXES) and ".experts." not in name else f32_to_bf16_bits(
            w.dequantize()
        )
    return name, w if w.dtype == np.uint16 else f32_to_bf16_bits(w)
