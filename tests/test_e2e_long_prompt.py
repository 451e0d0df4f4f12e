"""One long prompt on the emulated device must not fail every request.

A prompt of thousands of tokens used to be prefilled in one CPU step of tens of seconds: the
device heartbeat stood still for the whole step, the frontend declared the device dead (503 for
every request) and a short request waited for the whole prompt. Scaled down here: a 1,500-token
prompt on SmolLM2-135M against an 8 s heartbeat timeout (one step of 1,500 tokens takes longer on
a 2-core CPU; a layer of a 256-token step took under 2 s at a load average of 17). Fixed by steps
of 256 tokens on the emulated device, the heartbeat beating between chunks and between the layers
of a step (the numpy executor's progress hook), and a short prompt riding in the steps of the long
one (blink/device/scheduler.py).
"""

from __future__ import annotations

import threading
import time
import urllib.request

import numpy as np
import pytest
from test_e2e_openai import Server

LONG = 1500


@pytest.mark.slow
def test_a_long_prompt_keeps_the_device_alive_and_a_short_request_is_served_meanwhile(tmp_path):
    cfg = tmp_path / "blink.toml"
    cfg.write_text("[server]\nheartbeat_timeout_s = 8.0\n")
    s = Server("--model", "default", "--max-context", "2048", "--n-slots", "4", "--config", str(cfg))
    try:
        c = s.client(api_key="unused", timeout=300)
        model = c.models.list().data[0].id
        eos = {"ignore_eos": True}
        ids = np.random.default_rng(0).integers(100, 20000, LONG).tolist()
        done: dict[str, float] = {}
        errors: list[BaseException] = []

        def long_request() -> None:
            try:
                r = c.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0, extra_body=eos)
                assert r.usage.prompt_tokens == LONG and r.usage.completion_tokens == 2
                done["long"] = time.monotonic()
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        t = threading.Thread(target=long_request)
        t0 = time.monotonic()
        t.start()
        time.sleep(1.0)  # the long prompt is claimed and prefilling
        r = c.completions.create(model=model, prompt="The capital of", max_tokens=4, temperature=0, extra_body=eos)
        done["short"] = time.monotonic()
        assert r.usage.completion_tokens == 4
        health = []
        while t.is_alive() and time.monotonic() - t0 < 240:
            health.append(urllib.request.urlopen(s.url + "/health", timeout=10).status)
            t.join(0.5)
        t.join(60)
        assert not errors, errors
        assert "long" in done, "the long request did not finish"
        assert done["short"] < done["long"], "the short request waited for the long prompt"
        assert set(health) <= {200}
    finally:
        s.stop()
