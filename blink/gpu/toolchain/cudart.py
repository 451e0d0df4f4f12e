"""Thin libcuda helpers the scheduler launcher needs beyond `blink.gpu.toolchain.cuda_api.Driver`:
mapping the ring (a /dev/shm file) into the device."""

from __future__ import annotations

import ctypes

from blink.gpu.toolchain.cuda_api import Driver

_vp = ctypes.c_void_p

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02


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
