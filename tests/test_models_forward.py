"""Numpy paged forward vs the float64 naive reference on tiny random Llama, Qwen3, Qwen2 and Phi-3 models."""

from __future__ import annotations

import numpy as np
import pytest

from blink.device.numpy_executor import NumpyExecutor
from blink.models.config import preset
from blink.models.reference import PagedDriver, reference_logits
from blink.models.weights import random_weights

BS = 4  # small blocks so every sequence spans several, out of order
NB = 96
WIDTH = 24


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-phi3", "tiny-qwen3-moe"])
def model(request):
    config = preset(request.param)
    return config, random_weights(config, seed=7)


def make_exec(model) -> NumpyExecutor:
    config, weights = model
    return NumpyExecutor(config, weights, num_blocks=NB, block_size=BS, max_batch=8, max_num_batched_tokens=256)


def prompts(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lens]


def test_prefill_matches_reference_all_positions(model):
    config, weights = model
    ex = make_exec(model)
    (ids,) = prompts(config.vocab_size, [37])
    got = ex.forward_logits(PagedDriver(NB, BS, WIDTH).step([(0, ids)]), all_tokens=True)
    want = reference_logits(config, weights, ids)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert rel_err(got, want) < 1e-5
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_shuffled_blocks_equal_contiguous(model):
    config, _ = model
    (ids,) = prompts(config.vocab_size, [29])
    outs = []
    for shuffle in (None, 3):
        ex = make_exec(model)
        drv = PagedDriver(NB, BS, WIDTH, shuffle_seed=shuffle)
        b = drv.step([(0, ids)])
        logits = [ex.forward_logits(b, all_tokens=True)]
        for t in range(5):
            logits.append(ex.forward_logits(drv.step([(0, [10 + t])])))
        if shuffle is not None:
            assert drv.tables[0] != sorted(drv.tables[0])
        outs.append(np.concatenate(logits))
    # Same arithmetic in the same order: the block permutation must not change a single bit.
    assert np.array_equal(outs[0], outs[1])


def test_packed_varlen_prefill_equals_each_alone(model):
    config, _ = model
    seqs = prompts(config.vocab_size, [13, 1, 30, 7], seed=1)
    ex = make_exec(model)
    packed = ex.forward_logits(PagedDriver(NB, BS, WIDTH).step(list(enumerate(seqs))))
    assert packed.shape == (4, config.vocab_size)
    for i, ids in enumerate(seqs):
        alone = make_exec(model).forward_logits(PagedDriver(NB, BS, WIDTH, shuffle_seed=i + 10).step([(0, ids)]))
        assert rel_err(packed[i : i + 1], alone) < 1e-5


def test_prefill_then_decode_equals_long_prefill(model):
    config, weights = model
    (ids,) = prompts(config.vocab_size, [24], seed=2)
    ex = make_exec(model)
    drv = PagedDriver(NB, BS, WIDTH)
    got = [ex.forward_logits(drv.step([(0, ids[:9])]))]
    for t in ids[9:]:
        got.append(ex.forward_logits(drv.step([(0, [t])])))
    want = reference_logits(config, weights, ids)[8:]
    assert rel_err(np.concatenate(got), want) < 1e-5
    one_shot = make_exec(model).forward_logits(PagedDriver(NB, BS, WIDTH).step([(0, ids)]), all_tokens=True)[8:]
    assert rel_err(np.concatenate(got), one_shot) < 1e-5


def test_mixed_step_chunked_prefill_and_decode_rows(model):
    """One step holding decode rows of two sequences and the second chunk of a third prompt."""
    config, weights = model
    a, b, c = prompts(config.vocab_size, [11, 6, 21], seed=3)
    ex = make_exec(model)
    drv = PagedDriver(NB, BS, WIDTH, shuffle_seed=5)
    ex.forward_logits(drv.step([(0, a[:-1]), (1, b[:-1]), (2, c[:8])]))
    got = ex.forward_logits(drv.step([(0, a[-1:]), (2, c[8:]), (1, b[-1:])]))
    for row, ids in zip(range(3), (a, c, b), strict=True):
        want = reference_logits(config, weights, ids)[-1:]
        assert rel_err(got[row : row + 1], want) < 1e-5


def test_batched_decode_of_different_lengths(model):
    config, weights = model
    seqs = prompts(config.vocab_size, [3, 17, 9, 26, 1], seed=4)
    ex = make_exec(model)
    drv = PagedDriver(NB, BS, WIDTH, shuffle_seed=6)
    ex.forward_logits(drv.step([(i, s[:-1]) for i, s in enumerate(seqs) if len(s) > 1]))
    got = ex.forward_logits(drv.step([(i, s[-1:]) for i, s in enumerate(seqs)]))
    for i, ids in enumerate(seqs):
        assert rel_err(got[i : i + 1], reference_logits(config, weights, ids)[-1:]) < 1e-5


def test_qk_norm_and_rope_scaling_matter(model):
    """Guard against the reference and the engine agreeing by both ignoring a feature."""
    config, weights = model
    (ids,) = prompts(config.vocab_size, [40], seed=5)
    base = reference_logits(config, weights, ids)
    if config.qk_norm or config.attn_bias:
        w2 = dict(weights)
        for k in w2:
            if k.endswith(("q_norm.weight", "k_proj.bias", "v_proj.bias")):
                w2[k] = w2[k] * 2.0
        other = make_exec((config, w2)).forward_logits(PagedDriver(NB, BS, WIDTH).step([(0, ids)]), all_tokens=True)
    elif config.arch == "phi3":  # plain RoPE: its theta (250000) must reach the engine
        c2 = config.replace(rope_theta=10000.0)
        other = make_exec((c2, weights)).forward_logits(PagedDriver(NB, BS, WIDTH).step([(0, ids)]), all_tokens=True)
    else:
        assert config.rope_scaling.type == "llama3"
        c2 = config.replace(rope_scaling=type(config.rope_scaling)())
        other = make_exec((c2, weights)).forward_logits(PagedDriver(NB, BS, WIDTH).step([(0, ids)]), all_tokens=True)
    assert rel_err(other, base) > 1e-3


def test_moe_routing_matters():
    """MoE: top-k, its renormalisation and the expert weights each change the logits, in the engine and the
    reference alike (neither ignores them); the dense layer of mlp_only_layers is dense."""
    config = preset("tiny-qwen3-moe")
    weights = random_weights(config, seed=7)
    assert [config.layer_is_moe(i) for i in range(config.num_layers)] == [True, False, True]
    (ids,) = prompts(config.vocab_size, [24], seed=4)
    base = reference_logits(config, weights, ids)
    w2 = dict(weights)
    w2["model.layers.2.mlp.experts.5.down_proj.weight"] = 2 * w2["model.layers.2.mlp.experts.5.down_proj.weight"]
    for c2, w in [
        (config.replace(num_experts_per_tok=3), weights),
        (config.replace(norm_topk_prob=False), weights),
        (config, w2),
    ]:
        ours = make_exec((c2, w)).forward_logits(PagedDriver(NB, BS, WIDTH).step([(0, ids)]), all_tokens=True)
        ref = reference_logits(c2, w, ids)
        assert rel_err(ours, ref) < 1e-5 and rel_err(ref, base) > 1e-3


def test_random_weights_keep_logits_in_a_sane_range(model):
    """Random presets must give O(1) logits so greedy/sampling tests are not decided by noise."""
    config, weights = model
    (ids,) = prompts(config.vocab_size, [32], seed=9)
    logits = reference_logits(config, weights, ids)
    assert 0.3 < float(logits.std()) < 5.0
    assert len(set(logits.argmax(-1).tolist())) > 8  # not collapsed onto one token
