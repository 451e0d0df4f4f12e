"""The numpy model with steps of at least STEP_S: a sleep after the forward pass, before sampling. A
CPU device whose steps last as long as a GPU's do at real model sizes, for the conformance cases that
time what a client does while a step runs (on the tiny model a CPU step is over before a Python
client has read the token before it)."""

from __future__ import annotations

import time

from blink.device.numpy_executor import NumpyExecutor

STEP_S = 0.03


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
