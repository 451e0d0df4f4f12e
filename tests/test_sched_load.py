"""bench/scheduler/ring_load.py: the scheduler benchmarks' ring-level load, over blink's own frontend roles
(RequestTracker), against the emulated device (the same ring protocol as the GPU scheduler)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.scheduler.ring_load import LoadGen, random_requests, steady
from blink.config import BlinkConfig
from blink.launch import create_ring, device_spec, new_ring_name, start_device
from blink.protocol.layout import FinishReason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def ring():
    cfg = BlinkConfig().replace(
        model={"spec": "random:tiny-llama"},
        device={"kind": "emulated", "num_kv_blocks": 256, "max_batch": 8, "max_context": 256},
        ring={"n_slots": 16, "prompt_arena_tokens": 16 * 64, "output_capacity": 64},
    )
    name = new_ring_name()
    t = create_ring(name, cfg.ring)
    proc = start_device(device_spec(cfg, name))
    try:
        proc.wait_ready(t, timeout=120)
        yield t, proc, name
    finally:
        proc.stop(t, drain=False)
        t.unlink()
        t.close()


def test_run_counts_every_token_and_timed_phases_carry_over(ring):
    t, _, _ = ring
    vocab = int(t.view().header["vocab_size"])
    gen = LoadGen(t)
    try:
        res = gen.run(random_requests(8, 8, 5, vocab), concurrency=4, keep_tokens=True)
        assert (res.submitted, res.completed, res.tokens) == (8, 8, 40)
        assert res.finish == {int(FinishReason.LENGTH): 8} and sorted(res.outputs) == list(range(8))
        assert all(len(v) == 5 for v in res.outputs.values()) and len(res.t_first) == 8
        assert all(0 < x < 60 for x in res.t_first)
        a = steady(gen, 8, 6, 4, 1.0, vocab, seed=1)
        assert a.submitted > 4 and a.tokens > 0 and a.makespan_s >= 1.0
        assert len(a.timeline) >= 3 and a.timeline[-1][1] <= a.tokens
        assert a.left_in_flight > 0  # left running at the deadline ...
        b = gen.run(random_requests(2, 8, 3, vocab, seed=2), concurrency=4)
        assert b.tokens >= 6 and b.completed >= 2  # ... and read on (and counted) by the next run
        assert gen.in_flight == 0
    finally:
        gen.close()


def test_cli_serves_one_workload_and_stops_the_device(ring):
    _, proc, name = ring
    cmd = [sys.executable, "-m", "bench.scheduler.ring_load", "--ring", name, "--n", "6"]
    cmd += ["--prompt", "8", "--new", "4", "--concurrency", "3", "--shutdown", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["tokens"], out["n"], out["concurrency"]) == (24, 6, 3) and out["ttft_p50_ms"] > 0
    assert proc.wait(30) == 0  # header.shutdown = 1: the device drained and stopped


def test_sched_common_serves_a_workload_with_the_host_loop_and_a_numpy_executor():
    """bench.scheduler.harness.serve_workload's host path (the ablation's baseline): the device loop in
    this process, ring_load in a child process, exact token counts, device counters."""
    from bench.scheduler.harness import serve_workload
    from blink.device.numpy_executor import NumpyExecutor

    ex = NumpyExecutor.from_model(
        "random:tiny-llama", num_blocks=128, block_size=16, max_batch=8, max_num_batched_tokens=256
    )
    args = ["--n", "10", "--prompt", "12", "--new", "5", "--concurrency", "4"]
    res = serve_workload(None, "host", args, 8, 16, 32, max_batch=4, timeout_s=120, executor=ex)
    assert res["tokens"] == 50 and res["n"] == 10 and res["finish"] == {str(int(FinishReason.LENGTH)): 10}
    assert res["device"]["steps"] > 0 and res["device"]["launch_errors"] == 0


def test_fresh_ring_is_unlinked_on_the_way_out_even_after_an_error():
    """bench.scheduler.harness.fresh_ring (serve_workload, the overhead and sm_steal benchmarks): a ring of its
    own under a new name, gone afterwards (a benchmark that fails leaves no ring in /dev/shm)."""
    from bench.scheduler.harness import fresh_ring
    from blink.protocol.ring_geometry import RingGeometry
    from blink.protocol.transport import shm_path

    with pytest.raises(RuntimeError):
        with fresh_ring(RingGeometry(8, 8 * 16, 32)) as (name, t, view):
            with fresh_ring(RingGeometry(8, 8 * 16, 32)) as (other, _, _):
                assert other != name
            assert os.path.exists(shm_path(name)) and not os.path.exists(shm_path(other))
            assert len(view.slots) == 8 and len(t.view().slots) == 8
            raise RuntimeError("the benchmark failed")
    assert not os.path.exists(shm_path(name))
