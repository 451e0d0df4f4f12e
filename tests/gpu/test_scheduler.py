"""The GPU-resident scheduler on the H200, through the ring only (tiny random model).

The kernel serves a ring while these tests act as the frontend (tests/conformance/client.py).
Reference: the host-driven loop (blink.device.ring_device + HostExecutor) over the same graphs.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np
import pytest
from conformance.client import RingClient

from blink.protocol.layout import UNLIMITED, DeviceStatus, FinishReason, SlotState
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import ShmTransport

pytestmark = pytest.mark.gpu

_names = itertools.count()


@pytest.fixture(scope="module")
def engine():
    from blink.gpu.engine.engine import Engine, EngineConfig
    from blink.models.config import preset

    ecfg = EngineConfig(
        max_seqs=8,
        max_num_batched_tokens=128,
        block_size=16,
        max_context=1024,
        num_kv_blocks=128,
        batch_buckets=(1, 2, 4, 8),
        token_buckets=(16, 32, 64, 128),
        progress=False,
    )
    eng = Engine.create(preset("tiny-llama"), ecfg)
    eng.capture()
    yield eng
    eng.close()


class Ring:
    def __init__(self, n_slots: int = 16, output_capacity: int = 64, per_slot: int = 1100):
        self.name = f"blink-gpu-test-{os.getpid()}-{next(_names)}"
        self.t = ShmTransport.create(self.name, RingGeometry(n_slots, n_slots * per_slot, output_capacity))
        self.view = self.t.view()
        self.client = RingClient(self.t)

    def close(self) -> None:
        del self.view
        self.t.close()
        self.t.unlink()


@pytest.fixture
def ring():
    r = Ring()
    yield r
    r.close()


def start_gpu(engine, ring: Ring, **kw):
    from blink.gpu.scheduler.scheduler import GpuScheduler, GpuSchedulerConfig

    s = GpuScheduler(engine, ring.view, GpuSchedulerConfig(**kw))
    s.start()
    ring.client.wait_status(DeviceStatus.READY, 10)
    return s


def prompts(n, lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, lengths[i % len(lengths)]).tolist() for i in range(n)]


def host_loop_tokens(engine, ps, max_new, **params):
    """The same requests through the host-driven loop (the reference for the same graphs)."""
    from blink.device.ring_device import RingDevice
    from blink.gpu.engine.host_executor import HostExecutor

    r = Ring()
    try:
        dev = RingDevice(r.view, HostExecutor(engine))
        th = threading.Thread(target=dev.run, daemon=True)
        th.start()
        r.client.wait_status(DeviceStatus.READY, 10)
        slots = [r.client.submit(p, max_new_tokens=max_new, seed=i, **params) for i, p in enumerate(ps)]
        out = [x.tokens for x in r.client.wait(slots, 60)]
        r.client.shutdown(1)
        th.join(30)
        return out
    finally:
        r.close()


def test_greedy_tokens_equal_the_host_loop_and_stats_add_up(engine, ring):
    c = ring.client
    ps = prompts(12, [1, 5, 17, 40, 130, 33], engine.config.vocab_size)
    ref = host_loop_tokens(engine, ps, 20)
    s = start_gpu(engine, ring)
    got = c.wait([c.submit(p, max_new_tokens=20, seed=i) for i, p in enumerate(ps)], timeout=60)
    assert [r.tokens for r in got] == ref
    assert all(r.finish is FinishReason.LENGTH for r in got)
    assert all(r.t_submit_ns <= r.t_admit_ns <= r.t_first_ns for r in got)
    c.wait_idle()
    h = c.header()
    assert int(h["tokens_generated"]) == 12 * 20
    assert int(h["requests_admitted"]) == int(h["requests_completed"]) == 12
    assert int(h["launches"]) == int(h["steps"]) + int(h["prefill_steps"])
    assert int(h["launch_errors"]) == 0
    assert s.stop() == DeviceStatus.STOPPED
    d = s.diagnostics()
    assert d["launch_errors"] == 0 and d["fault"] == 0


def test_sampled_tokens_equal_the_host_loop(engine, ring):
    """Seeds, temperature, top-k and top-p reach the graphs as the host loop passes them."""
    c = ring.client
    ps = prompts(6, [3, 20, 64], engine.config.vocab_size, seed=5)
    params = dict(temperature=1.0, top_p=0.9, top_k=40)
    ref = host_loop_tokens(engine, ps, 12, **params)
    s = start_gpu(engine, ring)
    got = c.wait([c.submit(p, max_new_tokens=12, seed=i, **params) for i, p in enumerate(ps)], timeout=60)
    assert [r.tokens for r in got] == ref
    assert len({tuple(t) for t in ref}) > 1
    assert s.stop() == DeviceStatus.STOPPED


def test_unbounded_generation_crosses_many_launch_windows(engine, ring):
    c = ring.client
    s = start_gpu(engine, ring, window=16)  # small window: many tail self-relaunches
    (p,) = prompts(1, [9], engine.config.vocab_size, seed=1)
    r = c.generate(p, max_new_tokens=700, timeout=60)
    assert r.finish is FinishReason.LENGTH and len(r.tokens) == 700
    h = c.header()
    assert int(h["relaunches"]) >= 700 // 16 - 1
    assert int(h["launch_errors"]) == 0
    assert s.stop() == DeviceStatus.STOPPED


def test_window_of_120_fire_and_forget_launches(engine, ring):
    c = ring.client
    s = start_gpu(engine, ring)  # the real limit: 120 launches per instance
    ps = prompts(3, [4], engine.config.vocab_size, seed=2)
    got = c.wait([c.submit(p, max_new_tokens=300) for p in ps], timeout=60)
    assert [len(r.tokens) for r in got] == [300] * 3
    assert int(c.header()["relaunches"]) >= 2 and int(c.header()["launch_errors"]) == 0
    assert s.stop() == DeviceStatus.STOPPED


def test_output_backpressure_pauses_then_resumes_with_the_same_tokens(engine):
    small = Ring(output_capacity=8)
    try:
        c = small.client
        s = start_gpu(engine, small)
        (p,) = prompts(1, [12], engine.config.vocab_size, seed=3)
        ref = c.generate(p, max_new_tokens=40, timeout=30).tokens
        i = c.submit(p, max_new_tokens=40)
        t_end = time.monotonic() + 10
        while c.state(i) != SlotState.DECODE_PAUSED:
            assert time.monotonic() < t_end, "slot never paused"
            time.sleep(0.001)
        time.sleep(0.05)
        assert int(c.slot(i)["generated"]) == 8  # never more than output_capacity ahead of consumed
        (r,) = c.wait([i], timeout=30)
        assert r.tokens == ref and r.finish is FinishReason.LENGTH
        assert s.stop() == DeviceStatus.STOPPED
    finally:
        small.close()


def test_cancel_then_stop_now_cancels_the_rest(engine, ring):
    c = ring.client
    s = start_gpu(engine, ring)
    ps = prompts(3, [8], engine.config.vocab_size, seed=4)
    slots = [c.submit(p, max_new_tokens=UNLIMITED) for p in ps]
    time.sleep(0.05)
    c.cancel(slots[0])
    (r0,) = c.wait([slots[0]], timeout=10)
    assert r0.finish is FinishReason.CANCELLED and len(r0.tokens) > 0
    c.shutdown(2)
    c.wait_status(DeviceStatus.STOPPED, 10)
    rest = c.wait(slots[1:], timeout=10)
    assert all(r.finish is FinishReason.CANCELLED for r in rest)
    s.join()


def test_heartbeat_beats_while_idle(engine, ring):
    c = ring.client
    s = start_gpu(engine, ring)
    b0, ns0 = c.h("heartbeat"), c.h("heartbeat_ns")
    time.sleep(0.05)
    b1, ns1 = c.h("heartbeat"), c.h("heartbeat_ns")
    assert b1 - b0 >= 50  # at least every millisecond (the kernel beats every 100 us)
    assert 0 < ns1 - ns0 < 200_000_000
    assert abs(ns1 - time.time_ns()) < 50_000_000  # the device clock is calibrated to the host's
    assert s.stop() == DeviceStatus.STOPPED
