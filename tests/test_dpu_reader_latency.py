"""The token reader's latency and its cost: a token is read within ~fine_s of its publication, both
at a running batch's step cadence and for a lone prompt, and a waiting reader does not spin a core.

The device is a thread that writes the ring by hand (test_dpu_ring.HandDevice) on its own clock:
steps of STEP_S, tokens stamped t_first_ns at publication. The reader stamps t_read_ns when it
reads a first token, so t_read - t_first is the time a token lay in the ring unseen. Before the
fine timer the reader polled every 1 ms of asyncio (1.1-1.3 ms in practice): a median of ~0.6 ms.
"""

from __future__ import annotations

import asyncio
import queue
import random
import statistics
import threading
import time

import pytest
import uvloop
from test_dpu_ring import HandDevice, _req

from blink.dpu.fine_timer import FineTimer
from blink.dpu.request_tracker import RequestTracker
from blink.dpu.slot_tracker import SlotTracker
from blink.dpu.token_reader import TokenReader
from blink.protocol.layout import FinishReason
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import ShmTransport

STEP_S = 0.005  # an 8B decode step on the H200


@pytest.fixture
def dev():
    d = HandDevice(n_slots=8, per_slot=32, cap=4096)
    yield d
    d.close()


class StepThread(threading.Thread):
    """Every STEP_S: admit and give a first token to the slots queued in `first`, complete the
    slots that got theirs a step earlier, and one token to every slot in `running`."""

    def __init__(self, d: HandDevice, running: list[int], delay=None):
        super().__init__(daemon=True)
        self.d, self.running, self.delay = d, running, delay
        self.first: queue.Queue[int] = queue.Queue()
        self.stop = threading.Event()

    def run(self) -> None:
        d, done = self.d, []
        while not self.stop.is_set():
            time.sleep(self.delay() if self.delay else STEP_S)
            d.beat()
            for s in done:
                d.complete(s, FinishReason.LENGTH)
            done = []
            while not self.first.empty():
                s = self.first.get()
                d.admit(s)
                d.v.slots[s]["t_first_ns"] = time.time_ns()
                d.publish(s, [5])
                done.append(s)
            for s in self.running:
                d.publish(s, [6])


async def _first_token_delays(d: HandDevice, rt: RequestTracker, st: StepThread, n: int) -> list[float]:
    delays = []
    for i in range(n):
        h = await rt.submit(_req(1000 + i))
        st.first.put(h.slot)
        ev = await asyncio.wait_for(h.queue.get(), 2)
        delays.append((h.timing[4] - h.timing[3]) * 1e-9)
        while not ev.finished:  # its completion (maybe read with the token): the slot is released
            ev = await asyncio.wait_for(h.queue.get(), 2)
    return delays


@pytest.mark.asyncio
async def test_first_token_read_within_fine_interval_at_step_cadence(dev):
    """A running batch gives the step cadence; new requests' first tokens come at step ends."""
    rt = RequestTracker(ShmTransport.open(dev.name), reader_kwargs={"health_interval_s": 0.05})
    await rt.start()
    bg = await rt.submit(_req(1))  # a running decode (max 5 tokens, but this device ignores that)
    dev.admit(bg.slot)
    st = StepThread(dev, [bg.slot])
    st.start()
    try:
        for _ in range(10):  # the reader learns the cadence
            await asyncio.wait_for(bg.queue.get(), 2)
        delays = await _first_token_delays(dev, rt, st, 40)
        assert rt.reader.cadence.step_s is not None and 0.6 * STEP_S < rt.reader.cadence.step_s < 2 * STEP_S
    finally:
        st.stop.set()
        st.join()
        await rt.close()
    assert statistics.median(delays) < 0.4e-3, sorted(delays)


@pytest.mark.asyncio
async def test_lone_first_token_read_within_fine_interval(dev):
    """No running batch (no cadence): a lone prompt's first token, published at a random time."""
    rt = RequestTracker(ShmTransport.open(dev.name), reader_kwargs={"health_interval_s": 0.05})
    await rt.start()
    st = StepThread(dev, [], delay=lambda: random.uniform(1e-3, 6e-3))
    st.start()
    try:
        delays = await _first_token_delays(dev, rt, st, 40)
        assert rt.reader.cadence.step_s is None  # first tokens alone are no cadence
    finally:
        st.stop.set()
        st.join()
        await rt.close()
    assert statistics.median(delays) < 0.4e-3, sorted(delays)


def test_a_waiting_reader_does_not_spin(dev):
    """A request awaiting its first token for 0.5 s: the reader cycles every fine_s (200 us) for
    urgent_fine_s, then every max_idle_s, never as fast as the loop turns (uvloop's sleep(0.0002)
    does not sleep: the server runs on uvloop);
    with only tokens of a stalled batch outstanding (no cadence, none urgent) every max_idle_s;
    parked without requests."""
    uvloop.run(_waiting_reader(dev))


async def _waiting_reader(dev: HandDevice) -> None:
    fe = ShmTransport.open(dev.name)
    rd = TokenReader(SlotTracker(fe, RingGeometry.from_header(dev.v.header)), health_interval_s=0.05)
    task = asyncio.ensure_future(rd.run())
    try:
        s = rd.tracker.claim(_req(1))
        rd.register(s, 1, lambda e: None)
        c0, t0, w0 = rd.cycles, time.process_time(), time.monotonic()
        await asyncio.sleep(0.5)
        cycles, cpu, wall = rd.cycles - c0, time.process_time() - t0, time.monotonic() - w0
        assert cycles <= 1.2 * (rd.cadence.urgent_fine_s / rd.cadence.fine_s + wall / rd.cadence.max_idle_s), cycles
        assert cpu < 0.5 * wall, cpu  # spinning would be ~100 %
        dev.admit(s)
        dev.publish(s, [5])  # its first token: no longer urgent, and no step cadence
        await asyncio.sleep(0.05)
        c0 = rd.cycles
        await asyncio.sleep(0.5)
        assert rd.cycles - c0 <= 1.2 * 0.5 / rd.cadence.max_idle_s
        dev.complete(s, FinishReason.LENGTH)
        await asyncio.sleep(0.05)
        assert not rd.active
        c0 = rd.cycles
        await asyncio.sleep(0.3)
        assert rd.cycles - c0 <= 0.3 / rd.health_interval_s + 2  # parked: wakes for health checks only
    finally:
        rd.stop()
        await task


def test_next_wait_follows_the_step_cadence(dev):
    rd = TokenReader(SlotTracker(ShmTransport.open(dev.name), RingGeometry.from_header(dev.v.header)))
    assert rd.next_wait(time.monotonic()) == rd.cadence.max_idle_s  # nothing known, nothing urgent
    s = rd.tracker.claim(_req(1))
    rd.register(s, 1, lambda e: None)  # awaits its first token
    assert rd.next_wait(time.monotonic()) == rd.cadence.fine_s
    assert rd.next_wait(time.monotonic() + rd.cadence.urgent_fine_s) == rd.cadence.max_idle_s  # a long prefill, a stall
    rd._urgent.clear()
    t = 100.0
    for k in range(6):
        rd.cadence.saw_step(t + k * STEP_S)
    t_last = t + 5 * STEP_S
    assert rd.cadence.step_s == pytest.approx(STEP_S)
    assert rd.next_wait(t_last + 0.1e-3) == rd.cadence.max_idle_s  # early in the step: coarse
    assert rd.next_wait(t_last + 2.9e-3) == pytest.approx(0.7 * STEP_S - 2.9e-3)  # until 70 % of it
    assert rd.next_wait(t_last + 3.6e-3) == rd.cadence.fine_s  # the step's end is due
    assert rd.next_wait(t_last + 9e-3) == rd.cadence.fine_s  # a longer (prefill) step: still due
    assert rd.next_wait(t_last + 25e-3) == rd.cadence.max_idle_s  # 4 steps without tokens: no cadence


@pytest.mark.asyncio
async def test_fine_timer_sleeps_below_a_millisecond():
    timer = FineTimer()
    try:
        assert timer.fine
        ts = []
        for _ in range(50):
            t = time.perf_counter()
            await timer.sleep(200e-6)
            ts.append(time.perf_counter() - t)
        assert min(ts) >= 190e-6  # it does sleep
        assert statistics.median(ts) < 0.6e-3  # asyncio's own timers: >= 1 ms
    finally:
        timer.close()


def test_first_tokens_are_delivered_in_a_cycle_of_their_own(dev):
    """The loop's cycles deliver first tokens apart from the other slots' news of the same step,
    so that their consumers run before the rest is read (test_dpu_sse_path: why that matters)."""
    rd = TokenReader(SlotTracker(ShmTransport.open(dev.name), RingGeometry.from_header(dev.v.header)))
    got: list[int] = []
    old = rd.tracker.claim(_req(1))
    rd.register(old, 1, lambda e: got.append(e.request_id))
    dev.admit(old)
    dev.publish(old, [5])
    rd.poll_once(first_apart=True)
    new = rd.tracker.claim(_req(2))
    rd.register(new, 2, lambda e: got.append(e.request_id))
    dev.admit(new)
    for s in (old, new):
        dev.publish(s, [6])
    assert rd.poll_once(first_apart=True) == 1 and got == [1, 2]  # only the new request's first token
    assert rd.poll_once(first_apart=True) == 1 and got == [1, 2, 1]  # then the rest
