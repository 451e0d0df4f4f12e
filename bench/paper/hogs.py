"""CPU and memory-bandwidth hogs on named cores: the interference of bench/paper/evaluate.py.

    python -m bench.paper.hogs --cores 2-13 [--kind mix|compress|memory] [--seconds 60]

One process per core, pinned to it (sched_setaffinity), running until stopped:

  compress  bzip2 of 900 kB blocks of text-like data, as pbzip2 does per block (the paper's
            compression hog): integer work, branchy, about 1 MB of working set per process
  memory    an LLC and memory-bandwidth thrasher: a streaming copy between two 64 MiB buffers
            (read + write bandwidth), then 1M random 8-byte reads and writes over a 256 MiB table
            (cache and TLB misses); together they evict the last-level cache shared with the
            process under test and load its memory channels
  mix       compress on every other core, memory on the rest (the default)

Each hog is a separate process, so no interpreter lock bounds the load. `Hogs(cores, kind)` is a
context manager for benchmarks; the CLI runs them for --seconds (0: until interrupted).
"""

from __future__ import annotations

import argparse
import bz2
import os
import signal
import subprocess
import sys
import time

KINDS = ("mix", "compress", "memory")


def parse_cores(s: str) -> list[int]:
    """'2-5,8' -> [2, 3, 4, 5, 8]."""
    out: list[int] = []
    for part in s.split(","):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def _compress_forever() -> None:
    words = [b"the", b"ring", b"slot", b"token", b"prefill", b"decode", b"kernel", b"graph", b"batch", b"block"]
    seed = 12345
    block = bytearray()
    while len(block) < 900_000:  # pseudo-random words: compresses like text, not like zeros
        seed = (seed * 1103515245 + 12345) & 0x7FFFFFFF
        block += words[seed % len(words)] + (b" " if seed & 8 else b"\n")
    data = bytes(block)
    while True:
        bz2.compress(data, 9)


def _memory_forever() -> None:
    import numpy as np

    a = np.ones(8 << 20, np.float64)  # 64 MiB each
    b = np.empty_like(a)
    table = np.zeros(32 << 20, np.int64)  # 256 MiB
    rng = np.random.default_rng(os.getpid())
    while True:
        np.copyto(b, a)
        np.copyto(a, b)
        idx = rng.integers(0, table.size, 1 << 20)
        table[idx] += 1


def _worker(kind: str, core: int) -> None:
    os.sched_setaffinity(0, {core})
    (_compress_forever if kind == "compress" else _memory_forever)()


class Hogs:
    """Start one hog per core on enter, kill them on exit. kind "mix" alternates the two kinds."""

    def __init__(self, cores: list[int], kind: str = "mix"):
        if kind not in KINDS:
            raise ValueError(f"hog kind must be one of {KINDS}, got {kind!r}")
        self.cores, self.kind = list(cores), kind
        self.procs: list[subprocess.Popen] = []

    def kinds(self) -> list[str]:
        if self.kind != "mix":
            return [self.kind] * len(self.cores)
        return ["compress" if i % 2 == 0 else "memory" for i in range(len(self.cores))]

    def __enter__(self) -> Hogs:
        here = os.path.abspath(__file__)
        for core, kind in zip(self.cores, self.kinds(), strict=True):
            cmd = [sys.executable, here, "--worker", kind, "--cores", str(core)]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        time.sleep(0.5)  # imports done, buffers touched: the load is on when the caller measures
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"a hog exited at once with code {p.returncode}")
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []

    def describe(self) -> dict:
        return {"cores": self.cores, "kind": self.kind, "per_core": self.kinds(), "doc": "bench/paper/hogs.py"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", required=True, help="e.g. 2-13 or 2,3,8")
    ap.add_argument("--kind", choices=KINDS, default="mix")
    ap.add_argument("--seconds", type=float, default=0.0, help="0: until interrupted")
    ap.add_argument("--worker", choices=("compress", "memory"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a.worker, parse_cores(a.cores)[0])
        return 0
    with Hogs(parse_cores(a.cores), a.kind) as h:
        print(f"hogs: {', '.join(f'{k}@{c}' for c, k in zip(h.cores, h.kinds(), strict=True))}", flush=True)
        try:
            if a.seconds:
                time.sleep(a.seconds)
            else:
                signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
