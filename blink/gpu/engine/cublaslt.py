"""GEMM algorithm per shape, chosen by timing (cuBLASLt), for the engine's cuBLAS projections.

cublasGemmEx runs the first answer of cuBLAS's heuristic. On the H200 that answer for the
256-row gate_up projection of Llama-3-8B (256 x 4096 @ 28672 x 4096^T) ran at 332 TFLOP/s, where
torch.matmul on the same GPU (its own cuBLAS build) reached 653 (bench/results/archive/diag_h200_ed68643_prefill.json).
For each (rows, n_out, k, output type) the engine uses, `GemmTuner.tune` asks cuBLASLt's heuristic
for up to `candidates` algorithms and, on the real operands:
  1. drops those a device-launch graph does not accept (the scheduler launches every step graph
     from the GPU, so a GEMM that captured into anything else would break the step);
  2. drops those whose result differs from cublasGemmEx's by more than bf16 rounding;
  3. times the rest against cublasGemmEx, and keeps the fastest only when it beats GemmEx by
     `margin` (otherwise the shape stays on GemmEx, the engine's behaviour before tuning).
The choice is kept per process (`_CHOSEN`): every engine of a process computes a shape with the
same algorithm, so two engines over the same weights give the same tokens.

Types and enum values below are those of cublasLt.h (CUDA 12/13):
cublasLtMatmulHeuristicResult_t = {cublasLtMatmulAlgo_t algo (8 x u64); size_t workspaceSize;
cublasStatus_t state; float wavesCount; int reserved[4]} = 96 bytes.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blink.gpu.toolchain.cuda_api import (
    CUBLAS_COMPUTE_32F,
    CUBLAS_OP_N,
    CUBLAS_OP_T,
    CUDA_R_16BF,
    CUDA_R_32F,
    CudaError,
    Driver,
    loaded_library_path,
)

_vp = ctypes.c_void_p
MATMUL_DESC_TRANSA, MATMUL_DESC_TRANSB, MATMUL_DESC_SM_COUNT_TARGET = 3, 4, 15
PREF_MAX_WORKSPACE_BYTES = 1


class HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


# a cuBLASLt algorithm replaces cublasGemmEx for a shape only when this much faster
GEMM_MARGIN = 0.03

Key = tuple[int, int, int, bool]  # rows, n_out, k, fp32 output (per process: one SM target per process)
# per process: shape -> the chosen heuristic result (its 96 bytes), or None = cublasGemmEx
_CHOSEN: dict[Key, bytes | None] = {}


def choose(gemmex_ms: float, candidate_ms: list[float], margin: float) -> int | None:
    """Index of the candidate to use, or None (stay on cublasGemmEx): the fastest candidate,
    only when it is faster than GemmEx by more than `margin` (a fraction)."""
    if not candidate_ms:
        return None
    best = min(range(len(candidate_ms)), key=candidate_ms.__getitem__)
    return best if candidate_ms[best] < gemmex_ms * (1.0 - margin) else None


@dataclass
class Plan:
    """One shape on cuBLASLt: descriptors and the algorithm, alive as long as the engine."""

    desc: int
    a: int
    b: int
    c: int
    algo: HeuristicResult


@dataclass
class TuneResult:
    key: Key
    gemmex_ms: float
    candidates: int  # offered by the heuristic
    usable: int  # passed the device-launch and result checks
    best_ms: float  # fastest usable candidate (nan if none)
    chosen: bool  # the engine uses cuBLASLt for this shape

    def as_dict(self) -> dict:
        r, n, k, f32 = self.key
        return {
            "rows": r,
            "n_out": n,
            "k": k,
            "out_f32": f32,
            "gemmex_ms": self.gemmex_ms,
            "best_lt_ms": self.best_ms,
            "candidates": self.candidates,
            "usable": self.usable,
            "lt": self.chosen,
        }


class GemmTuner:
    """cuBLASLt plans for the shapes that tuning moved off cublasGemmEx (see the module doc)."""

    def __init__(self, stream: int, workspace_ptr: int, workspace_bytes: int, sm_count_target: int = 0) -> None:
        self.stream, self.ws, self.ws_bytes = stream, workspace_ptr, workspace_bytes
        self.sm_count_target = sm_count_target  # as cublasSetSmCountTarget (0: every SM)
        # the cuBLASLt next to the libcublas the engine calls (a process with torch may map two)
        lt = ctypes.CDLL(loaded_library_path("libcublasLt.so", near=loaded_library_path("libcublas.so", "libcublasLt")))
        pp = ctypes.POINTER(_vp)
        lt.cublasLtCreate.argtypes = [pp]
        lt.cublasLtMatmulDescCreate.argtypes = [pp, ctypes.c_int, ctypes.c_int]
        lt.cublasLtMatmulDescSetAttribute.argtypes = [_vp, ctypes.c_int, _vp, ctypes.c_size_t]
        lt.cublasLtMatrixLayoutCreate.argtypes = [pp, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
        lt.cublasLtMatmulPreferenceCreate.argtypes = [pp]
        lt.cublasLtMatmulPreferenceSetAttribute.argtypes = [_vp, ctypes.c_int, _vp, ctypes.c_size_t]
        lt.cublasLtMatmulPreferenceDestroy.argtypes = [_vp]
        lt.cublasLtMatmulDescDestroy.argtypes = [_vp]
        lt.cublasLtDestroy.argtypes = [_vp]
        lt.cublasLtMatrixLayoutDestroy.argtypes = [_vp]
        lt.cublasLtMatmulAlgoGetHeuristic.argtypes = [_vp] * 7 + [ctypes.c_int, _vp, ctypes.POINTER(ctypes.c_int)]
        lt.cublasLtMatmul.argtypes = [_vp] * 14 + [ctypes.c_size_t, _vp]
        self.lt = lt
        h = _vp()
        self._check(lt.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        self.handle = h.value
        self.plans: dict[Key, Plan] = {}
        self._one = ctypes.c_float(1.0)
        self._zero = ctypes.c_float(0.0)

    @staticmethod
    def _check(st: int, what: str) -> None:
        if st != 0:
            raise CudaError(f"{what}: cublasStatus {st}")

    def _descriptors(self, key: Key) -> tuple[int, int, int, int]:
        """Column-major, as Cublas.linear: D[n_out, rows] = W^T(op T of [k, n_out]) X([k, rows])."""
        rows, n_out, k, f32 = key
        lt, i32 = self.lt, ctypes.c_int32
        desc = _vp()
        self._check(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate")
        attrs = [(MATMUL_DESC_TRANSA, CUBLAS_OP_T), (MATMUL_DESC_TRANSB, CUBLAS_OP_N)]
        if self.sm_count_target:
            attrs.append((MATMUL_DESC_SM_COUNT_TARGET, self.sm_count_target))
        for attr, op in attrs:
            v = i32(op)
            self._check(
                lt.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), ctypes.sizeof(v)),
                "MatmulDescSetAttribute",
            )
        lay = []
        for dtype, r, c, ld in ((CUDA_R_16BF, k, n_out, k), (CUDA_R_16BF, k, rows, k)) + (
            ((CUDA_R_32F if f32 else CUDA_R_16BF), n_out, rows, n_out),
        ):
            m = _vp()
            self._check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(m), dtype, r, c, ld), "MatrixLayoutCreate")
            lay.append(m.value)
        return desc.value, lay[0], lay[1], lay[2]

    def _heuristics(self, desc: int, a: int, b: int, c: int, n: int) -> list[HeuristicResult]:
        lt = self.lt
        pref = _vp()
        self._check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(self.ws_bytes)
            self._check(
                lt.cublasLtMatmulPreferenceSetAttribute(
                    pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), ctypes.sizeof(ws)
                ),
                "MatmulPreferenceSetAttribute",
            )
            res = (HeuristicResult * n)()
            got = ctypes.c_int(0)
            st = lt.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, n, res, ctypes.byref(got))
            if st != 0:
                return []
            return [res[i] for i in range(got.value) if res[i].state == 0]
        finally:
            lt.cublasLtMatmulPreferenceDestroy(pref)

    def matmul(self, plan: Plan, x: int, w: int, y: int) -> None:
        self._check(
            self.lt.cublasLtMatmul(
                self.handle,
                plan.desc,
                ctypes.byref(self._one),
                w,
                plan.a,
                x,
                plan.b,
                ctypes.byref(self._zero),
                y,
                plan.c,
                y,
                plan.c,
                ctypes.byref(plan.algo.algo),
                self.ws,
                self.ws_bytes,
                self.stream,
            ),
            "cublasLtMatmul",
        )

    def tune(
        self,
        key: Key,
        x: int,
        w: int,
        y: object,
        gemmex: Callable[[], None],
        driver: Driver,
        time_ms: Callable[[Callable[[], None]], float],
        candidates: int,
        margin: float,
    ) -> TuneResult:
        """Choose GemmEx or a cuBLASLt algorithm for `key` on these operands (y: a CuPy array, the
        output buffer; it is overwritten). A shape chosen before in this process reuses that choice."""
        import cupy as cp

        chosen = _CHOSEN.get(key, b"")
        if chosen is None:
            return TuneResult(key, float("nan"), 0, 0, float("nan"), False)
        if chosen:
            hr = HeuristicResult.from_buffer_copy(chosen)
            if hr.workspace_size <= self.ws_bytes:
                self.plans[key] = Plan(*self._descriptors(key), hr)
                return TuneResult(key, float("nan"), 0, 0, float("nan"), True)
        desc, a, b, c = self._descriptors(key)
        offered = self._heuristics(desc, a, b, c, candidates)
        sync = lambda: cp.cuda.runtime.streamSynchronize(self.stream)  # noqa: E731 (CuPy's ops below run on its stream)
        gemmex()
        sync()
        ref = cp.array(y, copy=True)  # type: ignore[call-overload]
        as_f32 = _bf16_to_f32 if ref.dtype == cp.uint16 else (lambda a: a)  # bf16 bits or fp32 output
        want = as_f32(ref)
        scale = float(cp.abs(want).max()) or 1.0
        usable: list[tuple[Plan, float]] = []
        for hr in offered:
            plan = Plan(desc, a, b, c, hr)
            if not self._device_launchable(plan, x, w, y, driver):  # type: ignore[arg-type]
                continue
            self.matmul(plan, x, w, int(y.data.ptr))  # type: ignore[attr-defined]
            sync()
            if float(cp.abs(as_f32(y) - want).max()) > 2e-2 * scale:
                continue
            usable.append((plan, time_ms(lambda plan=plan: self.matmul(plan, x, w, int(y.data.ptr)))))  # type: ignore[attr-defined]
        gemmex_ms = time_ms(gemmex)
        pick = choose(gemmex_ms, [t for _, t in usable], margin)
        best_ms = min((t for _, t in usable), default=float("nan"))
        if pick is not None:
            self.plans[key] = usable[pick][0]
            _CHOSEN[key] = bytes(usable[pick][0].algo)
        else:
            _CHOSEN[key] = None
            self._destroy(desc, a, b, c)
        return TuneResult(key, gemmex_ms, len(offered), len(usable), best_ms, pick is not None)

    def _destroy(self, desc: int, *layouts: int) -> None:
        self.lt.cublasLtMatmulDescDestroy(desc)
        for m in layouts:
            self.lt.cublasLtMatrixLayoutDestroy(m)

    def close(self) -> None:
        for p in self.plans.values():
            self._destroy(p.desc, p.a, p.b, p.c)
        self.plans.clear()
        if self.handle:
            self.lt.cublasLtDestroy(self.handle)
            self.handle = None

    def _device_launchable(self, plan: Plan, x: int, w: int, y: object, driver: Driver) -> bool:
        """Capture the GEMM alone and instantiate it for device launch; False if either fails."""
        s = self.stream
        driver.begin_capture(s)
        ok = True
        try:
            self.matmul(plan, x, w, int(y.data.ptr))  # type: ignore[attr-defined]
        except CudaError:
            ok = False
        try:
            graph = driver.end_capture(s)
        except CudaError:
            return False  # the capture was invalidated
        try:
            if ok:
                driver.graph_exec_destroy(driver.instantiate_device_launch(graph))
        except CudaError:
            ok = False
        finally:
            driver.graph_destroy(graph)
        return ok


def _bf16_to_f32(a: object) -> object:
    """uint16 bf16 bit patterns -> float32 (CuPy)."""
    import cupy as cp

    return (a.astype(cp.uint32) << 16).view(cp.float32)  # type: ignore[attr-defined]


def gpu_time_ms(driver: Driver, kernels: Any, stream: Any, fn: Callable[[], None], iters: int = 6) -> float:
    """GPU milliseconds per fn() (work enqueued on `stream`, a CuPy stream), behind the spin_ns
    kernel, so that the launch calls are all enqueued before the timed work starts."""
    import cupy as cp

    fn()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    driver.launch(kernels["spin_ns"], (1, 1, 1), (1, 1, 1), kernels.args("spin_ns", {"ns": 300_000}), int(stream.ptr))
    a.record(stream)
    for _ in range(iters):
        fn()
    b.record(stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / iters


def tune_engine(eng: Any, rows: list[int], progress: Callable[..., None] | None = None) -> None:
    """Choose cublasGemmEx or a cuBLASLt algorithm for every cuBLAS shape of an Engine's steps at
    these row counts (its gemm_jobs, on layer 0's weights and random activations); the choices go
    to eng.cublas.tuner, the timings to eng.report.gemm_tuning."""
    import cupy as cp

    t0 = time.perf_counter()
    blas, r = eng.cublas, eng.ecfg.gemm_sm_reserve
    if blas.tuner is None:
        blas.tuner = GemmTuner(
            eng.s, int(eng.workspace.data.ptr), int(eng.workspace.nbytes), eng.num_sms - r if r else 0
        )
    jobs = eng.gemm_jobs(rows)
    f = eng.fwd
    inputs = (f.hid, f.attn, f.act, f.last)
    rng = cp.random.RandomState(eng.ecfg.seed)
    for buf in inputs:  # bf16 N(0, 1) bit patterns (timing on zeros would flatter every kernel)
        buf[...] = (rng.standard_normal(buf.shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    cp.cuda.Device().synchronize()  # CuPy wrote on its own stream; the GEMMs run on the engine's

    def timer(fn: Callable[[], None]) -> float:
        return gpu_time_ms(eng.driver, eng.kernels, eng.stream, fn)

    for n, (x, w, y, rows_, f32) in enumerate(jobs):
        n_out, k = int(w.shape[0]), int(w.shape[1])
        args = (int(x.data.ptr), int(w.data.ptr), int(y.data.ptr), rows_, n_out, k, f32)
        res = blas.tuner.tune(
            (rows_, n_out, k, f32),
            args[0],
            args[1],
            y,
            lambda args=args: blas.linear(*args, tuned=False),
            eng.driver,
            timer,
            eng.ecfg.gemm_candidates,
            GEMM_MARGIN,
        )
        eng.report.gemm_tuning.append(res.as_dict())
        if progress is not None:
            progress(n + 1, len(jobs), time.perf_counter() - t0, "tuning GEMMs")
    eng.stream.synchronize()
    for buf in inputs:
        buf[...] = 0
    cp.cuda.Device().synchronize()
    eng.report.tune_seconds += time.perf_counter() - t0
    if progress is not None and jobs:
        lt = sum(1 for g in eng.report.gemm_tuning if g["lt"])
        print(f"\n{lt} of {len(jobs)} GEMM shapes on cuBLASLt", file=sys.stderr)
