"""Conformance suite fixtures; the device factory and the rig are in rig.py (see its docstring:
`BLINK_CONFORMANCE_DEVICE='{"kind": "cuda"}' pytest tests/conformance` checks another device)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from conformance.rig import DEVICE_NAME, TINY, TINY_MOE, TRANSPORTS, Rig, RigSpec, open_rig

from blink.protocol.layout import DeviceStatus


@pytest.fixture(scope="module", params=TRANSPORTS)
def ring_transport(request) -> str:
    """How the client reaches the ring: every test runs over shared memory and over TCP."""
    return request.param


# The shared rig's (transport, model): the tiny dense model over each transport, and the tiny MoE model
# (routed experts in every step the device runs) over shared memory.
RIG_CASES = [(t, TINY) for t in TRANSPORTS] + [("shm", TINY_MOE)]


@pytest.fixture(scope="module", params=RIG_CASES, ids=lambda c: f"{c[0]}-{c[1].removeprefix('random:')}")
def rig(request) -> Iterator[Rig]:
    """The shared device of a test module (tiny model). Every test must leave it clean."""
    transport, model = request.param
    yield from open_rig(RigSpec(model=model), transport)


@pytest.fixture
def clean(rig: Rig) -> Iterator[Rig]:
    """The shared rig, checked clean after the test (all slots EMPTY, all KV blocks free)."""
    yield rig
    rig.assert_clean()


@pytest.fixture
def make_rig(ring_transport: str) -> Iterator[Callable[..., Rig]]:
    """Start a device of a custom spec; it is checked clean and stopped after the test."""
    rigs: list[Rig] = []

    def make(**kw) -> Rig:
        r = Rig(RigSpec(**kw), transport=ring_transport)
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        try:
            if r.proc.poll() is None and r.client.h("device_status") == DeviceStatus.READY:
                r.assert_clean()
                assert r.stop() == 0
        finally:
            r._kill()


def pytest_report_header(config: pytest.Config) -> str:
    return f"conformance device: {DEVICE_NAME}"
