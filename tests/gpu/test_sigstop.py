"""CPU freedom: with the device process (CUDA context owner) SIGSTOPped for 10 s, blink's frontend
roles in this process (bench/scheduler/ring_load.py) keep submitting and reading through the ring, at the
unstopped rate."""

from __future__ import annotations

import os
import signal

import pytest

from bench.scheduler.ring_load import LoadGen, steady
from blink.config import BlinkConfig
from blink.launch import device_spec, start_device
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import ShmTransport

pytestmark = pytest.mark.gpu

PHASE_S = 10.0


def test_tokens_keep_flowing_while_the_device_process_is_stopped():
    name = f"blink-sigstop-{os.getpid()}"
    t = ShmTransport.create(name, RingGeometry(64, 64 * 64, 256))
    view = t.view()
    device = {"kind": "cuda", "num_kv_blocks": 512, "max_batch": 32, "max_num_batched_tokens": 256, "max_context": 1024}
    cfg = BlinkConfig().replace(model={"spec": "random:tiny-llama"}, device=device)
    proc = start_device(device_spec(cfg, name))
    try:
        proc.wait_ready(t, timeout=120)
        vocab = int(view.header["vocab_size"])
        gen = LoadGen(t)
        steady(gen, 16, 64, 32, 1.0, vocab, seed=0)  # warm up
        running = steady(gen, 16, 64, 32, PHASE_S, vocab, seed=1)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            beat0 = int(view.header["heartbeat"])
            stopped = steady(gen, 16, 64, 32, PHASE_S, vocab, seed=2)
            beat1 = int(view.header["heartbeat"])
            assert proc.poll() is None
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert beat1 - beat0 > 1000 * PHASE_S / 2  # the kernel beat on while its host process slept
        assert running.makespan_s >= PHASE_S and stopped.makespan_s >= PHASE_S  # timed phases, not a fixed count
        assert stopped.completed > 100 and stopped.tokens > 0
        ratio = stopped.tokens / running.tokens
        print(f"running {running.tokens / PHASE_S:.0f} tok/s, stopped {stopped.tokens / PHASE_S:.0f} tok/s")
        assert 0.9 < ratio < 1.1, ratio  # bench/scheduler/sigstop.py measures the 30 s version precisely
        gen.close()
        view.header["shutdown"] = 2
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        del view
        t.close()
        t.unlink()
