"""Engine launchers used by the GPU actor: the CUDA engine or the emulated device, on a named ring.

Both serve an existing ring until header.shutdown says stop. The emulated device runs the ring
interpreter (blink.device.ring_device) with the numpy executor on a thread of the GPU actor's
process; the CUDA engine (blink.gpu.serve) is imported only when a GPU is used.
"""

from __future__ import annotations

import logging
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


def start_emulated(cfg: DeployConfig, ring_name: str) -> ThreadEngine:
    from blink.device.numpy_executor import NumpyExecutor
    from blink.device.ring_device import RingDevice, RingDeviceConfig

    dev = cfg.serving.device
    model = cfg.serving.model
    executor = NumpyExecutor.from_model(
        model.spec,
        num_blocks=dev.num_kv_blocks or 1024,
        block_size=dev.kv_block_size,
        max_batch=dev.max_batch,
        max_tokens=dev.max_tokens,
    )
    transport = ShmTransport.open(ring_name)
    device = RingDevice(transport.view(), executor, RingDeviceConfig())
    engine = ThreadEngine(f"emulated-{ring_name}", device.run, transport)
    return engine


def start_cuda(cfg: DeployConfig, ring_name: str):
    from blink.gpu import serve  # noqa: F401  (lazy: CuPy and the CUDA engine only on GPU nodes)

    raise NotImplementedError("the CUDA engine launcher (blink.gpu.serve) is not wired into the GPU actor yet")
