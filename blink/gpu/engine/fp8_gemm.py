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
DESC_FAST_ACCUM = 25
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_OUTER_VEC_32F = 3
PREF_MAX_WORKSPACE_BYTES = 1
HEURISTIC_CANDIDATES = 8
SCALE_MODES = ("outer", "epilogue")

# Where the engine takes "outer" over "epilogue" (both offered): GEMMs of at least FP8_OUTER_MIN_ROWS rows
# and FP8_OUTER_MIN_OUTPUTS outputs (rows x n_out). Measured (bench.kernels.fp8_gemm_graphs, captured
# graphs, H200, Llama-3-8B, us a projection, epilogue / outer): 64 rows: every projection loses with
# outer (down 30 / 45, gate_up 45 / 49); 128: qkv 15.9 / 16.8, gate_up 49.7 / 40.2; 256: qkv 20.1 /
# 17.8, o 16.6 / 16.8, gate_up 71.0 / 58.3, down 38.6 / 45.8 (the narrow outputs with a large K: the
# one outer-vector algorithm cuBLASLt offers runs fewer CTAs than SMs); 1024 and 4096: outer wins every
# projection (-15 to -25 %). So 256 x 6144 outputs (qkv at 256 rows) is the smallest measured win and
# 256 x 4096 the largest loss. docs/decisions.md.
FP8_OUTER_MIN_ROWS = 128
FP8_OUTER_MIN_OUTPUTS = 256 * 6144


def fp8_gemm_mode(modes: set[str] | frozenset[str], rows: int, n_out: int) -> str:
    """The scaling mode of a GEMM of `rows` x `n_out` among the `modes` set up: "outer" from
    FP8_OUTER_MIN_ROWS rows and FP8_OUTER_MIN_OUTPUTS outputs (or when it is the only one), else
    "epilogue"; "dequant" when there is no W8A8 GEMM."""
    if "outer" in modes and (
        "epilogue" not in modes or (rows >= FP8_OUTER_MIN_ROWS and rows * n_out >= FP8_OUTER_MIN_OUTPUTS)
    ):
        return "outer"
    return "epilogue" if "epilogue" in modes else "dequant"


def fp8_epilogue_elems(modes: set[str] | frozenset[str], max_rows: int, max_outputs: int) -> int:
    """fp32 sums (rows x n_out) the largest "epilogue" GEMM of a step of up to max_rows rows writes."""
    if "epilogue" not in modes:
        return 0
    if "outer" not in modes:
        return max_rows * max_outputs
    below = (min(max_rows, FP8_OUTER_MIN_ROWS - 1)) * max_outputs  # every width below the row line
    return min(max_rows * max_outputs, max(below, FP8_OUTER_MIN_OUTPUTS - 1))


def describe_fp8_modes(modes: set[str] | frozenset[str]) -> str:
    """ "dequant", "epilogue", "outer", or both with the line between them."""
    if {"outer", "epilogue"} <= set(modes):
        return f"epilogue, outer from {FP8_OUTER_MIN_ROWS} rows and {FP8_OUTER_MIN_OUTPUTS} outputs"
    return next(iter(modes), "dequant")


Key = tuple[int, int, int]  # rows, n_out, k
Attr = tuple[int, ctypes._SimpleCData]


def descriptor_attributes(
    scales: str, sm_count_target: int = 0, fast_accum: bool = False, query_scale_ptr: int = 0
) -> list[Attr]:
    """The matmul descriptor's attributes, as set before the heuristic query: TN; the SM target;
    cuBLASLt's fast FP8 accumulation (FAST_ACCUM: no periodic promotion of the tensor cores' partial
    sums to fp32 registers) where asked; for "outer" the outer-vector scale modes and, when
    query_scale_ptr is given, both scale pointers set to it (a device address that stands in until
    _run sets each call's vectors)."""
    i32 = ctypes.c_int32
    attrs: list[Attr] = [(DESC_TRANSA, i32(CUBLAS_OP_T)), (DESC_TRANSB, i32(CUBLAS_OP_N))]
    if sm_count_target:
        attrs.append((DESC_SM_COUNT_TARGET, i32(sm_count_target)))
    if fast_accum:
        attrs.append((DESC_FAST_ACCUM, ctypes.c_int8(1)))
    if scales == "outer":
        attrs += [(DESC_A_SCALE_MODE, i32(SCALE_OUTER_VEC_32F)), (DESC_B_SCALE_MODE, i32(SCALE_OUTER_VEC_32F))]
        if query_scale_ptr:
            attrs += [(DESC_A_SCALE_POINTER, _vp(query_scale_ptr)), (DESC_B_SCALE_POINTER, _vp(query_scale_ptr))]
    return attrs


@dataclass
class Plan:
    desc: int
    a: int
    b: int
    d: int
    algo: HeuristicResult
    index: int = 0  # its place in the heuristic's list
    offered: int = 1  # how many algorithms the heuristic offered


class Fp8Gemm:
    """FP8 x FP8 GEMMs through cuBLASLt on one stream, with the engine's workspace.

    fast_accum: cuBLASLt's FAST_ACCUM (EngineConfig.fp8_fast_accum). query_scale_ptrs ("outer"): set
    the scale pointers (to the workspace) before the heuristic query. cuBLASLt 13.1 offers no
    outer-vector algorithm for null vector pointers on the H200, so False (the first version's query,
    kept for bench.kernels.fp8_gemm_graphs) leaves "outer" unsupported."""

    def __init__(
        self,
        driver: Driver,
        stream: int,
        workspace_ptr: int,
        workspace_bytes: int,
        scales: str,
        sm_count_target: int = 0,
        fast_accum: bool = False,
        query_scale_ptrs: bool = True,
    ) -> None:
        if scales not in SCALE_MODES:
            raise ValueError(f"fp8 GEMM scales {scales!r} not in {SCALE_MODES}")
        self.drv, self.stream, self.ws, self.ws_bytes = driver, stream, workspace_ptr, workspace_bytes
        self.scales, self.sm_count_target, self.fast_accum = scales, sm_count_target, fast_accum
        self.query_scale_ptr = workspace_ptr if query_scale_ptrs else 0
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
        for attr, value in descriptor_attributes(
            self.scales, self.sm_count_target, self.fast_accum, self.query_scale_ptr
        ):
            self._set(desc.value, attr, value)
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

    def offered(self, key: Key) -> int:
        """How many algorithms cuBLASLt's heuristic offers for this shape with these scales (no GPU work)."""
        desc, a, b, d = self._descriptors(key)
        try:
            return len(self._heuristics(desc, a, b, d))
        finally:
            self._destroy(desc, a, b, d)

    def supported(self, key: Key) -> bool:
        """Whether cuBLASLt offers an algorithm for this shape with these scales (no GPU work)."""
        return self.offered(key) > 0

    def plan(self, key: Key, operands: tuple[int, int, int, int, int]) -> Plan:
        """The plan of `key`, made on first use: the first heuristic algorithm
        that captures into a device-launchable graph (checked only outside a capture; inside one, the
        first offered)."""
        p = self.plans.get(key)
        if p is not None:
            return p
        desc, a, b, d = self._descriptors(key)
        offered = self._heuristics(desc, a, b, d)
        probe = not self.drv.is_capturing(self.stream)
        for i, hr in enumerate(offered):
            p = Plan(desc, a, b, d, hr, i, len(offered))
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
