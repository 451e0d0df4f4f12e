"""Transports: how a party reaches the ring's bytes.

A transport is one-sided: read or write bytes at an offset, publish a 32/64-bit word with
release ordering, read one with acquire ordering. The frontend roles use only this
interface, so the same code runs over shared memory (one machine), TCP to a ring agent on the
GPU host (`tcp_transport.py`) or RDMA (`rdma_transport.py`, DPU -> GPU host).

`transact(writes, reads)` is the batched form, and on a remote transport one round trip: the
writes land in list order (each one a release for the ones before it: a state word written
after the record it publishes is seen after it), then the reads run, and see every write of the
batch. The first read completes before the others start (it is an acquire for them: read the
counters first, then the data they cover); the reads after it are not ordered among themselves.
`post(writes)` is a batch of writes whose completion is not awaited: ordered like a transact's
and before every later batch, its failure shows at a later call at the latest. The frontend's hot
loops are one batch each: a token-reader cycle is one `transact` (slot records, header, a window
of tokens per active slot) and one `post` (`consumed` and releases), a submission one `post`; so
a poll costs one round trip, not one per slot.

Errors: an access outside the ring raises `RangeError` (a bug in the caller, any transport); a
ring that cannot be reached any more (agent gone, network down, peer's QP in error) raises
`TransportError`. Neither leaves a batch half-reported: a failed batch may have applied a
prefix of its writes, which is why the frontend treats TransportError as "device down".

`ShmTransport` maps a file in /dev/shm. On x86-64 (TSO) an aligned 4/8-byte store is
a single instruction and stores are not reordered with older stores, so a plain store
after the data stores is a release; a plain load before dependent loads is an acquire.
Other architectures would need explicit fences here (aarch64 DPU cores: dmb ish).
"""

from __future__ import annotations

import mmap
import os
import platform
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from .ring_geometry import RingGeometry, RingView

SHM_DIR = "/dev/shm"

if platform.machine() not in ("x86_64", "AMD64"):  # pragma: no cover - checked on import
    raise ImportError(f"ShmTransport's ordering argument holds on x86-64 only, not {platform.machine()}")


Data = bytes | bytearray | memoryview | np.ndarray
Write = tuple[int, Data]  # (offset, bytes to store there)
Read = tuple[int, np.ndarray]  # (offset, array filled from there: its nbytes are read)


class TransportError(ConnectionError):
    """The ring cannot be reached (agent gone, network down, remote queue pair in error)."""


class RangeError(ValueError):
    """An access outside the ring's bytes, or an unaligned word access."""


class Transport(Protocol):
    """One-sided access to a ring."""

    size: int
    kind: str  # "shm" | "tcp" | "rdma": logged at start-up, reported by /metrics and status

    def read(self, offset: int, n: int) -> bytes: ...
    def read_into(self, offset: int, out: np.ndarray) -> np.ndarray: ...
    def write(self, offset: int, data: Data) -> None: ...
    def load_u32(self, offset: int) -> int: ...
    def load_u64(self, offset: int) -> int: ...
    def store_u32(self, offset: int, value: int) -> None: ...
    def store_u64(self, offset: int, value: int) -> None: ...
    def transact(self, writes: Sequence[Write], reads: Sequence[Read] = ()) -> None: ...
    def post(self, writes: Sequence[Write]) -> None: ...
    def close(self) -> None: ...


def as_bytes(data: Data) -> memoryview:
    """The bytes of `data` as a flat memoryview (a C-contiguous copy of a strided array)."""
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    return memoryview(data).cast("B")


def out_bytes(out: np.ndarray) -> np.ndarray:
    """The writable bytes of a read target (it must be C-contiguous: a read fills it in place)."""
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("a read target must be a writable C-contiguous array")
    return out.reshape(-1).view(np.uint8)


def check_range(size: int, offset: int, n: int) -> None:
    if offset < 0 or n < 0 or offset + n > size:
        raise RangeError(f"access [{offset}, {offset + n}) outside the ring's {size} bytes")


def check_word(size: int, offset: int, width: int) -> None:
    if offset % width:
        raise RangeError(f"unaligned {8 * width}-bit access at {offset}")
    check_range(size, offset, width)


def host_id() -> str:
    """This machine's boot id: equal on both ends only when they run on one kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def file_id(path: str) -> str:
    """A file's identity (device and inode): two mount namespaces with their own /dev/shm tmpfs see
    different files under one name, which is what keeps `auto` from picking shm across them."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def shm_path(name: str) -> str:
    if "/" in name or not name:
        raise ValueError(f"bad ring name {name!r}")
    return os.path.join(SHM_DIR, name)


class BatchOfOne:
    """Single accesses as batches of one `transact` (a remote transport's round trip); the class
    supplies `size` and `transact(writes, reads)`."""

    size: int

    def read(self, offset: int, n: int) -> bytes:
        out = np.empty(n, np.uint8)
        self.transact((), [(offset, out)])
        return out.tobytes()

    def read_into(self, offset: int, out: np.ndarray) -> np.ndarray:
        self.transact((), [(offset, out)])
        return out

    def write(self, offset: int, data: Data) -> None:
        self.transact([(offset, data)])

    def _load(self, offset: int, dtype: str) -> int:
        out = np.empty(1, dtype)
        check_word(self.size, offset, out.itemsize)
        self.transact((), [(offset, out)])
        return int(out[0])

    def load_u32(self, offset: int) -> int:
        return self._load(offset, "<u4")

    def load_u64(self, offset: int) -> int:
        return self._load(offset, "<u8")

    def store_u32(self, offset: int, value: int) -> None:
        check_word(self.size, offset, 4)
        self.transact([(offset, np.array([value], "<u4"))])

    def store_u64(self, offset: int, value: int) -> None:
        check_word(self.size, offset, 8)
        self.transact([(offset, np.array([value], "<u8"))])


class ShmTransport:
    """A ring in a /dev/shm file, mapped MAP_SHARED by every process that opens it."""

    kind = "shm"

    def __init__(self, path: str, mm: mmap.mmap, owner: bool):
        self.path = path
        self._mm = mm
        self.size = len(mm)
        self.owner = owner
        # Typed views: an element store through them is one aligned machine store (never torn),
        # unlike struct.pack_into, which writes byte by byte.
        self._u8 = np.frombuffer(mm, np.uint8)
        self._u32 = np.frombuffer(mm, np.uint32)
        self._u64 = np.frombuffer(mm, np.uint64)

    @classmethod
    def create(cls, name: str, geometry: RingGeometry, exist_ok: bool = False) -> ShmTransport:
        path = shm_path(name)
        flags = os.O_RDWR | os.O_CREAT | (0 if exist_ok else os.O_EXCL)
        fd = os.open(path, flags, 0o600)
        try:
            os.ftruncate(fd, geometry.total_bytes)
            mm = mmap.mmap(fd, geometry.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        t = cls(path, mm, owner=True)
        RingView.create(mm, geometry)
        return t

    @classmethod
    def open(cls, name_or_path: str) -> ShmTransport:
        path = name_or_path if name_or_path.startswith("/") else shm_path(name_or_path)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, mm, owner=False)

    def view(self) -> RingView:
        """Local load/store views (only a shared-memory transport has them)."""
        return RingView(self._mm)

    def address(self) -> int:
        """Virtual address of ring byte 0 in this process (what an RDMA memory region registers)."""
        return int(self._u8.ctypes.data)

    # -- one-sided interface ------------------------------------------------------
    def read(self, offset: int, n: int) -> bytes:
        check_range(self.size, offset, n)
        return self._mm[offset : offset + n]

    def read_into(self, offset: int, out: np.ndarray) -> np.ndarray:
        b = out_bytes(out)
        check_range(self.size, offset, b.size)
        b[:] = self._u8[offset : offset + b.size]
        return out

    def write(self, offset: int, data: Data) -> None:
        b = as_bytes(data)
        check_range(self.size, offset, b.nbytes)
        self._u8[offset : offset + b.nbytes] = np.frombuffer(b, np.uint8)

    def load_u32(self, offset: int) -> int:
        check_word(self.size, offset, 4)
        return int(self._u32[offset >> 2])

    def load_u64(self, offset: int) -> int:
        check_word(self.size, offset, 8)
        return int(self._u64[offset >> 3])

    def store_u32(self, offset: int, value: int) -> None:
        check_word(self.size, offset, 4)
        self._u32[offset >> 2] = value

    def store_u64(self, offset: int, value: int) -> None:
        check_word(self.size, offset, 8)
        self._u64[offset >> 3] = value

    def transact(self, writes: Sequence[Write], reads: Sequence[Read] = ()) -> None:
        # Program order is the batch order; x86-64 keeps stores in order and loads in order (TSO).
        # A 4/8-byte aligned write is one machine store (a state word or doorbell: never torn).
        for off, data in writes:
            b = as_bytes(data)
            if b.nbytes == 4 and off % 4 == 0:
                self.store_u32(off, int(np.frombuffer(b, "<u4")[0]))
            elif b.nbytes == 8 and off % 8 == 0:
                self.store_u64(off, int(np.frombuffer(b, "<u8")[0]))
            else:
                self.write(off, b)
        for off, out in reads:
            self.read_into(off, out)

    def post(self, writes: Sequence[Write]) -> None:
        self.transact(writes)

    def close(self) -> None:
        self._u8 = self._u32 = self._u64 = None  # release exported buffers before closing the map
        try:
            self._mm.close()
        except BufferError:
            pass  # a RingView still holds it; the map closes when that view is collected

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
