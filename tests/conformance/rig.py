"""The device under test behind a fresh shared-memory ring (used by conftest's fixtures).

The suite talks to the device only through the ring (tests/conformance/client.py), so any device
that serves a /dev/shm ring can be checked. Which device is chosen here, and only here (the environment is read nowhere else):

    pytest tests/conformance                                    # the emulated device (CI)
    BLINK_DEVICE_FACTORY=pkg.module:function pytest tests/conformance   # e.g. the CUDA scheduler

A device factory is called as

    factory(ring: str, *, model: str, kv_blocks: int, block_size: int, max_batch: int,
            max_tokens: int, max_context: int) -> handle

after the test created the ring /dev/shm/<ring> (geometry chosen by the test). It must start the
device serving that ring and return at once; `handle` is `subprocess.Popen`-like (poll(), wait(timeout),
kill()). The suite waits for device_status READY, runs, sets header.shutdown and waits for STOPPED
and for the handle to exit. `model` is a spec of blink.models.registry: "random:tiny-llama" (most
cases) or "default" (SmolLM2-135M, cases marked `slow`).
"""

from __future__ import annotations

import importlib
import itertools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from conformance.client import RingClient

from blink.device.emulated import EmulatedDeviceConfig, start_emulated_device
from blink.protocol.layout import DeviceStatus, RingGeometry, SlotState
from blink.protocol.transport import ShmTransport

TINY = "random:tiny-llama"
SMOLLM2 = "default"
FACTORY_ENV = "BLINK_DEVICE_FACTORY"


def emulated_factory(
    ring: str, *, model: str, kv_blocks: int, block_size: int, max_batch: int, max_tokens: int, max_context: int
):
    cfg = EmulatedDeviceConfig(
        ring=ring,
        model=model,
        kv_blocks=kv_blocks,
        block_size=block_size,
        max_batch=max_batch,
        max_tokens=max_tokens,
        max_context=max_context,
    )
    return start_emulated_device(cfg)


def _factory_from_env() -> tuple[str, Callable]:
    spec = os.environ.get(FACTORY_ENV, "")
    if not spec:
        return "emulated", emulated_factory
    mod, _, fn = spec.partition(":")
    if not fn:
        raise pytest.UsageError(f"{FACTORY_ENV} must be 'module:function', got {spec!r}")
    return spec, getattr(importlib.import_module(mod), fn)


FACTORY_NAME, FACTORY = _factory_from_env()


@dataclass(frozen=True)
class RigSpec:
    model: str = TINY
    n_slots: int = 32
    prompt_tokens_per_slot: int = 1100
    output_capacity: int = 64
    kv_blocks: int = 128
    block_size: int = 16
    max_batch: int = 8
    max_tokens: int = 128
    max_context: int = 1024


_counter = itertools.count()


class Rig:
    """A ring, the device serving it, and a client."""

    def __init__(self, spec: RigSpec, start_timeout: float = 120.0):
        self.spec = spec
        self.name = f"blink-conf-{os.getpid()}-{next(_counter)}"
        geo = RingGeometry(spec.n_slots, spec.n_slots * spec.prompt_tokens_per_slot, spec.output_capacity)
        self.transport = ShmTransport.create(self.name, geo)
        self.proc = None
        try:
            self.proc = FACTORY(
                self.name,
                model=spec.model,
                kv_blocks=spec.kv_blocks,
                block_size=spec.block_size,
                max_batch=spec.max_batch,
                max_tokens=spec.max_tokens,
                max_context=spec.max_context,
            )
            self.client = RingClient(self.transport)
            t_end = time.monotonic() + start_timeout
            while self.client.h("device_status") != DeviceStatus.READY:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"device exited with {self.proc.returncode} before READY")
                if time.monotonic() > t_end:
                    raise TimeoutError("device not READY")
                time.sleep(0.01)
        except BaseException:
            self._kill()
            raise
        self.vocab = int(self.client.header()["vocab_size"])

    def assert_clean(self) -> None:
        """Every slot EMPTY (the client freed its requests) and the KV pool whole again."""
        states = self.client.states()
        assert (states == SlotState.EMPTY).all(), f"slots not EMPTY: {np.flatnonzero(states != SlotState.EMPTY)}"
        self.client.wait_idle()

    def stop(self, mode: int = 1, timeout: float = 30.0) -> int:
        """Ask the device to stop; returns the handle's exit code."""
        self.client.shutdown(mode)
        self.client.wait_status(DeviceStatus.STOPPED, timeout)
        rc = self.proc.wait(timeout)
        self._kill()
        return rc

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.transport.close()
        self.transport.unlink()


def open_rig(spec: RigSpec) -> Iterator[Rig]:
    rig = Rig(spec)
    try:
        yield rig
        rig.assert_clean()
        assert rig.stop() == 0
    finally:
        rig._kill()
