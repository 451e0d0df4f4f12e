"""Sleeps of a fraction of a millisecond inside an asyncio event loop, without spinning.

asyncio timers are no finer than a millisecond: uvloop rounds a delay to whole milliseconds (so
`asyncio.sleep(0.0002)` does not sleep at all: awaited in a loop, it spins a core), and the
selector loop rounds its epoll timeout up to the next millisecond. The token reader wants to look
at the ring every ~100-250 us while a publication is due (a first token awaited, a decode step
about to end) and not at all in between, so it sleeps on a Linux timerfd: the kernel's hrtimer
makes the fd readable at the deadline (tens of us late at most), the event loop's epoll wakes on
it like on a socket, and nothing runs until then.

One FineTimer per consumer, used by one task at a time. Where timerfd is missing (not Linux, no
libc through ctypes) `sleep` falls back to asyncio.sleep: the same code runs, at the millisecond
grain.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Itimerspec(ctypes.Structure):
    _fields_ = (("it_interval", _Timespec), ("it_value", _Timespec))


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.timerfd_create.argtypes = (ctypes.c_int, ctypes.c_int)
        lib.timerfd_settime.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        return lib
    except (OSError, AttributeError):
        return None


class FineTimer:
    """`await timer.sleep(seconds)`: a one-shot timerfd armed for the delay, watched by the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop or asyncio.get_running_loop()
        self._lib = _libc()
        self.fd = -1
        self._fut: asyncio.Future[None] | None = None
        self._spec = _Itimerspec()
        if self._lib is not None:
            fd = self._lib.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
            if fd >= 0:
                self.fd = fd
                self.loop.add_reader(fd, self._fired)

    @property
    def fine(self) -> bool:
        """Whether sleeps are finer than asyncio's millisecond."""
        return self.fd >= 0

    def _fired(self) -> None:
        try:
            os.read(self.fd, 8)  # the expiration count; reading it re-arms readability
        except BlockingIOError:
            return
        fut, self._fut = self._fut, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def sleep(self, seconds: float) -> None:
        if self.fd < 0:
            await asyncio.sleep(seconds)
            return
        ns = max(1000, int(seconds * 1e9))  # a zero it_value would disarm the timer
        self._spec.it_value.tv_sec, self._spec.it_value.tv_nsec = divmod(ns, 1_000_000_000)
        if self._lib.timerfd_settime(self.fd, 0, ctypes.byref(self._spec), None) != 0:
            await asyncio.sleep(seconds)
            return
        self._fut = fut = self.loop.create_future()
        try:
            await fut
        finally:
            self._fut = None

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
        if self._fut is not None and not self._fut.done():
            self._fut.cancel()
