"""Engine launchers used by the GPU actor: the CUDA engine or the emulated device, on a named ring.

Both run as a child process of the GPU actor (blink.gpu.serve / blink.device.emulated) and serve
the ring until header.shutdown says stop; one process model for both, so the CPU tests exercise
the lifecycle the GPU runs. blink.gpu is imported only when a GPU is used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from blink.protocol.transport import ShmTransport

from .config import DeployConfig

if TYPE_CHECKING:
    from blink.device.emulated import EmulatedDeviceConfig

log = logging.getLogger(__name__)


def emulated_config(cfg: DeployConfig, ring_name: str) -> EmulatedDeviceConfig:
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


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the thread that forked it dies (Linux prctl)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


class ProcessEngine:
    """An engine in a child process (blink.gpu.serve.start and blink.device.emulated both spawn one).

    A killed GPU actor must take its engine with it: a surviving engine would keep beating on
    the old ring and hold the GPU the restarted actor needs. So the child gets
    PR_SET_PDEATHSIG(SIGKILL), and it is forked from a thread that lives exactly as long as
    the child (the death signal fires when the forking *thread* exits, not just the process).
    Ray's raylet also kills a dead worker's children by default; the death signal keeps the
    guarantee where that is switched off and for engines started outside Ray.
    """

    def __init__(
        self,
        spawn: Callable[..., subprocess.Popen],
        transport: ShmTransport,
        name: str,
        on_exit: Callable[[int], None] | None = None,
    ):
        self._transport = transport
        self._proc: subprocess.Popen | None = None
        self._error = ""
        # The engine's stdout/stderr go to a file: nobody has to drain a pipe, and the tail
        # explains an engine that died during start-up (status() reports the path).
        fd, self.log_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        forked = threading.Event()

        def own() -> None:
            try:
                self._proc = spawn(preexec_fn=_die_with_parent, stdout=fd, stderr=subprocess.STDOUT)
            except Exception as e:  # surfaced by alive() == False and `error`
                self._error = f"{type(e).__name__}: {e}"
                return
            finally:
                os.close(fd)
                forked.set()
            rc = self._proc.wait()
            if on_exit is not None:
                on_exit(rc)

        self._owner = threading.Thread(target=own, name="engine-owner", daemon=True)
        self._owner.start()
        forked.wait()

    @property
    def error(self) -> str:
        """Why the engine is not running: a spawn failure, or the last lines it wrote before exiting."""
        if self._error or self._proc is None or self._proc.poll() is None:
            return self._error
        with open(self.log_path, errors="replace") as f:
            tail = [line.rstrip() for line in f.readlines()[-5:] if line.strip()]
        return f"exit code {self._proc.returncode}: " + " | ".join(tail)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float) -> None:
        if self._proc is None:
            return
        hdr = self._transport.view().header
        if int(hdr["shutdown"]) == 0:
            hdr["shutdown"] = 1
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5.0)
        if self._proc.returncode == 0:  # clean stop: nothing to look at later
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.log_path)
        self._transport.close()


def start_cuda(cfg: DeployConfig, ring_name: str, on_exit: Callable[[int], None]) -> ProcessEngine:
    """The CUDA engine process on this actor's GPU (Ray set CUDA_VISIBLE_DEVICES for the actor)."""
    from blink.gpu import serve as gpu_serve  # lazy: CuPy and the CUDA engine only on GPU nodes

    return ProcessEngine(
        lambda **kw: gpu_serve.start(ring_name=ring_name, config=cfg.serving, **kw),
        ShmTransport.open(ring_name),
        f"blink-cuda-{ring_name}",
        on_exit,
    )


def start_emulated(cfg: DeployConfig, ring_name: str, on_exit: Callable[[int], None]) -> ProcessEngine:
    """The emulated device as a child process (the CUDA engine's process model, without a GPU)."""
    from blink.device.emulated import start_emulated_device

    ecfg = emulated_config(cfg, ring_name)
    return ProcessEngine(
        lambda **kw: start_emulated_device(ecfg, **kw),
        ShmTransport.open(ring_name),
        f"blink-emulated-{ring_name}",
        on_exit,
    )
