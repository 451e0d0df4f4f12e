"""HF checkpoint directories (config.json + *.safetensors) as canonical weights (see
blink.models.weights): float32 (`load_hf_dir`) or bf16 views of the mapped files (`hf_dir_bf16`)."""

from __future__ import annotations

import json
import mmap
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from blink.models.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from blink.models.checkpoint_config import from_hf_config
from blink.models.config import ModelConfig, UnsupportedModelError
from blink.models.fp8 import Fp8Weight
from blink.models.fp8_checkpoint import SCALE_SUFFIX, scale_name, stored_fp8
from blink.models.progress import ProgressFn, make_progress
from blink.models.weights import (
    FP8_PROJECTION_SUFFIXES,
    Bf16Tensors,
    Weights,
    _checked,
    check_shapes,
    fused_rows,
    fused_shapes,
    split_fused,
    weight_shapes,
)

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
