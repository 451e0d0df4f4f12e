"""GPU actor: one per GPU. Creates its replica's ring, loads the model, starts the engine, detaches.

After `start()` the engine (the CUDA persistent scheduler, or the emulated device without a GPU)
serves the ring on its own; this actor only keeps the process that owns the ring and the device
context alive and answers `status()` from the ring header. No Ray call is made per token.

Lifecycle: the constructor is cheap; the deployer calls `start()` under a timeout. When Ray
restarts a killed GPU actor (max_restarts), the new incarnation starts itself from the
constructor: it replaces the dead ring with a fresh one (new inode, same name), which is how the
frontend, watching the heartbeat and the file identity, sees the replica come back.

Unless ring.transport is shm, the actor also serves its ring to frontends on other hosts: a ring
agent (blink.protocol.ring_agent) on a thread of this process, bound to this node's address
(port: ring.listen's, else any; loopback only on a one-node cluster), reported by ring_info() as
"agent". Over TCP every round trip of
a remote frontend runs on that thread (this host's CPU); over RDMA the agent only bootstraps each
frontend's queue pair. The agent admits only clients that prove the deployment's secret (made by
`blink deploy`, handed to every actor with its arguments) and splits the ring's slots into one
partition per frontend actor (blink.protocol.ring_agent).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from typing import Any

from blink.launch import DeviceProcess, create_ring, device_spec, start_device
from blink.protocol.gc_freeze import freeze_startup_heap
from blink.protocol.layout import DEVICE_COUNTERS, DEVICE_GAUGES, DeviceStatus
from blink.protocol.transport import ShmTransport, shm_path

from . import raycount
from .config import DeployConfig
from .lifecycle import reconstructed, start_in_background

log = logging.getLogger(__name__)

# Header fields `status()` reports (device-written counters and gauges).
STATUS_FIELDS = DEVICE_GAUGES + DEVICE_COUNTERS + ("fault", "heartbeat_ns", "max_batch", "n_slots")


class GpuActor:
    def __init__(self, cfg_json: str, replica: int, secret: bytes = b"", partitions: int = 1):
        """secret: the ring agent's (blink deploy makes it); partitions: the frontend actors, one
        partition of the ring's slots each."""
        raycount.install()
        raycount.note_incoming("__init__")
        self.cfg = DeployConfig.from_json(cfg_json)
        self.replica = replica
        self._secret, self._partitions = secret, partitions
        self.ring_name = self.cfg.ring_name(replica)
        self._lock = threading.Lock()
        self._transport: ShmTransport | None = None
        self._engine: DeviceProcess | None = None
        self._device = ""
        self._start_error: str = ""
        self._incarnation = 0
        self._agent = None  # RingAgent serving the ring to other hosts (ring.transport != shm)
        self._serving = False  # the engine reached READY (an exit after that is a crash)
        self._gc_frozen = 0  # objects freeze_startup_heap left out of full collections
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
                path = shm_path(self.ring_name)
                if os.path.exists(path):
                    # A ring left by a dead incarnation: unlink rather than reuse, so anyone still
                    # mapping it keeps the old bytes and sees a new inode under the name.
                    os.unlink(path)
                self._transport = create_ring(self.ring_name, self.cfg.serving.ring)
                spec = device_spec(self.cfg.serving, self.ring_name)  # auto resolved here, on the GPU's node
                self._device = spec.kind
                # The engine's output goes to a file: nobody has to drain a pipe, and the tail explains
                # an engine that died during start-up (ring_info() reports the path).
                fd, log_path = tempfile.mkstemp(prefix=f"blink-{spec.kind}-{self.ring_name}-", suffix=".log")
                os.close(fd)
                self._engine = start_device(spec, log_path=log_path, on_exit=lambda rc: self._engine_exited(rc, gen))
                try:
                    # The deployer bounds start() with its own timeout; this one only ends the wait early
                    # when the engine died (bad model path, out of memory) so its error reaches the caller.
                    self._engine.wait_ready(self._transport, timeout=float("inf"))
                    self._start_agent()
                except BaseException:
                    self._teardown(drain=False, timeout_s=5.0)  # a retried start() begins afresh
                    raise
                self._serving = True
                self._gc_frozen = freeze_startup_heap().objects  # the ring agent's thread serves from here
        return self.ring_info()

    def _start_agent(self) -> None:
        rc = self.cfg.serving.ring
        if rc.transport == "shm":
            return
        import ray

        from blink.protocol.ring_agent import RingAgent

        port = rc.listen.rpartition(":")[2] if rc.listen else "0"
        # On a one-node cluster (blink serve --ray) nobody outside this host needs the agent, so it
        # listens on loopback only; otherwise on the node's address.
        alone = sum(1 for n in ray.nodes() if n.get("Alive")) <= 1
        host = "127.0.0.1" if alone else ray.util.get_node_ip_address()
        self._agent = RingAgent(
            self.ring_name, f"{host}:{port}", rc.rdma_device, secret=self._secret, partitions=self._partitions
        )
        self._agent.start_thread()
        log.info("replica %d: ring agent on %s", self.replica, self._agent.address)

    def _engine_exited(self, returncode: int, incarnation: int) -> None:
        # An engine that dies while serving takes its actor down with it, so Ray restarts the
        # actor and the replica comes back exactly as after a killed actor (fresh ring, new engine).
        if incarnation == self._incarnation and self._serving and not self._stopping:
            log.error("engine of replica %d exited with %d while serving; exiting the actor", self.replica, returncode)
            os._exit(1)

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
            "agent": self._agent.address if self._agent is not None else None,
            "gc_frozen": self._gc_frozen,
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
        if self._agent is not None:
            self._agent.stop_thread()
            self._agent = None
        if self._engine is not None and self._transport is not None:
            self._engine.stop(self._transport, drain, timeout_s)
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
