"""Engine launchers used by the GPU actor: the CUDA engine or the emulated device, on a named ring.

Both serve an existing ring until header.shutdown says stop. The emulated device runs the ring
interpreter (blink.device.ring_device) with the numpy executor on a thread of the GPU actor's
process; the CUDA engine (blink.gpu.serve) is imported only when a GPU is used.
"""

from __future__ import annotations

import logging
import subprocess
import threading

from blink.protocol.layout import DeviceStatus
from blink.protocol.transport import ShmTransport

from .config import DeployConfig

log = logging.getLogger(__name__)


class ThreadEngine:
    """A ring-serving loop on a daemon thread; `stop` relies on header.shutdown, set by the caller."""

    def __init__(self, name: str, target, transport: ShmTransport):
        self._transport = transport
        self.error = ""
        self.result: DeviceStatus | None = None

        def run() -> None:
            try:
                self.result = target()
            except BaseException as e:  # the device already marked the ring FAILED; keep the reason
                log.exception("engine %s failed", name)
                self.error = f"{type(e).__name__}: {e}"

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float) -> None:
        hdr = self._transport.view().header
        if int(hdr["shutdown"]) == 0:
            hdr["shutdown"] = 1
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            hdr["shutdown"] = 2  # drain took too long: cancel what is left
            self._thread.join(5.0)


def emulated_config(cfg: DeployConfig, ring_name: str):
    """The emulated device's settings from the serving config's [device] and [model] sections."""
    from blink.device.emulated import EmulatedDeviceConfig
    from blink.dpu.launch import emulated_kv_blocks

    dev = cfg.serving.device
    kw = dict(
        ring=ring_name,
        model=cfg.serving.model.spec,
        block_size=dev.kv_block_size,
        max_batch=dev.max_batch,
        max_tokens=dev.max_tokens,
        max_context=dev.max_context or 0,
    )
    return EmulatedDeviceConfig(kv_blocks=emulated_kv_blocks(cfg.serving), **kw)


def start_emulated(cfg: DeployConfig, ring_name: str) -> ThreadEngine:
    """The emulated device on a thread of this process: it dies with the GPU actor, as a GPU
    context would (a child process would outlive a killed actor and keep beating)."""
    from blink.device.emulated import run_emulated

    ecfg = emulated_config(cfg, ring_name)
    transport = ShmTransport.open(ring_name)
    return ThreadEngine(f"emulated-{ring_name}", lambda: run_emulated(ecfg), transport)


class ProcessEngine:
    """An engine behind a process handle (poll / wait / kill), as blink.gpu.serve.start returns."""

    def __init__(self, handle, transport: ShmTransport):
        self._h = handle
        self._transport = transport

    def alive(self) -> bool:
        return self._h.poll() is None

    def stop(self, timeout_s: float) -> None:
        hdr = self._transport.view().header
        if int(hdr["shutdown"]) == 0:
            hdr["shutdown"] = 1
        try:
            self._h.wait(timeout_s)
        except (TimeoutError, subprocess.TimeoutExpired):
            self._h.kill()
            self._h.wait(5.0)


def start_cuda(cfg: DeployConfig, ring_name: str) -> ProcessEngine:
    """The CUDA engine on this actor's GPU (Ray set CUDA_VISIBLE_DEVICES for the actor)."""
    from blink.gpu import serve as gpu_serve  # lazy: CuPy and the CUDA engine only on GPU nodes

    return ProcessEngine(gpu_serve.start(ring_name=ring_name, config=cfg.serving), ShmTransport.open(ring_name))
