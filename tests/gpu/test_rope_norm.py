"""rope_kv_write and add_rmsnorm (blink/gpu/engine/csrc/model_kernels.cu) against numpy references of
the same rounding sequence, bit for bit: odd token counts in larger graph buckets (rows past the
live count stay untouched), several sequences (one of them empty) with shuffled block tables, head
dims 16 to 128, with and without q/k-norm; rows that take the register path and rows that loop.

The references round where the kernels round (every bf16 tensor op of transformers) and sum the
squares of an RMSNorm in the kernels' order (per-lane partials, then warp_sum's butterfly; block_sum
across warps). rsqrtf is the GPU's (MUFU.RSQ, which numpy cannot reproduce), evaluated by CuPy on
the reference's own fp32 argument."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from kernel_rig import KernelRig

from blink.gpu.engine.weights import bf16_bits_to_f32, f32_to_bf16_bits
from blink.models import fp8

pytestmark = pytest.mark.gpu

f32 = bf16_bits_to_f32


def _rbf(a: np.ndarray) -> np.ndarray:
    return f32(f32_to_bf16_bits(np.asarray(a, np.float32)))


@functools.cache
def _rsqrtf():
    import cupy as cp

    return cp.ElementwiseKernel("float32 x", "float32 y", "y = rsqrtf(x)", "blink_ref_rsqrtf")


def _gpu_rsqrt(x: np.ndarray) -> np.ndarray:
    import cupy as cp

    return cp.asnumpy(_rsqrtf()(cp.asarray(np.ascontiguousarray(x, np.float32))))


def _butterfly(v: np.ndarray) -> np.ndarray:
    """warp_sum over the last axis (32 lanes): v += shfl_xor(v, o) for o = 16 .. 1; lane 0's value."""
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        v = (v + v[..., lanes ^ o]).astype(np.float32)
    return v[..., 0]


def _lane_partials(x: np.ndarray, lanes: int) -> np.ndarray:
    """[..., n] -> [..., lanes]: lane l's running fp32 sum of x[l]^2, x[l + lanes]^2, ... in order."""
    out = np.zeros((*x.shape[:-1], lanes), np.float32)
    for j in range(0, x.shape[-1], lanes):
        c = x[..., j : j + lanes]
        out[..., : c.shape[-1]] = (out[..., : c.shape[-1]] + c * c).astype(np.float32)
    return out


def ref_rmsnorm_rs(x: np.ndarray, eps: float, threads: int = 256) -> np.ndarray:
    """add_rmsnorm's 1/rms of each row of x [T, H] (bf16 values): thread i sums the squares of its
    8-value vectors i, i + threads, ... (values in order), warp_sum per warp, then warp_sum over the
    warps' sums (block_sum)."""
    T, H = x.shape
    vec = x.reshape(T, H // 8, 8)
    part = np.zeros((T, threads), np.float32)
    for v0 in range(0, H // 8, threads):
        blk = vec[:, v0 : v0 + threads]
        for i in range(8):
            part[:, : blk.shape[1]] = (part[:, : blk.shape[1]] + blk[:, :, i] * blk[:, :, i]).astype(np.float32)
    warps = _butterfly(part.reshape(T, threads // 32, 32))
    tot = _butterfly(np.concatenate([warps, np.zeros((T, 32 - threads // 32), np.float32)], axis=1))
    return _gpu_rsqrt((tot / np.float32(H)).astype(np.float32) + np.float32(eps))


def ref_add_rmsnorm(resid: np.ndarray, delta: np.ndarray | None, w: np.ndarray, eps: float):
    """(new residual, normed output) as bf16 bits, for resid/delta [T, H] and w [H] bf16 bits."""
    x = f32(resid) if delta is None else _rbf(f32(resid) + f32(delta))
    rs = ref_rmsnorm_rs(x, eps)
    return f32_to_bf16_bits(x), f32_to_bf16_bits(f32(w)[None] * _rbf(x * rs[:, None]))


def ref_rope(qkv, pos, cu, bt, cos, sin, nq, nkv, hd, bs, qn, kn, eps, q_out, kc, vc) -> None:
    """rope_kv_write on the live tokens of qkv [T, nh * hd] (bf16 bits), into q_out [*, nq * hd] and
    the caches kc / vc [blocks, bs, nkv, hd] (bits, updated in place)."""
    T, nh, half = qkv.shape[0], nq + 2 * nkv, hd // 2
    x = f32(qkv).reshape(T, nh, hd)
    seq = np.searchsorted(cu, np.arange(T), side="right") - 1  # the largest s with cu[s] <= t
    slot = bt[seq, pos // bs] * bs + pos % bs
    qk = x[:, : nq + nkv].copy()
    for lo, hi, nw in ((0, nq, qn), (nq, nq + nkv, kn)):
        if nw is None:
            continue
        h = qk[:, lo:hi]
        rs = _gpu_rsqrt((_butterfly(_lane_partials(h, 32)) / np.float32(hd)).astype(np.float32) + np.float32(eps))
        qk[:, lo:hi] = _rbf(f32(nw)[None, None] * _rbf(h * rs[:, :, None]))
    a, b = qk[..., :half], qk[..., half:]
    c, s = _rbf(cos[pos])[:, None], _rbf(sin[pos])[:, None]
    out = np.concatenate([_rbf(a * c) + _rbf(-b * s), _rbf(b * c) + _rbf(a * s)], axis=-1)
    bits = f32_to_bf16_bits(out)
    q_out[:T] = bits[:, :nq].reshape(T, nq * hd)
    kc.reshape(-1, nkv, hd)[slot] = bits[:, nq:]
    vc.reshape(-1, nkv, hd)[slot] = qkv.reshape(T, nh, hd)[:, nq + nkv :]


@pytest.fixture(scope="module")
def rig() -> KernelRig:
    return KernelRig()


def _bits(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return f32_to_bf16_bits((rng.standard_normal(shape) * scale).astype(np.float32))


def _steps(rng: np.random.Generator, T: int, bs: int):
    """A packed step of T tokens: sequences of random query lengths (the second one empty), each
    continuing a random cached prefix, with shuffled block tables."""
    lens = [1, 0]
    while sum(lens) < T:
        lens.append(int(min(T - sum(lens), rng.integers(1, max(2, T // 3)))))
    ctx = rng.integers(0, 200, len(lens))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pos = np.concatenate([c + np.arange(n) for c, n in zip(ctx, lens, strict=True)]).astype(np.int32)
    mbps = int((ctx.max() + T) // bs + 1)
    nblocks = len(lens) * mbps
    bt = rng.permutation(nblocks).astype(np.int32).reshape(len(lens), mbps)
    return cu, pos, bt, mbps, nblocks


@pytest.mark.parametrize(
    "nq,nkv,hd,qk_norm",
    [(32, 8, 128, False), (32, 8, 128, True), (40, 10, 128, False), (9, 3, 64, False), (8, 2, 64, True),
     (6, 2, 32, True), (4, 2, 16, False)],
    ids=["llama3", "qwen3", "phi4", "smollm2", "hd64-qknorm", "tiny-qwen3", "tiny-llama"],
)  # fmt: skip
@pytest.mark.parametrize("T,bucket", [(1, 1), (7, 8), (133, 160), (1001, 1024)])
@pytest.mark.parametrize("sms", [132, 1], ids=["sms132", "sms1"])  # small blocks for small T, and 256 threads
@pytest.mark.parametrize("kernel", ["rope_kv_write", "rope_kv_write_warp"])  # forward.rope_kernel picks by T
@pytest.mark.parametrize("kv", ["bf16", "fp8"])  # fp8: the _fp8kv kernels, codes = e4m3 of the bf16 values
def test_rope_kv_write_bitwise(rig, nq, nkv, hd, qk_norm, T, bucket, sms, kernel, kv):
    import cupy as cp

    from blink.gpu.engine.forward import rope_launch

    rng = np.random.default_rng(hd * 1000 + T + nq)
    nh, bs, eps = nq + 2 * nkv, 16, 1e-6
    cu, pos, bt, mbps, nblocks = _steps(rng, T, bs)
    max_pos = int(pos.max()) + 1
    qkv = _bits(rng, (bucket, nh * hd), 2.0)
    norm_w = lambda: f32_to_bf16_bits((1 + rng.standard_normal(hd) * 0.3).astype(np.float32))  # noqa: E731
    qn, kn = (norm_w(), norm_w()) if qk_norm else (None, None)
    inv = 1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd))
    ang = np.arange(max_pos, dtype=np.float32)[:, None] * inv.astype(np.float32)[None]
    cos, sin = np.cos(ang.astype(np.float64)).astype(np.float32), np.sin(ang.astype(np.float64)).astype(np.float32)
    q0 = _bits(rng, (bucket, nq * hd))
    kc0, vc0 = _bits(rng, (nblocks, bs, nkv, hd)), _bits(rng, (nblocks, bs, nkv, hd))
    if kv == "fp8":  # the cache in codes; the reference writes bf16 into NaN-filled caches, then encodes
        kc0, vc0 = (rng.integers(0, 256, (nblocks, bs, nkv, hd)).astype(np.uint8) for _ in range(2))
    d = {k: cp.asarray(v) for k, v in dict(qkv=qkv, q=q0, kc=kc0, vc=vc0, cos=cos, sin=sin, bt=bt).items()}
    pos_b = np.zeros(bucket, np.int32)
    pos_b[:T] = pos
    cu_b = np.full(max(bucket + 1, len(cu)), T, np.int32)  # the step buffers are bucket-sized; past num_seqs: stale
    cu_b[: len(cu)] = cu
    grid, block = (
        rope_launch(nh, hd, bucket, sms) if kernel == "rope_kv_write" else ((bucket, -(-nh // 8), 1), (256, 1, 1))
    )
    if kernel == "rope_kv_write_warp" and sms == 1:
        pytest.skip("rope_kv_write_warp's geometry does not depend on the SM count")
    rig.launch(
        kernel + ("_fp8kv" if kv == "fp8" else ""), grid, block, qkv=d["qkv"], q_out=d["q"], k_cache=d["kc"], v_cache=d["vc"],
        q_norm_w=None if qn is None else cp.asarray(qn), k_norm_w=None if kn is None else cp.asarray(kn),
        cos_tab=d["cos"], sin_tab=d["sin"], positions=cp.asarray(pos_b), cu_q_lens=cp.asarray(cu_b),
        block_tables=d["bt"], num_tokens=cp.asarray(np.array([T], np.uint32)),
        num_seqs=cp.asarray(np.array([len(cu) - 1], np.uint32)), nq=nq, nkv=nkv, hd=hd, bs=bs, mbps=mbps, eps=eps,
    )  # fmt: skip
    q, kc, vc = q0.copy(), kc0.copy(), vc0.copy()
    if kv == "fp8":
        kc, vc = np.full(kc0.shape, 0x7FC0, np.uint16), np.full(vc0.shape, 0x7FC0, np.uint16)
    ref_rope(qkv[:T], pos, cu[:-1], bt, cos, sin, nq, nkv, hd, bs, qn, kn, eps, q, kc, vc)
    if kv == "fp8":
        kc, vc = (np.where(c != 0x7FC0, fp8.e4m3_encode(bf16_bits_to_f32(c)), c0) for c, c0 in ((kc, kc0), (vc, vc0)))
    for name, want in (("q_out", q), ("k_cache", kc), ("v_cache", vc)):
        got = cp.asnumpy(d[{"q_out": "q", "k_cache": "kc", "v_cache": "vc"}[name]])
        bad = np.argwhere(got != want)
        print(f"{kernel} {name} T={T}/{bucket} grid={grid} block={block}: {len(bad)} differ, first {bad[:3]}")
        assert not len(bad), name


@pytest.mark.parametrize("H", [4096, 5120, 3584, 576, 64, 8192])  # vectors a thread: 2, 3, 2, 1, 1, loop
@pytest.mark.parametrize("T,bucket", [(1, 1), (7, 8), (133, 160)])
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("kernel", ["add_rmsnorm", "add_rmsnorm_rows"])  # forward.norm_kernel picks by T
def test_add_rmsnorm_bitwise(rig, H, T, bucket, with_delta, kernel):
    import cupy as cp

    rng = np.random.default_rng(H + T)
    eps = 1e-5
    r0, d0, out0 = _bits(rng, (bucket, H), 3.0), _bits(rng, (bucket, H)), _bits(rng, (bucket, H))
    w = f32_to_bf16_bits((1 + rng.standard_normal(H) * 0.2).astype(np.float32))
    r, out = cp.asarray(r0), cp.asarray(out0)
    rig.launch(
        kernel, (bucket, 1, 1), (256, 1, 1), residual=r, delta=cp.asarray(d0) if with_delta else None,
        w=cp.asarray(w), out=out, num_tokens=cp.asarray(np.array([T], np.uint32)), H=H, eps=eps,
    )  # fmt: skip
    want_r, want_o = ref_add_rmsnorm(r0[:T], d0[:T] if with_delta else None, w, eps)
    want_r, want_o = np.concatenate([want_r, r0[T:]]), np.concatenate([want_o, out0[T:]])
    for name, got, want in (("residual", cp.asnumpy(r), want_r), ("out", cp.asnumpy(out), want_o)):
        bad = np.argwhere(got != want)
        print(f"{kernel} {name} H={H} T={T}/{bucket} delta={with_delta}: {len(bad)} differ, first {bad[:3]}")
        assert not len(bad), name
