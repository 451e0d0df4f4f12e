"""Thin libcuda helpers the scheduler launcher needs beyond `blink.gpu.toolchain.cuda_api.Driver`:
mapping the ring (a /dev/shm file) into the device, module globals, stream queries."""

from __future__ import annotations

import ctypes

from blink.gpu.toolchain.cuda_api import Driver

_vp = ctypes.c_void_p

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CUDA_ERROR_NOT_READY = 600


def host_register(drv: Driver, host_ptr: int, nbytes: int) -> int:
    """Pin and map host memory (Mapped | Portable); returns its device address.

    With unified addressing the device address equals the host address; the ring's contract
    (layout.py) relies on that, so a mismatch is an error rather than something to translate."""
    drv.check(
        drv.lib.cuMemHostRegister_v2(
            _vp(host_ptr),
            ctypes.c_size_t(nbytes),
            ctypes.c_uint(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
        ),
        "cuMemHostRegister(ring)",
    )
    dptr = ctypes.c_uint64()
    drv.check(drv.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), _vp(host_ptr), ctypes.c_uint(0)), "get ptr")
    if int(dptr.value) != host_ptr:
        host_unregister(drv, host_ptr)
        raise RuntimeError(f"ring mapped at device address {dptr.value:#x} != host address {host_ptr:#x} (no UVA?)")
    return int(dptr.value)


def host_unregister(drv: Driver, host_ptr: int) -> None:
    drv.check(drv.lib.cuMemHostUnregister(_vp(host_ptr)), "cuMemHostUnregister(ring)")


def module_global(drv: Driver, module: int, name: str) -> tuple[int, int]:
    """(device address, size in bytes) of a __device__ variable."""
    ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    drv.check(drv.lib.cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), _vp(module), name.encode()), name)
    return int(ptr.value), int(size.value)


def stream_query(drv: Driver, stream: int) -> int:
    """0 when the stream's work is done, CUDA_ERROR_NOT_READY while it runs, else the error."""
    return int(drv.lib.cuStreamQuery(_vp(stream)))
