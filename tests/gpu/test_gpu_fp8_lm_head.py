"""The FP8 LM head (EngineConfig.fp8_lm_head; the definition: blink.models.fp8, FP8_LM_HEAD) on the GPU: its
kernels (the FP8 GEMV's and the tensor-core kernel's fp32 twins, the chunked dequantize + bf16 GEMM past 32
rows, the prompt-logprob head) against the definition's sums, the loader's FP8 head (streamed untied, or an
FP8 copy of a tied embedding) bit for bit, and the engine against the numpy model with the same head."""

from __future__ import annotations

import numpy as np
import pytest
from fp8_steps import NUMPY_KW, compare, engine_logits

from blink.models import fp8
from blink.models.bf16 import bf16_bits_to_f32
from blink.models.config import preset

pytestmark = pytest.mark.gpu


def _engine(cfg, tensors=None, max_seqs: int = 4, head: bool = True, fp8_gemm: str = "auto"):
    from blink.gpu.engine.engine import Engine, EngineConfig

    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 48) if b <= max_seqs)
    ecfg = EngineConfig(
        max_seqs=max_seqs, max_num_batched_tokens=128, max_context=512, num_kv_blocks=64, block_size=8,
        batch_buckets=buckets, token_buckets=(16, 128), progress=False, quantization="fp8", fp8_gemm=fp8_gemm,
        fp8_lm_head=head,
    )  # fmt: skip
    return Engine.create(cfg, ecfg, bf16_tensors=tensors)


def _ref64(codes, scales, x_bits):
    """float64 logits of the definition: scale[n] * sum_k x[t, k] value(code[n, k]), on the GPU."""
    import cupy as cp

    w64 = cp.asarray(fp8.E4M3_VALUES.astype(np.float64))[codes]
    x64 = cp.asarray(bf16_bits_to_f32(cp.asnumpy(x_bits)).astype(np.float64))
    return cp.asnumpy((x64 @ w64.T) * scales.astype(cp.float64))


def _check(got, ref, rel_rms: float, what: str) -> None:
    tol = 1e-6 * np.abs(ref) + rel_rms * np.sqrt(np.mean(ref**2))
    bad = np.abs(got - ref) > tol
    assert not bad.any(), (what, int(bad.sum()), float(np.max(np.abs(got - ref) / (tol + 1e-30))))


@pytest.mark.parametrize("name", ["smollm2-135m", "llama3-8b"])
def test_fp8_head_matches_the_definition_at_every_row_count(name: str):
    """Forward.fp8_head as the engine launches it (S rows of `last`, fp32 logits of the whole vocabulary):
    the f32 GEMV in bucket pieces (1-3 rows), the tensor-core kernel's f32 twin (4-32), the chunked
    dequantize + bf16 GEMM (33 and more: each weight rounded to bf16, 2**-9 relative, so about 1e-3 of
    the logits' rms a logit, 5-6 of those at the extremes of 6 M logits). A wrong scale, row or chunk
    offset is off by the whole logit."""
    import cupy as cp

    from blink.gpu.engine.fp8_weights import Fp8Linear

    cfg = preset(name).replace(num_layers=1)
    eng = _engine(cfg, max_seqs=48)
    head, f = eng.weights.lm_head, eng.fwd
    assert isinstance(head, Fp8Linear) and head.shape == (cfg.vocab_size, cfg.hidden_size)
    rng = cp.random.RandomState(1)
    x = rng.standard_normal((48, cfg.hidden_size), dtype=cp.float32)
    f.last[:48] = (x.view(cp.uint32) >> 16).astype(cp.uint16)
    cp.cuda.Device().synchronize()
    ref_all = _ref64(head.codes, head.scales, f.last[:48])
    for rows in (1, 2, 3, 4, 8, 17, 32, 33, 48):
        f.logits[:] = cp.nan
        cp.cuda.Device().synchronize()  # CuPy's writes (legacy stream) before the engine's stream reads
        f.linear(f.last, head, f.logits, rows, eng.s, out_f32=True)
        eng.stream.synchronize()
        got = cp.asnumpy(f.logits[:rows]).astype(np.float64)
        bound = 1e-5 if rows < 4 else 1e-4 if rows <= 32 else 1.5e-2
        _check(got, ref_all[:rows], bound, f"{name} rows {rows}")
        assert np.isnan(cp.asnumpy(f.logits[rows : rows + 1])).all()  # nothing written past the live rows
    eng.close()


def test_prompt_logprob_head_is_the_definition():
    """plp_lm_head_fp8 (prompt logprobs with an FP8 head): the codes' values summed, times the row's scale."""
    import cupy as cp
    from kernel_rig import KernelRig

    rig = KernelRig()
    V, K, P = 1000, 576, 40
    rng = cp.random.RandomState(2)
    codes = rng.randint(0, 256, (V, K), dtype=cp.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    scales = rng.uniform(1e-4, 1e-2, V).astype(cp.float32)
    hid = (rng.standard_normal((P, K), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    logits = cp.full((P, V), cp.nan, dtype=cp.float32)
    one, count = cp.ones(1, dtype=cp.uint32), cp.full(1, P - 3, dtype=cp.uint32)
    rig.launch(
        "plp_lm_head_fp8", (-(-V // 64), 1, 1), (256, 1, 1), hid=hid, W=codes, scales=scales, logits=logits,
        V=V, K=K, plp_count=count, ext_on=one,
    )  # fmt: skip
    got = cp.asnumpy(logits)
    _check(got[: P - 3].astype(np.float64), _ref64(codes, scales, hid)[: P - 3], 1e-5, "plp")
    assert np.isnan(got[P - 3 :]).all()  # rows past plp_count untouched


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_loader_fp8_head_is_the_definition_bit_for_bit(name: str):
    """Streamed (GpuWeights.from_bf16): an untied head through the staging buffer in pieces of rows (it is
    larger than the largest projection), a tied one quantized from the loaded embedding, which stays bf16."""
    import cupy as cp

    from blink.models.weights import random_bf16

    cfg = preset(name)
    bits = dict(random_bf16(cfg, seed=7))
    src = bits["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    eng = _engine(cfg, list(bits.items()))
    want = fp8.quantize_bf16(src)
    np.testing.assert_array_equal(cp.asnumpy(eng.weights.lm_head.codes), want.codes)
    np.testing.assert_array_equal(cp.asnumpy(eng.weights.lm_head.scales), want.scales)
    np.testing.assert_array_equal(cp.asnumpy(eng.weights.embed), bits["model.embed_tokens.weight"])
    eng.close()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "smollm2-135m"])
def test_fp8_head_engine_matches_the_numpy_model_with_the_fp8_head(name: str):
    """Weight-only in every step (fp8_gemm "dequant"; the numpy model weight-only at every size): the engine
    with the FP8 head against the definition with it (bf16 rounding apart) and closer to it than to the
    same FP8 model with a bf16 head."""
    from blink.device.numpy_executor import NumpyExecutor
    from blink.models.weights import random_bf16, random_weights

    cfg = preset(name)
    if name == "smollm2-135m":
        cfg = cfg.replace(num_layers=4)
    w = {k: fp8.as_device_weight(v) for k, v in random_weights(cfg, seed=5).items()}
    eng = _engine(cfg, random_bf16(cfg, seed=5), fp8_gemm="dequant")
    eng.capture()
    refs = [NumpyExecutor(cfg, w, quantization="fp8", fp8_lm_head=h, **NUMPY_KW) for h in (True, False)]
    for ref in refs:
        ref.model.fp8_gemv_max_tokens = None  # weight-only at every size, as the engine on this path
    errs, errs_bf16_head = compare(engine_logits(eng), cfg, refs)
    print(f"{name} fp8 head: rel err median {np.median(errs):.2e} {errs}, vs bf16 head {np.median(errs_bf16_head):.2e}")
    assert np.median(errs) < 3e-2 and max(errs) < 0.1, errs
    assert np.median(errs) < np.median(errs_bf16_head), (errs, errs_bf16_head)
    eng.close()


def test_f32_twins_are_the_bf16_kernels_before_their_rounding():
    """gemv_fp8_f32_* (every configuration of buckets 1, 2: the pipelined ones too) and gemv_fp8_mma_f32_*
    write the fp32 value that the bf16 kernels round: bf16(f32 output) is their output bit for bit."""
    import cupy as cp
    from kernel_rig import KernelRig

    from blink.gpu.engine.fp8_weights import (
        FP8_GEMV_CONFIGS,
        fp8_gemv_grid,
        fp8_gemv_name,
        fp8_mma_grid,
        fp8_mma_name,
    )
    from blink.models.bf16 import f32_to_bf16_bits

    rig = KernelRig()
    n, k = 1000, 1552  # partial warps, K past whole 512-byte stretches
    rng = cp.random.RandomState(4)
    codes = rng.randint(0, 256, (n, k), dtype=cp.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    scales = rng.uniform(1e-4, 1e-2, n).astype(cp.float32)
    x = (rng.standard_normal((8, k), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    for nt in (1, 2):
        for cfg in FP8_GEMV_CONFIGS[nt]:
            y16, y32 = cp.zeros((nt, n), dtype=cp.uint16), cp.zeros((nt, n), dtype=cp.float32)
            grid = (fp8_gemv_grid(n, nt, "", cfg), 1, 1)
            args = dict(W=codes, scales=scales, X=x, N=n, K=k)
            rig.launch(fp8_gemv_name(nt, "", cfg), grid, (256, 1, 1), Y=y16, **args)
            rig.launch(fp8_gemv_name(nt, "f32", cfg), grid, (256, 1, 1), Y=y32, **args)
            np.testing.assert_array_equal(f32_to_bf16_bits(cp.asnumpy(y32)), cp.asnumpy(y16), err_msg=f"t{nt} {cfg}")
    for tokens in (4, 8, 13):
        y16, y32 = cp.zeros((tokens, n), dtype=cp.uint16), cp.zeros((tokens, n), dtype=cp.float32)
        args = dict(W=codes, scales=scales, X=x if tokens <= 8 else cp.tile(x, (2, 1)), N=n, K=k, T=tokens)
        rig.launch(fp8_mma_name(tokens), (fp8_mma_grid(n), 1, 1), (256, 1, 1), Y=y16, **args)
        rig.launch(fp8_mma_name(tokens, f32=True), (fp8_mma_grid(n), 1, 1), (256, 1, 1), Y=y32, **args)
        np.testing.assert_array_equal(f32_to_bf16_bits(cp.asnumpy(y32)), cp.asnumpy(y16), err_msg=f"mma {tokens}")
