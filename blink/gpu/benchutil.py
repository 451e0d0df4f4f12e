"""Shared pieces of the GPU benchmarks (bench/decode.py, bench/prefill.py, bench/hf_baseline.py):
result metadata, CUDA-event timing, and the device-to-device copy bandwidth of this GPU."""

from __future__ import annotations

import datetime
import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

from blink.treedigest import tree_digest


def metadata(commit: str, argv: list[str] | None = None) -> dict[str, Any]:
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(0)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "sms": int(props["multiProcessorCount"]),
        "commit": commit,
        "tree_sha256": tree_digest(),  # check against `python -m blink.treedigest --commit <commit>`
        "command": " ".join(argv if argv is not None else sys.argv),
    }


def time_ms(fn: Callable[[], None], stream: Any, iters: int = 20, warmup: int = 3) -> float:
    """Mean milliseconds of fn() (which enqueues work on `stream`) over `iters` back-to-back calls."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    stream.synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(stream)
    for _ in range(iters):
        fn()
    b.record(stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / iters


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> dict[str, float]:
    """Device-to-device copy: bytes read + written per second (the usual 'copy bandwidth')."""
    import cupy as cp

    src = cp.ones(nbytes // 2, dtype=cp.uint16)
    dst = cp.empty_like(src)
    s = cp.cuda.Stream(non_blocking=True)

    def run() -> None:
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3, s.ptr)

    ms = time_ms(run, s, iters=iters)
    return {"bytes": nbytes, "ms": ms, "read_plus_write_GBps": 2 * nbytes / ms / 1e6, "read_GBps": nbytes / ms / 1e6}


def write_json(path: str, result: dict[str, Any]) -> None:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {p}", file=sys.stderr)
