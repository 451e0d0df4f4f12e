"""The CUDA device's weight loading holds one tensor at a time on the host (issue 17).

The device used to load an HF directory into a float32 dict of the whole model and round it to bf16
on upload: host peak ~2x the bf16 checkpoint in float32, so Qwen3-32B (64 GB bf16) did not load on a
128 GiB host although it fits the GPU. These tests write tiny checkpoints (BF16, F16 and F32
tensors, sharded, Phi-3's fused projections) and check the path the device takes.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from blink.gpu import serve
from blink.models.checkpoint_config import to_hf_config
from blink.models.config import preset
from blink.models.registry import synthetic_tokenizer
from blink.models.weights import random_weights, weight_shapes
from blink.protocol.wire import DeviceSpec

_NP = {"F32": np.float32, "F16": np.float16}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtypes: dict[str, str]) -> None:
    """A .safetensors file of float32 `tensors`, each stored as dtypes[name] (BF16: rounded to nearest even)."""
    from blink.gpu.weights import f32_to_bf16_bits

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


def cuda_spec(model: str) -> DeviceSpec:
    return DeviceSpec(
        ring="unused", kind="cuda", model=model, scheduler="gpu", max_batch=1, max_tokens=1,
        kv_block_size=16, num_kv_blocks=0, kv_cache_fraction=0.5, max_context=0,
    )  # fmt: skip


@pytest.mark.parametrize("dtypes", [("BF16",), ("BF16", "F32", "F16")], ids=["bf16", "mixed"])
def test_cuda_device_hf_load_holds_one_tensor_at_a_time(tmp_path, dtypes):
    """Issue 17: what the CUDA device reads from an HF directory (serve.weight_source, consumed as
    the upload consumes it) peaks at a few copies of the largest tensor, not at the whole model."""
    config = preset("tiny-qwen3").replace(num_layers=12)
    write_hf_dir(tmp_path, config, dtypes)
    sizes = [int(np.prod(s)) for s in weight_shapes(config).values()]
    largest, model = 4 * max(sizes), 4 * sum(sizes)  # float32 bytes
    assert model > 12 * largest  # the bound below tells "a tensor at a time" from "the whole model"
    tracemalloc.start()
    try:
        got_config, source = serve.weight_source(cuda_spec(str(tmp_path)))
        assert got_config.num_layers == 12 and source is not None
        for _ in source:  # the upload takes each item, copies it to the GPU and drops it
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 4 * largest, f"host peak {peak / 2**20:.2f} MiB; largest tensor {largest / 2**20:.2f} MiB (f32)"
