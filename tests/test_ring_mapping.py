"""The ring's registration with the CUDA driver (blink.gpu.toolchain.cudart), held by the host loop's
executor and by the GPU scheduler. The driver lets a range of host memory be registered once per
process (a second cuMemHostRegister fails with CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED), so the
mapping is reference counted, and the host loop releases it when the ring device stops serving: a
later ring at the same address (the same ring served again, or a new one mapped where an unmapped one
was) registers again. `_DriverLib` keeps the driver's registration table and its error codes; no
CUDA call is made."""

from __future__ import annotations

import ctypes
import os
import threading
from types import SimpleNamespace

import pytest

from blink.device.ring_device import RingDevice
from blink.gpu.engine.host_executor import HostExecutor
from blink.gpu.toolchain import cudart
from blink.gpu.toolchain.cuda_api import CudaError, Driver
from blink.protocol.layout import DeviceFeatures, DeviceStatus
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import ShmTransport

ALREADY_REGISTERED, NOT_REGISTERED = 712, 713


class _DriverLib:
    """libcuda's host registration table: one registration per address, as the driver enforces."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []

    def cuMemHostRegister_v2(self, ptr, nbytes, flags) -> int:
        self.calls.append("register")
        if ptr.value in self.registered:
            return ALREADY_REGISTERED
        self.registered[ptr.value] = nbytes.value
        return 0

    def cuMemHostGetDevicePointer_v2(self, dptr, ptr, flags) -> int:
        dptr._obj.value = ptr.value  # unified addressing: the device address is the host address
        return 0

    def cuMemHostUnregister(self, ptr) -> int:
        self.calls.append("unregister")
        return 0 if self.registered.pop(ptr.value, None) is not None else NOT_REGISTERED

    def cuGetErrorName(self, res, name) -> int:
        name._obj.value = {ALREADY_REGISTERED: b"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"}.get(res.value, b"?")
        return 0


@pytest.fixture
def drv() -> Driver:
    d = object.__new__(Driver)  # Driver's checks over the table above instead of libcuda
    d.lib = _DriverLib()
    return d


def test_two_holders_share_one_registration(drv):
    """The host executor and the GPU scheduler mapping the same ring: one driver registration, released
    with the last reference."""
    buf = ctypes.create_string_buffer(4096)
    ptr = ctypes.addressof(buf)
    assert cudart.host_register(drv, ptr, 4096) == ptr
    assert cudart.host_register(drv, ptr, 4096) == ptr
    assert drv.lib.calls == ["register"] and cudart.host_references(ptr) == 2
    cudart.host_unregister(drv, ptr)
    assert drv.lib.registered and cudart.host_references(ptr) == 1
    cudart.host_unregister(drv, ptr)
    assert not drv.lib.registered and drv.lib.calls == ["register", "unregister"]
    assert cudart.host_references(ptr) == 0
    with pytest.raises(RuntimeError, match="not mapped"):
        cudart.host_unregister(drv, ptr)
    cudart.host_register(drv, ptr, 4096)  # registered again after the last release
    with pytest.raises(RuntimeError, match="4096 bytes, not 2048"):
        cudart.host_register(drv, ptr, 2048)
    cudart.host_unregister(drv, ptr)
    assert not drv.lib.registered


def test_memory_registered_outside_the_bookkeeping_is_an_error(drv):
    buf = ctypes.create_string_buffer(4096)
    ptr = ctypes.addressof(buf)
    drv.lib.registered[ptr] = 4096
    with pytest.raises(CudaError, match="ALREADY_REGISTERED"):
        cudart.host_register(drv, ptr, 4096)
    assert cudart.host_references(ptr) == 0


def _host_executor(drv, mapped: list, bound: list | None = None) -> HostExecutor:
    """A HostExecutor over an engine that only records which ring its sampler reads (map_ring) and the
    threads it bound its context to (bind_thread)."""
    ex = object.__new__(HostExecutor)
    bind = (lambda: bound.append(threading.get_ident())) if bound is not None else (lambda: None)
    ex.engine = SimpleNamespace(driver=drv, map_ring=lambda base, geo=None: mapped.append(base), bind_thread=bind)
    ex.vocab_size, ex.max_context, ex.block_size, ex.num_blocks = 64, 64, 16, 16
    ex.max_batch, ex.max_num_batched_tokens, ex.features = 4, 64, DeviceFeatures.TOKEN_MASK
    ex._registered = 0
    return ex


def test_the_host_loop_releases_the_ring_when_it_stops_serving(drv):
    """Served twice at the same address (the same ring; a new ring where a closed one was mapped): each
    run maps the ring and releases it when it stops, so the second registers again (it failed with
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED while the first run's registration was never released)."""
    t = ShmTransport.create(f"blink-test-map-{os.getpid()}", RingGeometry(4, 4 * 256, 16))
    try:
        view = t.view()
        for _ in range(2):
            mapped: list = []
            ex = _host_executor(drv, mapped)
            view.header["shutdown"] = 2
            assert RingDevice(view, ex).run() == DeviceStatus.STOPPED
            base = mapped[0]
            assert mapped == [base, None] and base and not drv.lib.registered
            assert cudart.host_references(base) == 0
        assert drv.lib.calls == ["register", "unregister"] * 2
    finally:
        t.close()
        t.unlink()


def test_the_host_loop_binds_its_context_in_the_thread_that_maps_the_ring(drv):
    """RingDevice.run maps the ring in the thread it serves from (tests serve from a thread of their own):
    the engine's context is bound in that thread before the driver registers the ring (without it the
    registration found no current context on the GPU)."""
    t = ShmTransport.create(f"blink-test-bind-{os.getpid()}", RingGeometry(4, 4 * 256, 16))
    try:
        view = t.view()
        view.header["shutdown"] = 2
        mapped: list = []
        bound: list = []
        ex = _host_executor(drv, mapped, bound)
        th = threading.Thread(target=lambda: RingDevice(view, ex).run())
        th.start()
        th.join(10)
        assert bound == [th.ident] and mapped[0] and drv.lib.calls == ["register", "unregister"]
    finally:
        t.close()
        t.unlink()
