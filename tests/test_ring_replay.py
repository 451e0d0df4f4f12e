"""Logprobs, penalties, min_p and logit_bias on the emulated device through the ring and the frontend's
RequestTracker, replayed through the definition on each step's raw logits (tests/ring_replay.py, which
the CUDA host loop's GPU test shares): every sampled token is the definition's, and every request gets
the records of its own run. All requests share a prompt, so with prefix caching the second and later
ones start from cached blocks: their first chunk is not `fresh` (only a penalized row, which never
reads the cache, needs it), and a run is found by its first sample, not by `fresh`."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import ring_replay

from blink.device.numpy_executor import NumpyExecutor
from blink.device.ring_device import RingDevice, RingDeviceConfig
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import ShmTransport

N_SLOTS = 4


class _RecordingModel:
    """The executor's model, keeping the logits of the last forward pass (the raw logits it samples from)."""

    def __init__(self, model) -> None:
        self.model, self.last = model, None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, *a, **k):
        self.last = self.model.forward(*a, **k)
        return self.last


class _Recording(NumpyExecutor):
    def execute(self, batch):
        toks = super().execute(batch)
        self.steps.append((batch, self.model.last[: batch.num_seqs].copy(), toks.copy()))
        return toks


@pytest.fixture(scope="module")
def base() -> NumpyExecutor:
    return NumpyExecutor.from_model("random:tiny-llama", 64, 16, N_SLOTS, 64)


def _executor(base: NumpyExecutor) -> _Recording:
    ex = object.__new__(_Recording)  # the module's weights, its own KV cache and records
    ex.__dict__.update(base.__dict__)
    ex.model = _RecordingModel(base.model)
    ex.k_cache, ex.v_cache = np.zeros_like(base.k_cache), np.zeros_like(base.v_cache)
    ex.penalty_states, ex.steps = {}, []
    return ex


@pytest.mark.parametrize("max_num_batched_tokens", [64, 7])
def test_records_are_each_requests_own_run(base, max_num_batched_tokens):
    V = base.vocab_size
    _, cases = ring_replay.cases(V)
    reqs = ring_replay.requests(V)
    t = ShmTransport.create(f"blink-test-replay-{os.getpid()}", RingGeometry(N_SLOTS, N_SLOTS * 2048, 16))
    ex = _executor(base)
    dev = RingDevice(t.view(), ex, RingDeviceConfig(max_num_batched_tokens=max_num_batched_tokens))
    th = threading.Thread(target=dev.run, daemon=True)
    th.start()
    try:
        _, outs = ring_replay.deliver(t, reqs + reqs[::-1])  # two rounds on the same slots
    finally:
        t.view().header["shutdown"] = 2
        th.join(30)
        t.close()
        t.unlink()
    cached_first = [
        s
        for b, _, _ in ex.steps
        if b.ext is not None
        for s in range(b.num_seqs)
        if b.ext.emit[s] and b.sample_pos[s] == 0 and not b.ext.fresh[s]
    ]
    assert cached_first  # some request started from cached prompt blocks
    runs = ring_replay.replay(ex.steps, V)
    assert len(runs) == 2 * sum("logprobs" in c for c in cases)
    ring_replay.check_records(cases + cases[::-1], outs, runs)
