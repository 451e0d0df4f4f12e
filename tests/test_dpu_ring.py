"""Slot tracker, token reader and request tracker against a real ShmTransport ring, with the
"device" side driven by hand in the test (numpy views of the same shared memory)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from blink.dpu.request_tracker import DeviceDownError, QueueFullError, RequestTracker
from blink.dpu.slot_tracker import SlotTracker
from blink.dpu.token_reader import TokenReader
from blink.protocol.layout import DeviceStatus, FinishReason, SlotError, SlotFlags, SlotState
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.sampling_params import SamplingParams
from blink.protocol.transport import ShmTransport
from blink.protocol.wire import SubmitRequest, TokenEvent


class HandDevice:
    """The device's side of the ring, written directly by the test."""

    def __init__(self, n_slots: int = 4, per_slot: int = 32, cap: int = 8, n_masks: int = 0, vocab: int = 1000):
        self.name = f"blink-test-{uuid.uuid4().hex[:12]}"
        geo = RingGeometry(n_slots, n_slots * per_slot, cap, n_masks, vocab if n_masks else 0)
        self.t = ShmTransport.create(self.name, geo)
        self.v = self.t.view()
        h = self.v.header
        h["vocab_size"], h["max_context"], h["max_batch"] = vocab, 64, n_slots
        h["device_status"] = DeviceStatus.READY

    def beat(self) -> None:
        self.v.header["heartbeat"] += 1

    def admit(self, s: int) -> None:
        assert self.v.slots[s]["state"] == SlotState.PREFILL_PENDING
        self.v.slots[s]["state"] = SlotState.DECODE_PROCESSING

    def publish(self, s: int, ids: list[int]) -> None:
        rec = self.v.slots[s]
        cap = self.v.geo.output_capacity
        for tok in ids:
            k = int(rec["generated"])
            assert k - int(rec["consumed"]) < cap, "test device would overrun the output ring"
            self.v.output_arena[s, k % cap] = tok
            rec["generated"] = k + 1

    def complete(self, s: int, reason: FinishReason = FinishReason.STOP, err: SlotError = SlotError.NONE) -> None:
        self.v.slots[s]["finish_reason"] = reason
        self.v.slots[s]["error"] = err
        self.v.slots[s]["state"] = SlotState.DECODE_COMPLETED

    def close(self) -> None:
        self.t.close()
        self.t.unlink()


@pytest.fixture
def dev():
    d = HandDevice()
    yield d
    d.close()


def _req(rid: int, n: int = 3, **kw) -> SubmitRequest:
    return SubmitRequest(rid, list(range(10, 10 + n)), 5, sampling=SamplingParams(**kw))


def test_claim_writes_record_then_state_and_doorbell(dev):
    fe = ShmTransport.open(dev.name)
    st = SlotTracker(fe, RingGeometry.from_header(dev.v.header))
    req = SubmitRequest(
        77,
        [5, 6, 7],
        9,
        min_new_tokens=2,
        stop_ids=[2, 3],
        sampling=SamplingParams(temperature=0.5, top_p=0.9, top_k=40, seed=123),
    )
    s = st.claim(req)
    assert s == 0
    rec = dev.v.slots[s]
    assert rec["state"] == SlotState.PREFILL_PENDING
    assert rec["request_id"] == 77 and rec["prompt_len"] == 3 and rec["max_new_tokens"] == 9
    assert rec["min_new_tokens"] == 2 and rec["top_k"] == 40 and rec["seed"] == 123
    assert np.isclose(rec["temperature"], 0.5) and np.isclose(rec["top_p"], 0.9)
    assert rec["n_stop"] == 2 and list(rec["stop_ids"][:2]) == [2, 3]
    assert rec["flags"] == SlotFlags.NONE and rec["generated"] == 0 and rec["consumed"] == 0
    off = int(rec["prompt_offset"])
    assert off == s * st.prompt_capacity
    assert list(dev.v.prompt_arena[off : off + 3]) == [5, 6, 7]
    assert dev.v.header["submit_seq"] == 1
    # greedy (a temperature below SAMPLING_EPS) is temperature 0 on the ring, no flag; the next claim
    # goes to the next slot (hint)
    s2 = st.claim(SubmitRequest(78, [1], 1, sampling=SamplingParams(temperature=1e-40), group=5))
    assert s2 == 1 and dev.v.slots[1]["temperature"] == 0.0 and dev.v.slots[1]["flags"] == SlotFlags.NONE
    assert dev.v.slots[1]["group"] == 5
    assert int(dev.v.slots[1]["prompt_offset"]) == st.prompt_capacity
    assert dev.v.header["submit_seq"] == 2
    with pytest.raises(ValueError):
        st.claim(SubmitRequest(79, [1] * (st.prompt_capacity + 1), 1))


def test_free_slot_scan_is_circular_and_respects_ring_state(dev):
    fe = ShmTransport.open(dev.name)
    st = SlotTracker(fe, RingGeometry.from_header(dev.v.header))
    slots = [st.claim(_req(i)) for i in range(4)]
    assert slots == [0, 1, 2, 3]
    assert st.claim(_req(9)) is None and st.n_free == 0
    st.release(2)  # hint is at 0 after slot 3: the scan wraps and finds 2
    assert st.find_free() == 2
    # a slot that is EMPTY locally-released but another party made non-EMPTY is not free after refresh
    dev.v.slots[2]["state"] = SlotState.DECODE_COMPLETED
    st.refresh()
    assert st.find_free() is None


@pytest.mark.parametrize("window", [None, 3])  # shm default: no read-ahead; 3: windows that wrap
def test_token_reader_delivers_in_order_and_releases(dev, window):
    fe = ShmTransport.open(dev.name)
    st = SlotTracker(fe, RingGeometry.from_header(dev.v.header))
    got: list[TokenEvent] = []
    released: list[int] = []
    rd = TokenReader(st, on_release=released.append, window=window)
    s = st.claim(_req(5))
    rd.register(s, 5, got.append)
    assert rd.poll_once() == 0 and got == []
    dev.admit(s)
    dev.publish(s, [100, 101, 102])
    assert rd.poll_once() == 3
    assert got[-1].token_ids == [100, 101, 102] and not got[-1].finished
    assert dev.v.slots[s]["consumed"] == 3  # flow control stored back
    # wrap the output ring (capacity 8) several times
    seq = list(range(200, 230))
    for i in range(0, 30, 5):
        dev.publish(s, seq[i : i + 5])
        rd.poll_once()
    dev.publish(s, [2])
    dev.complete(s, FinishReason.STOP)
    rd.poll_once()
    ids = [t for e in got for t in e.token_ids]
    assert ids == [100, 101, 102, *seq, 2]
    assert got[-1].finish_reason == FinishReason.STOP
    assert dev.v.slots[s]["state"] == SlotState.EMPTY and released == [s]
    assert s not in rd.active and st.find_free() is not None


def test_token_reader_stamps_the_first_token_path(dev):
    """TTFT trace: the reader hands over (submit, admit, launch, first, read) and writes t_read_ns
    into the slot (a frontend-owned word) when it reads the first token, and only then."""
    fe = ShmTransport.open(dev.name)
    st = SlotTracker(fe, RingGeometry.from_header(dev.v.header))
    rd = TokenReader(st)
    timing: list[int] = []
    s = st.claim(_req(7))
    rd.register(s, 7, lambda e: None, timing=timing)
    dev.admit(s)
    rec = dev.v.slots[s]
    rec["t_admit_ns"], rec["t_launch_ns"], rec["t_first_ns"] = 11, 12, 13
    dev.publish(s, [100])
    before = time.time_ns()
    rd.poll_once()
    t_read = int(dev.v.slots[s]["t_read_ns"])
    assert timing[:4] == [int(rec["t_submit_ns"]), 11, 12, 13] and timing[4] == t_read >= before
    dev.publish(s, [101])
    rd.poll_once()
    assert int(dev.v.slots[s]["t_read_ns"]) == t_read  # the first token's, not the latest


def test_urgent_slot_first_and_error_finish(dev):
    fe = ShmTransport.open(dev.name)
    st = SlotTracker(fe, RingGeometry.from_header(dev.v.header))
    order: list[int] = []
    rd = TokenReader(st)
    a = st.claim(_req(1))
    rd.register(a, 1, lambda e: order.append(e.request_id))
    dev.admit(a)
    dev.publish(a, [6])
    rd.poll_once()
    assert order == [1]
    b = st.claim(_req(2))
    rd.register(b, 2, lambda e: order.append(e.request_id))
    rd.poll_once()  # b has no token yet: it stays urgent
    dev.admit(b)
    for s in (a, b):
        dev.publish(s, [7])
    rd.poll_once()
    assert order == [1, 2, 1]  # the slot waiting for its first token is served before slot 0
    got: list[TokenEvent] = []
    c = st.claim(_req(3))
    rd.register(c, 3, got.append)
    dev.complete(c, FinishReason.ERROR, SlotError.PROMPT_TOO_LONG)
    rd.poll_once()
    assert got[-1].finish_reason == FinishReason.ERROR and got[-1].error == SlotError.PROMPT_TOO_LONG
    assert "PROMPT_TOO_LONG" in got[-1].message


async def _drain(h) -> list[TokenEvent]:
    return [e async for e in h]


@pytest.mark.asyncio
async def test_request_tracker_queue_full_cancel_and_heartbeat(dev):
    fe = ShmTransport.open(dev.name)
    rt = RequestTracker(fe, max_queue=2, heartbeat_timeout_s=0.5, reader_kwargs={"health_interval_s": 0.02})
    await rt.start()
    try:
        hs = [await rt.submit(_req(rt.new_request_id())) for _ in range(4)]  # fills the 4 slots
        queued = [asyncio.ensure_future(rt.submit(_req(rt.new_request_id()))) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert rt.stats().queued == 2
        with pytest.raises(QueueFullError):
            await rt.submit(_req(99))
        # finish the first request: the first queued one gets its slot, FIFO
        dev.admit(hs[0].slot)
        dev.publish(hs[0].slot, [1, 2])
        dev.complete(hs[0].slot, FinishReason.LENGTH)
        evs = await asyncio.wait_for(_drain(hs[0]), 2)
        assert [t for e in evs for t in e.token_ids] == [1, 2] and evs[-1].finish_reason == FinishReason.LENGTH
        h5 = await asyncio.wait_for(queued[0], 2)
        assert h5.slot == hs[0].slot and not queued[1].done()
        # cancel: flag + doorbell; the device completes it CANCELLED and the slot is released
        hs[1].cancel()
        assert dev.v.slots[hs[1].slot]["cancel"] == 1 and dev.v.header["cancel_seq"] == 1
        dev.complete(hs[1].slot, FinishReason.CANCELLED)
        h6 = await asyncio.wait_for(queued[1], 2)
        assert h6.slot == hs[1].slot
        # prompt validation against the device's max_context (64) and the slot's arena share (32)
        with pytest.raises(ValueError, match="at most 32"):
            await rt.submit(_req(100, n=40))
        # heartbeat: while beating, healthy; when it stops, in-flight requests end with an error
        waiting = asyncio.ensure_future(rt.submit(_req(102)))  # all 4 slots are held: it queues
        for _ in range(10):
            dev.beat()
            await asyncio.sleep(0.03)
        assert rt.health().ok
        evs = await asyncio.wait_for(_drain(hs[2]), 3)
        assert evs[-1].finish_reason == FinishReason.ERROR and "heartbeat" in evs[-1].message
        assert not rt.health().ok
        with pytest.raises(DeviceDownError):  # the queued request is not left waiting forever
            await asyncio.wait_for(waiting, 1)
        with pytest.raises(DeviceDownError):
            await rt.submit(_req(101))
        # a stall is not final: the failed request's slot was cancelled; when the heartbeat
        # resumes the frontend serves again and the device's CANCELLED completion frees the slot
        s2 = hs[2].slot
        assert dev.v.slots[s2]["cancel"] == 1
        dev.beat()
        await asyncio.sleep(0.1)
        assert rt.health().ok
        dev.complete(s2, FinishReason.CANCELLED)
        for _ in range(100):
            if dev.v.slots[s2]["state"] == SlotState.EMPTY:
                break
            await asyncio.sleep(0.01)
        assert dev.v.slots[s2]["state"] == SlotState.EMPTY
        h7 = await asyncio.wait_for(rt.submit(_req(103)), 1)
        assert h7.slot == s2
    finally:
        await rt.close()


@pytest.mark.asyncio
async def test_reattach_reclaims_orphan_slots(dev):
    fe1 = ShmTransport.open(dev.name)
    st = SlotTracker(fe1, RingGeometry.from_header(dev.v.header))
    a, b = st.claim(_req(1)), st.claim(_req(2))
    dev.admit(a)
    dev.publish(a, [4, 5])
    dev.admit(b)
    dev.complete(b, FinishReason.STOP)
    # a new frontend attaches: b (completed) is released at once, a (running) is cancelled and drained
    rt = RequestTracker(ShmTransport.open(dev.name), reader_kwargs={"health_interval_s": 0.02})
    await rt.start()
    try:
        assert rt.reclaimed == 2
        assert dev.v.slots[b]["state"] == SlotState.EMPTY
        assert dev.v.slots[a]["cancel"] == 1
        dev.publish(a, [6])
        dev.complete(a, FinishReason.CANCELLED)
        for _ in range(100):
            if dev.v.slots[a]["state"] == SlotState.EMPTY:
                break
            await asyncio.sleep(0.01)
        assert dev.v.slots[a]["state"] == SlotState.EMPTY and dev.v.slots[a]["consumed"] == 3
        assert rt.stats().busy_slots == 0
    finally:
        await rt.close()


def test_dpu_never_imports_cupy():
    code = (
        "import sys, pkgutil, importlib, blink.dpu\n"
        "for m in pkgutil.iter_modules(blink.dpu.__path__):\n"
        "    importlib.import_module('blink.dpu.' + m.name)\n"
        "import blink.protocol.wire, blink.config\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_slow_consumer_leaves_tokens_in_the_ring(dev):
    fe = ShmTransport.open(dev.name)
    st = SlotTracker(fe, RingGeometry.from_header(dev.v.header))
    got: list[TokenEvent] = []
    backlog = [0]
    rd = TokenReader(st, max_backlog=2)
    s = st.claim(_req(1))
    rd.register(s, 1, got.append, backlog=lambda: backlog[0])
    dev.admit(s)
    dev.publish(s, [1, 2, 3])
    backlog[0] = 2  # the consumer has not taken its events: nothing is read, consumed stays put
    assert rd.poll_once() == 0 and got == [] and dev.v.slots[s]["consumed"] == 0
    dev.complete(s, FinishReason.LENGTH)
    rd.poll_once()
    assert dev.v.slots[s]["state"] == SlotState.DECODE_COMPLETED  # not released while unread
    backlog[0] = 0
    assert rd.poll_once() == 3
    assert got[-1].token_ids == [1, 2, 3] and got[-1].finish_reason == FinishReason.LENGTH
    assert dev.v.slots[s]["state"] == SlotState.EMPTY


def test_wire_types_round_trip_as_msgpack_arrays():
    from blink.protocol import wire

    msgs = [
        SubmitRequest(
            7,
            [1, 2, 3],
            16,
            min_new_tokens=2,
            stop_ids=[2],
            sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=2**63),
        ),
        TokenEvent(7, [4, 5], FinishReason.ERROR, SlotError.BAD_PARAMS, "bad"),
        wire.CancelRequest(7),
        wire.DeviceHealth(False, DeviceStatus.FAILED, 12, "fault"),
        wire.RingStats(8, 3, 1, 5),
    ]
    for m in msgs:
        b = wire.encode(m)
        assert b[0] & 0xF0 == 0x90 or b[0] == 0xDC  # a msgpack array (array_like), not a map with field names
        assert wire.decoder(type(m)).decode(b) == m
    assert len(wire.encode(TokenEvent(1, [9]))) <= 12  # an array of values (one byte each here): no field names


@pytest.mark.asyncio
async def test_a_crashing_reader_fails_requests_and_is_restarted(dev):
    st = SlotTracker(ShmTransport.open(dev.name), RingGeometry.from_header(dev.v.header))
    rd = TokenReader(st, health_interval_s=0.02)
    got: list[TokenEvent] = []

    def bad_sink(ev: TokenEvent) -> None:
        raise RuntimeError("boom")

    a, b = st.claim(_req(1)), st.claim(_req(2))
    rd.register(a, 1, bad_sink)
    rd.register(b, 2, got.append)
    task = asyncio.ensure_future(rd.run())
    dev.admit(a)
    dev.publish(a, [3])
    for _ in range(200):
        if got:
            break
        await asyncio.sleep(0.01)
    assert got[-1].finish_reason == FinishReason.ERROR and "crashed" in got[-1].message
    assert rd.restarts == 1 and not task.done()  # supervised: the loop runs again, not left dead
    dev.beat()
    c = st.claim(_req(3))
    rd.register(c, 3, got.append)
    dev.admit(c)
    dev.publish(c, [5])
    for _ in range(200):
        if got[-1].token_ids == [5]:
            break
        await asyncio.sleep(0.01)
    assert got[-1].request_id == 3 and got[-1].token_ids == [5]
    assert rd.health().ok and rd.failed is None
    rd.stop()
    await asyncio.wait_for(task, 2)


@pytest.mark.asyncio
async def test_a_grammar_the_cache_dropped_compiles_off_the_event_loop_when_its_request_is_claimed(monkeypatch):
    """A constrained request gets its matcher at submit: a grammar the compiled-grammar cache dropped
    meanwhile (other requests' grammars pushed it out) compiles in a grammar thread, not on the event
    loop at the claim (100 ms and more for a large schema), and one that does not compile is refused."""
    import threading

    from blink.dpu.structured import Grammars, request_grammar
    from blink.dpu.tokenizer import load_tokenizer

    tok = load_tokenizer("random:tiny-llama")
    grammars = Grammars(tok.grammars.tokenizer, tok.info.vocab_size, cache=1)
    threads: list[threading.Thread] = []
    compile_ = grammars._compile

    def spy(text: str):
        threads.append(threading.current_thread())
        return compile_(text)

    monkeypatch.setattr(grammars, "_compile", spy)
    d = HandDevice(n_masks=2, vocab=tok.info.vocab_size)
    rt = RequestTracker(ShmTransport.open(d.name), reader_kwargs={"health_interval_s": 0.02}, grammars=grammars)
    await rt.start()
    try:
        g, other = request_grammar({"guided_regex": "[a-c]{3}"}), request_grammar({"guided_regex": "[x-z]{3}"})
        assert await grammars.prepare(g) == "" and await grammars.prepare(other) == ""  # g is dropped
        threads.clear()
        h = await rt.submit(SubmitRequest(1, [5, 6, 7], 3, grammar=g))
        assert threads and threading.main_thread() not in threads, threads
        assert d.v.slots[h.slot]["state"] == SlotState.PREFILL_PENDING and h.slot in rt._slot_masks
        with pytest.raises(ValueError, match="does not compile"):
            await rt.submit(SubmitRequest(2, [5, 6, 7], 3, grammar="start: (("))
    finally:
        await rt.close()
        d.close()
