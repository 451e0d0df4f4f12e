"""The weight-only FP8 kernels of decode steps (fp8.cu) against the numpy definition (blink.models.fp8) at
every projection shape of Llama-3-8B and Qwen3-32B: the GEMV at T = 1..8 tokens (the engine's bucket
pieces), the tensor-core kernel at up to 32; the GEMV's configurations against each other bit for bit, and
its fusions against the unfused kernels bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_rig import KernelRig

from blink.models import fp8
from blink.models.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from blink.models.config import preset

pytestmark = pytest.mark.gpu

ROLES = ("qkv", "o", "gate_up", "down")


def _shapes() -> list[tuple[int, int]]:
    from bench.common import gemm_roles

    out = []
    for name in ("llama3-8b", "qwen3-32b"):
        roles = gemm_roles(preset(name))
        out += [roles[r] for r in ROLES]
    return out


@pytest.fixture(scope="module")
def rig() -> KernelRig:
    return KernelRig()


def _operands(n: int, k: int, tmax: int, seed: int):
    """Random finite e4m3 codes of both signs (n, k), scales, and bf16 activations (tmax, k), on the GPU."""
    import cupy as cp

    rng = cp.random.RandomState(seed)
    codes = rng.randint(0, 256, (n, k), dtype=cp.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    scales = rng.uniform(1e-4, 1e-2, n).astype(cp.float32)
    x = rng.standard_normal((tmax, k), dtype=cp.float32)
    x_bits = (x.view(cp.uint32) >> 16).astype(cp.uint16)  # bf16 by truncation: any bf16 values do
    return codes, scales, x_bits


def _gemv(rig: KernelRig, codes, scales, x, rows: int, kind: str = "", config=None, smem: int = 0, **extra):
    """Y (rows, n) bf16 bits: the plain GEMV over `rows` rows in the engine's bucket pieces, or one fused
    kernel (rows = its bucket; extra: its other arguments, Y given there for the resid kernel)."""
    import cupy as cp

    from blink.gpu.engine.fp8_weights import fp8_gemv_grid, fp8_gemv_name, fp8_gemv_pieces

    n, k = codes.shape
    if kind:
        name = fp8_gemv_name(rows, kind, config)
        if smem:  # the pipelined kernels' static ring counts against the default 48 KB: always raise it
            rig.drv.set_max_dynamic_smem(rig.k[name], smem)
        y = extra.pop("Y", None)
        if y is None:
            y = cp.zeros((rows, n // 2 if kind.endswith("swiglu") else n), dtype=cp.uint16)
        grid = (fp8_gemv_grid(n, rows, kind, config), 1, 1)
        rig.launch(name, grid, (256, 1, 1), smem, W=codes, scales=scales, X=x, Y=y, N=n, K=k, **extra)
        return y
    y = cp.zeros((rows, n), dtype=cp.uint16)
    for r0, nt in fp8_gemv_pieces(rows):
        rig.launch(
            fp8_gemv_name(nt, "", config), (fp8_gemv_grid(n, nt, "", config), 1, 1), (256, 1, 1),
            W=codes, scales=scales, X=x[r0:], Y=y[r0:], N=n, K=k,
        )  # fmt: skip
    return y


def _mma(rig: KernelRig, codes, scales, x, tokens: int, mt: int):
    """Y (tokens, n) bf16 bits of the tensor-core kernel with MT = mt."""
    import cupy as cp

    from blink.gpu.engine.fp8_weights import fp8_mma_grid, fp8_mma_name

    n, k = codes.shape
    y = cp.zeros((tokens, n), dtype=cp.uint16)
    rig.launch(
        fp8_mma_name(tokens, mt), (fp8_mma_grid(n, mt), 1, 1), (256, 1, 1),
        W=codes, scales=scales, X=x, Y=y, N=n, K=k, T=tokens,
    )  # fmt: skip
    return y


MMA_TOKENS = (1, 2, 3, 5, 8, 12, 16, 24, 32)


@pytest.mark.parametrize("n,k", [*_shapes(), (96, 576), (5, 1552)])
def test_fp8_kernels_match_the_definition_at_every_shape_and_token_count(rig, n, k):
    """y = bf16(scale * sum x e4m3(code)) against float64 sums of the definition's values (its decode table,
    on the GPU: the largest weight is 262 M codes): off by y's bf16 rounding (2**-8 relative with the sum's
    own error) and fp32 summation, nothing more. The GEMV at T = 1..8 as the engine launches it (6 = 4 + 2);
    the tensor-core kernel at up to 32 tokens in every compiled MT (its fp32 sums in another order: a looser
    share of the output's rms; a wrong layout is off by the whole output)."""
    import cupy as cp

    from blink.gpu.engine.fp8_weights import FP8_MMA_COMPILED

    codes, scales, x = _operands(n, k, 32, n + k)
    table = cp.asarray(fp8.E4M3_VALUES.astype(np.float64))
    w64 = table[codes]
    x64 = cp.asarray(bf16_bits_to_f32(cp.asnumpy(x)).astype(np.float64))
    ref_all = cp.asnumpy((x64 @ w64.T) * scales.astype(cp.float64))
    del w64

    def check(y, rows: int, rel_rms: float, what: str) -> None:
        got = bf16_bits_to_f32(cp.asnumpy(y)).astype(np.float64)
        ref = ref_all[:rows]
        tol = 2.0**-8 * np.abs(ref) + rel_rms * np.sqrt(np.mean(ref**2))
        bad = np.abs(got - ref) > tol
        assert not bad.any(), (what, rows, int(bad.sum()), float(np.max(np.abs(got - ref) / (tol + 1e-30))))

    for rows in range(1, 9):
        check(_gemv(rig, codes, scales, x, rows), rows, 1e-5, "gemv")
    for tokens in MMA_TOKENS:
        nt8 = next(t for t in sorted(FP8_MMA_COMPILED) if 8 * t >= tokens)
        for mt in FP8_MMA_COMPILED[nt8]:
            check(_mma(rig, codes, scales, x, tokens, mt), tokens, 1e-4, f"mma m{mt}")


@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 14336), (96, 576), (5, 1552)])
def test_every_configuration_gives_the_same_bits(rig, n, k):
    """Every compiled (R, U) of a bucket sums in the same order: the same bits as the engine's, for row
    counts that leave partial warps (n = 5, 1000) and K past whole 512-byte stretches (576, 1552)."""
    import cupy as cp

    from blink.gpu.engine.fp8_weights import FP8_GEMV_CONFIGS

    codes, scales, x = _operands(n, k, 8, 3)
    for nt, configs in FP8_GEMV_CONFIGS.items():
        want = cp.asnumpy(_gemv(rig, codes, scales, x, nt))
        for c in configs:
            got = cp.asnumpy(_gemv(rig, codes, scales, x, nt, config=c))
            np.testing.assert_array_equal(got, want, err_msg=f"t{nt} {c}")


@pytest.mark.parametrize("nt", [1, 2, 4, 8])
def test_fused_kernels_are_the_unfused_kernels_bit_for_bit(rig, nt):
    """gemv_fp8_{resid,norm,swiglu,norm_swiglu}: the residual add, add_rmsnorm's normalisation and
    swiglu of the unfused path, with the same bits, in every compiled configuration (rope: the engine
    tests, which run the fused decode step)."""
    import cupy as cp

    from blink.gpu.engine.fp8_weights import FP8_GEMV_CONFIGS

    H, inter = 4096, 1536
    codes, scales, x = _operands(2 * inter, H, nt, 11)
    nw = (cp.random.RandomState(1).uniform(0.5, 1.5, H).astype(cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    ntok = cp.asarray([nt], dtype=cp.uint32)
    normed = cp.zeros_like(x)  # add_rmsnorm without a delta: rmsnorm(x) * nw
    rig.launch("add_rmsnorm", (nt, 1, 1), (256, 1, 1), residual=x.copy(), delta=None, w=nw, out=normed,
               num_tokens=ntok, H=H, eps=1e-5)  # fmt: skip
    plain = _gemv(rig, codes, scales, normed, nt)
    act = cp.zeros((nt, inter), dtype=cp.uint16)
    rig.launch("swiglu", (-(-inter // 2048), nt, 1), (256, 1, 1), gu=plain, out=act, num_tokens=ntok, I=inter)
    plain_x = _gemv(rig, codes, scales, x, nt)
    act_x = cp.zeros((nt, inter), dtype=cp.uint16)
    rig.launch("swiglu", (-(-inter // 2048), nt, 1), (256, 1, 1), gu=plain_x, out=act_x, num_tokens=ntok, I=inter)
    resid0 = f32_to_bf16_bits(np.random.default_rng(nt).standard_normal((nt, 2 * inter)).astype(np.float32))
    smem = nt * H * 2
    for c in FP8_GEMV_CONFIGS[nt]:
        norm = _gemv(rig, codes, scales, x, nt, "norm", c, smem, nw=nw, eps=1e-5)
        np.testing.assert_array_equal(cp.asnumpy(norm), cp.asnumpy(plain), err_msg=f"norm {c}")
        ns = _gemv(rig, codes, scales, x, nt, "norm_swiglu", c, smem, nw=nw, eps=1e-5)
        np.testing.assert_array_equal(cp.asnumpy(ns), cp.asnumpy(act), err_msg=f"norm_swiglu {c}")
        sw = _gemv(rig, codes, scales, x, nt, "swiglu", c, nw=None, eps=0.0)
        np.testing.assert_array_equal(cp.asnumpy(sw), cp.asnumpy(act_x), err_msg=f"swiglu {c}")
        y = cp.asarray(resid0).copy()
        _gemv(rig, codes, scales, x, nt, "resid", c, nw=None, eps=0.0, Y=y)
        want = f32_to_bf16_bits(bf16_bits_to_f32(resid0) + bf16_bits_to_f32(cp.asnumpy(plain_x)))
        np.testing.assert_array_equal(cp.asnumpy(y), want, err_msg=f"resid {c}")


def test_tensor_core_kernel_keeps_the_subnormal_codes(rig):
    """Codes 0x01-0x07 (2**-9 .. 7 * 2**-9, e4m3's subnormals) pass the kernel's conversion as subnormal bf16
    times 2**120: a weight of nothing but those gives the definition's sums (a flush to zero gives 0)."""
    import cupy as cp

    n, k = 64, 1024
    rng = np.random.default_rng(5)
    codes = rng.integers(1, 8, (n, k), dtype=np.uint8) | (rng.integers(0, 2, (n, k), dtype=np.uint8) << 7)
    x = f32_to_bf16_bits(rng.standard_normal((8, k)).astype(np.float32))
    scales = np.ones(n, np.float32)
    ref = bf16_bits_to_f32(x).astype(np.float64) @ fp8.e4m3_decode(codes).T.astype(np.float64)
    got = bf16_bits_to_f32(cp.asnumpy(_mma(rig, cp.asarray(codes), cp.asarray(scales), cp.asarray(x), 8, 1)))
    np.testing.assert_allclose(got, ref, rtol=2.0**-8, atol=1e-3 * np.sqrt(np.mean(ref**2)))
