"""`blink serve --device cuda` through the launch layer: the device starts from its spec, serves, is
restarted after it dies, and dies with its frontend.

For each scheduler: start the server, one completion (8 tokens), SIGKILL the device process, wait
for /health 200 (the restarted device), one more completion, /metrics shows one restart, then
SIGKILL the server and check its device is gone within 5 s. (tests/test_device_lifecycle.py checks
the same on the emulated device.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.request

import pytest

from blink.testing import ServeProcess, gone

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def complete(url: str, model: str) -> int:
    body = json.dumps({"model": model, "prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def until(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"not within {timeout} s")
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.mark.parametrize("scheduler", ["gpu", "host"])
def test_cuda_device_restarts_and_dies_with_its_server(scheduler: str) -> None:
    device, model = "cuda", "random:tiny-llama"
    argv = ["--device", device, "--scheduler", scheduler, "--model", model, "--max-device-restarts", "1"]
    s = ServeProcess(argv, timeout=600)
    try:
        n = complete(s.url, s.model)
        print(f"[{scheduler}] serving; completion tokens: {n}", flush=True)
        assert n == 8
        (dev,) = s.children()
        os.kill(dev, signal.SIGKILL)
        dt = until(lambda: s.children() not in ([], [dev]) and s.get("/health")[0] == 200, 600)
        restarts = re.search(r"^blink_device_restarts_total (\S+)$", s.get("/metrics")[1], re.M)
        print(f"[{scheduler}] device killed: /health 200 again after {dt:.1f} s, restarts {restarts and restarts[1]}")
        assert restarts and float(restarts[1]) == 1
        n = complete(s.url, s.model)
        print(f"[{scheduler}] after the restart, completion tokens: {n}", flush=True)
        assert n == 8
        (dev,) = s.children()
        s.proc.kill()
        s.proc.wait(30)
        print(f"[{scheduler}] frontend killed (-9): device gone after {until(lambda: gone(dev), 5):.1f} s", flush=True)
    except BaseException:
        print("".join(s.log[-30:]), file=sys.stderr)
        raise
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
