"""Thin libcuda helpers the scheduler launcher needs beyond `blink.gpu.toolchain.cuda_api.Driver`:
mapping the ring (a /dev/shm file) into the device.

A range of host memory can be registered with the driver once per process: the host loop's executor
and the GPU scheduler may both map the same ring (tests serve one ring with each in turn, and a ring
created after another was unmapped can land at the same address). `host_register` therefore counts
references per address: the first registers, later ones share the mapping, and `host_unregister`
unregisters when the last reference goes (before the ring is unmapped)."""

from __future__ import annotations

import ctypes
import threading

from blink.gpu.toolchain.cuda_api import Driver

_vp = ctypes.c_void_p

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02

_lock = threading.Lock()
_mapped: dict[int, list[int]] = {}  # host address -> [bytes, references]


def host_register(drv: Driver, host_ptr: int, nbytes: int) -> int:
    """Pin and map host memory (Mapped | Portable), or take one more reference to this process's mapping
    of it; returns its device address. Pair every call with `host_unregister`.

    With unified addressing the device address equals the host address; the ring's contract
    (layout.py) relies on that, so a mismatch is an error rather than something to translate."""
    with _lock:
        held = _mapped.get(host_ptr)
        if held is not None:
            if held[0] != nbytes:
                raise RuntimeError(f"host memory at {host_ptr:#x} is mapped with {held[0]} bytes, not {nbytes}")
            held[1] += 1
            return host_ptr
        drv.check(
            drv.lib.cuMemHostRegister_v2(
                _vp(host_ptr),
                ctypes.c_size_t(nbytes),
                ctypes.c_uint(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
            ),
            "cuMemHostRegister(ring)",
        )
        dptr = ctypes.c_uint64()
        res = drv.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), _vp(host_ptr), ctypes.c_uint(0))
        if res != 0 or int(dptr.value) != host_ptr:
            drv.lib.cuMemHostUnregister(_vp(host_ptr))
            drv.check(res, "cuMemHostGetDevicePointer(ring)")
            raise RuntimeError(f"ring mapped at device address {dptr.value:#x} != host address {host_ptr:#x} (no UVA?)")
        _mapped[host_ptr] = [nbytes, 1]
        return host_ptr


def host_unregister(drv: Driver, host_ptr: int) -> None:
    """Drop one reference taken by `host_register`; the last one unregisters the memory."""
    with _lock:
        held = _mapped.get(host_ptr)
        if held is None:
            raise RuntimeError(f"host memory at {host_ptr:#x} is not mapped")
        held[1] -= 1
        if held[1]:
            return
        del _mapped[host_ptr]
        drv.check(drv.lib.cuMemHostUnregister(_vp(host_ptr)), "cuMemHostUnregister(ring)")


def host_references(host_ptr: int) -> int:
    """References this process holds to its mapping of the host memory at host_ptr (0: not mapped)."""
    with _lock:
        held = _mapped.get(host_ptr)
        return held[1] if held is not None else 0
