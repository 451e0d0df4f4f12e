"""The GPU benchmarks' synthetic steps (bench/benchutil.py): their layout, and that the float64
reference engine accepts them as steps (the CUDA engine loads them through the same StepBatch)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from benchutil import synthetic_step  # noqa: E402


def test_prefill_step_layout():
    b = synthetic_step(3, 4, 10, 4, 100, np.random.default_rng(0))
    assert (b.num_seqs, b.num_tokens) == (3, 12)
    np.testing.assert_array_equal(b.cu_q_lens, [0, 4, 8, 12])
    np.testing.assert_array_equal(b.positions.reshape(3, 4), np.tile(np.arange(6, 10), (3, 1)))
    np.testing.assert_array_equal(b.seq_lens, [10, 10, 10])
    assert b.block_tables.shape == (3, 3) and len(np.unique(b.block_tables)) == 9  # ceil(10 / 4) each, disjoint
    assert b.input_ids.dtype == np.int32 and b.input_ids.min() >= 0 and b.input_ids.max() < 100
    assert (b.temperature == 0).all() and (b.top_k == 0).all() and (b.top_p == 1).all()


def test_decode_step_layout():
    b = synthetic_step(5, 1, 33, 16, 50, np.random.default_rng(1))
    assert (b.num_seqs, b.num_tokens) == (5, 5)
    assert (b.positions == 32).all() and (b.seq_lens == 33).all()
    np.testing.assert_array_equal(b.block_tables[1], [3, 4, 5])
    with pytest.raises(ValueError):
        synthetic_step(1, 0, 4, 4, 10, np.random.default_rng(0))
    with pytest.raises(ValueError):
        synthetic_step(1, 5, 4, 4, 10, np.random.default_rng(0))


def test_reference_engine_runs_synthetic_steps():
    from blink.device.numpy_executor import NumpyExecutor
    from blink.models.config import preset
    from blink.models.weights import random_weights

    cfg = preset("tiny-llama")
    ex = NumpyExecutor(
        cfg,
        random_weights(cfg, seed=3),
        num_blocks=64,
        block_size=8,
        max_batch=4,
        max_tokens=128,
        max_blocks_per_seq=16,
    )
    rng = np.random.default_rng(2)
    for S, new, ctx in ((4, 20, 20), (4, 1, 21)):  # whole prompts, then one decode token on top of them
        b = synthetic_step(S, new, ctx, 8, cfg.vocab_size, rng)
        lg = ex.forward_logits(b)
        assert lg.shape == (S, cfg.vocab_size) and np.isfinite(lg).all()
