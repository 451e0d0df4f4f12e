"""The engine's cuBLAS GEMMs stay on the engine's stream when CuPy uses the shared handle in between.

CuPy's own matmul points the handle at CuPy's current stream and drops the user workspace. A GEMM the
engine issued after one ran on CuPy's stream, beside (not after) the engine's kernels on its own: the
FP8 head's chunks (dequantize into a scratch, then the GEMM of the chunk) read half-written scratch and
left whole vocabulary columns wrong, in 1 of 3 runs of test_gpu_fp8_lm_head.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _handle_stream(blas) -> int:
    s = ctypes.c_void_p()
    assert blas.lib.cublasGetStream_v2(ctypes.c_void_p(blas.handle), ctypes.byref(s)) == 0
    return int(s.value or 0)


def test_a_gemm_after_a_cupy_matmul_runs_on_the_engine_stream():
    import cupy as cp

    from blink.gpu.toolchain.cuda_api import Cublas

    stream = cp.cuda.Stream(non_blocking=True)
    ws = cp.empty(8 << 20, dtype=cp.uint8)
    blas = Cublas(stream.ptr, int(ws.data.ptr), int(ws.nbytes))
    a = cp.ones((64, 64), dtype=cp.float32)
    (a @ a).sum().item()  # CuPy's cuBLAS call on the null stream
    assert _handle_stream(blas) != stream.ptr  # what CuPy left the shared handle on
    x = cp.asarray((np.ones((4, 64), np.float32).view(np.uint32) >> 16).astype(np.uint16))
    w = cp.asarray((np.full((32, 64), 0.5, np.float32).view(np.uint32) >> 16).astype(np.uint16))
    y = cp.zeros((4, 32), dtype=cp.float32)
    blas.linear(int(x.data.ptr), int(w.data.ptr), int(y.data.ptr), 4, 32, 64, out_f32=True)
    assert _handle_stream(blas) == stream.ptr
    stream.synchronize()
    assert cp.asnumpy(y).tolist() == [[32.0] * 32] * 4
