"""The CUDA MoE layer's host-side contract, without a GPU: the worst-case sizing of the permutation
(blink/gpu/engine/moe_launch.py), its numpy reference against the numpy engine's MoE, and the expert
weights' layout (blink/gpu/engine/weights.py)."""

from __future__ import annotations

import numpy as np
import pytest

from blink.gpu.engine.moe_launch import BIG_TILE_M, TILE_M, MoeLaunches, align_reference, check_moe, max_tiles
from blink.gpu.engine.weights import GpuWeights, LayerWeights
from blink.models.config import preset
from blink.models.llama_numpy import LlamaNumpy, _swiglu
from blink.models.weights import random_weights


def _assignments(rng: np.random.Generator, T: int, k: int, E: int):
    """Routings a step can produce: uniform, all tokens on the same k experts, one token per expert
    group, and every expert hit once (T*k == E)."""
    yield np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    yield np.tile(np.arange(k), (T, 1))
    yield (np.arange(T)[:, None] * k + np.arange(k)[None, :]) % E


@pytest.mark.parametrize("tm", [TILE_M, BIG_TILE_M])
@pytest.mark.parametrize("T", [1, 2, 3, 8, 16, 17, 64, 256, 1000])
@pytest.mark.parametrize("k,E", [(8, 128), (2, 8), (1, 4), (4, 16)])
def test_tiles_never_exceed_the_bound(T: int, k: int, E: int, tm: int):
    rng = np.random.default_rng(T * 31 + E)
    cfg = preset("qwen3-30b-a3b").replace(num_experts=E, num_experts_per_tok=k)
    for ids in _assignments(rng, T, k, E):
        ref = align_reference(ids, E, tm)
        tiles = int(ref["off"][-1]) // tm
        assert tiles <= max_tiles(T, k, E, tm), (T, k, E, tiles)
        assert ref["off"][-1] <= MoeLaunches.rows(cfg, T)  # the buffers' rows


def test_bound_is_reached():
    """The bound is tight: T*k pairs on distinct experts (decode at batch 1: k tiles, k grid rows)."""
    assert max_tiles(1, 8, 128) == 8
    ids = np.arange(8)[None, :]
    assert int(align_reference(ids, 128)["off"][-1]) // TILE_M == 8
    E, k = 128, 8
    T = E * (TILE_M - 1) // k  # every expert with TILE_M - 1 ... at most one tile each
    assert max_tiles(4096, k, E) == (4096 * k + E * (TILE_M - 1)) // TILE_M and max_tiles(T, k, E) <= T * k


def test_align_reference_is_a_padded_permutation():
    rng = np.random.default_rng(0)
    T, k, E = 37, 8, 128
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    ref = align_reference(ids, E)
    off, cnt, sp, pos = ref["off"], ref["cnt"], ref["sorted_pair"], ref["pair_pos"]
    assert (np.diff(off) % TILE_M == 0).all() and (np.diff(off) >= cnt).all() and (np.diff(off) < cnt + TILE_M).all()
    for e in range(E):
        seg = sp[off[e] : off[e + 1]]
        assert sorted(seg[: cnt[e]].tolist()) == np.flatnonzero(ids.ravel() == e).tolist()
        assert (seg[cnt[e] :] == -1).all()  # padding rows: neither computed nor read
    assert (sp[pos] == np.arange(T * k)).all()


@pytest.mark.parametrize("norm", [True, False])
def test_permuted_data_flow_matches_the_numpy_moe(norm: bool):
    """The kernels' data flow in numpy: gather rows by sorted_pair // k, each expert tile through
    swiglu and down, combine each token's k slots in slot order by pair_pos. Equal to LlamaNumpy's
    MoE (which groups by expert with argsort) on the tiny preset's layer 0."""
    cfg = preset("tiny-qwen3-moe").replace(norm_topk_prob=norm)
    eng = LlamaNumpy(cfg, random_weights(cfg, seed=3))
    L = eng.layers[0]
    h = np.random.default_rng(1).standard_normal((23, cfg.hidden_size)).astype(np.float32)
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    logits = h @ L.w_router.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]  # descending, ties to the lower index (moe_route)
    w = np.take_along_axis(p, ids, 1)
    if norm:
        w = w / w.sum(-1, keepdims=True)
    ref = align_reference(ids, E)
    y = np.zeros((int(ref["off"][-1]), cfg.hidden_size), np.float32)
    for tile in range(int(ref["off"][-1]) // TILE_M):
        row0 = tile * TILE_M
        e = int(np.searchsorted(ref["off"], row0, side="right") - 1)  # expert_of_row
        nr = min(TILE_M, int(ref["off"][e] + ref["cnt"][e]) - row0)
        if nr <= 0:
            continue
        x = h[ref["sorted_pair"][row0 : row0 + nr] // k]
        y[row0 : row0 + nr] = _swiglu(x @ L.w_gate_up[e].T) @ L.w_down[e].T
    out = (y[ref["pair_pos"].reshape(-1, k)] * w[..., None]).sum(1)
    np.testing.assert_allclose(out, eng._moe(h, L), rtol=1e-5, atol=1e-5)


def test_check_moe_limits():
    """The engine's limits, and the CLI's refusal before anything starts (blink serve --device cuda) agree."""
    from blink.gpu.engine import moe_launch
    from blink.models import registry

    assert (registry.CUDA_MOE_MAX_EXPERTS, registry.CUDA_MOE_MAX_TOPK) == (moe_launch.MAX_EXPERTS, moe_launch.MAX_TOPK)
    registry.check_device("random:qwen3-30b-a3b", "cuda")
    registry.check_device("random:tiny-qwen3-moe", "cuda")
    check_moe(preset("qwen3-30b-a3b"))
    with pytest.raises(ValueError, match="experts"):
        check_moe(preset("qwen3-30b-a3b").replace(num_experts=512))
    with pytest.raises(ValueError, match="multiples of 8"):
        check_moe(preset("tiny-qwen3-moe").replace(moe_intermediate_size=44))


def _fake_weights(cfg) -> GpuWeights:
    """GpuWeights over zero-stride numpy stand-ins of the real shapes (no memory, nbytes as real)."""
    sh = GpuWeights.shapes(cfg)

    def a(shape):
        return np.broadcast_to(np.uint16(0), shape)

    layers = []
    for li in range(cfg.num_layers):
        moe = cfg.layer_is_moe(li)
        layers.append(
            LayerWeights(
                attn_norm=a(sh["attn_norm"]), qkv=a(sh["qkv"]), q_norm=a(sh["q_norm"]), k_norm=a(sh["k_norm"]),
                o=a(sh["o"]), mlp_norm=a(sh["mlp_norm"]), gate_up=None if moe else a(sh["gate_up"]),
                down=None if moe else a(sh["down"]), router=a(sh["router"]) if moe else None,
                experts_gate_up=a(sh["experts_gate_up"]) if moe else None,
                experts_down=a(sh["experts_down"]) if moe else None,
            )
        )  # fmt: skip
    emb = a((cfg.vocab_size, cfg.hidden_size))
    return GpuWeights(cfg, emb, a((cfg.hidden_size,)), a((cfg.vocab_size, cfg.hidden_size)), layers)


def test_active_bytes_count_the_read_experts():
    """Qwen3-30B-A3B: a batch-1 decode step reads attention, router, k of 128 experts per layer, the
    final norm and the LM head (the embedding's one row is not counted, as for dense models): its
    active parameters less the embedding, in bf16."""
    cfg = preset("qwen3-30b-a3b")
    w = _fake_weights(cfg)
    emb = cfg.vocab_size * cfg.hidden_size
    assert w.bytes_per_step == 2 * (cfg.num_params() - emb)
    assert w.active_bytes_per_step() == 2 * (cfg.num_params(active=True) - emb)
    assert w.active_bytes_per_step(cfg.num_experts) == w.bytes_per_step
    assert 5.5e9 < w.active_bytes_per_step() < 6.5e9  # "A3B": ~3.3 B active parameters


def test_hf_tensors_split_experts_back():
    """The expert stack is [gate; up] per expert: hf_tensors gives back transformers' per-expert names
    and shapes (what the GPU tests copy into Qwen3MoeForCausalLM), and the dense layer's own MLP."""
    from blink.models.weights import weight_shapes

    cfg = preset("tiny-qwen3-moe")
    w = _fake_weights(cfg)
    got = {n: tuple(a.shape) for n, a in w.hf_tensors()}
    assert got == weight_shapes(cfg)


def test_cli_refuses_moe_beyond_the_kernels(tmp_path):
    """An HF folder (read through its config.json alone) with 512 experts: refused for CUDA in one line
    naming the limit, accepted for the emulated device."""
    from blink.models import registry
    from blink.models.config import UnsupportedModelError

    (tmp_path / "config.json").write_text(
        '{"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,'
        ' "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,'
        ' "num_experts": 512, "num_experts_per_tok": 8, "moe_intermediate_size": 32, "norm_topk_prob": true}'
    )
    with pytest.raises(UnsupportedModelError, match="at most 256 experts"):
        registry.check_device(str(tmp_path), "cuda")
    registry.check_device(str(tmp_path), "emulated")
