"""Data-parallel routing and replica failover in the frontend process, without Ray.

Two rings, each served by the ring interpreter with the hash executor on a thread; the Router
(the HTTP ingress's view of N replicas) must spread requests by free slots, drop a replica whose
heartbeat stops (ending its in-flight requests with an error event), and attach the fresh ring a
restarted GPU actor creates under the same name.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from conformance.hash_executor import HashExecutor, reference_greedy

from blink.actors.router import Router
from blink.device.ring_device import RingDevice
from blink.dpu.request_tracker import DeviceDownError, RequestTracker
from blink.protocol.layout import FinishReason
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.sampling_params import SamplingParams
from blink.protocol.transport import ShmTransport
from blink.protocol.wire import SubmitRequest

VOCAB = 512

GREEDY = SamplingParams(temperature=0.0)


class HangingExecutor(HashExecutor):
    """Stops answering once `hang` is set: the device loop blocks and its heartbeat goes silent,
    which is what a killed GPU actor looks like from the ring."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.hang = threading.Event()
        self.release = threading.Event()

    def execute(self, batch):
        if self.hang.is_set():
            self.release.wait()
            raise RuntimeError("released after hang")
        return super().execute(batch)


class Device:
    def __init__(self, name: str, executor: HashExecutor):
        self.transport = ShmTransport.create(name, RingGeometry(8, 4096, 64))
        self.executor = executor
        self.dev = RingDevice(self.transport.view(), executor)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.dev.run()
        except RuntimeError:
            pass  # HangingExecutor's release: the test already observed the hang

    def stop(self) -> None:
        self.transport.view().header["shutdown"] = 2
        if isinstance(self.executor, HangingExecutor):
            self.executor.release.set()
        self.thread.join(5)
        assert not self.thread.is_alive()
        self.transport.unlink()


def _ex(cls=HashExecutor, **kw):
    return cls(vocab_size=VOCAB, num_blocks=64, block_size=16, max_batch=8, max_num_batched_tokens=64, **kw)


async def _collect(handle) -> tuple[list[int], list]:
    toks, events = [], []
    async for ev in handle:
        toks += ev.token_ids
        events.append(ev)
    return toks, events


def _wait_ready(transport: ShmTransport) -> None:
    t_end = time.monotonic() + 10
    while int(transport.view().header["device_status"]) != 1:
        assert time.monotonic() < t_end
        time.sleep(0.005)


@pytest.mark.timeout(60)
def test_router_balances_fails_over_and_reattaches() -> None:
    names = [f"blink-test-router-{os.getpid()}-{i}" for i in range(2)]
    devs = [Device(names[0], _ex(step_delay_s=0.002)), Device(names[1], _ex(HangingExecutor, step_delay_s=0.002))]
    for d in devs:
        _wait_ready(d.transport)

    def make_tracker(t: ShmTransport) -> RequestTracker:
        return RequestTracker(t, heartbeat_timeout_s=0.5)

    async def main() -> None:
        router = Router(names, make_tracker, watch_interval_s=0.05)
        await router.start()
        try:
            assert [r.up for r in router.replicas] == [True, True]
            # 1) balance: each submit goes to the replica with the most free slots -> alternates.
            prompts = [[3 + i, 7, 11 + i] for i in range(6)]
            handles = []
            for p in prompts:
                rid = router.new_request_id()
                handles.append(await router.submit(SubmitRequest(rid, p, 12, sampling=GREEDY)))
            assert [r.requests for r in router.replicas] == [3, 3]
            outs = await asyncio.gather(*(_collect(h) for h in handles))
            for p, (toks, evs) in zip(prompts, outs, strict=True):
                assert toks == reference_greedy(p, 12, VOCAB)
                assert evs[-1].finish_reason == FinishReason.LENGTH

            # 2) replica 1 hangs mid-request: its request ends with an error event, routing skips it.
            ex1 = devs[1].executor
            long = await router.submit(SubmitRequest(router.new_request_id(), [5, 6], 40, sampling=GREEDY))
            other = await router.submit(SubmitRequest(router.new_request_id(), [9, 9], 40, sampling=GREEDY))
            on_1 = other if other._tracker is router.replicas[1].tracker else long
            assert {long._tracker, other._tracker} == {r.tracker for r in router.replicas}
            ex1.hang.set()
            toks, evs = await asyncio.wait_for(_collect(on_1), 5)
            assert evs[-1].finish_reason == FinishReason.ERROR and "heartbeat" in evs[-1].message
            t_end = time.monotonic() + 3
            while router.replicas[1].up or router.replicas[1].down_reason == "":
                assert time.monotonic() < t_end
                await asyncio.sleep(0.02)
            before = router.replicas[0].requests
            hs = [
                await router.submit(SubmitRequest(router.new_request_id(), [1, 2, i], 4, sampling=GREEDY))
                for i in range(3)
            ]
            assert router.replicas[0].requests == before + 3
            for h in hs:
                assert (await _collect(h))[1][-1].finish_reason == FinishReason.LENGTH
            await _collect(long if on_1 is other else other)
            assert router.health().ok  # one replica is enough

            # 3) "restart": a fresh ring under the same name (new inode) is attached again.
            devs[1].stop()
            devs[1] = Device(names[1], _ex(step_delay_s=0.002))
            t_end = time.monotonic() + 5
            while not router.replicas[1].up:
                assert time.monotonic() < t_end
                await asyncio.sleep(0.02)
            assert router.replicas[1].attaches == 2
            h = await router.submit(SubmitRequest(router.new_request_id(), [4, 4, 4], 6, sampling=GREEDY))
            got = await _collect(h)
            assert got[0] == reference_greedy([4, 4, 4], 6, VOCAB)

            # 4) every replica down: submit fails fast with DeviceDownError.
            devs[0].stop()
            devs[1].stop()
            t_end = time.monotonic() + 5
            while any(r.up for r in router.replicas):
                assert time.monotonic() < t_end
                await asyncio.sleep(0.05)
            with pytest.raises(DeviceDownError):
                await router.submit(SubmitRequest(router.new_request_id(), [1], 1))
            assert not router.health().ok
        finally:
            await router.close()

    try:
        asyncio.run(main())
    finally:
        for d in devs:
            if d.thread.is_alive():
                d.stop()


@pytest.mark.timeout(60)
def test_router_switches_at_once_to_a_replaced_ring() -> None:
    """The old device keeps beating on the unlinked ring (as a not-yet-reaped engine could), and the
    heartbeat timeout is a minute: only the new inode under the ring's name can tell the router."""
    name = f"blink-test-replace-{os.getpid()}"
    old = Device(name, _ex(step_delay_s=0.01))
    _wait_ready(old.transport)

    async def main() -> None:
        router = Router([name], lambda t: RequestTracker(t, heartbeat_timeout_s=60.0), watch_interval_s=0.05)
        await router.start()
        new = None
        try:
            h = await router.submit(SubmitRequest(router.new_request_id(), [5, 6], 1000, sampling=GREEDY))
            os.unlink(old.transport.path)  # the old mapping (and device) live on; only the name moves
            new = Device(name, _ex())
            t0 = time.monotonic()
            toks, evs = await asyncio.wait_for(_collect(h), 10)
            assert evs[-1].finish_reason == FinishReason.ERROR and "replaced" in evs[-1].message
            while router.replicas[0].attaches < 2 or not router.replicas[0].up:
                assert time.monotonic() - t0 < 10
                await asyncio.sleep(0.02)
            got = await _collect(
                await router.submit(SubmitRequest(router.new_request_id(), [7, 7], 5, sampling=GREEDY))
            )
            assert got[0] == reference_greedy([7, 7], 5, VOCAB)
            # served by the new ring; the device writes its statistics after the step's tokens
            t_end = time.monotonic() + 10
            while int(new.transport.view().header["requests_completed"]) < 1:
                assert time.monotonic() < t_end
                await asyncio.sleep(0.001)
            assert int(new.transport.view().header["requests_completed"]) == 1
        finally:
            await router.close()
            old.transport.view().header["shutdown"] = 2
            old.thread.join(5)
            if new is not None:
                new.stop()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_routing_counts_every_frontends_requests() -> None:
    """deploy.frontends = 2: frontend B's requests on replica 0 (slots A does not own) weigh in A's
    routing, read from the slot records A's token reader bulk-reads anyway."""
    names = [f"blink-test-route2-{os.getpid()}-{i}" for i in range(2)]
    devs = [Device(n, _ex(step_delay_s=0.005)) for n in names]
    for d in devs:
        _wait_ready(d.transport)

    async def main() -> None:
        a, b = (Router(names, lambda t, k=k: RequestTracker(t, owner=k, owners=2)) for k in (0, 1))
        await a.start()
        await b.start()
        try:
            b0 = b.replicas[0].tracker
            held = [
                await b0.submit(SubmitRequest(b0.new_request_id(), [5, 6], 1000, sampling=GREEDY)) for _ in range(3)
            ]
            t_end = time.monotonic() + 10  # A's idle token readers refresh their records every 0.25 s
            while a.replicas[0].tracker.load() < 3:
                assert time.monotonic() < t_end, a.replicas[0].tracker.load()
                await asyncio.sleep(0.02)
            assert a.replicas[0].tracker.load() == 3 and a.replicas[1].tracker.load() == 0
            mine = [await a.submit(SubmitRequest(a.new_request_id(), [1, 2, i], 4, sampling=GREEDY)) for i in range(3)]
            assert [r.requests for r in a.replicas] == [0, 3]  # all to the replica B is not using
            for h in mine:
                assert (await _collect(h))[1][-1].finish_reason == FinishReason.LENGTH
            for h in held:
                h.cancel()
        finally:
            await a.close()
            await b.close()

    try:
        asyncio.run(main())
    finally:
        for d in devs:
            d.stop()
