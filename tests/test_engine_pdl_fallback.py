"""Engine._capture_one where a device-launched graph refuses programmatic dependent launch: that graph is
captured again without it, the refusal is reported, and every later graph is captured without it (no GPU:
an Engine shell with a recording driver)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from blink.gpu.engine.engine import CaptureReport, Engine
from blink.gpu.toolchain.cuda_api import CudaError


class _Driver:
    """Capture and instantiation bookkeeping: instantiating a graph recorded with PDL fails when `refuse`."""

    def __init__(self, fwd: SimpleNamespace, refuse: bool) -> None:
        self.fwd, self.refuse = fwd, refuse
        self.graphs: dict[int, bool] = {}  # graph -> recorded with PDL
        self.destroyed: list[int] = []

    def begin_capture(self, s: int) -> None:
        pass

    def end_capture(self, s: int) -> int:
        g = len(self.graphs) + 1
        self.graphs[g] = self.fwd.pdl
        return g

    def graph_node_count(self, g: int) -> int:
        return 10

    def instantiate_device_launch(self, g: int) -> int:
        if self.graphs[g] and self.refuse:
            raise CudaError("cuGraphInstantiateWithFlags(DeviceLaunch): CUresult 1 (CUDA_ERROR_INVALID_VALUE)")
        return 100 + g

    def graph_upload(self, ex: int, s: int) -> None:
        pass

    def graph_destroy(self, g: int) -> None:
        self.destroyed.append(g)


def _engine(refuse: bool) -> tuple[Engine, _Driver]:
    eng = object.__new__(Engine)
    eng.fwd = SimpleNamespace(pdl=True, record=lambda s, S, T, decode: None)
    eng.driver = _Driver(eng.fwd, refuse)
    eng.s, eng._graphs, eng.report = 1, [], CaptureReport()
    eng.ecfg = SimpleNamespace(gemm_sm_reserve=0)
    eng.cublas = SimpleNamespace(set_sm_count_target=lambda n: None)
    eng.num_sms = 132
    return eng, eng.driver


def test_a_refused_graph_is_captured_again_without_pdl_and_so_are_the_later_ones(capsys: pytest.CaptureFixture):
    eng, d = _engine(refuse=True)
    assert eng._capture_one(1, 1, True, 2) == [102, 102]
    assert d.graphs == {1: True, 2: False} and d.destroyed == [1] and eng._graphs == [2]
    assert eng.fwd.pdl is False and "INVALID_VALUE" in eng.report.pdl_refused
    assert "without programmatic dependent launch" in capsys.readouterr().err
    assert eng._capture_one(8, 8, True, 2) == [103, 103] and d.graphs[3] is False
    assert (eng.report.graphs, eng.report.execs) == (2, 4)


def test_graphs_keep_pdl_where_device_launch_takes_it():
    eng, d = _engine(refuse=False)
    assert eng._capture_one(1, 1, True, 2) == [101, 101]
    assert d.graphs == {1: True} and not d.destroyed and eng.fwd.pdl and eng.report.pdl_refused == ""


def test_a_failure_without_pdl_is_raised():
    eng, d = _engine(refuse=True)
    eng.fwd.pdl = False
    d.instantiate_device_launch = lambda g: (_ for _ in ()).throw(CudaError("out of memory"))
    with pytest.raises(CudaError, match="out of memory"):
        eng._capture_one(1, 1, True, 2)
