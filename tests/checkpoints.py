"""Tiny HF checkpoints written the way safetensors stores them (BF16, F16, F32; FP8 as compressed-tensors
or quant_method fp8 write them), for loader tests on the CPU (tests/test_models_stream.py,
tests/test_fp8_checkpoint.py) and the GPU (tests/gpu/test_weights_load.py, tests/gpu/test_fp8_kernels.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from blink.models.bf16 import f32_to_bf16_bits
from blink.models.checkpoint_config import to_hf_config
from blink.models.registry import synthetic_tokenizer
from blink.models.weights import random_weights

_NP = {"F32": np.float32, "F16": np.float16, "F8_E4M3": np.uint8}  # F8_E4M3: given as its codes


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtypes: dict[str, str]) -> None:
    """A .safetensors file of float32 `tensors`, each stored as dtypes[name] (BF16: rounded to nearest even)."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        dt = dtypes[name]
        data = (f32_to_bf16_bits(t) if dt == "BF16" else t.astype(_NP[dt])).tobytes()
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write_hf_dir(d: Path, config, dtypes: tuple[str, ...] = ("BF16",), seed: int = 0) -> None:
    """config.json, tokenizer files and two shards of random weights; the i-th tensor stored as
    dtypes[i % len(dtypes)]; Phi-3's projections fused as its checkpoints hold them; plus a
    rotary inv_freq buffer the loaders must skip."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(to_hf_config(config)))
    tok = synthetic_tokenizer(config)
    (d / "tokenizer.json").write_text(tok._tok.to_str())
    w = random_weights(config, seed=seed)
    if config.arch == "phi3":
        for i in range(config.num_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            w[a + "qkv_proj.weight"] = np.concatenate([w.pop(a + f"{x}_proj.weight") for x in "qkv"])
            w[m + "gate_up_proj.weight"] = np.concatenate([w.pop(m + "gate_proj.weight"), w.pop(m + "up_proj.weight")])
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(config.head_dim // 2, np.float32)
    names = list(w)
    kinds = {n: dtypes[i % len(dtypes)] for i, n in enumerate(names)}
    half = len(names) // 2
    for k, part in enumerate((names[:half], names[half:])):
        write_safetensors(d / f"model-{k + 1:05d}-of-00002.safetensors", {n: w[n] for n in part}, kinds)


FP8_CONFIGS = {  # config.json quantization_config of each FP8 layout write_fp8_hf_dir writes
    "channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": {"dynamic": True},
                                              "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
    "tensor": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
               "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                             "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}},
    "fp8": {"quant_method": "fp8", "activation_scheme": "static"},
}  # fmt: skip


def write_fp8_hf_dir(d: Path, config, layout: str, seed: int = 0) -> dict[str, np.ndarray]:
    """An FP8 checkpoint of random weights: the linear layers' weights as e4m3 codes with a per-channel
    (out, 1) or per-tensor scale ((1,) for compressed-tensors, () and a static input_scale for "fp8"), the
    rest bf16. Returns the float32 values each weight stands for (codes x scale; bf16 ones widened)."""
    from blink.models import fp8

    d.mkdir(parents=True, exist_ok=True)
    hf = to_hf_config(config) | {"quantization_config": FP8_CONFIGS[layout]}
    (d / "config.json").write_text(json.dumps(hf))
    (d / "tokenizer.json").write_text(synthetic_tokenizer(config)._tok.to_str())
    tensors, dtypes, values = {}, {}, {}
    for name, w in random_weights(config, seed=seed).items():
        if name.endswith("_proj.weight"):
            if layout == "channel":
                q = fp8.quantize(w)
                codes, scale = q.codes, q.scales[:, None]
            else:
                s = np.float32(np.abs(w).max() / np.float32(448))
                codes, scale = fp8.e4m3_encode(w / s), np.array([s] if layout == "tensor" else s, np.float32)
            tensors[name], dtypes[name] = codes, "F8_E4M3"
            tensors[name + "_scale"], dtypes[name + "_scale"] = scale, "F32"
            if layout == "fp8":
                tensors[name[: -len("weight")] + "input_scale"], dtypes[name[: -len("weight")] + "input_scale"] = (
                    np.array(0.5, np.float32),
                    "F32",
                )
            values[name] = fp8.e4m3_decode(codes) * scale.reshape(-1, 1)
        else:
            tensors[name], dtypes[name] = w, "BF16"
            values[name] = fp8.as_device_weight(w)
    names = list(tensors)
    half = len(names) // 2  # two shards: a weight and its scale may sit in different files
    for k, part in enumerate((names[:half], names[half:])):
        write_safetensors(d / f"model-{k + 1:05d}-of-00002.safetensors", {n: tensors[n] for n in part}, dtypes)
    return values
