"""Sampling: the reference definition every device implements (numpy here, CUDA in blink/gpu).

For a row of logits and the request's (temperature T, top_k, top_p, seed) and the index k of
the token being sampled (0 for the first generated token):

1. T == 0 (or the GREEDY flag): argmax, lowest index on ties. Done.
2. p = softmax(logits / T) in float32.
3. top_k > 0: keep tokens with p >= the k-th largest p (ties at the boundary kept).
4. top_p < 1: among kept tokens, with mass renormalised, tau is the largest kept probability such
   that the kept mass at or above tau is >= top_p; keep tokens with p >= tau (ties kept).
   Only thresholds are involved, so a GPU finds the set without sorting the vocabulary.
5. u = uniform(seed, k) in [0, 1): splitmix64(seed XOR (k+1)*0x9E3779B97F4A7C15), top 24 bits / 2^24.
6. Walk the kept tokens in vocabulary order, accumulating p; the first token whose running sum
   exceeds u * (kept mass) is the sample (the last kept token if rounding leaves none).

Same logits + same (seed, k) -> same token on any device; the stream is counter-based, so it
does not depend on batching or on which step a request joined.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray | int) -> np.ndarray:
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def uniform(seed: int | np.ndarray, k: int | np.ndarray) -> np.ndarray:
    """The request's uniform draw for token index k, in [0, 1), float64 of a 24-bit value."""
    seed = np.asarray(seed, dtype=np.uint64)
    k = np.asarray(k, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = splitmix64(seed ^ ((k + np.uint64(1)) * _GOLDEN))
    return (x >> np.uint64(40)).astype(np.float64) * (1.0 / (1 << 24))


def sample_row(logits: np.ndarray, temperature: float, top_p: float, top_k: int, seed: int, k: int) -> int:
    logits = np.asarray(logits, dtype=np.float32)
    if temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits / np.float32(temperature)
    z = z - z.max()
    p = np.exp(z, dtype=np.float32)
    p /= p.sum(dtype=np.float32)
    keep = np.ones(p.shape, dtype=bool)
    if 0 < top_k < p.size:
        kth = np.partition(p, p.size - top_k)[p.size - top_k]
        keep &= p >= kth
    if top_p < 1.0:
        kept = np.where(keep, p, np.float32(0))
        s = np.sort(kept)[::-1]
        c = np.cumsum(s, dtype=np.float64)
        i = int(np.searchsorted(c, top_p * c[-1], side="left"))
        tau = s[min(i, s.size - 1)]
        keep &= p >= tau
    q = np.where(keep, p, np.float32(0)).astype(np.float64)
    c = np.cumsum(q)
    u = float(uniform(seed, k))
    j = int(np.searchsorted(c, u * c[-1], side="right"))
    if j >= p.size or not keep[j]:
        j = int(np.flatnonzero(keep)[-1]) if j >= p.size else j
    return j


def sample(
    logits: np.ndarray,
    temperature: np.ndarray,
    top_p: np.ndarray,
    top_k: np.ndarray,
    seeds: np.ndarray,
    ks: np.ndarray,
) -> np.ndarray:
    """Sample one token per row of logits (rows, vocab) -> int32 (rows,)."""
    out = np.empty(logits.shape[0], dtype=np.int32)
    for r in range(logits.shape[0]):
        out[r] = sample_row(logits[r], float(temperature[r]), float(top_p[r]), int(top_k[r]), int(seeds[r]), int(ks[r]))
    return out
