"""The W8A8 GEMM's host side without a GPU: the cuBLASLt descriptor it queries the heuristic with, and
the scaling mode each GEMM shape takes (blink/gpu/engine/fp8_gemm.py)."""

from __future__ import annotations

import inspect

import pytest

from blink.gpu.engine.fp8_gemm import (
    DESC_A_SCALE_MODE,
    DESC_A_SCALE_POINTER,
    DESC_B_SCALE_MODE,
    DESC_B_SCALE_POINTER,
    DESC_FAST_ACCUM,
    FP8_OUTER_MIN_OUTPUTS,
    FP8_OUTER_MIN_ROWS,
    SCALE_OUTER_VEC_32F,
    Fp8Gemm,
    describe_fp8_modes,
    descriptor_attributes,
    fp8_epilogue_elems,
    fp8_gemm_mode,
)


def _attrs(*a, **kw) -> dict[int, int]:
    return {k: v.value for k, v in descriptor_attributes(*a, **kw)}


def test_outer_scales_are_queried_with_vector_scale_pointers_set():
    """cuBLASLt (13.1, H200) offers no outer-vector algorithm when the heuristic is asked with null
    A/B scale pointers, so "auto" never took "outer": the query must carry non-null pointers (the
    calls set each layer's vectors before cublasLtMatmul)."""
    ws = 0x7F0000000000
    a = _attrs("outer", query_scale_ptr=ws)
    assert a[DESC_A_SCALE_MODE] == a[DESC_B_SCALE_MODE] == SCALE_OUTER_VEC_32F
    assert a[DESC_A_SCALE_POINTER] == a[DESC_B_SCALE_POINTER] == ws
    assert inspect.signature(Fp8Gemm).parameters["query_scale_ptrs"].default is True


def test_epilogue_descriptor_has_unit_scales_and_fast_accum_only_when_asked():
    a = _attrs("epilogue", 131, query_scale_ptr=1 << 40)
    assert not {DESC_A_SCALE_MODE, DESC_B_SCALE_MODE, DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER} & set(a)
    assert DESC_FAST_ACCUM not in a and _attrs("outer", fast_accum=True)[DESC_FAST_ACCUM] == 1
    assert DESC_A_SCALE_POINTER not in _attrs("outer")  # the first version's query (bench only)


def test_each_gemm_takes_outer_from_its_row_and_output_line():
    both = {"outer", "epilogue"}
    n_qkv, n_o, n_gu, n_down = 6144, 4096, 28672, 4096  # Llama-3-8B
    assert [fp8_gemm_mode(both, 64, n) for n in (n_qkv, n_o, n_gu, n_down)] == ["epilogue"] * 4
    assert [fp8_gemm_mode(both, 128, n) for n in (n_qkv, n_o, n_gu, n_down)] == ["epilogue"] * 2 + ["outer", "epilogue"]
    assert [fp8_gemm_mode(both, 256, n) for n in (n_qkv, n_o, n_gu, n_down)] == ["outer", "epilogue"] * 2
    assert [fp8_gemm_mode(both, 1024, n) for n in (n_qkv, n_o, n_gu, n_down)] == ["outer"] * 4
    assert fp8_gemm_mode({"outer"}, 16, 64) == "outer" and fp8_gemm_mode({"epilogue"}, 4096, 1 << 16) == "epilogue"
    assert fp8_gemm_mode(set(), 4096, 4096) == "dequant"
    assert FP8_OUTER_MIN_ROWS == 128 and FP8_OUTER_MIN_OUTPUTS == 256 * 6144


@pytest.mark.parametrize("max_rows", [16, 127, 128, 255, 256, 1024, 4096])
@pytest.mark.parametrize("modes", [{"outer", "epilogue"}, {"epilogue"}, {"outer"}])
def test_fp32_sums_hold_the_largest_epilogue_gemm(max_rows, modes):
    widths = [64, 576, 4096, 6144, 14336, 28672]
    need = max(
        (r * n for r in range(1, max_rows + 1) for n in widths if fp8_gemm_mode(modes, r, n) == "epilogue"), default=0
    )
    got = fp8_epilogue_elems(modes, max_rows, max(widths))
    assert need <= got <= max(need, FP8_OUTER_MIN_OUTPUTS)


def test_the_path_line_names_both_modes():
    assert describe_fp8_modes({"outer", "epilogue"}) == "epilogue, outer from 128 rows and 1572864 outputs"
    assert describe_fp8_modes({"epilogue"}) == "epilogue" and describe_fp8_modes(set()) == "dequant"
