"""Launch one engine kernel by name on CuPy arrays (the kernel tests of tests/gpu)."""

from __future__ import annotations


class KernelRig:
    def __init__(self) -> None:
        import cupy as cp

        from blink.gpu.toolchain.cuda_api import Driver
        from blink.gpu.toolchain.kernels import DEFAULT_CACHE, Kernels

        cp.cuda.Device().use()
        cp.zeros(1)
        self.drv = Driver()
        self.k = Kernels(self.drv, DEFAULT_CACHE)
        self.stream = cp.cuda.Stream(non_blocking=True)

    def launch(self, name, grid, block, smem=0, **args) -> None:
        import cupy as cp

        cp.cuda.Device().synchronize()  # the inputs were copied on CuPy's stream
        self.drv.launch(self.k[name], grid, block, self.k.args(name, args), int(self.stream.ptr), smem, name)
        self.stream.synchronize()
