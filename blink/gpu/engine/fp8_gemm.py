"""The W8A8 FP8 GEMM of large steps with FP8 weights: cuBLASLt on FP8 tensor cores.

A step past the FP8 GEMV's sizes quantizes each projection's input per token (fp8_quantize_rows in
engine/csrc/fp8.cu: xs[t] = amax / 448, e4m3 codes) and multiplies the codes with the weight's codes:

    Y[t, n] = bf16(xs[t] * ws[n] * sum_k e4m3(X8[t, k]) e4m3(W8[n, k]))       (fp32 sums)

(the definition: blink.models.fp8.w8a8_linear). cuBLASLt is column-major and takes FP8 only in the
"TN" form (both operands K-major): row-major Y [T, N] is column-major Y^T [N, T] = W8 (op T of the
column-major [K, N] that the row-major codes [N, K] are) times X8 (column-major [K, T], op N).
Two ways to apply the scales ("scales" in Fp8Gemm):
  "outer"    cuBLASLt's outer-vector scaling (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F): A's scale a
             vector over its N rows (ws), B's over its T columns (xs), bf16 D. One kernel.
  "epilogue" unit scales, fp32 D, then fp8_scale_rows (fp8.cu) scales and rounds to bf16: for a
             cuBLASLt without outer-vector scaling on this GPU.
The algorithm of each (rows, n_out, k) is the first that cuBLASLt's heuristic offers and that a
device-launchable graph accepts (every step graph is launched from the GPU). The workspace is the
engine's, given up front, so a captured GEMM allocates nothing. Enum values: cublasLt.h (CUDA 12.9/13).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from blink.gpu.toolchain.cuda_api import (
    CUBLAS_COMPUTE_32F,
    CUBLAS_OP_N,
    CUBLAS_OP_T,
    CUDA_R_16BF,
    CUDA_R_32F,
    CudaError,
    Driver,
    HeuristicResult,
    load_cublaslt,
)

_vp = ctypes.c_void_p
CUDA_R_8F_E4M3 = 28
DESC_TRANSA, DESC_TRANSB, DESC_SM_COUNT_TARGET = 3, 4, 15
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_OUTER_VEC_32F = 3
PREF_MAX_WORKSPACE_BYTES = 1
HEURISTIC_CANDIDATES = 8
SCALE_MODES = ("outer", "epilogue")

Key = tuple[int, int, int]  # rows, n_out, k


@dataclass
class Plan:
    desc: int
    a: int
    b: int
    d: int
    algo: HeuristicResult


class Fp8Gemm:
    """FP8 x FP8 GEMMs through cuBLASLt on one stream, with the engine's workspace."""

    def __init__(
        self,
        driver: Driver,
        stream: int,
        workspace_ptr: int,
        workspace_bytes: int,
        scales: str,
        sm_count_target: int = 0,
    ) -> None:
        if scales not in SCALE_MODES:
            raise ValueError(f"fp8 GEMM scales {scales!r} not in {SCALE_MODES}")
        self.drv, self.stream, self.ws, self.ws_bytes = driver, stream, workspace_ptr, workspace_bytes
        self.scales, self.sm_count_target = scales, sm_count_target
        lt = load_cublaslt()
        self.lt = lt
        h = _vp()
        self._check(lt.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        self.handle = h.value
        self.plans: dict[Key, Plan] = {}
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(st: int, what: str) -> None:
        if st != 0:
            raise CudaError(f"{what}: cublasStatus {st}")

    def _set(self, desc: int, attr: int, value: ctypes._SimpleCData) -> None:
        self._check(
            self.lt.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
            f"MatmulDescSetAttribute({attr})",
        )

    def _descriptors(self, key: Key) -> tuple[int, int, int, int]:
        rows, n_out, k = key
        lt = self.lt
        desc = _vp()
        self._check(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate")
        i32 = ctypes.c_int32
        self._set(desc.value, DESC_TRANSA, i32(CUBLAS_OP_T))
        self._set(desc.value, DESC_TRANSB, i32(CUBLAS_OP_N))
        if self.sm_count_target:
            self._set(desc.value, DESC_SM_COUNT_TARGET, i32(self.sm_count_target))
        if self.scales == "outer":
            self._set(desc.value, DESC_A_SCALE_MODE, i32(SCALE_OUTER_VEC_32F))
            self._set(desc.value, DESC_B_SCALE_MODE, i32(SCALE_OUTER_VEC_32F))
        out = CUDA_R_16BF if self.scales == "outer" else CUDA_R_32F
        lay = []
        for dtype, r, c, ld in ((CUDA_R_8F_E4M3, k, n_out, k), (CUDA_R_8F_E4M3, k, rows, k), (out, n_out, rows, n_out)):
            m = _vp()
            self._check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(m), dtype, r, c, ld), "MatrixLayoutCreate")
            lay.append(m.value)
        return desc.value, lay[0], lay[1], lay[2]

    def _heuristics(self, desc: int, a: int, b: int, d: int) -> list[HeuristicResult]:
        lt, pref = self.lt, _vp()
        self._check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(self.ws_bytes)
            self._check(
                lt.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
                "MatmulPreferenceSetAttribute",
            )
            res = (HeuristicResult * HEURISTIC_CANDIDATES)()
            got = ctypes.c_int(0)
            st = lt.cublasLtMatmulAlgoGetHeuristic(
                self.handle, desc, a, b, d, d, pref, HEURISTIC_CANDIDATES, res, ctypes.byref(got)
            )
            return [res[i] for i in range(got.value) if res[i].state == 0] if st == 0 else []
        finally:
            lt.cublasLtMatmulPreferenceDestroy(pref)

    def supported(self, key: Key) -> bool:
        """Whether cuBLASLt offers an algorithm for this shape with these scales (no GPU work)."""
        desc, a, b, d = self._descriptors(key)
        try:
            return bool(self._heuristics(desc, a, b, d))
        finally:
            self._destroy(desc, a, b, d)

    def plan(self, key: Key, operands: tuple[int, int, int, int, int]) -> Plan:
        """The plan of `key`, made on first use: the first heuristic algorithm that captures into a
        device-launchable graph (checked only outside a capture; inside one, the first offered)."""
        p = self.plans.get(key)
        if p is not None:
            return p
        desc, a, b, d = self._descriptors(key)
        offered = self._heuristics(desc, a, b, d)
        probe = not self.drv.is_capturing(self.stream)
        for hr in offered:
            p = Plan(desc, a, b, d, hr)
            if not probe or self._device_launchable(p, operands):
                self.plans[key] = p
                return p
        self._destroy(desc, a, b, d)
        raise CudaError(f"cuBLASLt has no FP8 ({self.scales} scales) algorithm for {key} usable in a device graph")

    def matmul(self, rows: int, n_out: int, k: int, x8: int, w8: int, d: int, xs: int, ws: int) -> None:
        """D = X8 W8^T: bf16 with the scales applied ("outer"), or fp32 unscaled ("epilogue": xs, ws unused)."""
        ops = (x8, w8, d, xs, ws)
        self._run(self.plan((rows, n_out, k), ops), ops)

    def _run(self, p: Plan, ops: tuple[int, int, int, int, int]) -> None:
        x8, w8, d, xs, ws = ops
        if self.scales == "outer":  # read when cublasLtMatmul is called: one descriptor serves every layer
            self._set(p.desc, DESC_A_SCALE_POINTER, _vp(ws))
            self._set(p.desc, DESC_B_SCALE_POINTER, _vp(xs))
        self._check(
            self.lt.cublasLtMatmul(
                self.handle, p.desc, ctypes.byref(self._one), w8, p.a, x8, p.b, ctypes.byref(self._zero),
                d, p.d, d, p.d, ctypes.byref(p.algo.algo), self.ws, self.ws_bytes, self.stream,
            ),
            "cublasLtMatmul(fp8)",
        )  # fmt: skip

    def _device_launchable(self, p: Plan, ops: tuple[int, int, int, int, int]) -> bool:
        return self.drv.device_launchable(self.stream, lambda: self._run(p, ops))

    def _destroy(self, desc: int, *layouts: int) -> None:
        self.lt.cublasLtMatmulDescDestroy(desc)
        for m in layouts:
            self.lt.cublasLtMatrixLayoutDestroy(m)

    def close(self) -> None:
        for p in self.plans.values():
            self._destroy(p.desc, p.a, p.b, p.d)
        self.plans.clear()
        if self.handle:
            self.lt.cublasLtDestroy(self.handle)
            self.handle = None
