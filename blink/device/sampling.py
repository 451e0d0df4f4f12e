"""Sampling: the reference definition every device implements (numpy here, CUDA in blink/gpu).

For a row of fp32 logits, the request's parameters (blink.protocol.sampling_params, whose ranges
the device has checked at admission) and the index k of the token being sampled (0 for the first
generated token), in vLLM V1's order. A NaN logit counts as -inf everywhere below, so every row,
whatever its values, gives a token id in [0, vocab).

0. Logprobs (when asked): of the raw logits, before logit_bias, penalties and temperature (vLLM's
   default `--logprobs-mode raw_logprobs`): lp = logits - max - log(sum exp(logits - max)), the sum
   in float64. The record holds lp[token] and the n alternatives with the largest logits, the lower
   id first on ties (a row without a finite maximum has NaN logprobs, and still valid ids).
1. logit_bias: logits[id] += bias for each entry.
2. Penalties, from the sequence's state: `seen` (ids in the prompt or the output) and `counts`
   (occurrences in the output). Repetition r != 1, for seen ids: l > 0 ? l / r : l * r. Then
   l -= frequency_penalty * count + presence_penalty * (count > 0).
   The token mask (structured output) belongs here: the tokens the request's bitmask forbids become
   -inf (apply_token_mask; logprobs stay those of the raw logits), and steps 3-9 need nothing more
   (a row that forbids every token falls back as below).
3. Greedy (T < SAMPLING_EPS in float32, or T NaN): argmax, lowest index on ties. Done. A row of -inf
   (every token masked) gives 0.
4. z = logits / T. When max z is not finite (+inf: a logit overflowed after the penalties or the
   division; -inf: every token masked), the row falls back to step 3's argmax of the logits. Else
   p = exp(z - max z) / sum in float32: finite, and the largest p is 1 / sum > 0.
5. min_p > 0: keep tokens with p >= min_p * max(p).
6. top_k > 0: keep tokens with p >= the k-th largest p (ties at the boundary kept).
7. top_p < 1: among kept tokens, with mass renormalised, tau is the largest kept probability such
   that the kept mass at or above tau is >= top_p; keep tokens with p >= tau (ties kept).
   Only thresholds are involved, so a GPU finds the set without sorting the vocabulary. The most
   likely token passes every threshold, so the kept mass is > 0.
8. u = uniform(seed, k) in [0, 1): splitmix64(seed XOR (k+1)*0x9E3779B97F4A7C15), top 24 bits / 2^24.
9. Walk the kept tokens in vocabulary order, accumulating p; the first token whose running sum
   exceeds u * (kept mass) is the sample (the last kept token if rounding leaves none).
10. The sampled token updates the state: counts[token] += 1, seen[token] = True. A prefill chunk
   sets `seen` for its tokens (a recompute re-marks generated tokens: they are seen already).

Same logits + same (seed, k) -> same token on any device; the stream is counter-based, so it
does not depend on batching or on which step a request joined.
"""

from __future__ import annotations

import numpy as np

from blink.protocol.sampling_params import SAMPLING_EPS

_EPS32 = np.float32(SAMPLING_EPS)
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


class PenaltyState:
    """A sequence's token history as the penalties see it (step 2; updated as in step 10)."""

    __slots__ = ("seen", "counts")

    def __init__(self, vocab_size: int) -> None:
        self.seen = np.zeros(vocab_size, bool)
        self.counts = np.zeros(vocab_size, np.int32)

    def mark(self, ids: np.ndarray) -> None:
        self.seen[ids] = True

    def add(self, token: int) -> None:
        self.counts[token] += 1
        self.seen[token] = True


def _nan_low(x: np.ndarray) -> np.ndarray:
    """x with NaN replaced by -inf (a copy only when there is a NaN)."""
    return np.where(np.isnan(x), np.float32(-np.inf), x) if np.isnan(x).any() else x


def logprobs(logits: np.ndarray) -> np.ndarray:
    """Step 0: log-softmax of a row of raw logits (float32, the normaliser summed in float64)."""
    z = _nan_low(np.asarray(logits, np.float32))
    with np.errstate(invalid="ignore", over="ignore"):
        z = z - z.max()
        lse = np.float32(np.log(np.exp(z, dtype=np.float32).sum(dtype=np.float64)))
        return z - lse


def logprob_record(logits: np.ndarray, token: int, n: int) -> tuple[float, np.ndarray, np.ndarray]:
    """Step 0's record of a row of raw logits: (lp[token], the n ids with the largest logits (the
    lower id first on ties), their lp)."""
    x = _nan_low(np.asarray(logits, np.float32))
    lp = logprobs(x)
    top = np.lexsort((np.arange(x.size), -x))[:n].astype(np.int32)
    return float(lp[token]), top, lp[top]


def process_logits(
    logits: np.ndarray,
    logit_bias_ids: np.ndarray | None = None,
    logit_bias_vals: np.ndarray | None = None,
    state: PenaltyState | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
) -> np.ndarray:
    """Steps 1 and 2: a float32 copy of the logits with logit_bias and the penalties applied."""
    x = np.array(logits, dtype=np.float32)
    if logit_bias_ids is not None and len(logit_bias_ids):
        np.add.at(x, np.asarray(logit_bias_ids, np.int64), np.asarray(logit_bias_vals, np.float32))
    if state is not None:
        r = np.float32(repetition_penalty)
        if r != 1 and r > 0:
            m = state.seen
            x[m] = np.where(x[m] > 0, x[m] / r, x[m] * r)
        if frequency_penalty or presence_penalty:
            c = state.counts
            f, p = np.float32(frequency_penalty), np.float32(presence_penalty)
            x -= f * c.astype(np.float32) + p * (c > 0).astype(np.float32)
    return x


def greedy_token(logits: np.ndarray) -> int:
    """Step 3: argmax, NaN as -inf, lowest index on ties (0 for a row without a number above -inf)."""
    return int(np.argmax(_nan_low(np.asarray(logits, np.float32))))


def apply_token_mask(logits: np.ndarray, mask: np.ndarray) -> None:
    """Step 2b in place: -inf where bit t % 32 of mask word t // 32 is clear (uint32 words; tokens
    past the mask are not allowed)."""
    bits = np.unpackbits(np.ascontiguousarray(mask, "<u4").view(np.uint8), bitorder="little").astype(bool)
    allowed = np.zeros(logits.shape[0], bool)
    n = min(bits.size, allowed.size)
    allowed[:n] = bits[:n]
    logits[~allowed] = -np.inf


def sample_row(
    logits: np.ndarray, temperature: float, top_p: float, top_k: int, seed: int, k: int, min_p: float = 0.0
) -> int:
    """Steps 3-9 on logits that already went through process_logits."""
    x = _nan_low(np.asarray(logits, dtype=np.float32))
    if not np.float32(temperature) >= _EPS32:  # compared in float32, as the ring and the kernel hold it
        return greedy_token(x)
    with np.errstate(over="ignore", invalid="ignore"):
        z = x / np.float32(temperature)
    m = z.max()
    if not np.isfinite(m):
        return greedy_token(x)
    p = np.exp(z - m, dtype=np.float32)
    p /= p.sum(dtype=np.float32)
    keep = np.ones(p.shape, dtype=bool)
    if min_p > 0.0:
        keep &= p >= np.float32(min_p) * p.max()
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
    return j if j < p.size else int(np.flatnonzero(keep)[-1])


def sample(
    logits: np.ndarray,
    temperature: np.ndarray,
    top_p: np.ndarray,
    top_k: np.ndarray,
    seed: np.ndarray,
    ks: np.ndarray,
    min_p: np.ndarray | None = None,
) -> np.ndarray:
    """Sample one token per row of (processed) logits (rows, vocab) -> int32 (rows,)."""
    out = np.empty(logits.shape[0], dtype=np.int32)
    for r in range(logits.shape[0]):
        mp = 0.0 if min_p is None else float(min_p[r])
        out[r] = sample_row(
            logits[r], float(temperature[r]), float(top_p[r]), int(top_k[r]), int(seed[r]), int(ks[r]), mp
        )
    return out
