"""Tiny HF checkpoints written the way safetensors stores them (BF16, F16, F32), for loader tests
on the CPU (tests/test_models_stream.py) and the GPU (tests/gpu/test_weights_load.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from blink.models.bf16 import f32_to_bf16_bits
from blink.models.checkpoint_config import to_hf_config
from blink.models.registry import synthetic_tokenizer
from blink.models.weights import random_weights

_NP = {"F32": np.float32, "F16": np.float16}


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
