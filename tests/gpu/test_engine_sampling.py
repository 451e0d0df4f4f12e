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
    from gpu_sampler import GpuSampler  # tests/gpu/gpu_sampler.py

    from blink.gpu.toolchain.cuda_api import Driver
    from blink.gpu.toolchain.kernels import Kernels

    cp.zeros(1)
    drv = Driver()
    return GpuSampler(drv, Kernels(drv), cp.cuda.Stream(non_blocking=True))


def params(rng: np.random.Generator, rows: int):
    t = rng.choice(np.array([0.0, 0.5, 0.8, 1.0, 1.7], np.float32), rows)
    p = rng.choice(np.array([1.0, 0.95, 0.9, 0.5, 0.1, 0.0], np.float32), rows)
    k = rng.choice(np.array([0, 1, 2, 5, 40, 1000], np.int32), rows)
    seed = rng.integers(0, 2**63, rows, dtype=np.uint64)
    ks = rng.integers(0, 5000, rows).astype(np.uint32)
    return t, p, k, seed, ks


@pytest.mark.parametrize("vocab,rows,ties", [(1000, 600, False), (1000, 300, True), (128256, 48, False)])
def test_matches_reference_token_for_token(sampler, vocab, rows, ties):
    rng = np.random.default_rng(vocab + rows)
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    if ties:  # coarse values: many exact ties at the top-k / top-p boundaries and at the argmax
        logits = np.round(logits * 2) / 2
    t, p, k, seed, ks = params(rng, rows)
    mine = sampler.sample(logits, t, p, k, seed, ks)
    ref = sampling.sample(logits, t, p, k, seed, ks)
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
    seed = rng.integers(0, 2**63, rows, dtype=np.uint64)
    ks = rng.integers(0, 100, rows).astype(np.uint32)
    a = sampler.sample(logits, t, p, k, seed, ks)
    b = sampler.sample(logits, t, p, k, seed, ks)
    np.testing.assert_array_equal(a, b)
    perm = rng.permutation(rows)  # another batch composition: the same request draws the same token
    c = sampler.sample(logits[perm], t[perm], p[perm], k[perm], seed[perm], ks[perm])
    np.testing.assert_array_equal(c, a[perm])
    d = sampler.sample(logits, t, p, k, seed + np.uint64(1), ks)
    assert (d != a).mean() > 0.3  # the seed matters


# -- the sampling extensions: CUDA (sampling.cu) vs the emulated device's definition vs torch ---------------
def _ext_case(rng: np.random.Generator, rows: int, vocab: int):
    """Random rows of everything the extensions take, and a penalty-state table of (rows, vocab)."""
    t, p, k, seed, ks = params(rng, rows)
    min_p = rng.choice(np.array([0.0, 0.0, 0.05, 0.3], np.float32), rows)
    pen_row = np.where(rng.random(rows) < 0.7, np.arange(rows), -1).astype(np.int32)
    fresh = (rng.random(rows) < 0.3).astype(np.int32)
    state = np.zeros((rows, vocab), np.uint32)
    for r in range(rows):  # an earlier history: seen ids, some with output counts
        ids = rng.integers(0, vocab, 40)
        state[r, ids] = sampling_seen_word(rng.integers(0, 4, 40))
    lens = rng.integers(1, 12, rows)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    input_ids = rng.integers(0, vocab, int(cu[-1])).astype(np.int32)
    presence_penalty = rng.choice(np.array([0.0, 0.5, -1.0, 2.0], np.float32), rows)
    frequency_penalty = rng.choice(np.array([0.0, 0.3, 1.5, -0.5], np.float32), rows)
    repetition_penalty = rng.choice(np.array([1.0, 1.3, 0.7, 2.0], np.float32), rows)
    nb = np.where(pen_row >= 0, rng.integers(0, 5, rows), 0)
    logit_bias_cu = np.concatenate([[0], np.cumsum(nb)]).astype(np.int32)
    logit_bias_ids = np.concatenate([rng.choice(vocab, n, replace=False) for n in nb]).astype(np.int32)
    logit_bias_vals = rng.uniform(-100, 100, int(logit_bias_cu[-1])).astype(np.float32)
    logprobs = rng.choice(np.array([-1, 0, 1, 5, 20], np.int32), rows)
    emit = (rng.random(rows) < 0.8).astype(np.int32)
    return dict(
        temperature=t, top_p=p, top_k=k, seed=seed, ks=ks, min_p=min_p, state=state, pen_row=pen_row,
        fresh=fresh, input_ids=input_ids, cu_q_lens=cu, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, logit_bias_cu=logit_bias_cu,
        logit_bias_ids=logit_bias_ids, logit_bias_vals=logit_bias_vals, logprobs=logprobs, emit=emit,
    )  # fmt: skip


def sampling_seen_word(counts: np.ndarray) -> np.ndarray:
    return np.uint32(0x80000000) | counts.astype(np.uint32)


def _reference(logits: np.ndarray, c: dict):
    """The emulated device's definition (blink.device.sampling), row by row."""
    rows, vocab = logits.shape
    toks = np.zeros(rows, np.int32)
    state = c["state"].copy()
    processed = {}
    records = {}
    for s in range(rows):
        st = None
        if c["pen_row"][s] >= 0:
            st = sampling.PenaltyState(vocab)
            if not c["fresh"][s]:
                w = state[s]
                st.seen[:] = (w & np.uint32(0x80000000)) != 0
                st.counts[:] = (w & np.uint32(0x7FFFFFFF)).astype(np.int32)
            st.mark(c["input_ids"][c["cu_q_lens"][s] : c["cu_q_lens"][s + 1]])
        b0, b1 = c["logit_bias_cu"][s], c["logit_bias_cu"][s + 1]
        x = sampling.process_logits(
            logits[s], c["logit_bias_ids"][b0:b1], c["logit_bias_vals"][b0:b1], st,
            float(c["presence_penalty"][s]), float(c["frequency_penalty"][s]), float(c["repetition_penalty"][s]),
        )  # fmt: skip
        toks[s] = sampling.sample_row(
            x, float(c["temperature"][s]), float(c["top_p"][s]), int(c["top_k"][s]), int(c["seed"][s]),
            int(c["ks"][s]), float(c["min_p"][s]),
        )  # fmt: skip
        if st is not None:
            processed[s] = x
            if c["emit"][s]:
                st.add(int(toks[s]))
            state[s] = np.where(st.seen, np.uint32(0x80000000), np.uint32(0)) | st.counts.astype(np.uint32)
        if c["logprobs"][s] >= 0:
            records[s] = sampling.logprob_record(logits[s], int(toks[s]), int(c["logprobs"][s]))
    return toks, processed, records, state


@pytest.mark.parametrize("vocab,rows", [(1000, 200), (49152, 24), (128256, 8)])
def test_extensions_match_the_definition_token_for_token(sampler, vocab, rows):
    rng = np.random.default_rng(vocab + 7 * rows)
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    c = _ext_case(rng, rows, vocab)
    got = sampler.sample_ext(logits, **c)
    toks, processed, records, state = _reference(logits, c)
    for s, x in processed.items():  # logit_bias and penalties: the same float operations, bit for bit
        np.testing.assert_array_equal(got.processed[s], x, err_msg=f"row {s}")
    bad = np.flatnonzero(got.tokens != toks)
    assert bad.size == 0, [(int(i), int(got.tokens[i]), int(toks[i]), float(c["min_p"][i])) for i in bad[:10]]
    for s, (lp, ids, lps) in records.items():
        n = ids.size
        np.testing.assert_array_equal(got.top_ids[s, :n], ids, err_msg=f"row {s}")
        np.testing.assert_allclose(got.top_logprobs[s, :n], lps, atol=2e-5, err_msg=f"row {s}")
        if c["emit"][s]:
            assert got.chosen_logprob[s] == pytest.approx(lp, abs=2e-5)
    rows_kept = c["pen_row"] >= 0
    np.testing.assert_array_equal(got.state[rows_kept], state[rows_kept])  # counts and seen bits, on the device


def test_extensions_match_torch(sampler):
    """Both the kernels and the emulated device against torch on the same logits (vLLM V1's order:
    raw log_softmax for logprobs; logit_bias, repetition_penalty on prompt|output, frequency_penalty and
    presence_penalty)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    rows, vocab = 32, 4096
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    c = _ext_case(rng, rows, vocab)
    c["logprobs"][:] = 20
    got = sampler.sample_ext(logits, **c)
    _, processed, _, _ = _reference(logits, c)
    lsm = torch.log_softmax(torch.tensor(logits), -1)
    vals, ids = torch.topk(lsm, 20, -1)
    np.testing.assert_array_equal(got.top_ids, ids.numpy())
    np.testing.assert_allclose(got.top_logprobs, vals.numpy(), atol=2e-5)
    for s in processed:
        x = torch.tensor(logits[s])
        b0, b1 = c["logit_bias_cu"][s], c["logit_bias_cu"][s + 1]
        x[torch.tensor(c["logit_bias_ids"][b0:b1], dtype=torch.long)] += torch.tensor(c["logit_bias_vals"][b0:b1])
        w = c["state"][s] if not c["fresh"][s] else np.zeros(vocab, np.uint32)
        seen = torch.tensor((w & np.uint32(0x80000000)) != 0)
        seen[torch.tensor(c["input_ids"][c["cu_q_lens"][s] : c["cu_q_lens"][s + 1]], dtype=torch.long)] = True
        counts = torch.tensor((w & np.uint32(0x7FFFFFFF)).astype(np.float32))
        r = float(c["repetition_penalty"][s])
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - float(c["frequency_penalty"][s]) * counts - float(c["presence_penalty"][s]) * (counts > 0).float()
        np.testing.assert_allclose(got.processed[s], x.numpy(), rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(processed[s], x.numpy(), rtol=1e-6, atol=1e-5)
