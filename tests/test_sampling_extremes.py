"""The sampling definition on rows no request should be able to break (tests/sampling_cases.py):
every token is in the vocabulary, and where the definition names one (greedy, the overflow
fallback, a masked row) it is that one, for any seed."""

from __future__ import annotations

import numpy as np
import pytest
from sampling_cases import Case, V, cases

from blink.device.numpy_executor import NumpyExecutor
from blink.device.sampling import PenaltyState, greedy_token, logprob_record, process_logits, sample, sample_row
from blink.protocol.sampling_params import SamplingParams


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_an_extreme_row_gives_a_token_of_the_vocabulary(case: Case):
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # no overflow, no NaN on the way
        toks = {
            sample_row(case.logits, case.temperature, case.top_p, case.top_k, seed, k, case.min_p)
            for seed in range(20)
            for k in (0, 7)
        }
    assert all(0 <= t < V for t in toks), toks
    if case.want is not None:
        assert toks == {case.want}
    if (case.logits > -np.inf).any():  # NaN (and -inf) is never chosen over a number
        assert all(case.logits[t] > -np.inf for t in toks)


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_batched_sampling_agrees_with_rows(case: Case):
    rows = np.stack([case.logits] * 3)
    got = sample(
        rows,
        np.full(3, case.temperature, np.float32),
        np.full(3, case.top_p, np.float32),
        np.full(3, case.top_k, np.int32),
        np.arange(3, dtype=np.uint64),
        np.zeros(3, np.uint32),
        np.full(3, case.min_p, np.float32),
    )
    want = [
        sample_row(case.logits, np.float32(case.temperature), case.top_p, case.top_k, s, 0, case.min_p)
        for s in range(3)
    ]
    assert got.tolist() == want


def test_greedy_treats_nan_as_minus_infinity():
    assert greedy_token(np.array([np.nan, -np.inf, -np.inf], np.float32)) == 0
    assert greedy_token(np.array([np.nan, 1.0, 2.0, np.nan], np.float32)) == 2
    assert greedy_token(np.array([-np.inf, np.inf, np.inf], np.float32)) == 1


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_a_logprob_record_names_tokens_of_the_vocabulary(case: Case):
    with np.errstate(all="ignore"):
        _, ids, _ = logprob_record(case.logits, 0, 20)
    assert ids.size == 20 and ids.min() >= 0 and ids.max() < V
    assert np.unique(ids).size == 20


def test_a_tiny_repetition_penalty_that_overflows_the_logits_falls_back_to_greedy():
    """Penalties can push logits to +inf (l / r with r tiny): the row is then greedy, not a crash."""
    logits = np.array([10.0, 5.0, 20.0, -1.0], np.float32)
    st = PenaltyState(4)
    st.mark(np.array([0, 2]))
    with np.errstate(over="ignore"):
        x = process_logits(logits, state=st, repetition_penalty=1e-38)
    assert np.isinf(x[0]) and np.isinf(x[2])
    assert sample_row(x, 1.0, 0.9, 0, 3, 0) == 0  # the first +inf


def test_the_emulated_executor_survives_a_masked_row():
    """A whole vocabulary biased to -100 and one token at +100 through the executor: in range."""
    ex = NumpyExecutor.from_model(
        "random:tiny-llama", num_blocks=8, block_size=16, max_batch=2, max_num_batched_tokens=32
    )
    from blink.device.executor import SamplingExt
    from blink.protocol.step import StepBatch

    vocab = ex.vocab_size
    bias = tuple((i, 100.0 if i == 5 else -100.0) for i in range(vocab))
    x = SamplingExt(
        params=[SamplingParams(repetition_penalty=1e-38, logit_bias=bias, logprobs=5)],
        slots=np.array([0], np.int32),
        fresh=np.array([True]),
        emit=np.array([True]),
        targets=np.full(3, -1, np.int32),
    )
    batch = StepBatch(
        input_ids=[1, 5, 9],
        positions=[0, 1, 2],
        cu_q_lens=[0, 3],
        seq_lens=[3],
        block_tables=np.zeros((1, 2), np.int32),
        temperature=[1e-5],
        top_p=[0.9],
        top_k=[5],
        seed=[1],
        sample_pos=[0],
        ext=x,
    )
    with np.errstate(over="ignore"):
        (tok,) = ex.execute(batch)
    assert 0 <= tok < vocab
    assert (x.logprobs["top_ids"][0, :5] < vocab).all()
