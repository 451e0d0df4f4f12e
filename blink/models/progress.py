"""A dependency-free text progress bar for long loads (weights, model download extraction)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

# progress(done, total): called with monotonically growing `done`; total is fixed per task.
ProgressFn = Callable[[int, int], None]


class TextProgress:
    """Writes `label [#####.....]  42%  done/total unit` to stderr, at most ~10 times a second."""

    def __init__(self, label: str, unit: str = "", stream: TextIO | None = None, width: int = 30) -> None:
        self.label = label
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._last = 0.0
        self._finished = False

    def _fmt(self, n: int) -> str:
        if self.unit == "B":
            return f"{n / 2**20:.1f}MiB"
        return f"{n}{self.unit}"

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        final = done >= total
        if self._finished or (not final and now - self._last < 0.1):
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * self.width)
        self.stream.write(
            f"\r{self.label} [{bar:<{self.width}}] {frac * 100:5.1f}%  {self._fmt(done)}/{self._fmt(total)}"
        )
        if final:
            self.stream.write("\n")
            self._finished = True
        self.stream.flush()


def make_progress(progress: bool | ProgressFn | None, label: str, unit: str = "") -> ProgressFn | None:
    """Normalise a `progress=` argument: True -> a stderr bar, False/None -> none, callable -> itself."""
    if progress is True:
        return TextProgress(label, unit)
    if not progress:
        return None
    return progress
