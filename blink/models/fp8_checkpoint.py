"""FP8 checkpoints: which `quantization_config`s are read, and a stored weight paired with its scale.

Read (weights e4m3 stored as safetensors F8_E4M3, `<name>_scale` = `<layer>.weight_scale` float32):
  - compressed-tensors, format "float-quantized": every config group's weights 8-bit float with
    strategy "tensor" (scale shape () or (1,)) or "channel" (scale (out, 1)); layers in `ignore` are
    stored unquantized and load as such;
  - quant_method "fp8" without `weight_block_size` (per-tensor `weight_scale`).
Activation settings (dynamic or static `input_scale`) are not used: activations stay bf16, the weights
are served as weight-only FP8 with their stored scales (a per-tensor scale is every row's).
Refused with the reason: block-wise FP8 (`weight_block_size`, `weight_scale_inv`), other strategies
and bit widths, and every other quant_method (awq, gptq, bitsandbytes, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from blink.models.config import UnsupportedModelError
from blink.models.fp8 import Fp8Weight

SCALE_SUFFIX = "_scale"  # <name>.weight -> <name>.weight_scale
_ADVICE = "Blink reads bf16/fp16/fp32 and FP8 (per-tensor or per-channel) checkpoints; or serve the unquantized one"


def check_quantization(q: Mapping[str, Any] | None) -> str:
    """The weight format a config.json's quantization_config asks for: "" (none) or "fp8";
    UnsupportedModelError for anything else, naming it."""
    if not q:
        return ""
    method = q.get("quant_method", "?") if isinstance(q, Mapping) else "?"
    if method == "fp8":
        if q.get("weight_block_size"):
            raise UnsupportedModelError(f"block-wise FP8 checkpoint (weight_block_size) is not supported. {_ADVICE}")
        return "fp8"
    if method == "compressed-tensors":
        _check_compressed_tensors(q)
        return "fp8"
    raise UnsupportedModelError(
        f"quantized checkpoint (quantization_config quant_method {method!r}) is not supported. {_ADVICE} "
        "with --quantization fp8"
    )


def _check_compressed_tensors(q: Mapping[str, Any]) -> None:
    fmt = q.get("format")
    if fmt != "float-quantized":
        raise UnsupportedModelError(
            f"compressed-tensors format {fmt!r} is not supported (float-quantized is). {_ADVICE}"
        )
    groups = q.get("config_groups") or {}
    if not groups:
        raise UnsupportedModelError(f"compressed-tensors checkpoint without config_groups. {_ADVICE}")
    for name, g in groups.items():
        w = (g or {}).get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float" or w.get("strategy") not in ("tensor", "channel"):
            raise UnsupportedModelError(
                f"compressed-tensors group {name!r}: weights {w.get('num_bits')}-bit {w.get('type')} "
                f"strategy {w.get('strategy')!r}; only 8-bit float per tensor or per channel is supported. {_ADVICE}"
            )


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def stored_fp8(name: str, codes: np.ndarray, scale: np.ndarray | None) -> Fp8Weight:
    """A stored e4m3 weight (uint8 codes, (out, in)) with its scale: per tensor (one value) or per
    channel (out values) -> Fp8Weight with one scale per row."""
    if scale is None:
        raise ValueError(f"{name}: FP8 weight without {scale_name(name)}")
    s = np.asarray(scale, dtype=np.float32).reshape(-1)
    rows = codes.shape[0]
    if s.size == 1:
        s = np.full(rows, s[0], dtype=np.float32)
    elif s.size != rows:
        raise UnsupportedModelError(f"{scale_name(name)}: {s.size} scales for {rows} rows (per tensor or per channel)")
    return Fp8Weight(codes, s)
