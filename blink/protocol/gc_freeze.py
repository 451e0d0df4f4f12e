"""A serving process's start-up heap, out of the garbage collector's full scans.

A full (generation 2) collection walks every container object alive, holding the GIL: in the
frontend that is the imports, aiohttp, the tokenizer and the templates, about 62,000 objects and
46 ms on a 2-core host, during which the event loop stops (every stream and /health) whenever
requests' allocations set one off. Whatever exists once a process has started serving lives as long
as the process, so each role (the frontend, the device, the ring agent) calls
`freeze_startup_heap` once, just before it serves: it collects the start-up garbage and then moves
everything alive into the permanent generation (`gc.freeze`), so that later collections scan only
what requests made. Reference counting still frees frozen objects; only a reference cycle among
them is never reclaimed (docs/decisions.md).
"""

from __future__ import annotations

import gc
import time
from typing import NamedTuple


class FrozenHeap(NamedTuple):
    objects: int  # left out of every later collection
    full_before_s: float  # the collection that ran first (the whole heap, its start-up garbage freed)
    full_after_s: float  # a full collection once frozen

    def describe(self) -> str:
        return (
            f"{self.objects} start-up objects frozen out of the garbage collector's full scans (a full "
            f"collection: {self.full_before_s * 1e3:.1f} ms before, {self.full_after_s * 1e3:.1f} ms after)"
        )


def freeze_startup_heap() -> FrozenHeap:
    """Collect, then freeze every object alive; the second collection's time is what a full one costs now
    (this thread's CPU time: another thread that takes the GIL in between does not count)."""
    t0 = time.thread_time()
    gc.collect()
    t1 = time.thread_time()
    gc.freeze()
    gc.collect()
    t2 = time.thread_time()
    return FrozenHeap(gc.get_freeze_count(), t1 - t0, t2 - t1)  # the count walks the frozen objects
