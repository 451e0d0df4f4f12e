"""`blink serve --device cuda` through the launch layer, on the H200: the device starts from its spec,
serves, is restarted after it dies, and dies with its frontend.

    python bench/launch_gpu_check.py [--scheduler gpu,host] [--model random:tiny-llama]

For each scheduler: start the server, one completion (8 tokens), SIGKILL the device process, wait
for /health 200 (the restarted device), one more completion, /metrics shows one restart, then
SIGKILL the server and check its device is gone within 5 s. One line per check; exit 1 on the
first failure. (tests/test_device_lifecycle.py checks the same on the emulated device.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from blink.testing import ServeProcess, gone  # noqa: E402


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


def check(device: str, scheduler: str, model: str) -> None:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheduler", default="gpu,host")
    ap.add_argument("--model", default="random:tiny-llama")
    ap.add_argument("--device", default="cuda", help="emulated: the same checks without a GPU")
    a = ap.parse_args()
    for s in a.scheduler.split(","):
        check(a.device, s, a.model)
    print("launch gpu check: OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
