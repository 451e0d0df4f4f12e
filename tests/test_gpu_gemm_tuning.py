"""The GEMM tuner's CPU-side parts: its choice rule, the cuBLASLt struct it passes by pointer,
and the engine option. The tuning itself runs on the GPU (tests/gpu/test_engine.py)."""

from __future__ import annotations

import ctypes

import pytest

from blink.gpu.engine.cublaslt import GEMM_MARGIN, HeuristicResult, choose
from blink.gpu.engine.engine import EngineConfig


def test_heuristic_result_matches_cublaslt_h():
    # cublasLtMatmulHeuristicResult_t: algo (8 x uint64), size_t workspaceSize, cublasStatus_t state,
    # float wavesCount, int reserved[4]
    assert ctypes.sizeof(HeuristicResult) == 96
    assert HeuristicResult.workspace_size.offset == 64
    assert HeuristicResult.state.offset == 72
    assert HeuristicResult.waves_count.offset == 76
    h = HeuristicResult()
    h.algo[7], h.workspace_size = 3, 1 << 20
    back = HeuristicResult.from_buffer_copy(bytes(h))
    assert back.algo[7] == 3 and back.workspace_size == 1 << 20


@pytest.mark.parametrize(
    "gemmex,cands,margin,want",
    [
        (1.0, [], 0.03, None),  # nothing usable: cublasGemmEx
        (1.0, [0.99, 0.98], 0.03, None),  # faster, but inside the margin: cublasGemmEx
        (1.0, [0.99, 0.5, 0.6], 0.03, 1),  # the fastest, clearly faster
        (1.0, [1.2], 0.03, None),
        (1.0, [1.2, 1.5], -1.0, 0),  # a negative margin keeps the fastest even when slower
    ],
)
def test_choose(gemmex, cands, margin, want):
    assert choose(gemmex, cands, margin) == want


def test_engine_option():
    assert EngineConfig().gemm_candidates == 0 and 0 < GEMM_MARGIN < 0.5  # off by default (engine.py)
    assert EngineConfig(gemm_candidates=8).gemm_candidates == 8
    with pytest.raises(ValueError):
        EngineConfig(gemm_candidates=-1)
    with pytest.raises(ValueError):
        EngineConfig(gemm_candidates=65)


def test_gemm_sm_reserve_option():
    assert EngineConfig(gemm_sm_reserve=1).gemm_sm_reserve == 1
    for bad in (-1, 9):
        with pytest.raises(ValueError):
            EngineConfig(gemm_sm_reserve=bad)
