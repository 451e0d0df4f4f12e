"""The frontend roles over TcpTransport (a ring agent in another process): one poll is one round
trip whatever the number of active slots, a submission costs none, and a ring that becomes
unreachable ends every in-flight request with an error event (health not ok) instead of hanging.
The "device" side is driven by hand through a local mapping of the ring (tests/test_dpu_ring.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_dpu_ring import HandDevice, _req

from blink.dpu.request_tracker import DeviceDownError, RequestTracker
from blink.dpu.slot_tracker import SlotTracker
from blink.dpu.token_reader import TokenReader
from blink.protocol.agent_auth import new_secret
from blink.protocol.layout import FinishReason, SlotState
from blink.protocol.ring_agent import start_agent_process
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.tcp_transport import TcpTransport
from blink.protocol.wire import TokenEvent


@pytest.fixture
def remote():
    dev = HandDevice(n_slots=16, per_slot=32, cap=64)
    dev.secret = new_secret()
    agent, addr = start_agent_process(dev.name, secret=dev.secret)
    yield dev, agent, addr
    if agent.poll() is None:
        agent.terminate()
        agent.wait(10)
    dev.close()


def test_one_poll_is_one_round_trip(remote):
    dev, _, addr = remote
    fe = TcpTransport(addr, dev.secret)
    st = SlotTracker(fe, RingGeometry.from_header(dev.v.header))
    got: dict[int, list[int]] = {}
    rd = TokenReader(st, window=16)
    rt0 = fe.round_trips
    slots = []
    for i in range(12):  # 12 submissions: posted, no round trip each
        s = st.claim(_req(i))
        slots.append(s)
        got[s] = []
        rd.register(s, i, lambda e, s=s: got[s].extend(e.token_ids))
    assert fe.round_trips == rt0 and fe.posts >= 12
    fe.load_u32(0)  # a later batch: every posted submission has landed
    for s in slots:
        dev.admit(s)
        dev.publish(s, [s, s + 1, s + 2])
    rt0 = fe.round_trips
    assert rd.poll_once() == 36
    assert fe.round_trips == rt0 + 1  # 12 slots, 36 tokens: one round trip
    assert all(got[s] == [s, s + 1, s + 2] for s in slots)
    rt0 = fe.round_trips
    assert rd.poll_once() == 0 and fe.round_trips == rt0 + 1  # nothing new: still one
    assert all(int(dev.v.slots["consumed"][s]) == 3 for s in slots)  # posted before that batch: landed
    # one slot with more new tokens than a window: one more round trip for the rest
    dev.publish(slots[0], list(range(100, 140)))
    rt0 = fe.round_trips
    assert rd.poll_once() == 40 and fe.round_trips == rt0 + 2
    assert got[slots[0]][3:] == list(range(100, 140))
    # completions: the final count is read after the state (a second round trip), then released
    events: list[TokenEvent] = []
    rd.active[slots[1]].sink = events.append
    dev.publish(slots[1], [7])
    dev.complete(slots[1], FinishReason.LENGTH)
    rt0 = fe.round_trips
    rd.poll_once()
    assert fe.round_trips == rt0 + 2
    assert events[-1].token_ids == [7] and events[-1].finish_reason == FinishReason.LENGTH
    fe.load_u32(0)  # any later batch: the posted release has landed
    assert dev.v.slots[slots[1]]["state"] == SlotState.EMPTY
    fe.close()


@pytest.mark.asyncio
async def test_killing_the_agent_ends_requests_with_an_error_and_nothing_hangs(remote):
    dev, agent, addr = remote
    rt = RequestTracker(TcpTransport(addr, dev.secret, timeout_s=2.0), reader_kwargs={"health_interval_s": 0.02})
    await rt.start()
    try:
        dev.beat()
        h = await rt.submit(_req(rt.new_request_id()))
        for _ in range(200):  # the submission was posted: it lands without a round trip of its own
            if dev.v.slots[h.slot]["state"] == SlotState.PREFILL_PENDING:
                break
            await asyncio.sleep(0.005)
        dev.admit(h.slot)
        dev.publish(h.slot, [1, 2])
        evs = [await asyncio.wait_for(h.queue.get(), 2)]
        assert evs[0].token_ids == [1, 2]
        assert rt.health().ok
        agent.kill()
        agent.wait()
        t0 = time.monotonic()
        ev = await asyncio.wait_for(h.queue.get(), 5)
        assert ev.finish_reason == FinishReason.ERROR and "unreachable" in ev.message
        assert time.monotonic() - t0 < 3
        assert not rt.health().ok and "unreachable" in rt.health().message
        with pytest.raises(DeviceDownError):
            await asyncio.wait_for(rt.submit(_req(2)), 2)
    finally:
        await asyncio.wait_for(rt.close(), 5)
