"""FP8 weights on the GPU against the numpy definition (blink.models.fp8): the quantization kernel and
the dequantization bit for bit (the FP8 GEMV: test_fp8_gemv.py), the engine's steps against
the numpy model with the same FP8 weights, and `blink serve --quantization fp8` on both schedulers."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from checkpoints import write_fp8_hf_dir
from fp8_steps import (
    NUMPY_KW,
    W8A8_REL_ERR,
    check_w8a8,
    check_weight_only_moe,
    compare,
    engine_logits,
    rel,
    with_bf16_experts,
)

from blink.models import fp8
from blink.models.bf16 import f32_to_bf16_bits
from blink.models.config import preset
from blink.models.reference import PagedDriver

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu():
    import cupy as cp

    from blink.gpu.toolchain.cuda_api import Driver
    from blink.gpu.toolchain.kernels import DEFAULT_CACHE, Kernels

    cp.cuda.Device().use()
    cp.zeros(1)
    driver = Driver()
    return driver, Kernels(driver, DEFAULT_CACHE)


def _weights(n: int, k: int, seed: int) -> np.ndarray:
    """bf16 bits of an (n, k) weight with rows of very different magnitudes, a zero row, an outlier."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * np.exp2(rng.integers(-12, 6, (n, 1))).astype(np.float32)
    w[1] = 0.0
    w[2, 7] = 3e4
    return f32_to_bf16_bits(w)


@pytest.mark.parametrize("n,k", [(300, 4096), (96, 576), (7, 14336)])
def test_quantize_kernel_is_the_numpy_definition_bit_for_bit(gpu, n, k):
    import cupy as cp

    from blink.gpu.engine.fp8_weights import Fp8Linear, quantize_rows

    bits = _weights(n, k, n)
    dst = Fp8Linear.empty((n, k))
    quantize_rows(*gpu, 0, cp.asarray(bits), dst)
    cp.cuda.Device().synchronize()
    want = fp8.quantize_bf16(bits)
    np.testing.assert_array_equal(cp.asnumpy(dst.scales), want.scales)
    np.testing.assert_array_equal(cp.asnumpy(dst.codes), want.codes)


def _codes(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    return codes, rng.uniform(1e-4, 1e-2, n).astype(np.float32)


@pytest.mark.parametrize("n,k", [(1000, 4096), (96, 576), (64, 14336)])
def test_dequant_kernel_is_bf16_of_value_times_scale(gpu, n, k):
    import cupy as cp

    driver, kernels = gpu
    codes, scales = _codes(n, k, 1)
    out = cp.zeros((n, k), dtype=cp.uint16)
    args = kernels.args(
        "fp8_dequant_rows", {"codes": cp.asarray(codes), "scales": cp.asarray(scales), "out": out, "N": n, "K": k}
    )
    driver.launch(kernels["fp8_dequant_rows"], (-(-k // 4096), n, 1), (256, 1, 1), args, 0)
    cp.cuda.Device().synchronize()
    want = f32_to_bf16_bits(fp8.e4m3_decode(codes) * scales[:, None])
    np.testing.assert_array_equal(cp.asnumpy(out), want)


def _fp8_engine(cfg, tensors, max_seqs: int = 4, fp8_gemm: str = "auto"):
    from blink.gpu.engine.engine import Engine, EngineConfig

    buckets = tuple(b for b in (1, 2, 4, 8) if b <= max_seqs)
    ecfg = EngineConfig(
        max_seqs=max_seqs, max_num_batched_tokens=128, max_context=512, num_kv_blocks=64, block_size=8,
        batch_buckets=buckets, token_buckets=(16, 128), progress=False, quantization="fp8", fp8_gemm=fp8_gemm,
    )  # fmt: skip
    eng = Engine.create(cfg, ecfg, bf16_tensors=tensors)
    eng.capture()
    assert eng.weights.layers[0].qkv.codes.dtype.itemsize == 1
    return eng


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "smollm2-135m", "tiny-qwen3-moe"])
def test_fp8_engine_matches_the_numpy_fp8_model(name):
    """Quantized on the GPU at load: against the numpy model with the same FP8 weights, and closer
    to it than to the bf16 model (tiny-qwen3-moe: the experts too, on the pair, tile GEMV and
    tensor-core _fp8 kernels; held in the median: fp8_steps.check_w8a8)."""
    from blink.device.numpy_executor import NumpyExecutor
    from blink.models.weights import random_bf16, random_weights

    cfg = preset(name)
    if name == "smollm2-135m":
        cfg = cfg.replace(num_layers=4)
    w = {k: fp8.as_device_weight(v) for k, v in random_weights(cfg, seed=5).items()}
    eng = _fp8_engine(cfg, random_bf16(cfg, seed=5))
    refs = [NumpyExecutor(cfg, w, quantization="fp8", **NUMPY_KW), NumpyExecutor(cfg, w, **NUMPY_KW)]
    errs, errs_bf16 = compare(engine_logits(eng), cfg, refs)
    print(
        f"{name} fp8: rel err vs numpy fp8 max {max(errs):.2e}, median {np.median(errs):.2e} {errs}, "
        f"vs numpy bf16 mean {np.mean(errs_bf16):.2e}"
    )
    check_w8a8(cfg, errs, errs_bf16)
    eng.close()


def test_fp8_moe_engine_weight_only_matches_the_numpy_fp8_model():
    """tiny-qwen3-moe weight-only in every step (fp8_gemm "dequant" past the GEMV; the experts' _fp8
    kernels are W8A16 always) against the weight-only definition: bf16 rounding apart (no activation
    code flips to move the routers), and closer to it than to the model with bf16 experts."""
    from blink.device.numpy_executor import NumpyExecutor
    from blink.models.weights import random_bf16, random_weights

    cfg = preset("tiny-qwen3-moe")
    w = {k: fp8.as_device_weight(v) for k, v in random_weights(cfg, seed=5).items()}
    eng = _fp8_engine(cfg, random_bf16(cfg, seed=5), fp8_gemm="dequant")
    assert eng.fwd.fp8_path == "dequant"
    refs = [NumpyExecutor(cfg, w, quantization="fp8", **NUMPY_KW) for _ in range(2)]
    for ref in refs:
        ref.model.fp8_gemv_max_tokens = None  # weight-only at every size, as the engine on this path
    with_bf16_experts(refs[1], NumpyExecutor(cfg, w, **NUMPY_KW))
    errs, errs_bf16_experts = compare(engine_logits(eng), cfg, refs)
    print(
        f"tiny-qwen3-moe fp8 weight-only: rel err vs numpy fp8 median {np.median(errs):.2e} {errs}, "
        f"vs bf16 experts median {np.median(errs_bf16_experts):.2e}"
    )
    check_weight_only_moe(errs, errs_bf16_experts)
    eng.close()


def test_fp8_engine_decode_of_8_sequences_runs_the_tensor_core_kernel():
    """Decode steps of 8 sequences run the weight-only tensor-core kernel (FP8_MMA_MIN_TOKENS, unfused):
    against the numpy FP8 model (weight-only in those steps too) and closer to it than to the bf16 one."""
    from blink.device.numpy_executor import NumpyExecutor
    from blink.gpu.engine.fp8_weights import FP8_MMA_MIN_TOKENS
    from blink.models.weights import random_bf16, random_weights

    assert FP8_MMA_MIN_TOKENS <= 8 <= fp8.FP8_GEMV_MAX_TOKENS
    cfg = preset("tiny-llama")
    w = {k: fp8.as_device_weight(v) for k, v in random_weights(cfg, seed=6).items()}
    eng = _fp8_engine(cfg, random_bf16(cfg, seed=6), max_seqs=8)
    kw = {**NUMPY_KW, "max_batch": 8}
    refs = [NumpyExecutor(cfg, w, quantization="fp8", **kw), NumpyExecutor(cfg, w, **kw)]
    rng = np.random.default_rng(3)
    drivers = [PagedDriver(64, 8, 64, shuffle_seed=1) for _ in range(3)]
    steps = [[(s, rng.integers(0, cfg.vocab_size, 10).tolist()) for s in range(8)]]
    steps += [[(s, [int(t)]) for s, t in enumerate(rng.integers(0, cfg.vocab_size, 8))] for _ in range(4)]
    errs: list[list[float]] = [[], []]
    for i, chunks in enumerate(steps):
        b, *b_refs = (d.step(chunks) for d in drivers)
        eng.step(b)
        mine = eng.logits(b.num_seqs)
        if i:  # the decode steps
            for e, ref, br in zip(errs, refs, b_refs, strict=True):
                e.append(rel(mine, ref.forward_logits(br)))
        else:
            for ref, br in zip(refs, b_refs, strict=True):
                ref.forward_logits(br)
    print(f"fp8 decode of 8: rel err vs numpy fp8 max {max(errs[0]):.2e}, vs numpy bf16 mean {np.mean(errs[1]):.2e}")
    assert max(errs[0]) < W8A8_REL_ERR, errs
    assert np.mean(errs[0]) < np.mean(errs[1]), errs
    eng.close()


@pytest.mark.parametrize("layout", ["channel", "tensor", "fp8"])
def test_fp8_checkpoint_engine_matches_numpy(tmp_path, layout):
    """An FP8 checkpoint's codes and scales uploaded as stored, against the numpy model on its values."""
    from blink.device.numpy_executor import NumpyExecutor
    from blink.models.hf_weights import hf_dir_bf16, load_hf_dir

    write_fp8_hf_dir(tmp_path, preset("tiny-qwen2"), layout, seed=4)
    cfg, tensors = hf_dir_bf16(tmp_path)
    eng = _fp8_engine(cfg, tensors)
    (errs,) = compare(engine_logits(eng), cfg, [NumpyExecutor(cfg, load_hf_dir(tmp_path)[1], **NUMPY_KW)])
    print(f"fp8 checkpoint ({layout}): rel err vs numpy max {max(errs):.2e}")
    assert max(errs) < W8A8_REL_ERR, errs
    eng.close()


@pytest.mark.parametrize(
    ("flag", "logged"),
    [("--quantization", "blink device: weights: fp8"), ("--kv-cache-dtype", "(fp8 e4m3); capturing graphs")],
    ids=["weights", "kv_cache"],
)
@pytest.mark.parametrize("scheduler", ["gpu", "host"])
def test_serve_fp8_on_both_schedulers(scheduler, flag, logged):
    """`blink serve --quantization fp8` and `--kv-cache-dtype fp8` (tests/gpu/test_gpu_fp8_kv.py) answer."""
    from blink.testing import ServeProcess

    s = ServeProcess(
        ["--model", "random:tiny-llama", "--device", "cuda", "--scheduler", scheduler, "--num-kv-blocks", "256",
         "--max-batch", "8", "--max-context", "512", flag, "fp8"], timeout=600,
    )  # fmt: skip
    try:
        assert logged in "".join(s.log), "".join(s.log)
        outs = []
        for _ in range(2):
            body = {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 16, "temperature": 0}
            req = urllib.request.Request(
                s.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                out = json.load(r)
            assert out["usage"]["completion_tokens"] >= 1
            outs.append(out["choices"][0]["text"])
        assert outs[0] == outs[1]  # greedy: the same text twice
    finally:
        assert s.stop() == 0, "".join(s.log)
