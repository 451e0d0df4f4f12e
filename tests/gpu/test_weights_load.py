"""Weights loaded for the CUDA device one tensor at a time (GpuWeights.from_bf16 over
blink.models.weights.Bf16Tensors) are bit for bit the weights GpuWeights.from_host makes
from the whole-model float32 dict, in every device array; and the engine takes them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from checkpoints import write_hf_dir

from blink.models.config import PRESET_NAMES, preset
from blink.models.hf_weights import hf_dir_bf16, load_hf_dir

pytestmark = pytest.mark.gpu

TINY = [n for n in PRESET_NAMES if n.startswith("tiny-")]


def device_arrays(w) -> Iterator[tuple[str, object]]:
    yield from (("embed", w.embed), ("final_norm", w.final_norm), ("lm_head", w.lm_head))
    for li, lw in enumerate(w.layers):
        for k, a in vars(lw).items():
            yield f"layers.{li}.{k}", a


def assert_same_weights(a, b) -> None:
    import cupy as cp

    got, want = dict(device_arrays(a)), dict(device_arrays(b))
    assert got.keys() == want.keys()
    for k, x in want.items():
        y = got[k]
        assert (x is None) == (y is None), k
        if x is not None:
            assert x.dtype == y.dtype == cp.uint16 and x.shape == y.shape, k
            assert np.array_equal(cp.asnumpy(x), cp.asnumpy(y)), k
    assert (a.lm_head is a.embed) == (b.lm_head is b.embed) == a.config.tie_word_embeddings


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("name", TINY)
def test_from_bf16_equals_from_host_bitwise(tmp_path, name, tied):
    from blink.gpu.engine.weights import GpuWeights

    config = preset(name).replace(tie_word_embeddings=tied)
    write_hf_dir(tmp_path, config, ("BF16", "F32", "F16"), seed=2)
    cfg, host = load_hf_dir(tmp_path)
    cfg2, tensors = hf_dir_bf16(tmp_path)
    assert cfg == cfg2
    assert_same_weights(GpuWeights.from_bf16(cfg2, tensors), GpuWeights.from_host(cfg, host))


def test_from_bf16_refuses_wrong_tensors(tmp_path):
    from blink.gpu.engine.weights import GpuWeights
    from blink.models.bf16 import f32_to_bf16_bits
    from blink.models.weights import random_weights

    config = preset("tiny-qwen3")
    bits = {n: f32_to_bf16_bits(w) for n, w in random_weights(config).items()}
    with pytest.raises(ValueError, match="missing"):
        GpuWeights.from_bf16(config, list(bits.items())[:-1])
    with pytest.raises(ValueError, match="expected uint16"):
        GpuWeights.from_bf16(
            config, [(n, b.T if b.ndim == 2 and b.shape[0] != b.shape[1] else b) for n, b in bits.items()]
        )
    with pytest.raises(ValueError, match="given twice"):
        GpuWeights.from_bf16(config, [*bits.items(), next(iter(bits.items()))])


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-phi3"])
def test_device_weight_source_builds_the_engine(tmp_path, name):
    """The device process's path (serve.weight_source -> Engine.create(bf16_tensors=...)) gives the
    engine the weights Engine.create(host_weights=load_hf_dir(...)) gives it."""
    from blink.gpu.engine.engine import Engine, EngineConfig
    from blink.gpu.serve import weight_source
    from blink.protocol.wire import DeviceSpec

    write_hf_dir(tmp_path, preset(name), ("BF16", "F32"), seed=1)
    spec = DeviceSpec(
        ring="unused", kind="cuda", model=str(tmp_path), scheduler="gpu", max_batch=4, max_num_batched_tokens=64,
        kv_block_size=16, num_kv_blocks=64, kv_cache_fraction=0.5, max_context=256,
    )  # fmt: skip
    ecfg = EngineConfig(
        max_seqs=4, max_num_batched_tokens=64, max_context=256, num_kv_blocks=64, batch_buckets=(1, 2, 4),
        token_buckets=(16, 64), progress=False,
    )  # fmt: skip
    cfg, tensors = weight_source(spec)
    streamed = Engine.create(cfg, ecfg, bf16_tensors=tensors)
    try:
        cfg2, host = load_hf_dir(tmp_path)
        from_host = Engine.create(cfg2, ecfg, host_weights=host)
        try:
            assert cfg == cfg2
            assert_same_weights(streamed.weights, from_host.weights)
        finally:
            from_host.close()
    finally:
        streamed.close()
