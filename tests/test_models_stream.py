"""The CUDA device's weight loading holds one tensor at a time on the host.

The device used to load an HF directory into a float32 dict of the whole model and round it to bf16
on upload: host peak ~2x the bf16 checkpoint in float32, so Qwen3-32B (64 GB bf16) did not load on a
128 GiB host although it fits the GPU. These tests write tiny checkpoints (BF16, F16 and F32
tensors, sharded, Phi-3's fused projections) and check the path the device takes.
"""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from checkpoints import write_hf_dir

from blink.gpu import serve
from blink.models import registry
from blink.models.bf16 import f32_to_bf16_bits
from blink.models.checkpoint_config import to_hf_config
from blink.models.config import PRESET_NAMES, preset
from blink.models.hf_weights import hf_dir_bf16, load_hf_dir
from blink.models.weights import random_weights, weight_shapes
from blink.protocol.wire import DeviceSpec


def cuda_spec(model: str) -> DeviceSpec:
    return DeviceSpec(
        ring="unused", kind="cuda", model=model, scheduler="gpu", max_batch=1, max_num_batched_tokens=1,
        kv_block_size=16, num_kv_blocks=0, kv_cache_fraction=0.5, max_context=0,
    )  # fmt: skip


@pytest.mark.parametrize("dtypes", [("BF16",), ("BF16", "F32", "F16")], ids=["bf16", "mixed"])
def test_cuda_device_hf_load_holds_one_tensor_at_a_time(tmp_path, dtypes):
    """What the CUDA device reads from an HF directory (serve.weight_source, consumed as
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


def collect(tensors) -> dict[str, np.ndarray]:
    """A Bf16Tensors iterator as a dict (copies), each name once, each uint16."""
    out = {}
    for name, bits in tensors:
        assert name not in out and bits.dtype == np.uint16, name
        out[name] = np.array(bits)
    return out


TINY = [n for n in PRESET_NAMES if n.startswith("tiny-")]


@pytest.mark.parametrize("name", TINY)
def test_hf_bf16_tensors_are_the_rounded_float32_weights(tmp_path, name):
    """The device's stream gives exactly f32_to_bf16_bits of the float32 dict the emulated device
    loads (today's CUDA path rounded that dict on upload): bf16, f32 and f16 sources, fused Phi-3
    projections, MoE experts, tied and untied heads, qwen2 biases, two shards."""
    config = preset(name)
    write_hf_dir(tmp_path, config, ("BF16", "F32", "F16"), seed=4)
    ref_config, ref = load_hf_dir(tmp_path)
    seen = []
    got_config, tensors = hf_dir_bf16(tmp_path, progress=lambda d, t: seen.append((d, t)))
    assert not seen  # nothing is read before the upload takes the first tensor
    got = collect(tensors)
    assert seen[-1][0] == seen[-1][1] > 0 and len(seen) > 10  # progress as the tensors go by
    assert got_config == ref_config and got.keys() == ref.keys() == weight_shapes(config).keys()
    for n, w in ref.items():
        np.testing.assert_array_equal(got[n], f32_to_bf16_bits(w), err_msg=n)
    # and through the registry, as the device process asks for it
    cfg2, tensors2 = registry.resolve_bf16(str(tmp_path))
    assert cfg2 == registry.resolve_model(str(tmp_path)).config
    assert all(np.array_equal(b, got[n]) for n, b in tensors2)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_random_bf16_tensors_are_the_rounded_random_weights(name):
    config, tensors = registry.resolve_bf16(f"random:{name}", seed=3)
    got = collect(tensors)
    ref = random_weights(config, seed=3)
    assert config == preset(name) and got.keys() == ref.keys()
    assert all(np.array_equal(got[n], f32_to_bf16_bits(w)) for n, w in ref.items())


def test_weight_source_random_presets():
    """A small random preset streams the emulated device's weights, rounded; a large one is left
    to the GPU (None) without a host copy."""
    config, tensors = serve.weight_source(cuda_spec("random:tiny-qwen2"))
    ref = random_weights(config)
    assert all(np.array_equal(b, f32_to_bf16_bits(ref[n])) for n, b in tensors)
    config, tensors = serve.weight_source(cuda_spec("random:qwen3-32b"))
    assert tensors is None and config == preset("qwen3-32b")


def test_hf_bf16_refuses_a_bad_checkpoint_before_reading_it(tmp_path):
    config = preset("tiny-qwen3")
    write_hf_dir(tmp_path, config)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="missing"):
        hf_dir_bf16(tmp_path)
    write_hf_dir(tmp_path, config.replace(intermediate_size=160))  # config.json then says 160
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(config)))
    with pytest.raises(ValueError, match="bad_shapes"):
        hf_dir_bf16(tmp_path)


def test_f32_to_bf16_bits_rounds_to_nearest_even():
    """Against float64 arithmetic on the bf16 grid: the nearer of the two neighbours, the even one
    at a tie, infinity past the largest finite bf16 (random floats, ties, subnormals, extremes)."""
    rng = np.random.default_rng(0)
    special = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x00008000, 0x00018000, 1]
    u = np.concatenate([rng.integers(0, 2**32, 20000, dtype=np.uint64), special, np.array(special) | 2**31])
    x = u.astype(np.uint32).view(np.float32)
    x = x[np.isfinite(x)]
    bits = x.view(np.uint32)
    lo = (bits & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)  # truncation: toward zero
    exp = np.maximum((bits >> 23) & 0xFF, 1).astype(np.int64)
    hi = lo + np.sign(x.astype(np.float64) + 0.0) * np.ldexp(1.0, exp - 127 - 7)  # one bf16 step away from zero
    hi = np.where(hi == 0, np.ldexp(1.0, -133), hi)
    xd = x.astype(np.float64)
    d_lo, d_hi = np.abs(xd - lo), np.abs(hi - xd)
    even_lo = ((bits >> 16) & 1) == 0
    want = np.where((d_lo < d_hi) | ((d_lo == d_hi) & even_lo), lo, hi)
    want = np.where(np.abs(want) == 2.0**128, np.copysign(np.inf, want), want)
    got = (f32_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    np.testing.assert_array_equal(got, want)
    assert f32_to_bf16_bits(np.float32([np.inf, -np.inf])).tolist() == [0x7F80, 0xFF80]
    assert f32_to_bf16_bits(np.float16([1.5, -2.0])).tolist() == [0x3FC0, 0xC000]  # other dtypes via float32
