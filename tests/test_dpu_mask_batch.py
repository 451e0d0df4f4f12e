"""Structured output on the frontend side of the ring: the time a constrained token's next mask takes
is counted (blink/dpu/mask_timing.py) and exported on /metrics."""

from __future__ import annotations

import numpy as np

from blink.dpu.mask_timing import MASK_LATENCY_EDGES_S, MaskLatency, quantile, summary
from blink.dpu.metrics import mask_latency_family


def test_mask_latency_percentiles_come_back_from_the_histogram():
    h = MaskLatency()
    rng = np.random.default_rng(2)
    ns = rng.lognormal(np.log(40e3), 0.6, 5000)  # around 40 us
    for v in ns:
        h.observe(int(v))
    h.observe(int(3e9))  # past the last bucket
    counts = h.snapshot()
    assert len(counts) == len(MASK_LATENCY_EDGES_S) + 1 and sum(counts) == 5001 and counts[-1] == 1
    for q in (0.5, 0.9, 0.99):
        want = np.percentile(ns, 100 * q) * 1e-9
        assert abs(quantile(counts, q) / want - 1) < 0.13, q
    s = summary(counts)
    assert s["masks"] == 5001 and 30 < s["us_p50"] < 50
    assert quantile([0] * len(counts), 0.5) is None and summary([0] * len(counts))["us_p50"] is None
    fam = mask_latency_family(counts)
    buckets = [x for x in fam.samples if x.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 5001
    assert [x.value for x in buckets] == sorted(x.value for x in buckets)  # cumulative
