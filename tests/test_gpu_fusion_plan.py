"""The launch sequence of a step with and without GEMV fusions (no GPU: Forward with fake buffers
and a recording _launch), against the kernels' argument counts in model_kernels.cu."""

from __future__ import annotations

import ctypes
import re
from types import SimpleNamespace

import pytest

from blink.gpu import kernels
from blink.gpu.engine import EngineConfig, parse_gemv_fusion
from blink.gpu.forward import GEMV_FUSIONS, Dims, Forward, RopeArgs
from blink.models.config import preset


class _Arr:
    """Stands in for a cupy array: a device pointer and a shape."""

    def __init__(self, *shape: int) -> None:
        self.shape = shape
        self.data = SimpleNamespace(ptr=4096)
        self.nbytes = 2
        for n in shape:
            self.nbytes *= n


def _forward(name: str, gemv_max_tokens: int, fusion: str) -> tuple[Forward, list]:
    c = preset(name).replace(num_layers=2)
    f = object.__new__(Forward)
    f.c, f.num_sms, f.max_splits = c, 132, 32
    f.d = Dims(8, 64, 66, 16, 1000, 1056)
    H, nqkv = c.hidden_size, c.q_size + 2 * c.kv_size
    qn = _Arr(c.head_dim) if c.arch == "qwen3" else None
    layer = SimpleNamespace(
        attn_norm=_Arr(H),
        qkv=_Arr(nqkv, H),
        q_norm=qn,
        k_norm=qn,
        o=_Arr(H, c.q_size),
        mlp_norm=_Arr(H),
        gate_up=_Arr(2 * c.intermediate_size, H),
        down=_Arr(H, c.intermediate_size),
        qkv_bias=_Arr(nqkv) if c.attn_bias else None,
    )
    f.w = SimpleNamespace(
        embed=_Arr(c.vocab_size, H), final_norm=_Arr(H), lm_head=_Arr(c.vocab_size, H), layers=[layer, layer]
    )
    names = [n for n, _, _ in __import__("blink.gpu.forward", fromlist=["STEP_FIELDS"]).STEP_FIELDS]
    f.arena = SimpleNamespace(ptr=dict.fromkeys(names, 8192))
    for b in "resid hid delta qkv q attn gu act last logits out_tokens done_seq kv cos sin part_o part_ml".split():
        setattr(f, b, _Arr(1))
    f.split_counters = _Arr(1)
    f.kv_layer_stride, f.kv_half = 1 << 20, 1 << 19
    f.decode_kernels = {"flashq": 1, "basic": 2}
    f.flash_combine = {"flashq": 3}
    f.flash_smem = {"flashq": 65536}
    f.fn_prefill, f.prefill_smem = 4, 1000
    f.decode_table, f._decode_override, f._only = ((1, "flashq"),), None, None
    f.gemv_max_tokens = gemv_max_tokens
    f.set_gemv_fusion(parse_gemv_fusion(fusion))
    calls: list = []
    f._launch = lambda name, grid, block, args, stream, smem=0, fn=None: calls.append((name, grid, args, smem))
    f.blas = SimpleNamespace(linear=lambda *a: calls.append(("cublas", None, a, 0)))
    return f, calls


def _kernel_params() -> dict[str, int]:
    """Parameter count of every extern "C" kernel of model_kernels.cu (macro kernels expanded by hand)."""
    src = (kernels.CSRC / "model_kernels.cu").read_text()
    out = {}
    for m in re.finditer(r'extern "C" __global__ void (\w+)\(([^)]*)\)', src):
        out[m.group(1)] = len(m.group(2).split(","))
    fused = re.search(r"gemv_##NAME##_t##NT\(([^)]*)\)", src)
    assert fused is not None
    for nt in (1, 2, 4, 8):
        for kind in ("norm", "norm_swiglu", "swiglu", "resid", "rope", "norm_rope"):
            out[f"gemv_{kind}_t{nt}"] = len(fused.group(1).split(","))
        out[f"gemv_bf16_t{nt}"] = out[f"gemv_f32_t{nt}"] = 5
    return out


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-8b", "qwen2.5-7b"])
@pytest.mark.parametrize("T", [1, 2, 8])
@pytest.mark.parametrize("fusion", ["none", "all", "norm", "swiglu", "rope", "norm,rope"])
def test_fused_decode_launches(name: str, T: int, fusion: str):
    f, calls = _forward(name, 8, fusion)
    f._record(0, T, T, True, True)
    names = [c[0] for c in calls]
    fuse = parse_gemv_fusion(fusion)
    rope = "rope" in fuse and name == "llama3-8b"  # qk-norm and qkv-bias models keep rope_kv_write
    per_layer = {
        "add_rmsnorm": 0 if "norm" in fuse else 2,
        "swiglu": 0 if "swiglu" in fuse else 1,
        "rope_kv_write": 0 if rope else 1,
        "add_bias": 1 if name == "qwen2.5-7b" else 0,
    }
    for k, n in per_layer.items():
        assert names.count(k) == 2 * n, (k, names)
    assert "cublas" not in names
    assert names.count("attn_flash") == 2
    assert f.fusions_for(T) == (fuse - {"rope"} if name != "llama3-8b" else fuse)
    params = _kernel_params()
    for name_, _, args, smem in calls:
        if name_ == "add_bias":  # between the qkv projection and RoPE
            assert len(args) == params[name_] and names[names.index(name_) + 1] == "rope_kv_write"
        if name_.startswith("gemv_"):
            assert name_.endswith(f"_t{T}") or name_.startswith("gemv_f32")
            assert len(args) == params[name_], name_
            rope_arg = [a for a in args if isinstance(a, RopeArgs)]
            assert bool(rope_arg) == ("rope" in name_)
            assert smem == (T * f.c.hidden_size * 2 if name_.startswith("gemv_norm") else 0)
    # the final norm adds delta only when the GEMVs did not add into the residual
    final = next(a for n, _, a, _ in calls if n == "final_norm_gather")
    assert (final[1].value == 0) == ("norm" in fuse)


@pytest.mark.parametrize("fusion", ["none", "all"])
def test_fusion_only_on_the_gemv_path(fusion: str):
    """cuBLAS decode buckets and prefill steps launch the same kernels whatever the fusion."""
    base_calls = {}
    for fu in ("none", fusion):
        f, calls = _forward("llama3-8b", 1, fu)
        f._record(0, 2, 2, True, True)  # batch 2 > gemv_max_tokens: cuBLAS
        f._record(0, 1, 64, False, True)  # prefill
        f._record(0, 1, 1, True, False)  # batch 1 with use_gemv=False (the cublas_only benchmark)
        base_calls[fu] = [c[0] for c in calls]
    assert base_calls[fusion] == base_calls["none"]


def test_gemv_fusion_config():
    assert parse_gemv_fusion("all") == frozenset(GEMV_FUSIONS)
    assert parse_gemv_fusion("none") == parse_gemv_fusion("") == frozenset()
    assert parse_gemv_fusion("norm, swiglu") == {"norm", "swiglu"}
    with pytest.raises(ValueError):
        parse_gemv_fusion("norm,bogus")
    with pytest.raises(ValueError):
        EngineConfig(gemv_fusion="fast")
    assert EngineConfig(gemv_fusion="rope").gemv_fusions == {"rope"}
    assert ctypes.sizeof(RopeArgs) == 10 * 8 + 5 * 4 + 4  # struct RopeArgs: padded to 8 bytes


def test_prefill_attention_config():
    from blink.gpu.attention_launch import PREFILL_VARIANTS

    for v in PREFILL_VARIANTS:
        assert EngineConfig(prefill_attention=v).prefill_attention == v
    with pytest.raises(ValueError):
        EngineConfig(prefill_attention="fa3")
