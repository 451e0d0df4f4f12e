"""The device under test behind a fresh shared-memory ring (used by conftest's fixtures).

The suite talks to the device only through the ring (tests/conformance/client.py), so any device
that serves a /dev/shm ring can be checked. Which device is chosen here, and only here (the
environment is read nowhere else):

    pytest tests/conformance                                              # the emulated device (CI)
    BLINK_CONFORMANCE_DEVICE='{"kind": "cuda"}' pytest tests/conformance  # the GPU-resident scheduler

BLINK_CONFORMANCE_DEVICE holds DeviceSpec fields (blink.protocol.wire) as JSON, laid over the spec
each test's RigSpec gives, e.g. '{"kind": "cuda", "scheduler": "host"}' (the host-driven loop). The device starts as `blink serve` starts it
(blink.launch.start_device) after the test created the ring /dev/shm/<ring> (geometry chosen by the
test); the suite waits for device_status READY, runs, sets header.shutdown and waits for STOPPED
and for the process to exit. `model` is a spec of blink.models.registry: "random:tiny-llama" (most
cases; the shared rig also runs "random:tiny-qwen3-moe", the MoE model) or "default" (SmolLM2-135M,
cases marked `slow`).

The client reaches the ring over shared memory, and again over TCP through a ring agent in its
own process (blink.protocol.ring_agent, as on a GPU host serving a frontend on another host):
conftest.py runs every test once per transport.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
from conformance.client import RingClient

from blink.config import BlinkConfig
from blink.launch import DeviceProcess, device_spec, start_device
from blink.protocol.agent_auth import new_secret
from blink.protocol.layout import DeviceStatus, SlotState
from blink.protocol.ring_agent import start_agent_process
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.tcp_transport import TcpTransport
from blink.protocol.transport import ShmTransport, TransportError
from blink.protocol.wire import DeviceSpec

TRANSPORTS = ("shm", "tcp")
TINY = "random:tiny-llama"
TINY_MOE = "random:tiny-qwen3-moe"
SMOLLM2 = "default"
DEVICE_ENV = "BLINK_CONFORMANCE_DEVICE"


def _device_from_env() -> dict:
    try:
        fields = json.loads(os.environ.get(DEVICE_ENV) or "{}")
    except json.JSONDecodeError as e:
        raise pytest.UsageError(f"{DEVICE_ENV} must be a JSON object of DeviceSpec fields: {e}") from e
    if not isinstance(fields, dict) or set(fields) - set(DeviceSpec.__struct_fields__):
        raise pytest.UsageError(f"{DEVICE_ENV}: not DeviceSpec fields: {fields!r}")
    return fields


DEVICE_FIELDS = _device_from_env()
DEVICE_NAME = json.dumps(DEVICE_FIELDS) if DEVICE_FIELDS else "emulated"
# RigSpec fields of a device whose steps last as long as a GPU's at real sizes: on the emulated device
# the numpy model with 30 ms steps (conformance/slow_executor.py); another device as it is. For the
# cases whose client must keep pace with the device (a tiny model's CPU step takes ~1.5 ms).
GPU_PACED = {} if DEVICE_FIELDS else {"executor": "tests.conformance.slow_executor:make"}
# The same, with the header's statistics written a moment after a step's tokens (a GPU device's counters
# lag its tokens): for the cases that read a counter right after a token.
GPU_PACED_LATE_STATS = {} if DEVICE_FIELDS else {"executor": "tests.conformance.slow_executor:make_late_stats"}


@dataclass(frozen=True)
class RigSpec:
    model: str = TINY
    n_slots: int = 32
    prompt_tokens_per_slot: int = 1100
    output_capacity: int = 64
    kv_blocks: int = 128
    block_size: int = 16
    max_batch: int = 8
    max_num_batched_tokens: int = 128
    max_context: int = 1024
    mixed_tokens: int = 0
    n_masks: int = 4  # token masks in the ring (structured output)
    mask_vocab: int = 49_152  # tokens a mask covers (SmolLM2 and the tiny models fit)
    prefix_caching: bool = True
    executor: str = ""  # the emulated device's executor factory ("module:function"); "" = the numpy model


_counter = itertools.count()


class Rig:
    """A ring, the device serving it, and a client (over `transport`: shm, or tcp through a ring agent)."""

    def __init__(self, spec: RigSpec, start_timeout: float = 120.0, transport: str = "shm"):
        self.spec = spec
        self.name = f"blink-conf-{os.getpid()}-{next(_counter)}"
        geo = RingGeometry(
            spec.n_slots,
            spec.n_slots * spec.prompt_tokens_per_slot,
            spec.output_capacity,
            spec.n_masks,
            spec.mask_vocab if spec.n_masks else 0,
        )
        self.transport = ShmTransport.create(self.name, geo)
        self.proc: DeviceProcess | None = None
        self.agent = None
        self.remote: TcpTransport | None = None
        try:
            self.proc = start_device(self.device_spec())
            if transport == "tcp":
                secret = new_secret()
                self.agent, addr = start_agent_process(self.name, secret=secret)
                self.remote = TcpTransport(addr, secret, timeout_s=30.0)
            self.client = RingClient(self.remote or self.transport, control=self.transport)
            self.proc.wait_ready(self.transport, start_timeout)
            self.client.describe()
        except BaseException:
            self._kill()
            raise
        self.vocab = int(self.client.header()["vocab_size"])

    def device_spec(self) -> DeviceSpec:
        """The spec `blink serve` would build for these settings, with BLINK_CONFORMANCE_DEVICE over it."""
        s = self.spec
        cfg = BlinkConfig().replace(
            model={"spec": s.model},
            device={
                "kind": "emulated",
                "num_kv_blocks": s.kv_blocks,
                "kv_block_size": s.block_size,
                "max_batch": s.max_batch,
                "max_num_batched_tokens": s.max_num_batched_tokens,
                "max_context": s.max_context,
                "mixed_tokens": s.mixed_tokens,
                "enable_prefix_caching": s.prefix_caching,
                "executor": s.executor,
            },
        )
        return msgspec.structs.replace(device_spec(cfg, self.name), **DEVICE_FIELDS)

    @property
    def exact(self) -> bool:
        """The device computes every token's logits the same whatever the step holds (the emulated
        device's float32 numpy). A CUDA step sums in an order that depends on how many tokens it
        carries (GEMV vs GEMM, prefill vs decode kernels), so a sequence recomputed or prefilled in
        other chunks can part from the first run at a near-tie of a random model's logits."""
        return self.device_spec().kind == "emulated"

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
        if self.remote is not None:
            self.remote.close()
        if self.agent is not None and self.agent.poll() is None:
            self.agent.terminate()
            self.agent.wait(10)
        self.transport.close()
        self.transport.unlink()


def open_rig(spec: RigSpec, transport: str = "shm") -> Iterator[Rig]:
    rig = Rig(spec, transport=transport)
    try:
        yield rig
        rig.assert_clean()
        assert rig.stop() == 0
    finally:
        rig._kill()


def refused_by_the_agent(rig: Rig, submit: Callable[[], object]) -> bool:
    """Over tcp: a request whose prompt or records point outside its slot's region never reaches the
    device: the ring agent refuses the publishing store (blink/protocol/ring_access.py) and closes
    the connection. Checks that, reconnects, and returns True; over shm returns False (the device's
    own check is the test's subject then)."""
    if rig.remote is None:
        return False
    with pytest.raises(TransportError, match="refused"):
        submit()
    rig.remote.reconnect()
    return True
