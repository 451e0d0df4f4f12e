"""Transports: how a party reaches the ring's bytes.

A transport is one-sided: read or write bytes at an offset, publish a 32/64-bit word with
release ordering, read one with acquire ordering. The frontend roles use only this
interface, so the same code runs over shared memory (one machine) or RDMA (DPU -> GPU).

`ShmTransport` maps a file in /dev/shm. On x86-64 (TSO) an aligned 4/8-byte store is
a single instruction and stores are not reordered with older stores, so a plain store
after the data stores is a release; a plain load before dependent loads is an acquire.
Other architectures would need explicit fences here (aarch64 DPU cores: dmb ish).
"""

from __future__ import annotations

import mmap
import os
import platform
from typing import Protocol

import numpy as np

from .layout import RingGeometry, RingView

SHM_DIR = "/dev/shm"

if platform.machine() not in ("x86_64", "AMD64"):  # pragma: no cover - checked on import
    raise ImportError(f"ShmTransport's ordering argument holds on x86-64 only, not {platform.machine()}")


class Transport(Protocol):
    """One-sided access to a ring."""

    size: int

    def read(self, offset: int, n: int) -> bytes: ...
    def read_into(self, offset: int, out: np.ndarray) -> np.ndarray: ...
    def write(self, offset: int, data: bytes | np.ndarray) -> None: ...
    def load_u32(self, offset: int) -> int: ...
    def load_u64(self, offset: int) -> int: ...
    def store_u32(self, offset: int, value: int) -> None: ...
    def store_u64(self, offset: int, value: int) -> None: ...
    def close(self) -> None: ...


def shm_path(name: str) -> str:
    if "/" in name or not name:
        raise ValueError(f"bad ring name {name!r}")
    return os.path.join(SHM_DIR, name)


class ShmTransport:
    """A ring in a /dev/shm file, mapped MAP_SHARED by every process that opens it."""

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

    # -- one-sided interface ------------------------------------------------------
    def read(self, offset: int, n: int) -> bytes:
        return self._mm[offset : offset + n]

    def read_into(self, offset: int, out: np.ndarray) -> np.ndarray:
        b = out.view(np.uint8).reshape(-1)
        b[:] = self._u8[offset : offset + b.size]
        return out

    def write(self, offset: int, data: bytes | np.ndarray) -> None:
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            self._u8[offset : offset + data.size] = data
        else:
            self._mm[offset : offset + len(data)] = data

    def load_u32(self, offset: int) -> int:
        return int(self._u32[offset >> 2])

    def load_u64(self, offset: int) -> int:
        return int(self._u64[offset >> 3])

    def store_u32(self, offset: int, value: int) -> None:
        if offset % 4:
            raise ValueError("unaligned 32-bit store")
        self._u32[offset >> 2] = value

    def store_u64(self, offset: int, value: int) -> None:
        if offset % 8:
            raise ValueError("unaligned 64-bit store")
        self._u64[offset >> 3] = value

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
