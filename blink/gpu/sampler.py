"""The on-device sampling kernel on its own: rows of fp32 logits in, one token per row out.

The engine's graphs run the same kernel (sample_tokens) on the LM head's output; this wrapper
exists so tests and tools can check it against blink.device.sampling on fixed logits.
"""

from __future__ import annotations

import ctypes

import numpy as np

from blink.gpu.cuda_api import Driver
from blink.gpu.kernels import Kernels


class GpuSampler:
    def __init__(self, driver: Driver, kernels: Kernels, stream: object) -> None:
        self.driver, self.fn, self.stream = driver, kernels["sample_tokens"], stream

    def sample(
        self,
        logits: np.ndarray,
        temperature: np.ndarray,
        top_p: np.ndarray,
        top_k: np.ndarray,
        seeds: np.ndarray,
        ks: np.ndarray,
    ) -> np.ndarray:
        import cupy as cp

        rows, vocab = logits.shape
        dev = [
            cp.asarray(np.ascontiguousarray(a, dtype=dt))
            for a, dt in (
                (logits, np.float32),
                (temperature, np.float32),
                (top_p, np.float32),
                (top_k, np.int32),
                (seeds, np.uint64),
                (ks, np.uint32),
            )
        ]
        out = cp.full(rows, -1, dtype=cp.int32)
        n = cp.asarray(np.array([rows], np.uint32))
        P = ctypes.c_uint64
        args = [
            P(dev[0].data.ptr),
            ctypes.c_int(vocab),
            *[P(a.data.ptr) for a in dev[1:]],
            P(out.data.ptr),
            P(n.data.ptr),
        ]
        cp.cuda.Device().synchronize()  # the uploads ran on CuPy's stream, the launch uses ours
        s = int(self.stream.ptr)  # type: ignore[attr-defined]
        self.driver.launch(self.fn, (rows, 1, 1), (1024, 1, 1), args, s, name="sample_tokens")
        self.stream.synchronize()  # type: ignore[attr-defined]
        return out.get()
