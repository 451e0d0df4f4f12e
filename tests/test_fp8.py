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


def test_activations_are_quantized_per_token_with_the_weights_arithmetic():
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    x[2] = 0.0
    x[3] *= 1000.0
    q = fp8.quantize_activations(x)
    assert q.codes.shape == x.shape and q.scales.shape == (5,)
    assert q.scales[2] == 1.0 and np.array_equal(q.scales, fp8.channel_scales(x))
    for t in range(5):  # each row on its own: the other rows change nothing
        one = fp8.quantize_activations(x[t : t + 1])
        assert np.array_equal(one.codes[0], q.codes[t]) and one.scales[0] == q.scales[t]
    assert np.array_equal(fp8.fake_quantize_activations(x), q.dequantize())


def test_w8a8_linear_is_the_product_of_the_quantized_operands():
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((7, 96)).astype(np.float32), rng.standard_normal((40, 96)).astype(np.float32)
    wq = fp8.quantize(w)
    y = fp8.w8a8_linear(x, wq)
    want = fp8.fake_quantize_activations(x).astype(np.float64) @ wq.dequantize().T.astype(np.float64)
    assert np.allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(y - exact).max() > 1e-4 * np.abs(exact).max()  # activation rounding is visible
    assert np.abs(y - exact).max() < 0.1 * np.abs(exact).max()


def test_w8a8_in_every_step_but_small_decode_steps():
    m = fp8.FP8_GEMV_MAX_TOKENS
    assert not fp8.uses_w8a8(m, decode=True) and fp8.uses_w8a8(m + 1, decode=True)
    assert fp8.uses_w8a8(1, decode=False) and fp8.uses_w8a8(m, decode=False)  # prefill graphs: >= 16 rows
    assert fp8.uses_w8a8(5, decode=True, gemv_max_tokens=4)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe"])
def test_fp8_model_quantizes_activations_only_in_large_steps(name):
    c = preset(name)
    w = random_weights(c, seed=4)
    w8a8, weight_only = (
        LlamaNumpy(c, w, quantization="fp8"),
        LlamaNumpy(c, w, quantization="fp8", fp8_gemv_max_tokens=None),
    )
    kv = w8a8.kv_cache_shape(16, 8)

    def run(m: LlamaNumpy, T: int) -> np.ndarray:
        ids = np.random.default_rng(T).integers(0, c.vocab_size, T)
        kc, vc = np.zeros(kv, np.float32), np.zeros(kv, np.float32)
        return m.forward(ids, np.arange(T), np.array([0, T]), np.arange(8)[None], kc, vc)

    def run_decode(m: LlamaNumpy, S: int) -> np.ndarray:  # S sequences, one token each at position 0
        ids = np.random.default_rng(S).integers(0, c.vocab_size, S)
        kc, vc = np.zeros(kv, np.float32), np.zeros(kv, np.float32)
        return m.forward(ids, np.zeros(S, np.int64), np.arange(S + 1), np.arange(S)[:, None], kc, vc)

    small = fp8.FP8_GEMV_MAX_TOKENS
    assert np.array_equal(run_decode(w8a8, small), run_decode(weight_only, small))  # the GEMV: bf16 activations
    assert not np.array_equal(run_decode(w8a8, small + 1), run_decode(weight_only, small + 1))
    assert not np.array_equal(run(w8a8, 3), run(weight_only, 3))  # a prefill of 3 tokens: a GEMM step
    a, b = run(w8a8, small + 4), run(weight_only, small + 4)
    assert not np.array_equal(a, b)
    cos = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    assert 0.95 < cos < 1.0  # random weights (MoE routing may flip): closeness, not accuracy
