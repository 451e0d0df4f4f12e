"""The device process's life under `blink serve` (emulated device; the CUDA device starts and stops
through the same launch layer, blink/launch.py):

- it dies with its frontend (kill -9 of `blink serve` leaves no device behind), and the ring a
  dead server left in /dev/shm is removed by the next server that starts;
- a device that dies is restarted (backoff, a bounded number of tries, counted in /metrics): the
  requests it had end with an error event, /health comes back to 200 by itself and new requests
  complete; once the tries are spent, `blink serve` exits non-zero (so an outside supervisor can
  take over).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from test_e2e_openai import Server, _post, own_shm_available

from blink.launch import wait_for_ready
from blink.protocol.layout import DeviceStatus
from blink.testing import child_pids, gone

TINY = ("--model", "random:tiny-llama", "--num-kv-blocks", "128", "--n-slots", "4")


def wait_for(cond, timeout: float, what: str) -> None:
    t_end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t_end, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def health(url: str) -> int:
    try:
        return urllib.request.urlopen(url + "/health", timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code


def complete(url: str) -> tuple[int, dict]:
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 3, "ignore_eos": True}
    return _post(url + "/v1/completions", json.dumps(body))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# -- the device dies with its parent; stale rings ------------------------------------------------


class OwnShm:
    """A mount namespace with its own tmpfs on /dev/shm, held by a sleeping process (root only).
    Servers started with `prefix` live in it and share this machine's network; `path(name)` is a
    file of its /dev/shm as this process sees it (through /proc/<holder>/root). Other tests' servers
    sweep the machine's /dev/shm for stale rings too, so a test about which server removed a ring
    must own its /dev/shm."""

    HOLD = "mount -t tmpfs -o size=64m tmpfs /dev/shm && echo ready && exec sleep infinity"

    def __init__(self):
        self.holder = subprocess.Popen(["unshare", "--mount", "sh", "-c", self.HOLD], stdout=subprocess.PIPE, text=True)
        if self.holder.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("no mount namespace with its own /dev/shm")
        self.prefix = ["nsenter", "-t", str(self.holder.pid), "-m", "--"]

    def path(self, name: str) -> str:
        return f"/proc/{self.holder.pid}/root/dev/shm/{name}"

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


def test_device_dies_with_the_frontend_and_its_ring_is_removed_at_the_next_start():
    if not own_shm_available():
        pytest.skip("needs its own /dev/shm (root): another test's server could sweep the stale rings first")
    shm = OwnShm()
    try:
        stale = shm.path(f"blink-{dead_pid()}-0123abcd")  # as a server killed long ago would leave it
        live = shm.path(f"blink-{os.getpid()}-4567cdef")  # its owner (this process) lives: kept
        for path in (stale, live):
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
        s = Server(*TINY, prefix=shm.prefix)
        assert not os.path.exists(stale) and os.path.exists(live)
        assert [ln for ln in s.log if "removed stale ring" in ln] == [
            f"blink: removed stale ring /dev/shm/{os.path.basename(stale)} (the server that made it is gone)\n"
        ], "".join(s.log)
        (child,) = child_pids(s.proc.pid)
        s.proc.kill()  # kill -9: no shutdown handler runs
        s.proc.wait(10)
        wait_for(lambda: gone(int(child)), 5.0, f"device {child} gone after its frontend was killed")
        assert s.ring and os.path.exists(shm.path(s.ring))  # nobody unlinked it

        s2 = Server(*TINY, prefix=shm.prefix)
        try:
            assert not os.path.exists(shm.path(s.ring)) and os.path.exists(live)
            assert [ln for ln in s2.log if "removed stale ring" in ln] == [
                f"blink: removed stale ring /dev/shm/{s.ring} (the server that made it is gone)\n"
            ], "".join(s2.log)
            assert complete(s2.url)[0] == 200
        finally:
            assert s2.stop() == 0
    finally:
        shm.close()


def test_device_process_watches_its_parent():
    """The parent watch alone (no death signal: a device started by some other launcher) ends the
    device within a second of its parent's death."""
    code = (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'from blink.device.process import watch_parent;"
        "import os, time; watch_parent(os.getppid(), 0.05); print(os.getpid(), flush=True); time.sleep(60)'],"
        " stdout=subprocess.PIPE, text=True);"
        "print(p.stdout.readline().strip(), flush=True)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    wait_for(lambda: gone(int(out.stdout.split()[0])), 3.0, "orphaned device killed by its parent watch")


# -- self-healing ----------------------------------------------------------------------------------


def test_dead_device_is_restarted_and_the_server_heals():
    s = Server(*TINY, "--max-device-restarts", "2")
    try:
        (child,) = child_pids(s.proc.pid)
        assert health(s.url) == 200 and s.metrics()["blink_device_restarts_total"] == 0

        async def stream_through_the_kill() -> list[bytes]:
            async with aiohttp.ClientSession() as sess:
                body = {"model": "tiny-llama", "prompt": [5], "max_tokens": 1000, "ignore_eos": True, "stream": True}
                async with sess.post(s.url + "/v1/completions", json=body) as r:
                    events = []
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            events.append(line[6:].strip())
                            if len(events) == 2:
                                os.kill(int(child), signal.SIGKILL)
                    return events

        events = asyncio.run(stream_through_the_kill())
        assert events[-1] == b"[DONE]" and "exited" in json.loads(events[-2])["error"]["message"]
        wait_for(lambda: health(s.url) == 200, 30.0, "/health back to 200")
        (new_child,) = child_pids(s.proc.pid)
        assert new_child != child
        code, js = complete(s.url)
        assert code == 200 and js["usage"]["completion_tokens"] == 3, js
        m = s.metrics()
        assert m["blink_device_restarts_total"] == 1 and m["blink_ring_busy_slots"] == 0
        # The device publishes its running count after the step that finished the request, so a
        # scrape right after the response may still count it: the gauge must settle, not be 0 at once.
        wait_for(lambda: s.metrics()["blink_device_running"] == 0, 5.0, "the device's running gauge back to 0")
        assert m["blink_device_up"] == 1
        assert any("restarting the device" in ln for ln in s.log), "".join(s.log)
        assert s.proc.poll() is None
    finally:
        assert s.stop() == 0, "".join(s.log)
    assert not os.path.exists(f"/dev/shm/{s.ring}")


@pytest.mark.timeout(120)
def test_server_exits_nonzero_when_the_restarts_are_spent():
    s = Server(*TINY, "--max-device-restarts", "1")
    try:
        (child,) = child_pids(s.proc.pid)
        os.kill(int(child), signal.SIGKILL)
        first = child

        def restarted() -> bool:
            kids = child_pids(s.proc.pid)
            return len(kids) == 1 and kids != [first] and health(s.url) == 200

        wait_for(restarted, 30.0, "first restart")
        (child,) = child_pids(s.proc.pid)
        os.kill(int(child), signal.SIGKILL)  # the second death: no tries left
        rc = s.proc.wait(30)
        assert rc != 0
        assert any("giving up" in ln for ln in s.log), "".join(s.log)
        rings = [ln.split("/dev/shm/")[1].split(":")[0] for ln in s.log if "ring /dev/shm/" in ln]
        assert len(rings) == 2 and not any(os.path.exists(f"/dev/shm/{r}") for r in rings)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def test_wait_for_ready_polls_until_ready_and_raises_when_it_never_will():
    """The one start-up wait of a local device (DeviceProcess.wait_ready) and a remote one
    (blink.stack.wait_ready_remote): READY ends it, `check` fails it, and the timeout ends it."""
    said: list[str] = []
    seq = iter([DeviceStatus.STARTING] * 3 + [DeviceStatus.READY])
    assert wait_for_ready(lambda: int(next(seq)), lambda s: None, 5.0, said.append, poll_s=0) >= 0
    assert said == ["waiting for the device: starting (0 s)"]

    def check(status: int) -> None:
        if status == DeviceStatus.FAILED:
            raise RuntimeError("failed")

    seq = iter([DeviceStatus.STARTING, DeviceStatus.FAILED])
    with pytest.raises(RuntimeError, match="failed"):
        wait_for_ready(lambda: int(next(seq)), check, 5.0, poll_s=0)
    with pytest.raises(TimeoutError, match="remote device not ready after 0 s"):
        wait_for_ready(lambda: int(DeviceStatus.STARTING), check, 0.05, what="remote device", poll_s=0.01)
