"""How long a constrained request's next mask takes the frontend: from the start of the token reader's
cycle that read its token to the post of the mask that token decides (blink/dpu/token_reader.py). The
device samples a constrained row only once that mask is published (blink/protocol/layout.py, the mask
arena), so this latency is what a constrained stream adds to the device's step; header.mask_late_rows
counts the steps it made a row sit out.

A fixed histogram: MASK_LATENCY_EDGES_S, ten buckets a decade from 1 us to 1 s (each 26 % wider than
the one before), plus one for longer; /metrics exports it as `blink_mask_latency_seconds`, and
`quantile` reads percentiles back from the counts (bench/serving/structured.py does, from a scrape).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

PER_DECADE = 10
MASK_LATENCY_EDGES_S: tuple[float, ...] = tuple(
    round(10.0 ** (e / PER_DECADE), 12) for e in range(-6 * PER_DECADE, 1)
)  # upper bounds (seconds); one more bucket above the last


class MaskLatency:
    """Counts of masks posted per latency bucket and the latencies' sum (monotonic; a scrape takes
    differences)."""

    def __init__(self) -> None:
        self._edges_ns = np.array([e * 1e9 for e in MASK_LATENCY_EDGES_S])
        self.counts = np.zeros(len(MASK_LATENCY_EDGES_S) + 1, np.int64)
        self.sum_ns = 0

    def observe(self, ns: int, n: int = 1) -> None:
        """n masks posted `ns` nanoseconds after the start of the cycle that read their tokens."""
        self.counts[int(np.searchsorted(self._edges_ns, ns))] += n
        self.sum_ns += n * int(ns)

    def snapshot(self) -> list[int]:
        """The counts per bucket, then the sum in nanoseconds: one list of counts that replicas add
        element by element (blink/actors/router.py)."""
        return [*self.counts.tolist(), self.sum_ns]


def quantile(counts: Sequence[int], q: float) -> float | None:
    """The q-quantile (0..1, seconds) of a MaskLatency histogram, interpolated geometrically within its
    bucket (a bucket spans a ratio of 1.26: the answer is within 13 % of the true one); None when
    empty. The open bucket above 1 s answers its lower bound."""
    total = int(sum(counts))
    if total == 0:
        return None
    edges = MASK_LATENCY_EDGES_S
    rank = q * total
    seen = 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            if i >= len(edges):
                return edges[-1]
            lo = edges[i - 1] if i else edges[0] / 10 ** (1 / PER_DECADE)
            frac = (rank - seen) / c
            return lo * math.exp(frac * math.log(edges[i] / lo))
        seen += c
    return edges[-1]


def summary(counts: Sequence[int]) -> dict:
    """masks counted and p50 / p90 / p99 in microseconds (None when no mask was posted)."""

    def us(q: float) -> float | None:
        v = quantile(counts, q)
        return None if v is None else round(v * 1e6, 1)

    return {"masks": int(sum(counts)), "us_p50": us(0.5), "us_p90": us(0.9), "us_p99": us(0.99)}
