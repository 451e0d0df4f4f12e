"""The entry of every device process (emulated or CUDA): `python -m <device module> SPEC_JSON`.

The launch layer (blink/launch.py) starts it with PR_SET_PDEATHSIG(SIGKILL), so the device dies
with its parent. The parent watch here covers what the death signal cannot: a parent that died
between fork and prctl, and a device started some other way. It checks the parent id every
`PARENT_POLL_S` and kills this process once the parent is gone (a device nobody reads would
keep the GPU and a core busy forever).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import msgspec

from blink.protocol.layout import DeviceStatus
from blink.protocol.wire import DeviceSpec

PARENT_POLL_S = 0.5


def watch_parent(parent: int, poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Kill this process (SIGKILL, as the death signal would) once `parent` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"device: parent {parent} is gone; exiting", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    t = threading.Thread(target=watch, name="parent-watch", daemon=True)
    t.start()
    return t


def device_main(run: Callable[[DeviceSpec], DeviceStatus], argv: list[str] | None = None) -> int:
    """Decode the spec (the one argument), watch the parent, serve. Exit 0 after a clean stop, 1 after a fault."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            f"usage: python -m <device module> SPEC_JSON (blink.protocol.wire.DeviceSpec); got {args}", file=sys.stderr
        )
        return 2
    spec = msgspec.json.decode(args[0], type=DeviceSpec)
    watch_parent(os.getppid())
    return 0 if run(spec) == DeviceStatus.STOPPED else 1
