"""The launch sequence of a step with and without GEMV fusions (no GPU: Forward with fake buffers
and a recording driver); every launch's keyword arguments go through Kernels.args, i.e. are checked
against the kernels' signatures as nvcc sees them (needs nvcc, or the signatures cached by a build)."""

from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from blink.gpu.engine.forward import (
    GEMV_FUSIONS,
    ROPE_WARP_MAX_TOKENS,
    Dims,
    Forward,
    RopeArgs,
    pdl_kernel,
    rope_kernel,
)
from blink.gpu.engine.fp8_weights import (
    FP8_GEMV_BUCKETS,
    FP8_GEMV_CONFIG,
    FP8_GEMV_CONFIGS,
    FP8_LARGE_PATHS,
    FP8_MMA_COMPILED,
    FP8_MMA_MIN_TOKENS,
    FP8_PROJECTIONS,
    Fp8Linear,
    fp8_gemv_grid,
    fp8_gemv_name,
    fp8_gemv_pieces,
    fp8_mma_grid,
    fp8_mma_name,
    fp8_scratch_elems,
)
from blink.gpu.engine.moe_launch import (
    BIG_TILE_M,
    BIG_TILE_MIN_TOKENS,
    COLS,
    FUSED_ROUTE_MAX_TOKENS,
    MMA_BN,
    MMA_KC,
    MMA_MIN_TOKENS,
    PAIR_COLS,
    PAIR_MAX_TOKENS,
    PAIR_WARPS,
    ROUTER_MAX_TOKENS,
    ROUTER_WARPS,
    TILE_M,
    WARPS,
    MoeLaunches,
    max_tiles,
)
from blink.gpu.toolchain import kernels
from blink.models.config import preset
from blink.protocol.step import STEP_FIELDS


@pytest.fixture(scope="module")
def signatures() -> dict:
    try:
        return kernels.all_signatures()
    except RuntimeError as e:  # no nvcc and nothing cached
        pytest.skip(str(e))


class _Kernels(kernels.Kernels):
    """Kernels without a GPU: every name has handle 1; args() checks against the real signatures."""

    def __init__(self, params: dict) -> None:
        self.params, self._fns = params, dict.fromkeys(params, 1)


class _Arr:
    """Stands in for a cupy array: a device pointer and a shape."""

    def __init__(self, *shape: int) -> None:
        self.shape = shape
        self.data = SimpleNamespace(ptr=4096)
        self.nbytes = 2
        for n in shape:
            self.nbytes *= n


def _forward(
    name: str, gemv_max_tokens: int, fusion: str, signatures: dict, layers: int = 2, kv_suffix: str = ""
) -> tuple[Forward, list]:
    c = preset(name).replace(num_layers=layers)
    f = object.__new__(Forward)
    f.kv_suffix = kv_suffix
    f.c, f.num_sms, f.max_splits = c, 132, 32
    f.d = Dims(8, 256, 66, 16, 1000, 1056)
    H, nqkv = c.hidden_size, c.q_size + 2 * c.kv_size
    qn = _Arr(c.head_dim) if c.qk_norm else None
    layers = []
    for li in range(c.num_layers):
        moe = c.layer_is_moe(li)
        E, im = c.num_experts, c.moe_intermediate_size
        layers.append(_layer(c, H, nqkv, qn, moe, E, im))
    f.w = SimpleNamespace(embed=_Arr(c.vocab_size, H), final_norm=_Arr(H), lm_head=_Arr(c.vocab_size, H), layers=layers)
    f.arena = SimpleNamespace(ptr=dict.fromkeys([f.name for f in STEP_FIELDS], 8192))
    names = "resid hid delta qkv q attn gu act last logits out_tokens done_seq kv cos sin part_o part_ml"
    names += " proc chosen_lp top_ids top_lps lp_stats pen_state logit_bias_n logit_bias_ids logit_bias_vals mask_open"
    names += " plp_hid plp_logits plp_lp plp_ids plp_lps"
    for b in names.split():
        setattr(f, b, _Arr(1))
    f.moe = None
    if c.is_moe:
        f.moe = object.__new__(MoeLaunches)
        f.moe.c, f.moe.mma_min_tokens, f.moe.fused_route_max_tokens = c, MMA_MIN_TOKENS, FUSED_ROUTE_MAX_TOKENS
        f.moe.big_tile_min_tokens, f.moe.pair_max_tokens = BIG_TILE_MIN_TOKENS, PAIR_MAX_TOKENS
        for b in "logits topk_ids topk_w expert_off expert_cnt sorted_pair pair_pos act y".split():
            setattr(f.moe, b, _Arr(1))
    return _finish(f, gemv_max_tokens, fusion, signatures)


def _layer(c, H: int, nqkv: int, qn, moe: bool, E: int, im: int) -> SimpleNamespace:
    return SimpleNamespace(
        attn_norm=_Arr(H),
        qkv=_Arr(nqkv, H),
        q_norm=qn,
        k_norm=qn,
        o=_Arr(H, c.q_size),
        mlp_norm=_Arr(H),
        gate_up=None if moe else _Arr(2 * c.intermediate_size, H),
        down=None if moe else _Arr(H, c.intermediate_size),
        qkv_bias=_Arr(nqkv) if c.attn_bias else None,
        router=_Arr(E, H) if moe else None,
        experts_gate_up=_Arr(E, 2 * im, H) if moe else None,
        experts_down=_Arr(E, H, im) if moe else None,
    )


def _fusion(spec: str) -> frozenset[str]:
    """A GEMV fusion set: "none", "all" or a comma list of GEMV_FUSIONS (serving uses "all")."""
    if spec == "all":
        return frozenset(GEMV_FUSIONS)
    return frozenset(p.strip() for p in spec.split(",") if p.strip() not in ("", "none"))


def _finish(f: Forward, gemv_max_tokens: int, fusion: str, signatures: dict) -> tuple[Forward, list]:
    f.sampling_rows = 4
    f.mask_words = 1
    f.kv_layer_stride, f.kv_half = 1 << 20, 1 << 19
    f.k = _Kernels(signatures)
    f._init_attention(f.k, SimpleNamespace(set_max_dynamic_smem=lambda fn, n: None))
    f.gemv_max_tokens = gemv_max_tokens
    f.fp8, f.fp8_gemv_max_tokens, f.fp8_path, f.fp8_gemms = False, 8, "", {}
    f.fp8_mma_min_tokens, f.fp8_gemv_config = FP8_MMA_MIN_TOKENS, dict(FP8_GEMV_CONFIG)
    f.fp8_scratch = f.fp8_x8 = f.fp8_xs = f.fp8_d32 = f.fp8_head_scratch = _Arr(1)
    f.set_gemv_fusion(_fusion(fusion))
    calls: list = []
    f.pdl, f.programmatic = False, []  # the kernels launched with programmatic dependent launch
    f.drv = SimpleNamespace(
        launch=lambda fn, grid, block, args, stream, smem, name, programmatic=False: (
            calls.append((name, grid, args, smem)),
            programmatic and f.programmatic.append(name),
        )
    )
    f.blas = SimpleNamespace(linear=lambda *a: calls.append(("cublas", None, a, 0)))
    return f, calls


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-8b", "qwen2.5-7b"])
@pytest.mark.parametrize("T", [1, 2, 8])
@pytest.mark.parametrize("fusion", ["none", "all", "norm", "swiglu", "rope", "norm,rope"])
def test_fused_decode_launches(name: str, T: int, fusion: str, signatures: dict):
    f, calls = _forward(name, 8, fusion, signatures)
    f.record(0, T, T, True)
    names = [c[0] for c in calls]
    fuse = _fusion(fusion)
    rope = "rope" in fuse and name == "llama3-8b"  # qk-norm and qkv-bias models keep rope_kv_write
    per_layer = {
        "add_rmsnorm": 0 if "norm" in fuse else 2,
        "swiglu": 0 if "swiglu" in fuse else 1,
        "rope_kv_write": 0 if rope else 1,  # either kernel of the role (rope_kernel picks by T)
        "add_bias": 1 if name == "qwen2.5-7b" else 0,
    }
    c = f.c
    rope_name = rope_kernel(c.num_heads + 2 * c.num_kv_heads, c.head_dim, T, c.qk_norm, f.num_sms)[0]
    assert rope_name == ("rope_kv_write_warp" if T <= ROPE_WARP_MAX_TOKENS[c.qk_norm] else "rope_kv_write")
    assert not {"rope_kv_write", "rope_kv_write_warp"} - {rope_name} & set(names)  # only the chosen one
    for k, n in per_layer.items():
        assert sum(x.startswith(k) for x in names) == 2 * n, (k, names)
    assert "cublas" not in names
    # the sampling extensions' kernels sit around sample_tokens in every graph (each gated by ext_on;
    # token_mask also by mask_on)
    assert names[-6:] == ["penalty_mark", "logits_ext", "token_mask", "sample_tokens", "sample_post", "signal_done"]
    assert sum(n.startswith("attn_flashq_hd") for n in names) == 2
    assert f.fusions_for(T) == (fuse - {"rope"} if name != "llama3-8b" else fuse)
    for name_, _, args, smem in calls:
        if name_ == "add_bias":  # between the qkv projection and RoPE
            assert names[names.index(name_) + 1] == rope_name
        if name_.startswith("gemv_"):
            assert name_.endswith(f"_t{T}") or name_.startswith("gemv_f32")
            rope_arg = [a for a in args if isinstance(a, RopeArgs)]
            assert bool(rope_arg) == ("rope" in name_)
            assert smem == (T * f.c.hidden_size * 2 if name_.startswith("gemv_norm") else 0)
    # the final norm adds delta only when the GEMVs did not add into the residual
    final = next(a for n, _, a, _ in calls if n == "final_norm_gather")
    assert (final[1].value == 0) == ("norm" in fuse)


@pytest.mark.parametrize("T", [1, 64])
def test_prefill_graphs_score_prompt_tokens(T: int, signatures: dict):
    """Prefill graphs end with the prompt-logprob kernels (final norm, LM head, records; each gated by
    ext_on and plp_count), after sampling; decode graphs and engines without the extension tables
    launch none. The norm adds delta unless the GEMVs added into the residual."""
    f, calls = _forward("llama3-8b", 8, "all", signatures)
    f.record(0, 1, T, False)
    names = [c[0] for c in calls]
    assert names[-5:] == ["sample_post", "plp_norm", "plp_lm_head", "plp_records", "signal_done"]
    norm = next(a for n, _, a, _ in calls if n == "plp_norm")
    assert (norm[1].value == 0) == ("norm" in f.fusions_for(T))
    calls.clear()
    f.record(0, 8, 8, True)
    assert not [n for n, *_ in calls if n.startswith("plp_")]
    f.sampling_rows = 0
    calls.clear()
    f.record(0, 1, T, False)
    assert not [n for n, *_ in calls if n.startswith("plp_")]


@pytest.mark.parametrize("fusion", ["none", "all"])
def test_fusion_only_on_the_gemv_path(fusion: str, signatures: dict):
    """cuBLAS decode buckets and prefill steps launch the same kernels whatever the fusion."""
    base_calls = {}
    for fu in ("none", fusion):
        f, calls = _forward("llama3-8b", 1, fu, signatures)
        f.record(0, 2, 2, True)  # batch 2 > gemv_max_tokens: cuBLAS
        f.record(0, 1, 64, False)  # prefill
        f.gemv_max_tokens = 0
        f.record(0, 1, 1, True)  # batch 1 on cuBLAS (bench/engine/decode.py's cublas_only)
        base_calls[fu] = [c[0] for c in calls]
    assert base_calls[fusion] == base_calls["none"]


def test_every_gemv_fusion_serves_and_a_bad_one_is_refused():
    f = Forward.__new__(Forward)
    f.gemv_fusion = frozenset(GEMV_FUSIONS)  # what __init__ sets: serving fuses wherever it applies
    with pytest.raises(ValueError):
        f.set_gemv_fusion(frozenset({"norm", "bogus"}))
    assert ctypes.sizeof(RopeArgs) == 10 * 8 + 5 * 4 + 4  # struct RopeArgs: padded to 8 bytes


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-8b", "qwen2.5-7b", "smollm2-135m"])
def test_every_launch_matches_its_kernel_signature(name: str, signatures: dict):
    """Both decode attention kernels, the prefill kernel, GEMV and cuBLAS buckets, fused and not: each
    launch's keyword arguments are exactly its kernel's parameters, of types they convert to."""
    from blink.gpu.engine.attention_launch import FLASH_VARIANTS

    for fusion in ("none", "all"):
        f, calls = _forward(name, 1, fusion, signatures)
        for v in FLASH_VARIANTS:
            f.set_decode_attention(v)
            for S in (1, 4):
                f.record(0, S, S, True)
        f.set_decode_attention(None)
        f.record(0, 2, 64, False)
        launched = {n for n, *_ in calls if n != "cublas"}
        assert {f"attn_{v}_hd{f.c.head_dim}_g{f.c.num_heads // f.c.num_kv_heads}" for v in FLASH_VARIANTS} | {
            f"attn_prefill_fa2_hd{f.c.head_dim}"
        } < launched
        for n, _, args, _ in calls:
            if n != "cublas":
                assert len(args) == len(signatures[n]), n


def test_pack_args_checks_names_and_types():
    params = (("const bf16*", "x"), ("int", "n"), ("float", "eps"), ("RopeArgs", "ra"), ("uint64_t", "seed"))
    arr = SimpleNamespace(data=SimpleNamespace(ptr=4096))
    ra = RopeArgs()
    args = kernels.pack_args("k", params, dict(seed=2**63, eps=0.5, n=3, x=arr, ra=ra))
    assert [type(a) for a in args] == [ctypes.c_uint64, ctypes.c_int, ctypes.c_float, RopeArgs, ctypes.c_uint64]
    assert args[0].value == 4096 and args[1].value == 3 and args[3] is ra and args[4].value == 2**63
    assert kernels.pack_args("k", params[:1], {"x": None})[0].value == 0  # a null pointer
    with pytest.raises(TypeError, match="missing"):
        kernels.pack_args("k", params, dict(x=arr, n=3, eps=0.5, ra=ra))
    with pytest.raises(TypeError, match="unknown"):
        kernels.pack_args("k", params[:2], dict(x=arr, n=3, m=4))
    with pytest.raises(TypeError, match="Python number"):
        kernels.pack_args("k", params[1:2], dict(n=ctypes.c_float(3)))
    with pytest.raises(TypeError, match="RopeArgs"):
        kernels.pack_args("k", params[3:4], dict(ra=3))


def test_parse_signatures_of_preprocessed_macro_kernels():
    text = (
        'extern "C" __attribute__((global)) void __attribute__((launch_bounds(128, (4 <= 4 ? 3 : 2)))) '
        "attn_x_hd64_g4( const bf16* __restrict__ q, float *po, int nkv) { body(); }\n"
        'extern "C" __attribute__((global)) void __attribute__((launch_bounds(SB)))\n'
        "sample_tokens(const float* logits, unsigned long long ns) {}\n"
    )
    assert kernels.parse_signatures(text) == {
        "attn_x_hd64_g4": (("const bf16*", "q"), ("float*", "po"), ("int", "nkv")),
        "sample_tokens": (("const float*", "logits"), ("unsigned long long", "ns")),
    }


def test_only_launches_records_one_category(signatures: dict):
    """The benchmarks' per-category graphs (bench/common.py's only_launches): the step's launches
    of that category alone, in order, and the engine's driver and cuBLAS back afterwards."""
    from bench.common import CATEGORIES, kernel_category, only_launches

    f, calls = _forward("qwen2.5-7b", 1, "all", signatures)
    f.record(0, 4, 4, True)  # cuBLAS bucket: GEMMs, add_bias and every other category
    full = [n for n, *_ in calls]
    assert {kernel_category(n) for n in full if n != "cublas"} | {"gemm"} == set(CATEGORIES) - {"moe"}
    drv, blas = f.drv, f.blas
    for cat in CATEGORIES:
        calls.clear()
        with only_launches(f, {cat}):
            f.record(0, 4, 4, True)
        assert [n for n, *_ in calls] == [n for n in full if (kernel_category(n) if n != "cublas" else "gemm") == cat]
    assert (f.drv, f.blas) == (drv, blas)


@pytest.mark.parametrize("decode", ["flashq", "flashmma"])
def test_prefill_graph_runs_decode_attention_first(decode: str, signatures: dict):
    """A prefill graph may carry one-token decode rows (mixed steps): in every layer the decode
    attention of the graph's bucket (one CTA column per sequence, splits by that bucket) comes before
    the prefill kernel, which skips one-token rows (prefill_tile_of_block) and rewrites the others."""
    f, calls = _forward("llama3-8b", 8, "none", signatures)
    f.set_decode_attention(decode)
    S, T = 5, 64
    f.record(0, S, T, False)
    attn = [(n, grid) for n, grid, *_ in calls if n.startswith("attn_")]
    dec = f.decode_kernels[decode]
    splits = f.flash_splits(S, decode)
    per_layer = [(dec, (splits, f.c.num_kv_heads, S))]
    if splits > 1:
        per_layer.append((f.flash_combine[decode], (-(-f.c.num_heads // 4), S, 1)))
    per_layer.append((f.fn_prefill, (T // 64 + S, f.c.num_heads, 1)))
    names = [n for n, _ in attn]
    assert names == [n for n, _ in per_layer] * 2, names
    assert attn[0][1] == per_layer[0][1]
    assert attn[len(per_layer) - 1][1] == per_layer[-1][1]
    # a decode graph is unchanged: the decode kernel alone
    calls.clear()
    f.record(0, S, S, True)
    assert [n for n, *_ in calls if n.startswith("attn_")] == [n for n, _ in per_layer[:-1]] * 2


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "qwen3-30b-a3b"])
@pytest.mark.parametrize(
    "T,decode", [(1, True), (4, True), (8, True), (16, False), (64, False), (128, False), (256, False)]
)
@pytest.mark.parametrize("fusion", ["none", "all"])
def test_moe_layer_launches(name: str, T: int, decode: bool, fusion: str, signatures: dict):
    """A MoE layer's launches (blink/gpu/engine/moe_launch.py): after the o projection and the MLP norm, the
    router projection (fp32 out), then route and align (one launch in small graphs), the two expert
    kernels (tile GEMV; tensor cores in large graphs, with 64-row tiles in the largest) sized for the
    bucket's worst case, and the combine into delta; dense layers (mlp_only_layers) keep swiglu; no
    GEMV fusion."""
    f, calls = _forward(name, 8, fusion, signatures, layers=3)
    c = f.c
    f.record(0, min(T, 8), T, decode)
    names = [n for n, *_ in calls]
    moe_layers = [li for li in range(3) if c.layer_is_moe(li)]
    # the combine of a MoE layer before the last does the next layer's add_rmsnorm (moe_combine_norm)
    fused_norms = sum(li < 2 for li in moe_layers)
    assert (
        names.count("moe_combine_norm") == fused_norms and names.count("moe_combine") == len(moe_layers) - fused_norms
    )
    assert names.count("add_rmsnorm") == 2 * 3 - fused_norms and names.count("swiglu") == 3 - len(moe_layers)
    assert f.fusions_for(T) == frozenset()
    v = "_mma" if T >= MMA_MIN_TOKENS else ""  # tensor cores from MMA_MIN_TOKENS tokens (both dims % 16 == 0 here)
    tm = BIG_TILE_M if T >= BIG_TILE_MIN_TOKENS else TILE_M
    routing = [f"moe_route_align_m{tm}"] if T <= FUSED_ROUTE_MAX_TOKENS else ["moe_route", f"moe_align_m{tm}"]
    pair = T <= PAIR_MAX_TOKENS  # decode: no permutation, routing inside moe_pair_gate_up
    if pair:
        routing = []
    experts = ["moe_pair_gate_up", "moe_pair_down"] if pair else [f"moe_gate_up{v}_m{tm}", f"moe_down{v}_m{tm}"]
    starts = [i for i, n in enumerate(names) if n == (routing or experts)[0]]
    assert len(starts) == len(moe_layers)
    for li, i in zip(moe_layers, starts, strict=True):
        last = "moe_combine" if li == 2 else "moe_combine_norm"
        moe_seq = [*routing, *experts, last]
        assert names[i : i + len(moe_seq)] == moe_seq
        if li < 2:  # the next layer starts at its qkv projection
            assert names[i + len(moe_seq)] in ("cublas", f"gemv_bf16_t{T}"), names[i + len(moe_seq)]
        router = calls[i - 1]  # the router projection, fp32 out, right before the routing
        if T <= ROUTER_MAX_TOKENS:
            assert router[0] == f"moe_router_t{T}" and router[1] == (-(-c.num_experts // ROUTER_WARPS), 1, 1)
        else:
            assert router[0] in ("cublas", f"gemv_f32_t{T}"), router[0]
        assert names[i - 2] == "add_rmsnorm"
        gu, dn = calls[i + len(routing)], calls[i + len(routing) + 1]
        H, im, k = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
        rows = T * k if pair else max_tiles(T, k, c.num_experts, tm)
        assert gu[1][1] == dn[1][1] == rows
        if pair:
            assert gu[3] == H * 2 and dn[3] == im * 2
        else:
            assert gu[3] == MoeLaunches.smem(bool(v), H, tm) and dn[3] == MoeLaunches.smem(bool(v), im, tm)
        bn = MMA_BN if v else PAIR_WARPS * PAIR_COLS if pair else WARPS * COLS
        assert gu[1][0] == -(-im // bn) and dn[1][0] == -(-H // bn)
        assert calls[i + len(moe_seq) - 1][1] == (T, 1, 1)


@pytest.mark.parametrize("T,decode", [(1, True), (8, True), (16, False), (64, False), (256, False)])
def test_fp8_moe_layer_launches_the_fp8_expert_kernels(T: int, decode: bool, signatures: dict):
    """--quantization fp8 on a MoE model: the experts are Fp8Linear (codes (E, out, in), scales (E, out)); each
    expert launch is its kernel's _fp8 variant (pair, tile GEMV, tensor cores) with the codes as W and the scales
    as S (checked against the kernels' signatures), the tensor-core variants with room for the decoded weight
    fragments; the router and the routing are the bf16 model's."""
    f, calls = _forward("qwen3-30b-a3b", 8, "none", signatures, layers=2)
    c = f.c
    E, im, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
    for lw in f.w.layers:
        lw.experts_gate_up = Fp8Linear(_Arr(E, 2 * im, H), _Arr(E, 2 * im))
        lw.experts_down = Fp8Linear(_Arr(E, H, im), _Arr(E, H))
    f.record(0, min(T, 8), T, decode)
    experts = [(n, smem) for n, _, _, smem in calls if n.startswith(("moe_pair_", "moe_gate_up", "moe_down"))]
    assert len(experts) == 2 * c.num_layers and all(n.endswith("_fp8") for n, _ in experts), experts
    mma = T >= MMA_MIN_TOKENS
    tm = BIG_TILE_M if T >= BIG_TILE_MIN_TOKENS else TILE_M
    for n, smem in experts:
        if mma:
            assert smem == MoeLaunches.smem(True, H if "gate_up" in n else im, tm, fp8=True)
            assert smem > MoeLaunches.smem(True, H if "gate_up" in n else im, tm)
    assert sum(n.startswith("moe_router") or n == "cublas" or n.startswith("gemv_f32") for n, *_ in calls) >= 2


@pytest.mark.parametrize("nh,hd", [(48, 128), (60, 128), (15, 64), (12, 64), (10, 32), (8, 16), (3, 16), (20, 96)])
@pytest.mark.parametrize("T", [1, 7, 64, 256, 1001, 4096])
@pytest.mark.parametrize("sms", [1, 132])
def test_rope_launch_geometry(nh: int, hd: int, T: int, sms: int):
    """rope_kv_write's launch (forward.rope_launch) as the kernel assumes it: hd / 16 threads a head,
    whole warps (its warp search and per-head sums use every lane), at most ROPE_THREADS threads and
    ROPE_MAX_TOKENS tokens a block, and the grid covers every (token, head) pair."""
    from blink.gpu.engine.forward import ROPE_THREADS, rope_launch

    src = (kernels.CSRC / "model_kernels.cu").read_text()
    assert f"constexpr int ROPE_THREADS = {ROPE_THREADS};" in src
    assert "constexpr int ROPE_MAX_TOKENS = ROPE_THREADS / 3 + 2;" in src
    (gx, gy, gz), (bx, by, bz) = rope_launch(nh, hd, T, sms)
    per_head = hd // 16
    hpb = bx // per_head
    assert (gy, gz, by, bz) == (1, 1, 1, 1)
    assert bx % 32 == 0 and bx % per_head == 0 and 32 <= bx <= ROPE_THREADS
    assert gx * hpb >= T * nh > (gx - 1) * hpb
    assert max((g + hpb - 1) // nh - g // nh + 1 for g in range(0, gx * hpb, hpb)) <= ROPE_THREADS // 3 + 2
    step = 32 // math.gcd(per_head, 32)
    largest = ROPE_THREADS // per_head // step * step  # heads of the largest whole-warp block
    if -(-T * nh // largest) >= 2 * sms:  # enough blocks for 2 an SM: the largest block
        assert hpb == largest
    else:  # smaller blocks, down to 64 threads
        assert bx <= 64 or hpb <= step or -(-T * nh // hpb) >= 2 * sms
    with pytest.raises(ValueError):
        rope_launch(nh, 72, T, sms)
    # the kernel's index math, every thread of the grid at once: each live (token, head, 8-pair unit)
    # taken by exactly one thread, its token among the block's searched ones, its rows in shared memory
    import numpy as np

    blk, tid = np.meshgrid(np.arange(gx), np.arange(bx), indexing="ij")
    g0 = blk * hpb
    t0 = g0 // nh
    hl, f = tid // per_head, tid % per_head * 8
    t, h = (g0 + hl) // nh, (g0 + hl) % nh
    t_end = (g0 + hpb - 1) // nh + 1
    live = (t < T) & (t0 < T)
    assert (t[live] - t0[live] < np.minimum(t_end, T)[live] - t0[live]).all()
    assert (hl * hd + f + hd // 2 + 8 <= ROPE_THREADS * 16).all()
    units = (t[live] * nh + h[live]) * (hd // 2) + f[live]
    assert len(units) == len(set(units.tolist())) == T * nh * per_head


def _warp_seq_of_token(cu: list[int], num_seqs: int, t: int) -> int:
    """model_kernels.cu's warp_seq_of_token, lane by lane: 32 probes a round, ballot, highest lane."""
    lo, hi = 0, num_seqs - 1
    while lo < hi:
        stride = (hi - lo + 32) >> 5
        below = [lane for lane in range(32) if lo + lane * stride <= hi and cu[lo + lane * stride] <= t]
        assert below == list(range(len(below))) and below  # a non-empty prefix of the lanes
        lo += below[-1] * stride
        hi = min(hi, lo + stride - 1)
    return lo


@pytest.mark.parametrize("num_seqs", [1, 2, 31, 32, 33, 256, 1000, 1025, 5000])
def test_warp_seq_of_token_is_seq_of_token(num_seqs: int):
    """The 32-way search finds what common.cuh's binary search finds: the largest s < num_seqs with
    cu[s] <= t, empty sequences included (tokens then go to the last of equal cu values)."""
    import numpy as np

    rng = np.random.default_rng(num_seqs)
    lens = rng.integers(0, 4, num_seqs)
    lens[0] = max(lens[0], 1)
    cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
    for t in range(cu[-1]):
        want = int(np.searchsorted(cu[:num_seqs], t, side="right") - 1)
        assert _warp_seq_of_token(cu, num_seqs, t) == want, t


def test_moe_block_constants_match_moe_cu():
    """moe_launch.py's grid and shared-memory arithmetic mirrors moe.cu's #defines."""
    import re

    from blink.gpu.toolchain.kernels import CSRC

    src = (CSRC / "moe.cu").read_text()
    defines = {m[0]: m[1] for m in re.findall(r"^#define (\w+) ([^/\n]*\S)", src, re.M)}
    want = {"MOE_WARPS": WARPS, "MOE_COLS": COLS, "PAIR_WARPS": PAIR_WARPS, "PAIR_COLS": PAIR_COLS, "MMA_KC": MMA_KC}
    want["ROUTER_WARPS"] = ROUTER_WARPS
    assert {name: int(defines[name]) for name in want} == want
    assert defines["MMA_BN"] == "(MOE_WARPS * 16)" and MMA_BN == WARPS * 16
    routers = set(re.findall(r"^MOE_ROUTER\((\d+)\)", src, re.M))
    assert routers >= {str(t) for t in range(1, ROUTER_MAX_TOKENS + 1)}, routers


def test_norm_and_rope_kernels_by_step_size():
    """forward.norm_kernel / rope_kernel: the register-row RMSNorm below NORM_ROWS_MIN_TOKENS, the looped one from
    it; the warp-per-head RoPE up to ROPE_WARP_MAX_TOKENS (32 without q/k-norm, 128 with), the vectorised one above
    (bench/results/rope_norm-h200-0c493b6.json); both RoPE kernels launched over every head of every token."""
    from blink.gpu.engine.forward import NORM_ROWS_MIN_TOKENS, norm_kernel

    assert [norm_kernel(T)[0] for T in (1, 256, NORM_ROWS_MIN_TOKENS - 1, NORM_ROWS_MIN_TOKENS, 4096)] == [
        "add_rmsnorm", "add_rmsnorm", "add_rmsnorm", "add_rmsnorm_rows", "add_rmsnorm_rows"
    ]  # fmt: skip
    assert norm_kernel(4096)[1:] == ((4096, 1, 1), (256, 1, 1))
    nh, hd = 48, 128
    picks = {(T, q): rope_kernel(nh, hd, T, q, 132)[0] for T in (1, 32, 33, 64, 128, 129, 256) for q in (False, True)}
    assert [k for k, v in picks.items() if v == "rope_kv_write_warp"] == [
        (1, False), (1, True), (32, False), (32, True), (33, True), (64, True), (128, True)
    ]  # fmt: skip
    name, grid, block = rope_kernel(nh, hd, 7, False, 132)
    assert name == "rope_kv_write_warp" and grid == (7, 6, 1) and block == (256, 1, 1)  # 8 heads (warps) a block


def _fp8(f: Forward, path: str, calls: list, modes: tuple = ()) -> Forward:
    """f with every dense projection as an Fp8Linear (stand-in arrays), as GpuWeights.empty(fp8=True),
    on FP8 path `path` alone, or with the W8A8 GEMMs of `modes` (Forward.set_fp8_gemm's), the GEMMs'
    calls recorded as "fp8_gemm" with their mode last."""
    for lw in f.w.layers:
        for p in FP8_PROJECTIONS:
            n, k = getattr(lw, p).shape
            setattr(lw, p, Fp8Linear(_Arr(n, k), _Arr(n)))
    f.fp8 = True
    use = set(modes or (path,)) - {"dequant"}
    f.fp8_gemms = {m: SimpleNamespace(matmul=lambda *a, m=m: calls.append(("fp8_gemm", None, a, m))) for m in use}
    return f


@pytest.mark.parametrize("name", ["llama3-8b", "qwen2.5-7b"])
@pytest.mark.parametrize("T", [1, 2, 8, 16, 256])
@pytest.mark.parametrize("path", FP8_LARGE_PATHS)
def test_fp8_projections_launch_the_fp8_gemv_or_the_large_step_path(name: str, T: int, path: str, signatures: dict):
    f, calls = _forward(name, 8, "all", signatures, layers=2)
    f = _fp8(f, path, calls)
    S = min(T, 8)
    f.record(0, S, T, T <= 8)
    names = [c[0] for c in calls]
    bf16_gemv = [n for n in names if n.startswith("gemv_") and "fp8" not in n]
    assert bf16_gemv == [f"gemv_f32_t{S}"]  # the LM head's (S rows, bf16) only: no fusion
    fp8_kernels = ("fp8_dequant_rows", "fp8_quantize_rows", "fp8_gemm", "fp8_scale_rows", "cublas")
    seq = [n for n in names if n in fp8_kernels]
    n_qkv, H = f.c.q_size + 2 * f.c.kv_size, f.c.hidden_size
    if FP8_MMA_MIN_TOKENS <= T <= 8:  # the tensor-core kernel, every row in one launch, no fusions
        mma = [c for c in calls if c[0].startswith("gemv_fp8")]
        assert [c[0] for c in mma] == [fp8_mma_name(T)] * 8 and not seq and names.count("add_rmsnorm") == 4
        assert mma[0][1] == (fp8_mma_grid(n_qkv), 1, 1) and mma[0][2][-1].value == T  # T: the live columns
        return
    if T <= 8:  # decode buckets: the FP8 GEMV with the bf16 GEMV's fusions (no RoPE fusion with a qkv bias)
        qkv_kind = "norm_rope" if name == "llama3-8b" else "norm"
        kinds = [qkv_kind, "resid", "norm_swiglu", "resid"] * 2
        assert [n for n in names if n.startswith("gemv_fp8")] == [fp8_gemv_name(T, k) for k in kinds] and not seq
        assert "add_rmsnorm" not in names and "swiglu" not in names
        assert names.count("rope_kv_write_warp") == (0 if name == "llama3-8b" else 2)
        qkv = next(c for c in calls if c[0] == fp8_gemv_name(T, qkv_kind))
        assert qkv[1] == (fp8_gemv_grid(n_qkv, T, qkv_kind), 1, 1) and qkv[3] == T * H * 2
        gu = next(c for c in calls if c[0] == fp8_gemv_name(T, "norm_swiglu"))
        assert gu[1] == (-(-f.c.intermediate_size // (4 * FP8_GEMV_CONFIG[T][0])), 1, 1)
        return
    assert names.count("add_rmsnorm") == 2 * 2 and names.count("swiglu") == 2
    if path == "dequant":  # each projection dequantized into the scratch right before its GEMM
        assert seq == ["fp8_dequant_rows", "cublas"] * (4 * 2)
        deq = [c for c in calls if c[0] == "fp8_dequant_rows"][0]
        assert deq[1] == (-(-f.c.hidden_size // 4096), n_qkv, 1)
    else:  # the input quantized per token (T rows), the FP8 GEMM, and for "epilogue" the scaling kernel
        per = ["fp8_quantize_rows", "fp8_gemm"] + (["fp8_scale_rows"] if path == "epilogue" else [])
        assert seq == per * (4 * 2)
        q = [c for c in calls if c[0] == "fp8_quantize_rows"][0]
        assert q[1] == (T, 1, 1)
        g = [c for c in calls if c[0] == "fp8_gemm"][0][2]
        assert g[:3] == (T, n_qkv, f.c.hidden_size)
        if path == "epilogue":
            sc = [c for c in calls if c[0] == "fp8_scale_rows"][0]
            assert sc[1] == (-(-n_qkv // 2048), T, 1)


@pytest.mark.parametrize(
    "T,modes",
    [
        (16, ["epilogue"] * 4),
        (128, ["epilogue", "epilogue", "outer", "epilogue"]),  # gate_up: 128 x 28672 outputs
        (256, ["outer", "epilogue", "outer", "epilogue"]),  # o and down: 256 x 4096, below the line
        (512, ["outer"] * 4),
    ],
)
def test_fp8_gemms_take_the_scaling_mode_of_their_shape(T: int, modes: list, signatures: dict):
    """Both W8A8 GEMMs set up: qkv, o, gate_up, down each take fp8_gemm_mode's, and the scaling kernel
    runs after exactly the "epilogue" ones (outer-vector scales write bf16 into the output)."""
    f, calls = _forward("llama3-8b", 8, "all", signatures, layers=1)
    f = _fp8(f, "", calls, ("epilogue", "outer"))
    f.record(0, min(T, 8), T, False)
    gemm = [c for c in calls if c[0] == "fp8_gemm"]
    assert [c[3] for c in gemm] == modes
    seq = [c[0] for c in calls if c[0] in ("fp8_gemm", "fp8_scale_rows")]
    assert seq == [n for m in modes for n in (["fp8_gemm", "fp8_scale_rows"] if m == "epilogue" else ["fp8_gemm"])]
    assert gemm[0][2][:3] == (T, f.c.q_size + 2 * f.c.kv_size, f.c.hidden_size)


def test_fp8_scratch_holds_the_largest_projection():
    c = preset("llama3-8b")
    assert fp8_scratch_elems(c) == 2 * c.intermediate_size * c.hidden_size
    c = preset("qwen3-32b")
    assert fp8_scratch_elems(c) == max(2 * c.intermediate_size, c.q_size + 2 * c.kv_size) * c.hidden_size


def test_fp8_decode_between_gemv_sizes_runs_in_pieces_and_prefill_never_on_the_gemv(signatures: dict):
    f, calls = _forward("llama3-8b", 8, "all", signatures, layers=1)
    f = _fp8(f, "outer", calls)
    f.record(0, 3, 3, True)  # by default 3 tokens run on the tensor-core kernel
    assert FP8_MMA_MIN_TOKENS <= 3
    assert [c[0] for c in calls if c[0].startswith("gemv_fp8")] == [fp8_mma_name(3)] * 4
    calls.clear()
    f.fp8_mma_min_tokens = 4  # EngineConfig.fp8_mma_min_tokens = 4: 3 tokens run on the GEMV
    f.record(0, 3, 3, True)  # a batch bucket of 3 (max_seqs 3): rows 0-1 on the t2 GEMV, row 2 on t1
    g = [c for c in calls if c[0].startswith("gemv_fp8")]
    assert [c[0] for c in g] == [fp8_gemv_name(2), fp8_gemv_name(1)] * 4  # no fusions between buckets
    assert "add_rmsnorm" in [c[0] for c in calls]
    x = lambda c: c[2][2].value  # noqa: E731 (the X pointer)
    y = lambda c: c[2][3].value  # noqa: E731
    H, n_qkv = f.c.hidden_size, f.c.q_size + 2 * f.c.kv_size
    assert x(g[1]) - x(g[0]) == 2 * 2 * H and y(g[1]) - y(g[0]) == 2 * 2 * n_qkv
    calls.clear()
    f.record(0, 1, 8, False)  # a prefill graph of 8 rows: the GEMM, as the numpy definition's prefill
    names = [c[0] for c in calls]
    assert not any(n.startswith("gemv_fp8") for n in names) and names.count("fp8_gemm") == 4


@pytest.mark.parametrize("T", [1, 8, 200])
def test_fp8_kv_cache_launches_the_fp8kv_kernels(T: int, signatures: dict):
    """--kv-cache-dtype fp8: every kernel that touches the cache is its _fp8kv instantiation (the RoPE/KV
    write, fa2 prefill, flashq decode); no rope-fused GEMV (it writes a bf16 cache)."""
    f, calls = _forward("llama3-8b", 8, "all", signatures, kv_suffix="_fp8kv")
    decode = T <= 8
    f.record(0, 1 if decode else 2, T, decode)
    names = [c[0] for c in calls]
    assert "rope" not in f.fusions_for(T)
    kv_kernels = [n for n in names if n.startswith(("rope_kv_write", "attn_"))]
    assert kv_kernels and all(n.endswith("_fp8kv") or "_combine_" in n for n in kv_kernels), kv_kernels
    assert not any("rope" in n for n in names if n.startswith("gemv_"))
    assert sum(n.startswith("attn_prefill_fa2") for n in names) == (0 if decode else 2)
    assert all(k.endswith("_fp8kv") for k in f.decode_kernels.values()) and f.fn_prefill.endswith("_fp8kv")


def test_fp8_kv_cache_has_its_own_flashmma_threshold(signatures: dict, monkeypatch: pytest.MonkeyPatch):
    """attention_launch.FLASHMMA_MIN_BATCH_FP8KV moves the fp8 cache's flashq/flashmma line alone."""
    from blink.gpu.engine import attention_launch as A

    fp8, _ = _forward("llama3-8b", 8, "none", signatures, kv_suffix="_fp8kv")
    bf16, _ = _forward("llama3-8b", 8, "none", signatures)
    assert [fp8.decode_variant(S) for S in (1, 127, 128)] == ["flashq", "flashq", "flashmma"]
    monkeypatch.setattr(A, "FLASHMMA_MIN_BATCH_FP8KV", 32)
    assert [fp8.decode_variant(S) for S in (1, 31, 32)] == ["flashq", "flashq", "flashmma"]
    assert [bf16.decode_variant(S) for S in (32, 127, 128)] == ["flashq", "flashq", "flashmma"]


def test_fp8_gemv_configurations_are_the_compiled_ones(signatures: dict):
    """FP8_GEMV_CONFIGS lists exactly the configurations fp8.cu compiles, each with the plain GEMV and
    every fusion and the fp32-output twin (the LM head's); the engine's FP8_GEMV_CONFIG is one of them; a
    row count runs in bucket pieces."""
    kinds = ("", "norm", "norm_swiglu", "swiglu", "resid", "rope", "norm_rope", "f32")
    table = {fp8_gemv_name(nt, k, c) for nt, cs in FP8_GEMV_CONFIGS.items() for c in cs for k in kinds}
    table |= {
        f"gemv_fp8_mma{o}_m{mt}_n{n8}" for n8, mts in FP8_MMA_COMPILED.items() for mt in mts for o in ("", "_f32")
    }
    assert {n for n in signatures if n.startswith("gemv_fp8")} == table
    assert [fp8_mma_name(t) for t in (1, 8, 9, 16, 17, 32)] == [
        "gemv_fp8_mma_m1_n1", "gemv_fp8_mma_m1_n1", "gemv_fp8_mma_m1_n2", "gemv_fp8_mma_m1_n2",
        "gemv_fp8_mma_m1_n4", "gemv_fp8_mma_m1_n4",
    ]  # fmt: skip
    with pytest.raises(ValueError):
        fp8_mma_name(33)
    assert set(FP8_GEMV_CONFIG) == set(FP8_GEMV_BUCKETS) == set(FP8_GEMV_CONFIGS)
    with pytest.raises(ValueError, match="no compiled configuration"):
        fp8_gemv_name(1, "", (3, 3))
    assert fp8_gemv_pieces(7) == [(0, 4), (4, 2), (6, 1)] and fp8_gemv_pieces(8) == [(0, 8)]
    assert fp8_gemv_grid(4096, 1, "", (2, 4)) == 256 and fp8_gemv_grid(4096, 1, "swiglu", (2, 4)) == 256


@pytest.mark.parametrize("T", [t for t in FP8_GEMV_BUCKETS if t < FP8_MMA_MIN_TOKENS])
def test_fp8_decode_without_fusions_runs_the_plain_fp8_gemv(T: int, signatures: dict):
    f, calls = _forward("llama3-8b", 8, "none", signatures, layers=2)
    f = _fp8(f, "outer", calls)
    f.record(0, T, T, True)
    names = [c[0] for c in calls]
    assert names.count(fp8_gemv_name(T)) == 4 * 2 and names.count("add_rmsnorm") == 2 * 2
    assert [n for n in names if n.startswith("gemv_fp8")] == [fp8_gemv_name(T)] * 8
    assert f.fusions_for(T) == frozenset()


@pytest.mark.parametrize("fp8", [False, True])
def test_pdl_launches_only_the_gemvs_that_wait_for_the_kernel_before(fp8: bool, signatures: dict):
    """EngineConfig.pdl: a one-token decode step launches its four GEMVs a layer with programmatic
    dependent launch and nothing else; steps off the GEMV (prefill, FP8's tensor-core kernel) none."""
    f, calls = _forward("llama3-8b", 8, "all", signatures, layers=2)
    if fp8:
        f = _fp8(f, "outer", calls)
    f.pdl = True
    f.record(0, 1, 1, True)
    names = [c[0] for c in calls]
    suffix = f"_t1_r{FP8_GEMV_CONFIG[1][0]}p{FP8_GEMV_CONFIG[1][1]}" if fp8 else "_t1"  # the pipelined loop
    prefix = "gemv_fp8_" if fp8 else "gemv_"
    layer = [f"{prefix}{k}{suffix}" for k in ("norm_rope", "resid", "norm_swiglu", "resid")]
    assert f.programmatic == [n for n in names if pdl_kernel(n)] == layer * 2
    for S, T, decode in ((1, 8, False), (4, 4, True)) if fp8 else ((1, 16, False),):  # bf16: the GEMV to 8 rows
        calls.clear()
        f.programmatic.clear()
        f.record(0, S, T, decode)
        assert f.programmatic == [] and calls
    f.pdl = False
    f.record(0, 1, 1, True)
    assert f.programmatic == []


CSRC = Path(__file__).resolve().parents[1] / "blink" / "gpu" / "engine" / "csrc"


def _fused_gemv_kernel_names() -> list[re.Pattern]:
    """The name patterns of the kernels whose macro calls gemv_fused_impl: a macro parameter stands for the
    values the sources pass it (any word where a macro passes on its own parameter)."""
    lines = [ln for src in sorted(CSRC.glob("*.cu")) for ln in src.read_text().replace("\\\n", " ").splitlines()]
    out = []
    for line in lines:
        m = re.match(r"#define (\w+)\(([^)]*)\)(.*)", line)
        if not m or "__global__" not in m.group(3) or "gemv_fused_impl" not in m.group(3):
            continue
        params = [p.strip() for p in m.group(2).split(",")]
        uses = [u.split(",") for ln in lines for u in re.findall(rf"(?<!#define )\b{m.group(1)}\(([^()]*)\)", ln)]
        uses = [[a.strip() for a in u] for u in uses if len(u) == len(params)]

        def values(i: int, uses: list = uses) -> str:
            vals = {u[i] for u in uses}
            return "|".join(sorted(vals)) if vals and all(re.fullmatch(r"[a-z0-9_]+", v) for v in vals) else r"\w+"

        for name in re.findall(r"\b(gemv_[\w#]+)\s*\(", m.group(3)):
            if name != "gemv_fused_impl":
                parts = [f"(?:{values(params.index(x))})" if x in params else re.escape(x) for x in name.split("##")]
                out.append(re.compile("".join(parts)))
    return out


def test_pdl_kernels_are_exactly_the_kernels_built_on_gemv_fused_impl(signatures: dict):
    patterns = _fused_gemv_kernel_names()
    assert len(patterns) == 6  # the FP8 GEMV's plain, f32, fused and rope kernels; the fused bf16 GEMVs
    fused = {n for n in signatures if any(p.fullmatch(n) for p in patterns)}
    assert {n for n in signatures if pdl_kernel(n)} == fused
    assert "gemv_resid_t1" in fused and "gemv_bf16_t1" not in fused and "gemv_fp8_mma_m1_n1" not in fused


def test_gemv_fused_impl_reads_only_weights_before_it_waits_for_the_kernel_before():
    """Under programmatic dependent launch the kernel before may still be writing the activations, the
    residual stream and the step's token data: gemv_fused_impl touches none of them before pdl_wait()."""
    src = (CSRC / "gemv_fused.cuh").read_text()
    body = src[src.index("void gemv_fused_impl") :]
    body = re.sub(r"//[^\n]*", "", body[body.index("{") :])  # the code after the parameter list
    assert body.count("pdl_wait();") == 1 and body.index("pdl_launch_dependents();") < body.index("pdl_wait();")
    before = body[: body.index("pdl_wait();")]
    step_data = r"ra\.(num_tokens|num_seqs|positions|cu_q_lens|block_tables|q_out|k_cache|v_cache|cos_tab|sin_tab)"
    for pattern in (r"\bX\b", r"\bY\b", r"\bnw\b", r"\bsx\[", step_data):
        assert not re.search(pattern, before), pattern
    assert re.search(r"\bW\b", before) and re.search(r"\bscales\[", before)  # the weights do come first
