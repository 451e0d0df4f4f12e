"""The CUDA sampling kernels against the definition (blink/device/sampling.py) on the rows no request
should be able to break (tests/sampling_cases.py): tiny and NaN temperatures, overflowing logits,
rows masked to -inf, NaN logits. The same token as the numpy device, always inside the vocabulary,
and logprob records that name only tokens of the vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
from sampling_cases import V, cases

from blink.device import sampling

pytestmark = pytest.mark.gpu

SEEDS = 16  # rows per case: one seed each


@pytest.fixture(scope="module")
def sampler():
    import cupy as cp
    from gpu_sampler import GpuSampler  # tests/gpu/gpu_sampler.py

    from blink.gpu.toolchain.cuda_api import Driver
    from blink.gpu.toolchain.kernels import Kernels

    cp.zeros(1)
    drv = Driver()
    return GpuSampler(drv, Kernels(drv), cp.cuda.Stream(non_blocking=True))


def _rows(case):
    n = SEEDS
    return (
        np.broadcast_to(case.logits, (n, V)).copy(),
        np.full(n, case.temperature, np.float32),
        np.full(n, case.top_p, np.float32),
        np.full(n, case.top_k, np.int32),
        np.arange(n, dtype=np.uint64) * np.uint64(7919),
        np.arange(n, dtype=np.uint32) % 3,
    )


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_the_kernel_gives_the_definitions_token(sampler, case):
    logits, t, p, k, seed, ks = _rows(case)
    with np.errstate(all="ignore"):
        want = sampling.sample(logits, t, p, k, seed, ks, np.full(SEEDS, case.min_p, np.float32))
    if case.min_p == 0.0:
        got = sampler.sample(logits, t, p, k, seed, ks)
    else:
        got = _ext(sampler, logits, t, p, k, seed, ks, min_p=np.full(SEEDS, case.min_p, np.float32)).tokens
    assert ((got >= 0) & (got < V)).all(), got
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_extension_rows_stay_in_the_vocabulary(sampler, case):
    """The same rows through the extension kernels (logit_bias masking all but nothing, logprob
    records of 20 alternatives): tokens as the definition, record ids in [0, V)."""
    logits, t, p, k, seed, ks = _rows(case)
    res = _ext(sampler, logits, t, p, k, seed, ks, min_p=np.full(SEEDS, case.min_p, np.float32), logprobs=20)
    with np.errstate(all="ignore"):
        want = sampling.sample(logits, t, p, k, seed, ks, np.full(SEEDS, case.min_p, np.float32))
        _, ids, _ = sampling.logprob_record(case.logits, 0, 20)
    assert res.tokens.tolist() == want.tolist()
    assert ((res.top_ids[:, :20] >= 0) & (res.top_ids[:, :20] < V)).all()
    assert (res.top_ids[:, :20] == ids).all()


def _ext(sampler, logits, t, p, k, seed, ks, *, min_p, logprobs: int = -1):
    S = logits.shape[0]
    return sampler.sample_ext(
        logits, t, p, k, seed, ks,
        min_p=min_p, state=np.zeros((S, V), np.uint32), pen_row=np.full(S, -1, np.int32),
        fresh=np.ones(S, np.int32), input_ids=np.zeros(S, np.int32), cu_q_lens=np.arange(S + 1, dtype=np.int32),
        presence_penalty=np.zeros(S, np.float32), frequency_penalty=np.zeros(S, np.float32),
        repetition_penalty=np.ones(S, np.float32), logit_bias_cu=np.zeros(S + 1, np.int32),
        logit_bias_ids=np.zeros(0, np.int32), logit_bias_vals=np.zeros(0, np.float32),
        logprobs=np.full(S, logprobs, np.int32), emit=np.ones(S, np.int32),
    )  # fmt: skip


def test_a_row_masked_by_logit_bias_samples_the_one_token_left(sampler):
    """Every id biased to -inf-like values except one (the masks a grammar will apply): that id."""
    rng = np.random.default_rng(3)
    S = 4
    logits = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    logits[:, :] = -np.inf
    logits[:, 17] = 0.5
    res = _ext(
        sampler, logits, np.full(S, 0.9, np.float32), np.full(S, 0.5, np.float32), np.full(S, 3, np.int32),
        np.arange(S, dtype=np.uint64), np.zeros(S, np.uint32), min_p=np.full(S, 0.2, np.float32),
    )  # fmt: skip
    assert res.tokens.tolist() == [17] * S
