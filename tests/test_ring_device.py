"""The ring interpreter in-process (a thread) with the hash stand-in executor, whose tokens are a
function of the context read back from its KV pool: outputs equal the cache-free reference only
if the device's block tables, chunking and recompute are right."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import numpy as np
import pytest
from conformance.client import RingClient
from conformance.hash_executor import HashExecutor, reference_greedy

from blink.device.kv_blocks import BlockManager
from blink.device.ring_device import RingDevice
from blink.device.scheduler import Scheduler, SchedulerConfig
from blink.device.step_batch import build_batch
from blink.launch import start_device
from blink.protocol.layout import DeviceStatus, FinishReason, SlotError
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.sampling_params import SamplingParams
from blink.protocol.transport import ShmTransport
from blink.protocol.wire import DeviceSpec

VOCAB = 512


class Rig:
    def __init__(self, executor, n_slots=16, output_capacity=64, config=None):
        self.name = f"blink-test-rd-{os.getpid()}-{id(self)}"
        self.t = ShmTransport.create(self.name, RingGeometry(n_slots, n_slots * 512, output_capacity))
        self.ex = executor
        self.dev = RingDevice(self.t.view(), executor, config)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.c = RingClient(self.t)
        self.c.wait_status(DeviceStatus.READY, timeout=5)

    def _run(self):
        try:
            self.dev.run()
        except BaseException as e:  # reported by the test that expects it
            self.error = e

    def stop(self):
        self.c.shutdown(1)
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.t.close()
        self.t.unlink()


@pytest.fixture
def rig_factory():
    rigs = []

    def make(executor=None, **kw):
        r = Rig(
            executor or HashExecutor(VOCAB, num_blocks=64, block_size=16, max_batch=8, max_num_batched_tokens=64), **kw
        )
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        r.stop()


def test_batched_outputs_match_the_cache_free_reference(rig_factory):
    rig = rig_factory()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (1, 2, 15, 16, 17, 63, 64, 65, 200, 300)]
    slots = [rig.c.submit(p, max_new_tokens=24) for p in prompts]
    for p, r in zip(prompts, rig.c.wait(slots), strict=True):
        assert r.finish is FinishReason.LENGTH
        assert r.tokens == reference_greedy(p, 24, VOCAB)
    rig.c.wait_idle()
    h = rig.c.header()
    assert int(h["prompt_tokens"]) == sum(map(len, prompts))
    assert int(h["tokens_generated"]) == 24 * len(prompts)
    assert int(h["requests_admitted"]) == int(h["requests_completed"]) == len(prompts)
    assert max(t for _, t in rig.ex.steps) <= 64  # prompts > max_num_batched_tokens were chunked
    assert int(h["steps"]) + int(h["prefill_steps"]) == int(h["launches"]) == len(rig.ex.steps)


def test_kv_pressure_preempts_and_recomputes_without_changing_tokens(rig_factory):
    # 12 blocks of 4 = 48 tokens of KV; six 20 + 20 token requests need 240: preemption is forced.
    ex = HashExecutor(VOCAB, num_blocks=12, block_size=4, max_batch=6, max_num_batched_tokens=64, max_context=48)
    rig = rig_factory(ex)
    assert int(rig.c.header()["max_context"]) == 48
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, 20).tolist() for _ in range(6)]
    slots = [rig.c.submit(p, max_new_tokens=20) for p in prompts]
    for p, r in zip(prompts, rig.c.wait(slots), strict=True):
        assert r.tokens == reference_greedy(p, 20, VOCAB)
    rig.c.wait_idle()
    assert int(rig.c.header()["prompt_tokens"]) > 6 * 20  # recompute prefills happened


class _SleepLog:
    """ring_device's `time`, recording every sleep the device asks for (the device's own choice; how
    long the host then takes to wake it is the host's)."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def sleep(self, s: float) -> None:
        self.asked.append(s)
        time.sleep(s)

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_idle_device_beats_every_ms_without_burning_a_core(rig_factory, monkeypatch):
    """Idle, the device sleeps at most max_sleep_s (0.5 ms) between polls and beats after each: that is
    checked on the sleeps it asks for, which a loaded host cannot change. The wall-clock rate is checked
    with the room the conformance suite gives it (sleeps overshoot by milliseconds on a loaded 2-core
    host): a device that stops beating while idle gives 0."""
    import blink.device.ring_device as ring_device

    rig = rig_factory()
    rig.c.generate([1, 2, 3], max_new_tokens=2)
    time.sleep(0.05)  # past the spin window
    clock = time.pthread_getcpuclockid(rig.thread.ident)
    cpu0, wall0, beat0 = time.clock_gettime(clock), time.monotonic(), rig.c.h("heartbeat")
    log = _SleepLog()
    monkeypatch.setattr(ring_device, "time", log)  # after beat0: each sleep logged is followed by a beat
    gaps, last_ns = [], rig.c.h("heartbeat_ns")
    while time.monotonic() - wall0 < 0.5:
        ns = rig.c.h("heartbeat_ns")
        if ns != last_ns:
            gaps.append(ns - last_ns)
            last_ns = ns
        time.sleep(0.0002)
    monkeypatch.undo()  # before the last read: only the last sleep logged may not have beaten yet
    cpu = time.clock_gettime(clock) - cpu0
    wall = time.monotonic() - wall0
    beats = rig.c.h("heartbeat") - beat0
    assert cpu / wall < 0.25, f"idle device used {cpu / wall:.0%} of a core"
    assert len(log.asked) > 10 and max(log.asked) <= rig.dev.config.max_sleep_s <= 1e-3, max(log.asked)
    assert beats >= len(log.asked) - 1  # a beat every poll: one after every sleep
    assert beats / wall > 100, f"{beats / wall:.0f} beats/s"
    assert np.median(gaps) < 10e6  # ns


def test_executor_fault_fails_in_flight_requests(rig_factory):
    class Broken(HashExecutor):
        def execute(self, batch):
            if batch.num_tokens == 1:
                raise RuntimeError("launch failed")
            return super().execute(batch)

    rig = rig_factory(Broken(VOCAB, num_blocks=16, block_size=16, max_batch=4, max_num_batched_tokens=64))
    r = rig.c.generate([5, 6, 7], max_new_tokens=10)
    assert r.finish is FinishReason.ERROR and r.error is SlotError.DEVICE_FAULT
    assert len(r.tokens) == 1  # the prefill's token was published before the failing decode
    rig.thread.join(5)
    assert isinstance(rig.error, RuntimeError)
    assert rig.c.h("device_status") == DeviceStatus.FAILED


def test_shutdown_now_cancels_in_flight(rig_factory):
    rig = rig_factory(HashExecutor(VOCAB, num_blocks=16, block_size=16, max_batch=4, step_delay_s=0.002))
    s = rig.c.submit([1, 2], max_new_tokens=0xFFFFFFFF)
    while not rig.c.poll(s).tokens:
        time.sleep(0.001)
    rig.c.shutdown(2)
    rig.thread.join(5)
    r = rig.c.wait([s], timeout=2)[0]
    assert r.finish is FinishReason.CANCELLED
    assert rig.c.h("device_status") == DeviceStatus.STOPPED


def test_build_batch_packs_chunks_and_block_tables():
    bm = BlockManager(32, 4)
    s = Scheduler(SchedulerConfig(4, 8, 64, 16), bm)
    s.add(0, range(10), sampling=SamplingParams(temperature=0.5, top_p=0.9, top_k=7, seed=11))
    s.add(1, range(3), sampling=SamplingParams(temperature=1e-6))  # below SAMPLING_EPS: greedy, packed as 0
    plan = s.schedule()
    b = build_batch(plan, bm, table_width=16)
    assert b.num_seqs == 1 and b.num_tokens == 8  # 8-token budget: seq 0 chunked, seq 1 waits
    assert b.input_ids.tolist() == list(range(8)) and b.seq_lens.tolist() == [8]
    assert s.update(plan, [0]) == []  # a chunk short of the prompt's end samples nothing
    plan = s.schedule()
    b = build_batch(plan, bm, table_width=16)
    assert b.input_ids.tolist() == [8, 9, 0, 1, 2]
    assert b.positions.tolist() == [8, 9, 0, 1, 2]
    assert b.cu_q_lens.tolist() == [0, 2, 5] and b.seq_lens.tolist() == [10, 3]
    assert b.block_tables[0, :3].tolist() == bm.table(0) and b.block_tables[1, :1].tolist() == bm.table(1)
    assert b.temperature.tolist() == [0.5, 0.0] and b.top_k.tolist() == [7, 0] and b.seed.tolist() == [11, 0]
    assert b.sample_pos.tolist() == [0, 0]


def _spec(ring: str, **kw) -> DeviceSpec:
    base = dict(
        ring=ring, kind="emulated", model="random:tiny-llama", scheduler="gpu", max_batch=16, max_num_batched_tokens=256
    )
    base.update(kv_block_size=16, num_kv_blocks=32, kv_cache_fraction=0.9, max_context=0)
    return DeviceSpec(**{**base, **kw})


def test_device_spec_crosses_the_process_boundary_as_json_and_is_checked():
    spec = _spec("r1", model="random:tiny-qwen3", num_kv_blocks=9, max_batch=3, max_context=100)
    assert msgspec.json.decode(msgspec.json.encode(spec), type=DeviceSpec) == spec
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(b'{"ring": "r", "no_such_field": 1}', type=DeviceSpec)
    with pytest.raises(ValueError):
        _spec("r", max_batch=0)
    with pytest.raises(ValueError):
        _spec("r", kind="auto")  # resolved before a spec exists
    with pytest.raises(ValueError):
        _spec("r", executor="not-a-factory")


def test_emulated_kv_pool_is_sized_inside_the_device():
    from blink.device.emulated import kv_blocks

    assert kv_blocks(_spec("r", num_kv_blocks=9)) == 9
    assert kv_blocks(_spec("r", num_kv_blocks=0, max_batch=4, max_context=100)) == 4 * 7
    assert kv_blocks(_spec("r", num_kv_blocks=0, max_batch=2)) == 2 * 2048 // 16


def test_emulated_process_with_a_plugged_executor_serves_the_ring():
    name = f"blink-test-emu-{os.getpid()}"
    t = ShmTransport.create(name, RingGeometry(8, 8 * 512, 64))
    spec = _spec(name, model="hash:300", executor="tests.conformance.hash_executor:make")
    proc = start_device(spec, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        c = RingClient(t)
        proc.wait_ready(t, timeout=30)
        assert int(c.header()["vocab_size"]) == 300
        prompts = [[1, 2, 3], list(range(40))]
        results = c.wait([c.submit(p, max_new_tokens=12) for p in prompts], timeout=30)
        assert [r.tokens for r in results] == [reference_greedy(p, 12, 300) for p in prompts]
        assert proc.stop(t, timeout=30) == 0
        assert c.h("device_status") == DeviceStatus.STOPPED
    finally:
        proc.kill()
        proc.wait(10)
        t.close()
        t.unlink()


def test_restart_on_the_same_ring_reaps_orphans_and_keeps_counters(rig_factory):
    rig = rig_factory()
    r = rig.c.generate([1, 2, 3], max_new_tokens=5)
    assert r.finish is FinishReason.LENGTH
    rig.c.shutdown(1)
    rig.thread.join(5)
    before = rig.c.header()
    orphan = rig.c.submit([4, 5], max_new_tokens=5, doorbell=False)
    slots = rig.t.view().slots
    slots[orphan]["state"] = 3  # as if a crashed device had it in DECODE_PROCESSING
    rig.c.shutdown(0)
    dev = RingDevice(
        rig.t.view(), HashExecutor(VOCAB, num_blocks=64, block_size=16, max_batch=8, max_num_batched_tokens=64)
    )
    th = threading.Thread(target=dev.run, daemon=True)
    th.start()
    rig.c.wait_status(DeviceStatus.READY, timeout=5)
    (r,) = rig.c.wait([orphan], timeout=5)
    assert (r.finish, r.error) == (FinishReason.ERROR, SlotError.DEVICE_FAULT)
    after = rig.c.header()
    for k in ("tokens_generated", "requests_completed", "steps", "heartbeat"):
        assert int(after[k]) >= int(before[k]), k
    assert int(after["requests_completed"]) == int(before["requests_completed"]) + 1
    rig.c.shutdown(1)
    th.join(5)
    rig.thread = th  # the fixture's stop() joins this one


def test_two_frontends_share_one_ring(rig_factory):
    """deploy.frontends = 2: two request trackers (owners 0 and 1 of 2) on one ring, submitting and
    cancelling at once. Each claims only its own slots (s % 2), both ring the shared doorbells with
    values of their own, and the device serves every request of both exactly as for one frontend."""
    import asyncio

    from blink.dpu.request_tracker import RequestTracker
    from blink.protocol.wire import SubmitRequest

    rig = rig_factory(n_slots=8)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, 120, 24)]

    async def main() -> None:
        fes = [ShmTransport.open(rig.name) for _ in range(2)]
        rts = [RequestTracker(t, owner=k, owners=2) for k, t in enumerate(fes)]
        for rt in rts:
            await rt.start()
        assert [rt.stats().n_slots for rt in rts] == [4, 4]
        seen: list[tuple[int, int]] = []  # (frontend, slot)

        async def one(k: int, i: int) -> list[int]:
            h = await rts[k].submit(
                SubmitRequest(rts[k].new_request_id(), prompts[i], 16, sampling=SamplingParams(temperature=0.0))
            )
            seen.append((k, h.slot))
            return [t async for e in h for t in e.token_ids]

        # a request cancelled on frontend 1 must not disturb frontend 0's
        h_cancel = await rts[1].submit(SubmitRequest(rts[1].new_request_id(), prompts[0], 10_000))
        outs = asyncio.gather(*(one(i % 2, i) for i in range(len(prompts))))
        await asyncio.sleep(0.05)
        h_cancel.cancel()
        got = await asyncio.wait_for(outs, 60)
        for i, toks in enumerate(got):
            assert toks == reference_greedy(prompts[i], 16, VOCAB), i
        assert all(slot % 2 == k for k, slot in seen), seen
        assert {k for k, _ in seen} == {0, 1}
        # the doorbells hold values only these frontends wrote: seq * 2 + owner
        h = rig.c.header()
        assert int(h["cancel_seq"]) % 2 == 1  # the last cancel came from frontend 1
        for rt in rts:
            await rt.close()
        for t in fes:
            t.close()

    asyncio.run(main())
    rig.c.wait_idle()
    h = rig.c.header()
    assert int(h["requests_completed"]) == len(prompts) + 1


def test_slot_tracker_owner_checks():
    from blink.dpu.slot_tracker import SlotTracker

    t = ShmTransport.create(f"blink-test-own-{os.getpid()}", RingGeometry(4, 4 * 16, 8))
    try:
        geo = RingGeometry.from_header(t.view().header)
        with pytest.raises(ValueError):
            SlotTracker(t, geo, owner=2, owners=2)
        with pytest.raises(ValueError):
            SlotTracker(t, geo, owner=0, owners=5)
        a, b = SlotTracker(t, geo, 0, 3), SlotTracker(t, geo, 2, 3)
        assert a.n_owned == 2 and b.n_owned == 1 and a.n_free == 2 and b.n_free == 1
        assert b.find_free() == 2
        from blink.protocol.wire import SubmitRequest

        assert b.claim(SubmitRequest(1, [1, 2], 1)) == 2 and b.claim(SubmitRequest(2, [1], 1)) is None
        assert int(t.view().header["submit_seq"]) == 1 * 3 + 2  # seq 1 of owner 2 of 3
        assert a.claim(SubmitRequest(3, [1], 1)) == 0 and int(t.view().header["submit_seq"]) == 3 + 0
        # a frontend attaching later continues above every value rung so far
        c = SlotTracker(t, geo, 1, 3)
        assert c.claim(SubmitRequest(4, [1], 1)) == 1 and int(t.view().header["submit_seq"]) == 2 * 3 + 1
    finally:
        t.close()
        t.unlink()


class _SlowLayers(HashExecutor):
    """The hash model with a step of 20 'layers' of 25 ms each, reporting progress after each."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.progress = None

    def set_progress(self, fn):
        self.progress = fn

    def execute(self, batch):
        for _ in range(20):
            time.sleep(0.025)
            if self.progress is not None:
                self.progress()
        return super().execute(batch)


def test_the_heartbeat_beats_inside_a_long_step(rig_factory):
    """A step of seconds must not look like a dead device. A 0.5 s step beats every 25 ms."""
    rig = rig_factory(_SlowLayers(VOCAB, num_blocks=64, block_size=16, max_batch=8, max_num_batched_tokens=64))
    slot = rig.c.submit(list(range(1, 60)), max_new_tokens=2)
    gaps, last, t_last = [], rig.c.h("heartbeat"), time.monotonic()
    while not rig.c.poll(slot).done:
        hb = rig.c.h("heartbeat")
        now = time.monotonic()
        if hb != last:
            gaps.append(now - t_last)
            last, t_last = hb, now
        time.sleep(0.002)
    rig.c.wait([slot])
    assert gaps and max(gaps) < 0.25, max(gaps)  # without the hook: one gap of a whole step (0.5 s)


def test_device_main_reports_a_model_that_does_not_load_in_one_line(capsys, monkeypatch):
    """In the device process, a loading error is one stderr line (exit 1); with
    spec.debug (blink serve --log-level debug) its traceback comes first."""
    import msgspec

    from blink.device import process
    from blink.protocol.wire import DeviceSpec

    monkeypatch.setattr(process, "watch_parent", lambda parent: None)

    def run(spec):
        raise ValueError("/models/x.gguf: not a GGUF file")

    base = dict(
        ring="r", kind="emulated", model="x", scheduler="gpu", max_batch=1, max_num_batched_tokens=1, kv_block_size=16
    )
    base.update(num_kv_blocks=0, kv_cache_fraction=0.5, max_context=0)
    for debug in (False, True):
        spec = msgspec.json.encode(DeviceSpec(**base, debug=debug)).decode()
        assert process.device_main(run, [spec]) == 1
        err = capsys.readouterr().err
        assert err.endswith("blink device: ValueError: /models/x.gguf: not a GGUF file\n")
        assert ("Traceback" in err) == debug and (err.count("\n") == 1) != debug
