"""The numpy model with steps of at least STEP_S: a sleep after the forward pass, before sampling. A
CPU device whose steps last as long as a GPU's do at real model sizes, for the conformance cases that
time what a client does while a step runs (on the tiny model a CPU step is over before a Python
client has read the token before it).

make_late_stats: the same, and the header's statistics reach the ring LATE_STATS_S after a step's
tokens, as the CUDA scheduler's do (its counters are copied to the header apart from the tokens): a
client that reads a counter the moment it sees a token reads the count of the step before."""

from __future__ import annotations

import time

from blink.device.numpy_executor import NumpyExecutor

STEP_S = 0.03
LATE_STATS_S = 0.01


def make(model: str, **kw) -> NumpyExecutor:
    ex = NumpyExecutor.from_model(model, **kw)
    forward = ex.model.forward

    def slow_forward(*args, **kwargs):
        t0 = time.monotonic()
        out = forward(*args, **kwargs)
        time.sleep(max(0.0, STEP_S - (time.monotonic() - t0)))
        return out

    ex.model.forward = slow_forward
    return ex


def make_late_stats(model: str, **kw) -> NumpyExecutor:
    from blink.device.ring_device import RingDevice  # this runs in the device's own process

    flush = RingDevice._flush_stats

    def late_flush(self: RingDevice) -> None:
        time.sleep(LATE_STATS_S)
        flush(self)

    RingDevice._flush_stats = late_flush
    return make(model, **kw)
