"""The emulated device: a CPU process that serves a shared-memory ring with the numpy executor.

    python -m blink.device.emulated --ring NAME --model random:tiny-llama [--max-batch 16 ...]

It opens the ring /dev/shm/NAME (or creates it with --create-slots N), builds the executor,
and runs `RingDevice` until header.shutdown asks it to stop. The process exits 0 after a clean
stop (status STOPPED) and 1 after a device fault (status FAILED).

`--executor module:function` swaps the executor factory (tests use a hash-based stand-in model;
anything with the `Executor` interface works). The factory is called as
`factory(model, num_blocks=, block_size=, max_batch=, max_tokens=, max_blocks_per_seq=)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from blink.protocol.layout import DeviceStatus, RingGeometry
from blink.protocol.transport import ShmTransport

from .executor import Executor
from .ring_device import RingDevice, RingDeviceConfig


@dataclass(frozen=True)
class EmulatedDeviceConfig:
    ring: str
    """Shared-memory ring name (/dev/shm/<ring>)."""
    model: str = "random:tiny-llama"
    """Model spec for the executor factory (a .gguf path, an HF dir, "random:<preset>", ...)."""
    executor: str = ""
    """Executor factory "module:function"; empty = NumpyExecutor.from_model."""
    kv_blocks: int = 256
    """KV blocks in the pool."""
    block_size: int = 16
    """Tokens per KV block."""
    max_batch: int = 16
    """Sequences per step."""
    max_tokens: int = 256
    """Packed tokens per prefill step."""
    max_context: int = 0
    """Tokens per sequence; 0 = as much as the model and the pool allow."""
    create_slots: int = 0
    """> 0: create the ring with this many slots instead of opening an existing one."""
    prompt_arena_tokens: int = 1 << 16
    """Prompt arena size of a created ring."""
    output_capacity: int = 256
    """Output ring size per slot of a created ring."""
    spin_s: float = 200e-6
    """Busy-poll time after activity before idle sleeps."""
    max_sleep_s: float = 500e-6
    """Longest idle sleep (<= 1 ms)."""

    def __post_init__(self) -> None:
        for f in ("kv_blocks", "block_size", "max_batch", "max_tokens"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.max_context < 0 or self.create_slots < 0:
            raise ValueError("max_context and create_slots must be >= 0")
        if self.executor and ":" not in self.executor:
            raise ValueError(f"executor must be 'module:function', got {self.executor!r}")

    def device_config(self) -> RingDeviceConfig:
        return RingDeviceConfig(spin_s=self.spin_s, max_sleep_s=self.max_sleep_s)

    def argv(self) -> list[str]:
        out = []
        for f in dataclasses.fields(self):
            out += [f"--{f.name.replace('_', '-')}", str(getattr(self, f.name))]
        return out


def parse_args(argv: list[str] | None = None) -> EmulatedDeviceConfig:
    ap = argparse.ArgumentParser(prog="python -m blink.device.emulated", description=__doc__.splitlines()[0])
    for f in dataclasses.fields(EmulatedDeviceConfig):
        flag = f"--{f.name.replace('_', '-')}"
        typ = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
        if f.default is dataclasses.MISSING:
            ap.add_argument(flag, dest=f.name, type=typ, required=True)
        else:
            ap.add_argument(flag, dest=f.name, type=typ, default=f.default)
    return EmulatedDeviceConfig(**vars(ap.parse_args(argv)))


def _import(path: str) -> Callable[..., Executor]:
    mod, _, fn = path.partition(":")
    return getattr(importlib.import_module(mod), fn)


def build_executor(cfg: EmulatedDeviceConfig) -> Executor:
    width = -(-cfg.max_context // cfg.block_size) if cfg.max_context else None
    kw = dict(
        num_blocks=cfg.kv_blocks,
        block_size=cfg.block_size,
        max_batch=cfg.max_batch,
        max_tokens=cfg.max_tokens,
        max_blocks_per_seq=width,
    )
    if cfg.executor:
        return _import(cfg.executor)(cfg.model, **kw)
    from .numpy_executor import NumpyExecutor

    return NumpyExecutor.from_model(cfg.model, **kw)


def run_emulated(cfg: EmulatedDeviceConfig) -> DeviceStatus:
    """Serve the ring in this process until it is told to stop."""
    if cfg.create_slots:
        geo = RingGeometry(cfg.create_slots, cfg.prompt_arena_tokens, cfg.output_capacity)
        transport = ShmTransport.create(cfg.ring, geo, exist_ok=True)
    else:
        transport = ShmTransport.open(cfg.ring)
    executor = build_executor(cfg)
    view = transport.view()
    try:
        return RingDevice(view, executor, cfg.device_config()).run()
    finally:
        executor.close()
        del view
        transport.close()


def start_emulated_device(cfg: EmulatedDeviceConfig, **popen_kwargs) -> subprocess.Popen:
    """Start the emulated device in a child process (python -m blink.device.emulated)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    # The child imports blink (and an --executor module) the same way the parent does.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), root, env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen([sys.executable, "-m", "blink.device.emulated", *cfg.argv()], env=env, **popen_kwargs)


def wait_ready(transport: ShmTransport, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    """Block until the device behind `transport` reports READY (raise if it died or timed out)."""
    t_end = time.monotonic() + timeout
    view = transport.view()
    while int(view.header["device_status"]) != DeviceStatus.READY:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"emulated device exited with {proc.returncode} before READY")
        if time.monotonic() > t_end:
            raise TimeoutError(f"device not READY after {timeout} s")
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    status = run_emulated(parse_args(argv))
    return 0 if status is DeviceStatus.STOPPED else 1


if __name__ == "__main__":
    raise SystemExit(main())
