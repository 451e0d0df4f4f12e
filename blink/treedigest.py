"""A digest of the source that a benchmark ran, so a result can be checked against a commit.

GPU results are produced on lent machines that get a copy of the working tree without `.git`:
the commit in a result is whatever the caller passed (BLINK_COMMIT), and uncommitted edits in the
tree travel with it. The benchmarks also record `tree_sha256`, computed from the files themselves;
`python -m blink.treedigest --commit <sha>` computes it for a commit (from git), and the two match
only if the result ran exactly that commit's sources.

The digest covers the source files under blink/ and bench/ (.py .cu .cuh .h .sh), by path and
content, in sorted order.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIRS = ("blink", "bench")
SUFFIXES = (".py", ".cu", ".cuh", ".h", ".sh")


def _digest(files: Iterable[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for path, data in sorted(files):
        h.update(path.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]


def _wanted(path: str) -> bool:
    return path.split("/", 1)[0] in DIRS and path.endswith(SUFFIXES) and "/__pycache__/" not in path


def tree_digest(root: Path = ROOT) -> str:
    """Digest of the source files as they are on disk under `root`."""
    files = []
    for d in DIRS:
        for f in (root / d).rglob("*"):
            rel = f.relative_to(root).as_posix()
            if f.is_file() and _wanted(rel):
                files.append((rel, f.read_bytes()))
    return _digest(files)


def commit_digest(commit: str, root: Path = ROOT) -> str:
    """Digest of the same files as committed in `commit` (needs git)."""

    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True).stdout

    names = [n for n in git("ls-tree", "-r", "--name-only", commit, "--", *DIRS).decode().splitlines() if _wanted(n)]
    return _digest((n, git("show", f"{commit}:{n}")) for n in names)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blink.treedigest", description=__doc__.splitlines()[0])
    ap.add_argument("--commit", help="digest of this commit's files (default: the working tree's)")
    a = ap.parse_args(argv)
    print(commit_digest(a.commit) if a.commit else tree_digest())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
