"""The reference sampling definition (blink/device/sampling.py): distributions and reproducibility."""

from __future__ import annotations

import numpy as np
import pytest

from blink.device.sampling import sample, sample_row, uniform


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    n = counts.sum()
    exp = probs * n
    stat = float((((counts - exp) ** 2) / exp).sum())
    # 99.9th percentile of chi-square for up to 10 degrees of freedom is < 30
    return stat < 30.0


def test_uniform_is_counter_based_and_uniform():
    u = uniform(np.uint64(123), np.arange(100_000))
    assert np.all((u >= 0) & (u < 1))
    hist, _ = np.histogram(u, bins=10, range=(0, 1))
    assert _chi2_ok(hist, np.full(10, 0.1))
    assert uniform(123, 5) == u[5]
    assert uniform(124, 5) != u[5]


def test_greedy_lowest_index_on_ties():
    logits = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    assert sample_row(logits, 0.0, 1.0, 0, seed=1, k=0) == 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_temperature_distribution(temperature):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=6).astype(np.float32)
    p = np.exp(logits / temperature)
    p /= p.sum()
    counts = np.bincount([sample_row(logits, temperature, 1.0, 0, seed=s, k=3) for s in range(20_000)], minlength=6)
    assert _chi2_ok(counts, p)


def test_top_p_keeps_the_nucleus_only():
    p = np.array([0.05, 0.5, 0.15, 0.3], np.float32)
    logits = np.log(p)
    counts = np.bincount([sample_row(logits, 1.0, 0.8, 0, seed=s, k=0) for s in range(20_000)], minlength=4)
    assert counts[0] == 0 and counts[2] == 0  # 0.5 + 0.3 >= 0.8: the nucleus is {1, 3}
    assert _chi2_ok(counts[[1, 3]], np.array([0.5, 0.3]) / 0.8)


def test_top_k():
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    counts = np.bincount([sample_row(logits, 1.0, 1.0, 2, seed=s, k=0) for s in range(20_000)], minlength=4)
    assert counts[0] == 0 and counts[1] == 0
    assert _chi2_ok(counts[[2, 3]], np.array([3, 4]) / 7)


def test_batch_sampling_matches_rows_and_is_reproducible():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(5, 50)).astype(np.float32)
    t = np.array([0, 1, 0.5, 1, 2], np.float32)
    tp = np.array([1, 0.9, 1, 0.5, 1], np.float32)
    tk = np.array([0, 0, 5, 0, 0], np.int32)
    seeds = np.arange(5, dtype=np.uint64) * 977
    ks = np.array([0, 1, 2, 3, 4], np.uint32)
    a = sample(logits, t, tp, tk, seeds, ks)
    b = sample(logits, t, tp, tk, seeds, ks)
    assert np.array_equal(a, b)
    for r in range(5):
        assert a[r] == sample_row(logits[r], float(t[r]), float(tp[r]), int(tk[r]), int(seeds[r]), int(ks[r]))
    assert a[0] == np.argmax(logits[0])
    other = sample(logits, t, tp, tk, seeds + 1, ks)
    assert not np.array_equal(a[1:], other[1:])
