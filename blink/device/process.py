"""The entry of every device process (emulated or CUDA): `python -m <device module> SPEC_JSON`.

The launch layer (blink/launch.py) starts it with PR_SET_PDEATHSIG(SIGKILL), so the device dies
with its parent. The parent watch here covers what the death signal cannot: a parent that died
between fork and prctl, and a device started some other way. It checks the parent id every
`PARENT_POLL_S` and kills this process once the parent is gone (a device nobody reads would
keep the GPU and a core busy forever).

Start-up phases (weights, KV cache, graphs, scheduler) are one stderr line each through
`phase()`, which the frontend's terminal shows as `blink device: ...`; progress of a long phase
(`progress()`) at most every PROGRESS_EVERY_S.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import msgspec

from blink.protocol.layout import DeviceStatus
from blink.protocol.wire import DeviceSpec

PARENT_POLL_S = 0.5


def kv_cache_key(spec: DeviceSpec) -> int:
    """header.kv_cache_key: what makes this device's KV for given tokens what it is (the model and,
    for random weights, their seed; the weights' quantization and the KV cache's dtype), 64 bits of
    blake2b; the frontends seed block keys with it."""
    ident = msgspec.json.encode([spec.model, spec.seed, spec.quantization, spec.kv_cache_dtype])
    return int.from_bytes(hashlib.blake2b(ident, digest_size=8).digest(), "little")


# What loading a model raises (missing or unreadable files, bad formats, unknown presets or
# architectures; NotImplementedError: the gguf package's dequantize for a quantization type it
# lacks): reported as one line unless spec.debug; anything else keeps its traceback.
LOAD_ERRORS = (OSError, ValueError, KeyError, NotImplementedError)
PROGRESS_EVERY_S = 2.0


def phase(msg: str) -> None:
    """One start-up phase of this device process, as a line on stderr."""
    print(f"blink device: {msg}", file=sys.stderr, flush=True)


def progress(what: str, unit: str = "") -> Callable[[int, int], None]:
    """A progress(done, total) callback reporting `what` by phase() lines: the first call, then at
    most every PROGRESS_EVERY_S, and the end. unit "B": bytes, shown in MiB."""
    last = [-1e9]

    def fmt(n: int) -> str:
        return f"{n / 2**20:.1f} MiB" if unit == "B" else f"{n}{unit}"

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < PROGRESS_EVERY_S:
            return
        last[0] = now
        pct = f" ({100 * done / total:.0f} %)" if total else ""
        phase(f"{what} {fmt(done)}/{fmt(total)}{pct}")

    return report


def kv_gib(layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int, elem_bytes: int) -> float:
    """GiB of a paged KV cache (K and V)."""
    return 2 * layers * blocks * block_size * kv_heads * head_dim * elem_bytes / 2**30


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
    try:
        status = run(spec)
    except LOAD_ERRORS as e:  # a model that does not load: one line (the frontend says it too)
        if spec.debug:
            traceback.print_exc()
        phase(f"{type(e).__name__}: {e}")
        return 1
    return 0 if status == DeviceStatus.STOPPED else 1
