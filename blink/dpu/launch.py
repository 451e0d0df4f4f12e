"""Start-up and shut-down of one serving stack in one process: ring, device, frontend roles.

`blink serve` and `blink generate` use this; so can tests and benchmarks. The frontend creates
the ring (a /dev/shm file with a name unique to this server), starts the device on it (the
emulated device in a child process, or the CUDA engine via `blink.gpu.serve`, imported lazily),
waits for header.device_status READY while showing progress, and on shutdown sets
header.shutdown, waits for the device to stop and unlinks the ring.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from blink.config import BlinkConfig
from blink.protocol.layout import HEADER_DTYPE, DeviceStatus, RingGeometry
from blink.protocol.transport import ShmTransport

from .request_tracker import RequestTracker
from .slot_tracker import read_header
from .tokenizer import FrontendTokenizer, load_tokenizer

_SHUTDOWN = HEADER_DTYPE.fields["shutdown"][1]


class DeviceHandle(Protocol):
    """A running device: `poll()` is None while it runs (subprocess.Popen satisfies this)."""

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def new_ring_name() -> str:
    return f"blink-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def emulated_kv_blocks(cfg: BlinkConfig) -> int:
    """KV pool of the emulated device when not configured: enough for max_batch sequences of
    max_context (2048 when unset). np.zeros pages are only touched as the cache fills."""
    if cfg.device.num_kv_blocks is not None:
        return cfg.device.num_kv_blocks
    ctx = cfg.device.max_context or 2048
    return cfg.device.max_batch * -(-ctx // cfg.device.kv_block_size)


def start_device(cfg: BlinkConfig, ring_name: str, kind: str, **popen_kwargs: Any) -> DeviceHandle:
    if kind == "emulated":
        from blink.device.emulated import EmulatedDeviceConfig, start_emulated_device

        ecfg = EmulatedDeviceConfig(
            ring=ring_name,
            model=cfg.model.spec,
            kv_blocks=emulated_kv_blocks(cfg),
            block_size=cfg.device.kv_block_size,
            max_batch=cfg.device.max_batch,
            max_tokens=cfg.device.max_tokens,
            max_context=cfg.device.max_context or 0,
        )
        return start_emulated_device(ecfg, **popen_kwargs)
    if kind == "cuda":
        try:
            from blink.gpu import serve as gpu_serve
        except ImportError as e:
            raise RuntimeError(f"--device cuda needs blink.gpu.serve, which is not available here: {e}") from e
        return gpu_serve.start(ring_name=ring_name, config=cfg)
    raise ValueError(f"unknown device kind {kind!r}")


def wait_ready(
    transport: ShmTransport,
    device: DeviceHandle,
    timeout: float,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Block until READY, reporting the status about once a second; raise if the device dies."""
    t0 = time.monotonic()
    last = -1.0
    while True:
        hdr = read_header(transport)
        status = int(hdr["device_status"])
        if status == DeviceStatus.READY:
            if progress:
                progress(f"device ready after {time.monotonic() - t0:.1f} s")
            return
        if status == DeviceStatus.FAILED:
            raise RuntimeError(f"device failed during start-up (fault {int(hdr['fault'])})")
        rc = device.poll()
        if rc is not None:
            raise RuntimeError(f"device exited with code {rc} before it was ready")
        el = time.monotonic() - t0
        if el > timeout:
            raise TimeoutError(f"device not ready after {timeout:.0f} s")
        if progress and el - last >= 1.0:
            last = el
            progress(f"waiting for the device: {DeviceStatus(status).name.lower()} ({el:.0f} s)")
        time.sleep(0.02)


class Stack:
    """Ring + device + frontend roles of one server (one process besides the device)."""

    def __init__(self, cfg: BlinkConfig, progress: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.progress = progress
        if cfg.device.kind not in ("emulated", "cuda"):
            raise ValueError(f"device kind must be resolved to emulated|cuda first, got {cfg.device.kind!r}")
        self.kind = cfg.device.kind
        self.ring_name = new_ring_name()
        self.transport: ShmTransport | None = None
        self.device: DeviceHandle | None = None
        self.tokenizer: FrontendTokenizer | None = None
        self.tracker: RequestTracker | None = None

    def start_device(self) -> None:
        """Create the ring, start the device, load the tokenizer meanwhile, wait for READY."""
        r = self.cfg.ring
        geo = RingGeometry(r.n_slots, r.prompt_arena_tokens, r.output_capacity)
        self.transport = ShmTransport.create(self.ring_name, geo)
        if self.progress:
            self.progress(f"ring /dev/shm/{self.ring_name}: {r.n_slots} slots; starting the {self.kind} device")
        self.device = start_device(self.cfg, self.ring_name, self.kind)
        self.tokenizer = load_tokenizer(self.cfg.model.spec, self.cfg.model.name, self.cfg.model.chat_template)
        wait_ready(self.transport, self.device, self.cfg.device.ready_timeout_s, self.progress)

    async def start_frontend(self) -> RequestTracker:
        assert self.transport is not None
        s = self.cfg.server
        device = self.device

        def liveness() -> str | None:
            rc = device.poll() if device is not None else None
            return None if rc is None else f"device process exited with code {rc}"

        self.tracker = RequestTracker(self.transport, s.max_queue, s.heartbeat_timeout_s, {"liveness": liveness})
        await self.tracker.start()
        return self.tracker

    async def stop_frontend(self) -> None:
        if self.tracker is not None:
            await self.tracker.close()
            self.tracker = None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the device to stop (drain), wait, then remove the ring. Safe to call twice."""
        if self.transport is not None and self.device is not None and self.device.poll() is None:
            self.transport.store_u32(_SHUTDOWN, 1)
            try:
                self.device.wait(timeout)
            except subprocess.TimeoutExpired:
                self.transport.store_u32(_SHUTDOWN, 2)
                try:
                    self.device.wait(2.0)
                except subprocess.TimeoutExpired:
                    self.device.kill()
                    self.device.wait()
        if self.transport is not None:
            self.transport.unlink()
            self.transport.close()
            self.transport = None


def stderr_progress(msg: str) -> None:
    print(f"blink: {msg}", file=sys.stderr, flush=True)
