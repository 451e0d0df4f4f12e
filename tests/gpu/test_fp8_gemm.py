"""The W8A8 path of large FP8 steps against the numpy definition (blink.models.fp8): the per-token
activation quantization bit for bit, the cuBLASLt FP8 GEMM with each scaling mode (also replayed
from a device-launchable graph) to a relative error bound, and the engine at a large batch against
the numpy FP8 model (W8A8 past the GEMV, weight-only on the dequantize path)."""

from __future__ import annotations

import numpy as np
import pytest
from fp8_steps import W8A8_REL_ERR, rel
from kernel_rig import KernelRig

from blink.models import fp8
from blink.models.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from blink.models.config import preset
from blink.models.reference import PagedDriver

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu():
    rig = KernelRig()
    return rig.drv, rig.k


def _activations(t: int, k: int, seed: int) -> np.ndarray:
    """bf16 bits of (t, k) activations: rows of very different magnitudes, a zero row, an outlier."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)).astype(np.float32) * np.exp2(rng.integers(-10, 8, (t, 1))).astype(np.float32)
    x[min(1, t - 1)] = 0.0
    x[0, 3] = 5e3
    return f32_to_bf16_bits(x)


def _quantize(gpu, x):
    """fp8_quantize_rows over the rows of x (a CuPy bf16 array): (codes, scales) CuPy arrays."""
    import cupy as cp

    driver, kernels = gpu
    t, k = x.shape
    codes, scales = cp.zeros((t, k), dtype=cp.uint8), cp.zeros(t, dtype=cp.float32)
    args = kernels.args("fp8_quantize_rows", {"W": x, "codes": codes, "scales": scales, "N": t, "K": k})
    driver.launch(kernels["fp8_quantize_rows"], (t, 1, 1), (256, 1, 1), args, 0)
    return codes, scales


@pytest.mark.parametrize("t,k", [(16, 4096), (100, 14336), (256, 5120), (9, 576)])
def test_activation_quantization_is_the_numpy_definition_bit_for_bit(gpu, t, k):
    import cupy as cp

    bits = _activations(t, k, t)
    codes, scales = _quantize(gpu, cp.asarray(bits))
    cp.cuda.Device().synchronize()
    want = fp8.quantize_activations(bf16_bits_to_f32(bits))
    np.testing.assert_array_equal(cp.asnumpy(scales), want.scales)
    np.testing.assert_array_equal(cp.asnumpy(codes), want.codes)


def _weight(n: int, k: int, seed: int) -> fp8.Fp8Weight:
    rng = np.random.default_rng(seed)
    return fp8.quantize_bf16(f32_to_bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * 0.02))


def _run_gemm(gpu, g, scales: str, x, w8, ws, y, d32, x8, xs) -> None:
    """The engine's sequence (Forward.fp8_linear past the GEMV) on stream g.stream."""
    driver, kernels = gpu
    t, k = x.shape
    n = w8.shape[0]
    a = kernels.args("fp8_quantize_rows", {"W": x, "codes": x8, "scales": xs, "N": t, "K": k})
    driver.launch(kernels["fp8_quantize_rows"], (t, 1, 1), (256, 1, 1), a, g.stream)
    d = y if scales == "outer" else d32
    p = lambda v: int(v.data.ptr)  # noqa: E731
    g.matmul(t, n, k, p(x8), p(w8), p(d), p(xs), p(ws))
    if scales == "epilogue":
        a = kernels.args("fp8_scale_rows", {"D": d32, "xs": xs, "ws": ws, "Y": y, "T": t, "N": n})
        driver.launch(kernels["fp8_scale_rows"], (-(-n // 2048), t, 1), (256, 1, 1), a, g.stream)


@pytest.mark.parametrize("scales", ["outer", "epilogue"])
@pytest.mark.parametrize("t,n,k", [(16, 6144, 4096), (100, 4096, 14336), (256, 28672, 4096), (48, 576, 576)])
def test_fp8_gemm_matches_the_w8a8_definition(gpu, scales, t, n, k):
    """y = bf16(xs[t] ws[n] sum e4m3 e4m3): the quantized operands are the definition's bits, so
    what is left is fp32 summation order and the bf16 rounding of y. Run directly, then replayed from
    a graph instantiated for device launch (as the step graphs are)."""
    import cupy as cp

    from blink.gpu.engine.fp8_gemm import Fp8Gemm

    driver, _ = gpu
    stream = cp.cuda.Stream(non_blocking=True)
    ws_buf = cp.empty(64 << 20, dtype=cp.uint8)
    g = Fp8Gemm(driver, int(stream.ptr), int(ws_buf.data.ptr), int(ws_buf.nbytes), scales)
    if not g.supported((t, n, k)):
        pytest.skip(f"cuBLASLt offers no FP8 GEMM with {scales} scales here")
    bits = f32_to_bf16_bits(np.random.default_rng(t).standard_normal((t, k)).astype(np.float32))
    wq = _weight(n, k, n)
    x, w8, ws = cp.asarray(bits), cp.asarray(wq.codes), cp.asarray(wq.scales)
    y, d32 = cp.zeros((t, n), dtype=cp.uint16), cp.zeros((t, n), dtype=cp.float32)
    x8, xs = cp.zeros((t, k), dtype=cp.uint8), cp.zeros(t, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    ref = fp8.w8a8_linear(bf16_bits_to_f32(bits), wq).astype(np.float64)
    rms = float(np.sqrt(np.mean(ref**2)))
    tol = 2.0**-8 * np.abs(ref) + 2e-3 * rms

    def check(what: str) -> None:
        got = bf16_bits_to_f32(cp.asnumpy(y)).astype(np.float64)
        err = np.abs(got - ref)
        print(f"{scales} {t}x{n}x{k} {what}: max |err|/rms {err.max() / rms:.2e}")
        assert (err <= tol).all(), (what, float(np.max(err / tol)))
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 4e-3

    _run_gemm(gpu, g, scales, x, w8, ws, y, d32, x8, xs)
    stream.synchronize()
    check("direct")
    y[...] = 0
    cp.cuda.Device().synchronize()
    driver.begin_capture(g.stream)
    try:
        _run_gemm(gpu, g, scales, x, w8, ws, y, d32, x8, xs)
    finally:
        graph = driver.end_capture(g.stream)
    ex = driver.instantiate_device_launch(graph)
    driver.graph_launch(ex, g.stream)
    stream.synchronize()
    check("graph")
    driver.graph_exec_destroy(ex)
    driver.graph_destroy(graph)
    g.close()


_KW = dict(num_blocks=256, block_size=8, max_batch=32, max_num_batched_tokens=512, max_blocks_per_seq=64)


@pytest.mark.parametrize("path", ["auto", "outer", "dequant"])
def test_fp8_engine_at_a_large_batch_matches_the_numpy_fp8_model(path):
    """32 sequences: a 384-token prefill step and 32-row decode steps (past the GEMV: W8A8 on "auto" and
    "outer" (every GEMM with outer-vector scales; tiny-llama's are all below "auto"'s line for them),
    weight-only on "dequant"), then 4-row decode steps (the FP8 GEMV), against the numpy FP8 model with
    the same step-size rule, and closer to it than to the bf16 model. W8A8 steps are held to
    fp8_steps.W8A8_REL_ERR (why: there), weight-only ones to bf16 rounding."""
    from blink.device.numpy_executor import NumpyExecutor
    from blink.gpu.engine.engine import Engine, EngineConfig
    from blink.gpu.engine.fp8_gemm import describe_fp8_modes
    from blink.models.weights import random_bf16, random_weights

    cfg = preset("tiny-llama")
    ecfg = EngineConfig(
        max_seqs=32, max_num_batched_tokens=512, max_context=512, num_kv_blocks=256, block_size=8,
        batch_buckets=(1, 2, 4, 8, 16, 32), token_buckets=(16, 128, 512), progress=False, quantization="fp8",
        fp8_gemm=path,
    )  # fmt: skip
    eng = Engine.create(cfg, ecfg, bf16_tensors=random_bf16(cfg, seed=6))
    eng.capture()
    if path == "auto":
        assert eng.fwd.fp8_path == describe_fp8_modes({"outer", "epilogue"}), eng.fwd.fp8_path  # sm_90: both
    w = {k: fp8.as_device_weight(v) for k, v in random_weights(cfg, seed=6).items()}
    refs = [NumpyExecutor(cfg, w, quantization="fp8", **_KW), NumpyExecutor(cfg, w, **_KW)]
    if path == "dequant":
        refs[0].model.fp8_gemv_max_tokens = None  # weight-only at every size, as the engine on this path
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, 12).tolist() for _ in range(32)]
    drivers = [PagedDriver(256, 8, 64, shuffle_seed=1) for _ in range(3)]
    steps = [[(s, p) for s, p in enumerate(prompts)]]
    steps += [[(s, [int(rng.integers(cfg.vocab_size))]) for s in range(32)] for _ in range(3)]
    steps += [[(s, [int(rng.integers(cfg.vocab_size))]) for s in range(4)] for _ in range(2)]
    errs: list[list[float]] = [[], []]
    for chunks in steps:
        b, *b_refs = (d.step(chunks) for d in drivers)
        eng.step(b)
        mine = eng.logits(b.num_seqs)
        for e, ref, br in zip(errs, refs, b_refs, strict=True):
            e.append(rel(mine, ref.forward_logits(br)))
    print(f"fp8 path {eng.fwd.fp8_path}: rel err vs numpy fp8 {errs[0]}, vs numpy bf16 {errs[1]}")
    assert max(errs[0]) < (2e-2 if path == "dequant" else W8A8_REL_ERR), errs
    assert np.mean(errs[0]) < np.mean(errs[1]), errs
    eng.close()
