"""FP8 linear-layer weights on the GPU (`--quantization fp8`; the definition: blink.models.fp8).

A quantized projection is an `Fp8Linear`: codes (out, in) uint8 e4m3 bit patterns and scales (out,)
float32, per output channel. The fused projections (qkv, gate_up) are one Fp8Linear each whose row
slices are the checkpoint's tensors (the scales are per row, so fusing changes nothing). A MoE layer's
experts are one Fp8Linear each for gate_up and down, stacked: codes (E, out, in), scales (E, out).

Loading streams: each bf16 tensor the loader yields is copied into one staging buffer (the size of
the largest quantized tensor) and quantized on the GPU into its rows of codes and scales, allocated
up front (fp8_quantize_rows in engine/csrc/fp8.cu: the numpy definition's arithmetic, so the same bits).
The host holds one bf16 tensor at a time, the device the FP8 model plus one bf16 tensor.
The staging copy and the kernel run on the legacy default stream, in order: a tensor's copy waits
for the previous tensor's kernel, so one buffer serves them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blink.gpu.toolchain.cuda_api import Driver
from blink.gpu.toolchain.kernels import Kernels

FP8_GEMV_BUCKETS = (1, 2, 4, 8)
FP8_GEMV_ROWS_PER_WARP = {1: 1, 2: 4, 4: 4, 8: 4}  # must match GEMV_FP8(NT, R, U) in fp8.cu
FP8_PROJECTIONS = ("qkv", "o", "gate_up", "down")  # LayerWeights fields that fp8 quantizes
FP8_EXPERTS = ("experts_gate_up", "experts_down")  # and in MoE layers, the stacked experts (E, out, in)
# Paths of FP8 projections past the GEMV (Forward.set_fp8_gemm; EngineConfig.fp8_gemm picks):
# the W8A8 cuBLASLt GEMM with outer-vector scales or with the scaling epilogue kernel, or weight-only
# dequantize + bf16 GEMM (where cuBLASLt has no FP8 GEMM).
FP8_LARGE_PATHS = ("outer", "epilogue", "dequant")
_LEGACY_STREAM = 0


@dataclass
class Fp8Linear:
    codes: object  # (out, in) uint8 CuPy array: e4m3fn bit patterns; experts: (E, out, in)
    scales: object  # (out,) float32 CuPy array: W[n, k] ~ scales[n] * e4m3(codes[n, k]); experts: (E, out)

    @classmethod
    def empty(cls, shape: tuple[int, ...]) -> Fp8Linear:
        import cupy as cp

        if shape[-1] % 16:
            raise ValueError(f"fp8 weights need an input size that is a multiple of 16, got {shape}")
        return cls(cp.empty(shape, dtype=cp.uint8), cp.empty(shape[:-1], dtype=cp.float32))

    def rows(self) -> Fp8Linear:
        """The weight as one (rows, in) matrix of views (stacked experts: (E * out, in))."""
        k = self.shape[-1]
        return Fp8Linear(self.codes.reshape(-1, k), self.scales.reshape(-1))  # type: ignore[attr-defined]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)  # type: ignore[attr-defined]

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes) + int(self.scales.nbytes)  # type: ignore[attr-defined]

    def __getitem__(self, rows: slice | int | tuple) -> Fp8Linear:
        """The rows `rows` (a slice; stacked experts: an expert, or (expert, slice)) as an Fp8Linear of
        views: a fused projection's pieces."""
        return Fp8Linear(self.codes[rows], self.scales[rows])  # type: ignore[index]


def quantize_rows(driver: Driver, kernels: Kernels, stream: int, src: object, dst: Fp8Linear) -> None:
    """Launch fp8_quantize_rows: the bf16 rows of `src` (a CuPy uint16 array or pointer, dst.shape)
    into dst's codes and scales."""
    n, k = dst.shape
    args = kernels.args("fp8_quantize_rows", {"W": src, "codes": dst.codes, "scales": dst.scales, "N": n, "K": k})
    driver.launch(kernels["fp8_quantize_rows"], (n, 1, 1), (256, 1, 1), args, stream, name="fp8_quantize_rows")


class Fp8Loader:
    """Quantizes bf16 tensors into preallocated Fp8Linear rows through one staging buffer."""

    def __init__(self, driver: Driver, kernels: Kernels, max_elems: int) -> None:
        import cupy as cp

        self.driver, self.kernels = driver, kernels
        self.stage = cp.empty(max_elems, dtype=cp.uint16)

    def put(self, dst: Fp8Linear, bits: np.ndarray) -> None:
        """bits (uint16 bf16, dst.shape) -> dst, quantized on the GPU."""
        n, k = dst.shape
        if bits.dtype != np.uint16 or bits.shape != (n, k):
            raise ValueError(f"fp8 load: {bits.dtype} {bits.shape}, expected uint16 {(n, k)}")
        stage = self.stage[: n * k]  # type: ignore[index]
        stage.set(np.ascontiguousarray(bits).reshape(-1))  # on the legacy stream: after the last kernel
        quantize_rows(self.driver, self.kernels, _LEGACY_STREAM, stage, dst)


def quantize_layers(layers: list, driver: Driver, kernels: Kernels) -> None:
    """Replace each layer's bf16 projections (FP8_PROJECTIONS, and a MoE layer's FP8_EXPERTS, row by
    row) by their FP8 quantization, one at a time (random weights made on the GPU). On the legacy
    stream: a bf16 array freed here is reused by CuPy only for work queued after the kernel that reads
    it. The caller synchronizes."""
    for lw in layers:
        for name in (*FP8_PROJECTIONS, *FP8_EXPERTS):
            w = getattr(lw, name)
            if w is not None:
                q = Fp8Linear.empty(tuple(w.shape))
                quantize_rows(driver, kernels, _LEGACY_STREAM, w, q.rows())
                setattr(lw, name, q)
