"""The launch layer: a ring and the device process serving it.

It composes blink/dpu (frontend) and blink/device + blink/gpu (devices), which never import
each other. `blink serve`, `blink generate`, the Ray GPU actor, the conformance rig and the
benchmarks all start a device the same way:

    spec = device_spec(cfg, ring)        # the one translation: BlinkConfig -> DeviceSpec (wire type)
    dev = start_device(spec)             # python -m <device module> SPEC_JSON, dies with its parent
    dev.wait_ready(transport, timeout, progress)
    ...
    dev.stop(transport)                  # header.shutdown 1 (drain), then 2, then SIGKILL

`--device auto` is resolved here, once, when the spec is built. Engine and scheduler settings
are derived inside the device process from the spec (blink.device.emulated, blink.gpu.serve).
The serving stack of `blink serve` (ring + device + frontend, healed when the device dies) that
composes these with the frontend is blink.stack.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable

import msgspec

from blink.config import BlinkConfig, ConfigError, RingConfig
from blink.protocol.layout import DeviceStatus
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import SHM_DIR, ShmTransport
from blink.protocol.wire import DeviceSpec

log = logging.getLogger(__name__)

DEVICE_MODULES = {"emulated": "blink.device.emulated", "cuda": "blink.gpu.serve"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Progress = Callable[[str], None]


# -- the spec ------------------------------------------------------------------------------------
@functools.cache
def gpu_usable() -> bool:
    """True when CUDA can see a device (probed in the launching process; the frontend never imports cupy).
    Probed once per process: the model check and the device spec both ask, and the answer is logged once."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception as e:  # no cupy, no driver, no device: all mean "no usable GPU"
        log.info("no usable GPU (%s: %s); using the emulated device", type(e).__name__, e)
        return False


def resolve_kind(kind: str) -> str:
    """auto -> cuda when a GPU is usable here, else emulated."""
    return ("cuda" if gpu_usable() else "emulated") if kind == "auto" else kind


def device_spec(cfg: BlinkConfig, ring: str) -> DeviceSpec:
    """The device process's spec for a server config, on the ring named `ring`."""
    d = cfg.device
    kind = resolve_kind(d.kind)
    if d.executor and kind != "emulated":
        raise ConfigError(f"device.executor ({d.executor}) is for the emulated device, not {kind}")
    return DeviceSpec(
        ring=ring,
        kind=kind,
        model=cfg.model.spec,
        scheduler=d.scheduler,
        max_batch=d.max_batch,
        max_num_batched_tokens=d.step_tokens(kind),
        mixed_tokens=d.mixed_step_tokens(kind),
        kv_block_size=d.kv_block_size,
        num_kv_blocks=d.num_kv_blocks or 0,
        kv_cache_fraction=d.kv_cache_fraction,
        max_context=d.max_context or 0,
        debug=cfg.server.log_level == "debug",
        kernel_cache=d.kernel_cache or "",
        executor=d.executor,
        quantization=d.quantization or "",
        fp8_lm_head=d.fp8_lm_head,
        kv_cache_dtype=d.kv_cache_dtype,
        prefix_caching=d.enable_prefix_caching,
    )


# -- rings ---------------------------------------------------------------------------------------
def new_ring_name() -> str:
    return f"blink-{os.getpid()}-{uuid.uuid4().hex[:8]}"


_SERVER_RING = re.compile(r"blink-(\d+)-[0-9a-f]{8}")  # new_ring_name()'s names


def create_ring(name: str, rc: RingConfig) -> ShmTransport:
    masks = (rc.mask_slots, rc.mask_vocab) if rc.mask_slots else (0, 0)
    return ShmTransport.create(name, RingGeometry(rc.n_slots, rc.prompt_arena_tokens, rc.output_capacity, *masks))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_rings() -> list[str]:
    """Remove the rings of servers that are gone (`blink serve` killed with -9 leaves its ring in
    /dev/shm): those named by new_ring_name() whose pid no longer runs. Returns their names."""
    out = []
    for name in sorted(os.listdir(SHM_DIR)):
        m = _SERVER_RING.fullmatch(name)
        if m is not None and not _alive(int(m[1])):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                out.append(name)
    return out


# -- the device process --------------------------------------------------------------------------
def die_with(parent: int) -> Callable[[], None]:
    """preexec_fn: SIGKILL this child when the thread that forked it dies (Linux prctl), and exit
    at once if the parent already died between fork and prctl."""

    def preexec() -> None:
        PR_SET_PDEATHSIG = 1
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:
            os._exit(1)

    return preexec


class DeviceProcess:
    """A device process serving one ring (Popen-like: poll, wait, kill, pid).

    It dies with its parent: PR_SET_PDEATHSIG(SIGKILL), plus the device's own parent watch
    (blink.device.process). The death signal fires when the *thread* that forked the child exits,
    so the child is forked from an owner thread that lives exactly as long as the child; the same
    thread reaps it and calls `on_exit(returncode)`.
    """

    def __init__(
        self,
        spec: DeviceSpec,
        *,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        on_exit: Callable[[int], None] | None = None,
    ):
        self.spec = spec
        self.log_path = log_path
        self.returncode: int | None = None
        self._proc: subprocess.Popen | None = None
        self._exited = threading.Event()
        env = dict(os.environ if env is None else env)
        # The child imports blink (and an executor plugin) the same way this process does.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), ROOT, env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", DEVICE_MODULES[spec.kind], msgspec.json.encode(spec).decode()]
        forked = threading.Event()
        spawn_error: list[BaseException] = []

        def own() -> None:
            out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - closed once forked
            try:
                self._proc = subprocess.Popen(
                    cmd,
                    env=env,
                    cwd=cwd,
                    preexec_fn=die_with(os.getpid()),
                    stdout=out,
                    stderr=out and subprocess.STDOUT,
                )
            except BaseException as e:
                spawn_error.append(e)
                self._exited.set()
                return
            finally:
                if out is not None:
                    out.close()
                forked.set()
            self.returncode = self._proc.wait()
            self._exited.set()
            if on_exit is not None:
                on_exit(self.returncode)

        self._owner = threading.Thread(target=own, name=f"device-{spec.ring}", daemon=True)
        self._owner.start()
        forked.wait()
        if spawn_error:
            raise spawn_error[0]

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def poll(self) -> int | None:
        return self.returncode if self._exited.is_set() else None

    def alive(self) -> bool:
        return not self._exited.is_set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self._proc.args if self._proc else "", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.alive() and self._proc is not None:
            try:
                self._proc.kill()
            except ProcessLookupError:  # exited meanwhile
                pass

    terminate = kill

    @property
    def error(self) -> str:
        """Why the device is not running: its exit code and the last lines it logged."""
        if self.alive():
            return ""
        tail = ""
        if self.log_path and os.path.exists(self.log_path):
            with open(self.log_path, errors="replace") as f:
                tail = " | ".join(line.rstrip() for line in f.readlines()[-5:] if line.strip())
        return f"exit code {self.returncode}" + (f": {tail}" if tail else "")

    def wait_ready(self, transport: ShmTransport, timeout: float, progress: Progress | None = None) -> None:
        """Block until READY, reporting the status about once a second; raise if the device fails."""
        hdr = transport.view().header

        def check(status: int) -> None:
            if status == DeviceStatus.FAILED:
                raise RuntimeError(f"device failed during start-up (fault {int(hdr['fault'])})")
            if not self.alive():
                raise RuntimeError(f"device exited before it was ready ({self.error})")

        waited = wait_for_ready(lambda: int(hdr["device_status"]), check, timeout, progress)
        if progress:
            progress(f"device ready after {waited:.1f} s")

    def stop(self, transport: ShmTransport, drain: bool = True, timeout: float = 10.0) -> int:
        """Ask the device to stop (1: finish in-flight requests, 2: cancel them), wait, escalate to
        2 and then SIGKILL. Returns the exit code; a clean stop removes the log file."""
        hdr = transport.view().header
        if self.alive():
            hdr["shutdown"] = max(int(hdr["shutdown"]), 1 if drain else 2)
            try:
                self.wait(timeout)
            except subprocess.TimeoutExpired:
                hdr["shutdown"] = 2
                try:
                    self.wait(2.0)
                except subprocess.TimeoutExpired:
                    self.kill()
        rc = self.wait()
        if rc == 0 and self.log_path and os.path.exists(self.log_path):
            os.unlink(self.log_path)
        return rc


def wait_for_ready(
    status: Callable[[], int],
    check: Callable[[int], None],
    timeout: float,
    progress: Progress | None = None,
    what: str = "device",
    poll_s: float = 0.01,
) -> float:
    """Poll a device's status until READY; `check(status)` raises when it never will be, and a
    TimeoutError after `timeout` s. Reports the status about once a second; returns the seconds waited."""
    t0 = time.monotonic()
    last = -1.0
    while (s := status()) != DeviceStatus.READY:
        check(s)
        el = time.monotonic() - t0
        if el > timeout:
            raise TimeoutError(f"{what} not ready after {timeout:.0f} s")
        if progress and el - last >= 1.0:
            last = el
            progress(f"waiting for the {what}: {DeviceStatus(s).name.lower()} ({el:.0f} s)")
        time.sleep(poll_s)
    return time.monotonic() - t0


def start_device(spec: DeviceSpec, **kwargs) -> DeviceProcess:
    """Start the device process for `spec` on its (existing) ring; see DeviceProcess for kwargs."""
    return DeviceProcess(spec, **kwargs)
