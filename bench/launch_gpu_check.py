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
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


def children(pid: int) -> list[int]:
    return [int(c) for t in glob.glob(f"/proc/{pid}/task/*/children") for c in open(t).read().split()]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


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
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--device", device, "--scheduler", scheduler, "--model", model]
    cmd += ["--port", "0", "--max-device-restarts", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    url: list[str] = []
    started = threading.Event()

    def drain() -> None:
        for line in proc.stderr:
            log.append(line)
            if m := re.search(r"serving (\S+) on (http://\S+)/v1", line):
                url[:] = [m.group(2), m.group(1)]
                started.set()
        started.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        if not started.wait(600) or not url:
            raise RuntimeError("server did not start:\n" + "".join(log[-20:]))
        base, name = url
        n = complete(base, name)
        print(f"[{scheduler}] serving; completion tokens: {n}", flush=True)
        assert n == 8
        (dev,) = children(proc.pid)
        os.kill(dev, signal.SIGKILL)
        dt = until(lambda: children(proc.pid) not in ([], [dev]) and get(base + "/health")[0] == 200, 600)
        restarts = re.search(r"^blink_device_restarts_total (\S+)$", get(base + "/metrics")[1], re.M)
        print(f"[{scheduler}] device killed: /health 200 again after {dt:.1f} s, restarts {restarts and restarts[1]}")
        assert restarts and float(restarts[1]) == 1
        n = complete(base, name)
        print(f"[{scheduler}] after the restart, completion tokens: {n}", flush=True)
        assert n == 8
        (dev,) = children(proc.pid)
        proc.kill()
        proc.wait(30)
        print(f"[{scheduler}] frontend killed (-9): device gone after {until(lambda: gone(dev), 5):.1f} s", flush=True)
    except BaseException:
        print("".join(log[-30:]), file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.kill()


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
