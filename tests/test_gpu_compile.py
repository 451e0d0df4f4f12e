"""Every CUDA source of the engine compiles for sm_90 (CPU-only: needs nvcc, no GPU)."""

from __future__ import annotations

import pathlib
import subprocess

import numpy as np
import pytest

from blink.gpu import kernels
from blink.gpu.engine import EngineConfig, _buckets, bucket_of
from blink.gpu.weights import bf16_bits_to_f32, f32_to_bf16_bits

CU_FILES = sorted(kernels.CSRC.glob("*.cu"))


def test_engine_sources_exist():
    assert set(kernels.SOURCES) <= {p.name for p in CU_FILES}


@pytest.mark.skipif(kernels.nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("src", CU_FILES, ids=lambda p: p.name)
def test_compiles_for_sm90(src: pathlib.Path, tmp_path: pathlib.Path):
    if src.name in kernels.SOURCES:
        out = kernels.build(src.name, tmp_path)
    else:  # other roles' sources (the scheduler): relocatable device code, device-side launches
        out = tmp_path / (src.stem + ".cubin")
        inc = kernels.CSRC.parent / "include"
        cmd = [kernels.nvcc_path(), "-arch=sm_90", "-rdc=true", "-cubin", "-I", str(kernels.CSRC), "-I", str(inc)]
        res = subprocess.run([*cmd, "-o", str(out), str(src)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
    assert out.exists() and out.read_bytes()[:4] == b"\x7fELF"
    # every extern "C" kernel the engine launches is in the cubin
    names = subprocess.run(["strings", str(out)], capture_output=True, text=True).stdout
    if src.name == "attention.cu":
        for hd in (16, 32, 64, 128):
            assert f"attn_prefill_hd{hd}" in names and f"attn_decode_hd{hd}_g4" in names
    if src.name == "model_kernels.cu":
        for k in ("embed_tokens", "add_rmsnorm", "rope_kv_write", "swiglu", "signal_done", "gemv_bf16_t8"):
            assert k in names
    if src.name == "sampling.cu":
        assert "sample_tokens" in names


@pytest.mark.skipif(kernels.nvcc_path() is None, reason="nvcc not installed")
def test_cache_key_tracks_source(tmp_path: pathlib.Path):
    a = kernels.build("sampling.cu", tmp_path)
    assert kernels.build("sampling.cu", tmp_path) == a  # cached
    assert kernels.cubin_key("sampling.cu") != kernels.cubin_key("attention.cu")


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38, 1e-40], np.float32)
    # 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0)
    got = bf16_bits_to_f32(f32_to_bf16_bits(x))
    assert got[0] == 1.0 and got[1] == 1.0 and got[2] == 1.015625 and got[3] == -2.5
    rng = np.random.default_rng(0)
    y = rng.standard_normal(10000).astype(np.float32)
    r = bf16_bits_to_f32(f32_to_bf16_bits(y))
    assert np.all(np.abs(r - y) <= np.abs(y) * 2.0**-8)


def test_bucket_lookup_tables():
    bb = _buckets((1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 512), 200)
    assert bb == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 200)  # capped, cap added
    tab = bucket_of(bb, 200)
    for n in range(1, 201):
        assert bb[tab[n]] >= n and (tab[n] == 0 or bb[tab[n] - 1] < n)
    with pytest.raises(ValueError):
        bucket_of((1, 4, 2), 4)


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError):
        EngineConfig(execs_per_shape=1)
    with pytest.raises(ValueError):
        EngineConfig(max_seqs=64, max_tokens=32)
    with pytest.raises(ValueError):
        EngineConfig(max_context=1000, block_size=16)
