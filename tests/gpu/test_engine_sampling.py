"""The CUDA sampling kernel against blink/device/sampling.py on fixed logits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from blink.device import sampling

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def sampler():
    import cupy as cp

    from blink.gpu.cuda_api import Driver
    from blink.gpu.kernels import Kernels
    from blink.gpu.sampler import GpuSampler

    cp.zeros(1)
    drv = Driver()
    return GpuSampler(drv, Kernels(drv), cp.cuda.Stream(non_blocking=True))


def params(rng: np.random.Generator, rows: int):
    t = rng.choice(np.array([0.0, 0.5, 0.8, 1.0, 1.7], np.float32), rows)
    p = rng.choice(np.array([1.0, 0.95, 0.9, 0.5, 0.1, 0.0], np.float32), rows)
    k = rng.choice(np.array([0, 1, 2, 5, 40, 1000], np.int32), rows)
    seeds = rng.integers(0, 2**63, rows, dtype=np.uint64)
    ks = rng.integers(0, 5000, rows).astype(np.uint32)
    return t, p, k, seeds, ks


@pytest.mark.parametrize("vocab,rows,ties", [(1000, 600, False), (1000, 300, True), (128256, 48, False)])
def test_matches_reference_token_for_token(sampler, vocab, rows, ties):
    rng = np.random.default_rng(vocab + rows)
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    if ties:  # coarse values: many exact ties at the top-k / top-p boundaries and at the argmax
        logits = np.round(logits * 2) / 2
    t, p, k, seeds, ks = params(rng, rows)
    mine = sampler.sample(logits, t, p, k, seeds, ks)
    ref = sampling.sample(logits, t, p, k, seeds, ks)
    bad = np.flatnonzero(mine != ref)
    assert bad.size == 0, [(int(i), float(t[i]), float(p[i]), int(k[i]), int(mine[i]), int(ref[i])) for i in bad[:10]]


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("top_p,top_k,temp", [(0.8, 0, 1.0), (0.95, 10, 0.7), (1.0, 0, 1.3)])
def test_distribution_chi_square(sampler, top_p, top_k, temp):
    rng = np.random.default_rng(7)
    vocab, n = 24, 40000
    row = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    logits = np.broadcast_to(row, (n, vocab))
    toks = sampler.sample(
        logits,
        np.full(n, temp, np.float32),
        np.full(n, top_p, np.float32),
        np.full(n, top_k, np.int32),
        np.full(n, 1234, np.uint64),
        np.arange(n, dtype=np.uint32),
    )
    # expected: the reference's kept set, renormalised
    z = row / np.float32(temp)
    pr = np.exp(z - z.max()).astype(np.float64)
    pr /= pr.sum()
    keep = np.ones(vocab, bool)
    if top_k:
        keep &= pr >= np.sort(pr)[::-1][top_k - 1]
    if top_p < 1:
        s = np.sort(np.where(keep, pr, 0))[::-1]
        c = np.cumsum(s)
        keep &= pr >= s[int(np.searchsorted(c, top_p * c[-1]))]
    expected = np.where(keep, pr, 0) / pr[keep].sum() * n
    counts = np.bincount(toks, minlength=vocab)
    assert counts[~keep].sum() == 0
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    assert stat < _chi2_critical(df), (stat, df)


def test_seeded_sampling_reproducible_and_batch_independent(sampler):
    rng = np.random.default_rng(3)
    rows, vocab = 64, 5000
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 2
    t = np.full(rows, 0.9, np.float32)
    p = np.full(rows, 0.9, np.float32)
    k = np.zeros(rows, np.int32)
    seeds = rng.integers(0, 2**63, rows, dtype=np.uint64)
    ks = rng.integers(0, 100, rows).astype(np.uint32)
    a = sampler.sample(logits, t, p, k, seeds, ks)
    b = sampler.sample(logits, t, p, k, seeds, ks)
    np.testing.assert_array_equal(a, b)
    perm = rng.permutation(rows)  # another batch composition: the same request draws the same token
    c = sampler.sample(logits[perm], t[perm], p[perm], k[perm], seeds[perm], ks[perm])
    np.testing.assert_array_equal(c, a[perm])
    d = sampler.sample(logits, t, p, k, seeds + np.uint64(1), ks)
    assert (d != a).mean() > 0.3  # the seed matters
