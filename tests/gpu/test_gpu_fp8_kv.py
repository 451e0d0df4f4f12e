"""The FP8 KV cache on the GPU (--kv-cache-dtype fp8) against the numpy definition (blink.models.fp8.kv_round):
the RoPE/KV-write kernels' codes, the engine's steps (fa2 prefill, flashq and flashmma decode reading the
fp8 cache) against the numpy model with an fp8 cache, and the _fp8kv attention kernels alone against float64
attention over the decoded codes (blink.models.fp8.e4m3_decode, KV_SCALE)."""

from __future__ import annotations

import numpy as np
import pytest
from fp8_steps import NUMPY_KW, compare, engine_logits

from blink.models import fp8
from blink.models.config import preset

pytestmark = pytest.mark.gpu


def _engine(cfg, tensors, decode_attention: str):
    from blink.gpu.engine.engine import Engine, EngineConfig

    ecfg = EngineConfig(
        max_seqs=4, max_num_batched_tokens=128, max_context=512, num_kv_blocks=64, block_size=8,
        batch_buckets=(1, 2, 4), token_buckets=(16, 128), progress=False, kv_cache_dtype="fp8",
    )  # fmt: skip
    eng = Engine.create(cfg, ecfg, bf16_tensors=tensors)
    eng.fwd.set_decode_attention(decode_attention)  # every decode bucket with this kernel
    eng.capture()
    c = cfg
    assert eng.fwd.kv.dtype.itemsize == 1
    assert eng.fwd.kv.nbytes == c.num_layers * 2 * 64 * 8 * c.kv_size  # one byte a value
    return eng


@pytest.mark.parametrize("decode", ["flashq", "flashmma"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "smollm2-135m"])
def test_fp8_kv_engine_matches_the_numpy_fp8_kv_model(name, decode):
    """Prefill chunks (fa2, rope_kv_write) and decode steps (flashq/flashmma, rope_kv_write_warp), teacher-forced:
    logits against the numpy model with an fp8 cache, closer to it than to the bf16 cache; layer 0's K/V codes
    against the numpy cache rounded by the definition."""
    import cupy as cp

    from blink.device.numpy_executor import NumpyExecutor
    from blink.models.weights import random_bf16, random_weights

    cfg = preset(name)
    if name == "smollm2-135m":
        cfg = cfg.replace(num_layers=4)
    w = {k: fp8.as_device_weight(v) for k, v in random_weights(cfg, seed=5).items()}
    eng = _engine(cfg, random_bf16(cfg, seed=5), decode)
    refs = [NumpyExecutor(cfg, w, kv_cache_dtype="fp8", **NUMPY_KW), NumpyExecutor(cfg, w, **NUMPY_KW)]
    errs = compare(engine_logits(eng), cfg, refs)  # prefill chunks, then decode steps of 1-2 sequences
    print(f"{name} {decode} fp8 KV: rel err vs numpy fp8-KV max {max(errs[0]):.2e}, vs bf16 KV {np.mean(errs[1]):.2e}")
    # e4m3 keeps 3 mantissa bits: a K or V whose bf16 (GPU) and float32 (numpy) values straddle a
    # rounding tie lands one code apart (12.5 % of that value), so the logits of these random models
    # differ by a few percent from the numpy fp8 model (measured on the H200: 4-8 % at most). A wrong
    # scale or layout gives errors near 100 %; the codes themselves are checked below and bit for bit
    # in tests/gpu/test_rope_norm.py.
    assert max(errs[0]) < 0.15, errs
    assert np.mean(errs[0]) < np.mean(errs[1]), errs
    # Layer 0's cache (its K/V depend on the embeddings and one projection only): the GPU's codes against
    # the numpy model's values; they may differ by one e4m3 step where bf16 and float32 K straddle a tie.
    kv = cp.asnumpy(eng.fwd.kv[0])  # (2, blocks, bs, nkv, hd) codes
    for i, ref in enumerate((refs[0].k_cache[0], refs[0].v_cache[0])):
        got = fp8.e4m3_decode(kv[i])
        used = ref != 0
        assert np.array_equal(fp8.kv_round(ref), ref)
        same = float(np.mean(got[used] == ref[used]))
        assert same > 0.9, same
        # one e4m3 step, plus what the GPU's bf16 K/V (before RoPE) and numpy's float32 differ by:
        # ~2^-9 of the vectors' size, more than a step for values near zero (measured on the H200:
        # 0.4 % of the values past one step, all under 0.05 in magnitude, off by at most 0.008)
        diff = np.abs(got[used] - ref[used])
        bound = np.abs(ref[used]) / 8 + 2.0**-9 + float(np.sqrt(np.mean(ref[used] ** 2))) / 64
        bad = np.flatnonzero(diff > bound)
        assert bad.size == 0, (bad.size, list(zip(got[used][bad[:8]], ref[used][bad[:8]], strict=True)))
    eng.close()


# `blink serve --kv-cache-dtype fp8` on both schedulers: tests/gpu/test_fp8_kernels.py test_serve_fp8_on_both_schedulers.


# ---- the _fp8kv attention kernels alone, against float64 attention over the cache's decoded values ----

_BS = 16


def _codes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """e4m3 codes with |value| <= 7.5 (exponent field <= 9: subnormals, zeros of either sign), either sign."""
    return (rng.integers(0, 80, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8)


def _paged(rng: np.random.Generator, lens: list[int], nkv: int, hd: int):
    """A paged fp8 cache holding sequences of `lens` tokens in shuffled blocks (plus unused blocks of
    NaN codes, which a read past a sequence would pick up): codes, block tables, each sequence's decoded
    K and V (float64)."""
    mbps = max(-(-n // _BS) for n in lens)
    nblocks = len(lens) * mbps + 3
    k8, v8 = np.full((2, nblocks, _BS, nkv, hd), 0x7F, np.uint8)
    perm = rng.permutation(nblocks)
    bt = perm[: len(lens) * mbps].reshape(len(lens), mbps).astype(np.int32)
    seqs = []
    for s, n in enumerate(lens):
        kc, vc = _codes(rng, (n, nkv, hd)), _codes(rng, (n, nkv, hd))
        for p in range(n):
            k8[bt[s, p // _BS], p % _BS], v8[bt[s, p // _BS], p % _BS] = kc[p], vc[p]
        dec = [fp8.e4m3_decode(c).astype(np.float64) * float(fp8.KV_SCALE) for c in (kc, vc)]
        seqs.append(dec)
    return k8, v8, bt, seqs


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, last: np.ndarray) -> np.ndarray:
    """float64: queries q (T, nq, hd), the query t sees keys 0..last[t] of k, v (L, nkv, hd)."""
    nq, nkv, hd = q.shape[1], k.shape[1], k.shape[2]
    g = np.repeat(np.arange(nkv), nq // nkv)
    s = np.einsum("thd,lhd->thl", q, k[:, g]) / np.sqrt(hd)
    s = np.where((np.arange(k.shape[0])[None, :] <= last[:, None])[:, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("thl,lhd->thd", p / p.sum(-1, keepdims=True), v[:, g])


def _bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    from blink.models.bf16 import f32_to_bf16_bits

    return f32_to_bf16_bits(rng.standard_normal(shape).astype(np.float32))


@pytest.fixture(scope="module")
def rig():
    from kernel_rig import KernelRig

    return KernelRig()


@pytest.mark.parametrize("variant", ["flashq", "flashmma"])
@pytest.mark.parametrize(("hd", "group"), [(128, 4), (128, 1), (64, 8), (32, 3), (16, 2)])
def test_fp8kv_decode_kernel_matches_float64(rig, variant, hd, group):
    """attn_{flashq,flashmma}_hd*_g*_fp8kv (codes by cp.async, decoded in registers / into f16 tiles), with the
    engine's launch geometry and flashq's combine, on sequences of 1..3000 keys (one split, many splits, partial
    tiles) in shuffled blocks, against float64 attention over the decoded codes (subnormals and both zeros
    among them); and against the bf16 kernel reading the same values from a bf16 cache."""
    import cupy as cp

    from blink.gpu.engine.attention_launch import FLASH_VARIANTS, flash_grid_splits, flash_smem_bytes
    from blink.models.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

    rng = np.random.default_rng(hd * 10 + group)
    nkv, lens = 2, [1, 7, 64, 100, 1000, 3000]
    nq, S = nkv * group, len(lens)
    k8, v8, bt, seqs = _paged(rng, lens, nkv, hd)
    q = _bf16(rng, (S, nq * hd))
    n, minb, _ = FLASH_VARIANTS[variant]
    target = 132 * minb  # the H200's wave (any value gives a valid launch): up to 32 splits of the long sequences
    nsplit = flash_grid_splits(S, nkv, hd, max(lens), target, n, 32)
    assert nsplit > 1
    d = {k: cp.asarray(v) for k, v in dict(q=q, bt=bt, sl=np.array(lens, np.int32)).items()}
    d |= dict(cu=cp.arange(S + 1, dtype=cp.int32), ns=cp.asarray(np.array([S], np.uint32)))
    d |= dict(po=cp.zeros(S * nsplit * nq * hd, cp.float32), plse=cp.zeros(S * nsplit * nq, cp.float32))
    sc = (1.0 / hd**0.5) * 1.4426950408889634
    outs = {}
    bf16_cache = [f32_to_bf16_bits(fp8.e4m3_decode(c) * fp8.KV_SCALE) for c in (k8, v8)]  # NaN codes stay NaN
    for kv, (kc, vc) in {"fp8": (k8, v8), "bf16": bf16_cache}.items():
        sfx = "_fp8kv" if kv == "fp8" else ""
        out = cp.zeros((S, nq * hd), cp.uint16)
        common = dict(po=d["po"], plse=d["plse"], out=out, cu=d["cu"], sl=d["sl"], ns=d["ns"], nkv=nkv, target=target)
        rig.launch(
            f"attn_{variant}_hd{hd}_g{group}{sfx}", (nsplit, nkv, S), (128, 1, 1), smem=flash_smem_bytes(variant, hd),
            q=d["q"], kc=cp.asarray(kc), vc=cp.asarray(vc), bt=d["bt"], bs=_BS, mbps=bt.shape[1], sc=sc, **common,
        )  # fmt: skip
        rig.launch(f"attn_flashq_combine_hd{hd}", (-(-nq // 4), S, 1), (128, 1, 1), nq=nq, grid_splits=nsplit, **common)
        outs[kv] = bf16_bits_to_f32(cp.asnumpy(out)).reshape(S, nq, hd).astype(np.float64)
    qf = bf16_bits_to_f32(q).reshape(S, nq, hd).astype(np.float64)
    for s, (k, v) in enumerate(seqs):
        want = _attention(qf[s : s + 1], k, v, np.array([lens[s] - 1]))[0]
        err = np.abs(outs["fp8"][s] - want)
        # bf16 output rounding (2^-9 of |o| <= 7.5) and f16 probabilities (flashmma)
        assert err.max() < 2e-2, (s, lens[s], float(err.max()))
        assert np.linalg.norm(err) / np.linalg.norm(want) < 4e-3, (s, lens[s])
    diff = np.abs(outs["fp8"] - outs["bf16"])
    print(f"{variant} hd{hd} g{group}: fp8 vs bf16 kernel max |diff| {diff.max():.2e}, equal {np.mean(diff == 0):.3f}")
    assert diff.max() < 2e-2


@pytest.mark.parametrize(("hd", "group"), [(128, 4), (64, 1), (16, 8)])
def test_fp8kv_prefill_kernel_matches_float64(rig, hd, group):
    """attn_prefill_fa2_hd*_fp8kv: packed chunks of 70 and 130 queries after cached prefixes of 5 and 200 keys and
    a fresh 200-token prompt (partial 64-key tiles, causal masks), beside a one-token row the kernel must leave to
    the decode kernel, against float64 causal attention over the decoded codes."""
    import cupy as cp

    from blink.models.bf16 import bf16_bits_to_f32

    rng = np.random.default_rng(hd + group)
    nkv = 2
    nq = nkv * group
    qls, pres = [70, 1, 130, 200], [5, 40, 200, 0]
    lens = [p + n for p, n in zip(pres, qls, strict=True)]
    k8, v8, bt, seqs = _paged(rng, lens, nkv, hd)
    T = sum(qls)
    cu = np.concatenate([[0], np.cumsum(qls)]).astype(np.int32)
    q = _bf16(rng, (T, nq * hd))
    out = cp.full((T, nq * hd), 0x7FC0, cp.uint16)  # NaN: rows the kernel must not write stay NaN
    rig.launch(
        f"attn_prefill_fa2_hd{hd}_fp8kv", (T // 64 + len(qls), nq, 1), (128, 1, 1), smem=5 * 64 * (hd + 8) * 2,
        q=cp.asarray(q), kc=cp.asarray(k8), vc=cp.asarray(v8), out=out, cu=cp.asarray(cu),
        sl=cp.asarray(np.array(lens, np.int32)), bt=cp.asarray(bt), ns=cp.asarray(np.array([len(qls)], np.uint32)),
        nkv=nkv, bs=_BS, mbps=bt.shape[1], sc=(1.0 / hd**0.5) * 1.4426950408889634,
    )  # fmt: skip
    got = bf16_bits_to_f32(cp.asnumpy(out)).reshape(T, nq, hd).astype(np.float64)
    qf = bf16_bits_to_f32(q).reshape(T, nq, hd).astype(np.float64)
    for s, (k, v) in enumerate(seqs):
        rows = slice(cu[s], cu[s + 1])
        if qls[s] == 1:
            assert np.isnan(got[rows]).all()  # the decode kernel's row
            continue
        want = _attention(qf[rows], k, v, pres[s] + np.arange(qls[s]))
        err = np.abs(got[rows] - want)
        assert err.max() < 2e-2, (s, float(err.max()))
        assert np.linalg.norm(err) / np.linalg.norm(want) < 4e-3, s
