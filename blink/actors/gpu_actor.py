"""GPU actor: one per GPU. Creates its replica's ring, loads the model, starts the engine, detaches.

After `start()` the engine (the CUDA persistent scheduler, or the emulated device without a GPU)
serves the ring on its own; this actor only keeps the process that owns the ring and the device
context alive and answers `status()` from the ring header. No Ray call is made per token.

Lifecycle: the constructor is cheap; the deployer calls `start()` under a timeout. When Ray
restarts a killed GPU actor (max_restarts), the new incarnation starts itself from the
constructor: it replaces the dead ring with a fresh one (new inode, same name), which is how the
frontend, watching the heartbeat and the file identity, sees the replica come back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from blink.protocol.layout import DEVICE_COUNTERS, DEVICE_GAUGES, DeviceStatus, RingGeometry
from blink.protocol.transport import ShmTransport, shm_path

from . import raycount
from .config import DeployConfig
from .lifecycle import reconstructed, start_in_background

log = logging.getLogger(__name__)

# Header fields `status()` reports (device-written counters and gauges).
STATUS_FIELDS = DEVICE_GAUGES + DEVICE_COUNTERS + ("fault", "heartbeat_ns", "max_batch", "n_slots")


class Engine(Protocol):
    """What the actor holds after start: something serving the ring until stopped."""

    def alive(self) -> bool: ...
    def stop(self, timeout_s: float) -> None: ...


def resolve_device(device: str) -> str:
    """auto -> cuda when CuPy sees a GPU in this process, else emulated."""
    if device != "auto":
        return device
    try:
        import cupy

        return "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "emulated"
    except (ImportError, RuntimeError) as e:  # no cupy / no libcuda / old driver: no usable GPU
        log.info("no usable GPU (%s: %s); using the emulated device", type(e).__name__, e)
        return "emulated"


def start_engine(device: str, cfg: DeployConfig, ring_name: str, on_exit: Callable[[int], None]) -> Engine:
    """Load the model and start the engine on an existing ring (lazy imports: CUDA only when asked).
    `on_exit(returncode)` runs when the engine process ends."""
    from . import engines

    if device == "cuda":
        return engines.start_cuda(cfg, ring_name, on_exit)
    return engines.start_emulated(cfg, ring_name, on_exit)


class GpuActor:
    def __init__(self, cfg_json: str, replica: int):
        raycount.install()
        raycount.note_incoming("__init__")
        self.cfg = DeployConfig.from_json(cfg_json)
        self.replica = replica
        self.ring_name = self.cfg.ring_name(replica)
        self._lock = threading.Lock()
        self._transport: ShmTransport | None = None
        self._engine: Engine | None = None
        self._device = ""
        self._start_error: str = ""
        self._incarnation = 0
        self._serving = False  # the engine reached READY (an exit after that is a crash)
        self._stopping = False
        if reconstructed():
            start_in_background(self.start, f"gpu-actor-{replica}", self._set_start_error)

    def _set_start_error(self, why: str) -> None:
        self._start_error = why

    def start(self) -> dict[str, Any]:
        """Create the ring, load the model, start the engine; idempotent. Returns ring_info()."""
        raycount.note_incoming("start")
        with self._lock:
            if self._engine is None:
                self._incarnation = gen = time.time_ns()
                self._serving = self._stopping = False
                rc = self.cfg.serving.ring
                geo = RingGeometry(rc.n_slots, rc.prompt_arena_tokens, rc.output_capacity)
                path = shm_path(self.ring_name)
                if os.path.exists(path):
                    # A ring left by a dead incarnation: unlink rather than reuse, so anyone still
                    # mapping it keeps the old bytes and sees a new inode under the name.
                    os.unlink(path)
                self._transport = ShmTransport.create(self.ring_name, geo)
                self._device = resolve_device(self.cfg.serving.device.kind)
                self._engine = start_engine(
                    self._device, self.cfg, self.ring_name, lambda rc: self._engine_exited(rc, gen)
                )
                try:
                    self._wait_ready(self._engine, self._transport)
                except BaseException:
                    self._teardown(drain=False, timeout_s=5.0)  # a retried start() begins afresh
                    raise
                self._serving = True
        return self.ring_info()

    def _engine_exited(self, returncode: int, incarnation: int) -> None:
        # An engine that dies while serving takes its actor down with it, so Ray restarts the
        # actor and the replica comes back exactly as after a killed actor (fresh ring, new engine).
        if incarnation == self._incarnation and self._serving and not self._stopping:
            log.error("engine of replica %d exited with %d while serving; exiting the actor", self.replica, returncode)
            os._exit(1)

    @staticmethod
    def _wait_ready(engine: Engine, transport: ShmTransport) -> None:
        # The deployer bounds start() with its own timeout; here we only stop waiting early
        # when the engine died (bad model path, out of memory) so its error reaches the caller.
        hdr = transport.view().header
        while int(hdr["device_status"]) != DeviceStatus.READY:
            if not engine.alive():
                raise RuntimeError(f"engine exited before READY: {getattr(engine, 'error', '') or 'no error recorded'}")
            time.sleep(0.01)

    def ring_info(self) -> dict[str, Any]:
        raycount.note_incoming("ring_info")
        import ray

        return {
            "replica": self.replica,
            "ring": self.ring_name,
            "path": shm_path(self.ring_name),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "device": self._device,
            "engine_pid": getattr(self._engine, "pid", None),
            "engine_log": getattr(self._engine, "log_path", ""),
            "incarnation": self._incarnation,
        }

    def status(self) -> dict[str, Any]:
        """The ring header's device fields, plus whether the engine is alive."""
        raycount.note_incoming("status")
        out: dict[str, Any] = {"replica": self.replica, "pid": os.getpid(), "device": self._device}
        out["start_error"] = self._start_error
        t = self._transport
        if t is None:
            out["state"] = "NOT_STARTED"
            return out
        hdr = t.view().header
        for f in STATUS_FIELDS:
            out[f] = int(hdr[f])
        out["state"] = DeviceStatus(out["device_status"]).name
        out["engine_alive"] = self._engine is not None and self._engine.alive()
        return out

    def stop(self, drain: bool = True, timeout_s: float = 30.0) -> dict[str, Any]:
        """Ask the engine to stop (drain: finish in-flight work), wait, unlink the ring."""
        raycount.note_incoming("stop")
        with self._lock:
            return self._teardown(drain, timeout_s)

    def _teardown(self, drain: bool, timeout_s: float) -> dict[str, Any]:
        self._stopping = True
        if self._transport is not None:
            self._transport.view().header["shutdown"] = 1 if drain else 2
        if self._engine is not None:
            self._engine.stop(timeout_s)
        st = self.status()
        if self._transport is not None:
            self._transport.unlink()
            self._transport.close()
        self._transport = None
        self._engine = None
        self._serving = False  # _stopping stays set: a late exit callback must not kill the actor
        return st

    def ray_counts(self) -> dict[str, int]:
        return raycount.counts()

    def pid(self) -> int:
        return os.getpid()
