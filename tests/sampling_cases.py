"""Rows of logits no sampler may be driven out of the vocabulary by, with the token the definition
(blink/device/sampling.py) gives for each: the cases the numpy device (tests/test_sampling_extremes.py)
and the CUDA kernel (tests/gpu/test_gpu_sampling_extremes.py) are both held to."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

V = 64
INF, NAN = np.float32(np.inf), np.float32(np.nan)


class Case(NamedTuple):
    name: str
    logits: np.ndarray  # (V,) float32
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    want: int | None = None  # the definition's token when it does not depend on the seed


def _normal(seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(V) * scale).astype(np.float32)


def _with(base: np.ndarray, **at: float) -> np.ndarray:
    x = base.copy()
    for k, v in at.items():
        x[int(k.removeprefix("i"))] = v
    return x


_n = _normal()
_top = int(np.argmax(_n))
_masked = np.full(V, -INF, np.float32)


def cases() -> list[Case]:
    return [
        # a temperature below SAMPLING_EPS is greedy, whatever top_p / top_k / min_p
        Case("tiny_temperature_top_p", _n, 1e-40, top_p=0.9, want=_top),
        Case("tiny_temperature_top_k", _n, 1e-40, top_k=5, want=_top),
        Case("tiny_temperature_min_p", _n, 1e-40, min_p=0.1, want=_top),
        Case("nan_temperature", _n, float("nan"), top_p=0.9, want=_top),
        # z = logits / T overflows: the greedy argmax of the logits
        Case("overflow_at_eps", _n * np.float32(1e34), 1e-5, top_p=0.9, want=_top),
        Case("huge_logits", _with(_n, i7=3e38, i9=-3e38), 0.5, top_k=5, want=7),
        Case("plus_inf", _with(_n, i5=INF), 1.0, top_p=0.9, want=5),
        Case("two_plus_inf", _with(_n, i5=INF, i3=INF), 1.0, want=3),
        # every token masked (-inf after logit_bias / penalties / masks): 0
        Case("all_minus_inf", _masked, 1.0, top_p=0.9, want=0),
        Case("all_minus_inf_greedy", _masked, 0.0, want=0),
        Case("all_nan", np.full(V, NAN, np.float32), 0.8, top_k=5, want=0),
        Case("all_nan_greedy", np.full(V, NAN, np.float32), 0.0, want=0),
        Case("nan_then_minus_inf", _with(_masked, i0=NAN), 1.0, want=0),
        Case("nan_and_minus_inf_greedy", _with(_masked, i0=NAN, i1=NAN), 0.0, want=0),
        # one token left: it is the sample whatever the draw
        Case("one_finite", _with(_masked, i11=-5.0), 1.0, top_p=0.5, top_k=3, want=11),
        Case("one_finite_among_nan", _with(np.full(V, NAN, np.float32), i13=2.0), 1.3, want=13),
        # NaN is -inf: never sampled, never the argmax
        Case("nan_greedy", _with(_n, **{f"i{_top}": NAN}), 0.0, want=int(np.argmax(_with(_n, **{f"i{_top}": -INF})))),
        Case("nan_sampled", _with(_n, i1=NAN, i2=NAN), 0.7, top_p=0.95),
        # extreme but valid thresholds
        Case("tiny_top_p", _n, 1.0, top_p=1e-30, want=_top),
        Case("min_p_one", _n, 1.0, min_p=1.0, want=_top),
        Case("top_k_one", _n, 2.0, top_k=1, want=_top),
        Case("huge_temperature", _n, 1e30, top_k=5),
        Case("subnormal_logits", _normal(1, 1e-39), 1e-5, top_p=0.5),
        Case("large_spread", _normal(2, 1e4), 1e-5, top_k=5, want=int(np.argmax(_normal(2, 1e4)))),
    ]
