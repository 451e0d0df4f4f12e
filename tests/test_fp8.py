"""The FP8 definition (blink.models.fp8): e4m3 rounding and saturation, per-channel scales, the
streaming quantizer, the numpy model with fp8 weights, and --quantization from the flag to the device."""

from __future__ import annotations

import numpy as np
import pytest

from blink import cli
from blink import config as C
from blink.models import fp8
from blink.models.config import preset
from blink.models.llama_numpy import LlamaNumpy
from blink.models.weights import random_weights

FINITE = np.flatnonzero(~np.isnan(fp8.E4M3_VALUES)).astype(np.uint8)


def test_decode_table_known_codes():
    v = fp8.e4m3_decode(np.array([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0xFE, 0x80], dtype=np.uint8))
    assert v.tolist() == [0.0, 2.0**-9, 7 * 2.0**-9, 2.0**-6, 1.0, 448.0, -448.0, -0.0]
    assert np.isnan(fp8.e4m3_decode(np.array([0x7F, 0xFF], dtype=np.uint8))).all()
    assert FINITE.size == 254


def test_every_finite_value_round_trips():
    assert np.array_equal(fp8.e4m3_encode(fp8.E4M3_VALUES[FINITE]), FINITE)


def test_ties_round_to_even_and_others_to_nearest():
    pos = np.sort(fp8.E4M3_VALUES[FINITE[FINITE < 0x7F]])
    lo, hi = pos[:-1], pos[1:]
    mid = (lo + hi) / 2  # exact in float32: adjacent e4m3 values differ in 4 significant bits at most
    got = fp8.e4m3_encode(mid)
    lo_c, hi_c = fp8.e4m3_encode(lo), fp8.e4m3_encode(hi)
    assert np.array_equal(got, np.where(lo_c % 2 == 0, lo_c, hi_c))
    eps = np.float32(1e-3) * (hi - lo)
    assert np.array_equal(fp8.e4m3_encode(mid - eps), lo_c)
    assert np.array_equal(fp8.e4m3_encode(mid + eps), hi_c)
    assert fp8.e4m3_encode(np.float32(1.0625)) == 0x38  # 1 + 1/16: tie of 1.0 (0x38, even) and 1.125
    assert fp8.e4m3_encode(np.float32(1.1875)) == 0x3A  # tie of 1.125 (0x39) and 1.25 (0x3A, even)


def test_saturates_instead_of_overflowing_to_nan():
    x = np.array([448.0, 460.0, 464.0, 1e6, np.inf, -500.0, -np.inf], dtype=np.float32)
    assert fp8.e4m3_encode(x).tolist() == [0x7E] * 5 + [0xFE] * 2
    assert fp8.e4m3_encode(np.float32(np.nan)) == 0x7F
    assert fp8.e4m3_encode(np.float32(-0.0)) == 0x80


def test_subnormals_and_underflow():
    x = np.array([2.0**-10, 2.0**-10 * 1.01, 3 * 2.0**-10, 2.0**-12, -(2.0**-9)], dtype=np.float32)
    # 2**-10 is the tie of 0 and 2**-9 -> 0 (even); a hair above -> 2**-9; 1.5 * 2**-9 -> 2 * 2**-9 (even)
    assert fp8.e4m3_encode(x).tolist() == [0x00, 0x01, 0x02, 0x00, 0x81]


def test_matches_torch_float8_e4m3fn():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(200_000).astype(np.float32) * s for s in (1e-3, 0.05, 1, 40, 300)])
    x = np.clip(x, -448, 448)  # torch's cast does not saturate (overflow is NaN)
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(fp8.e4m3_encode(x), want)


def test_per_channel_scales_map_each_rows_amax_to_448():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 96)).astype(np.float32) * rng.uniform(1e-3, 10, (64, 1)).astype(np.float32)
    w[5] = 0.0
    q = fp8.quantize(w)
    assert q.codes.dtype == np.uint8 and q.scales.dtype == np.float32 and q.scales.shape == (64,)
    assert q.scales[5] == 1.0 and not q.codes[5].any()
    live = np.arange(64) != 5
    assert np.array_equal(np.abs(w[live]).max(1) / np.float32(448), q.scales[live])
    assert (np.abs(fp8.e4m3_decode(q.codes[live])).max(1) == 448.0).all()
    # Round trip: within half a quantum, 2**-4 relative in the normal range, 2**-10 * scale below it.
    err = np.abs(q.dequantize() - w)
    bound = np.maximum(np.abs(w) * 2.0**-4, q.scales[:, None] * 2.0**-10) * 1.0001
    assert (err <= bound).all()
    assert not np.array_equal(q.dequantize(), w)  # it does quantize


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3-moe"])
def test_fp8_model_is_close_to_the_unquantized_one(name):
    c = preset(name)
    w = random_weights(c, seed=3)
    base, q = LlamaNumpy(c, w), LlamaNumpy(c, w, quantization="fp8")
    L = q.layers[0]
    codes_per_row = L.w_qkv / np.abs(L.w_qkv).max(-1, keepdims=True) * 448  # dequantized: value * scale
    assert np.allclose(codes_per_row, fp8.e4m3_decode(fp8.e4m3_encode(codes_per_row)), rtol=1e-6, atol=1e-6)
    assert np.array_equal(q.embed, base.embed) and np.array_equal(q.layers[0].ln1, base.layers[0].ln1)
    T = 12
    ids = np.random.default_rng(0).integers(0, c.vocab_size, T)
    kv = base.kv_cache_shape(4, 8)
    outs = []
    for m in (base, q):
        kc, vc = np.zeros(kv, np.float32), np.zeros(kv, np.float32)
        outs.append(m.forward(ids, np.arange(T), np.array([0, T]), np.array([[0, 1, 2, 3]]), kc, vc))
    a, b = outs
    cos = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    assert 0.98 < cos < 1.0  # random weights: a measure of closeness, not of accuracy


def test_unknown_quantization_is_refused():
    c = preset("tiny-llama")
    with pytest.raises(ValueError, match="awq"):
        LlamaNumpy(c, random_weights(c), quantization="awq")
    with pytest.raises(C.ConfigError, match="device.quantization"):
        C.DeviceConfig(quantization="awq")


def test_quantization_flag_reaches_both_devices():
    from blink.device.emulated import build_executor
    from blink.launch import device_spec

    args = cli.build_parser().parse_args(["serve", "--quantization", "fp8", "--device", "emulated"])
    cfg = cli.config_from_args(args)
    assert cfg.device.quantization == "fp8"
    spec = device_spec(cfg.replace(model={"spec": "random:tiny-llama"}), "r")
    assert spec.quantization == "fp8"
    assert build_executor(spec).model.quantization == "fp8"
    assert device_spec(C.BlinkConfig().replace(device={"kind": "emulated"}), "r").quantization == ""
    cuda = device_spec(cfg.replace(device={"kind": "cuda"}), "r")
    assert cuda.quantization == "fp8"
    from blink.gpu.serve import engine_config

    assert engine_config(cuda, 4096).quantization == "fp8"
    assert engine_config(device_spec(C.BlinkConfig().replace(device={"kind": "cuda"}), "r"), 4096).quantization == ""
