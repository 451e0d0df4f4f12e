"""blink.treedigest: the digest GPU results record matches a commit's only for that commit's sources."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from blink import treedigest

ROOT = Path(__file__).resolve().parents[1]


def test_clean_tree_matches_its_commit() -> None:
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", *treedigest.DIRS], capture_output=True, text=True
    )
    if dirty.returncode != 0:
        pytest.skip("not a git checkout")
    if dirty.stdout.strip():
        pytest.skip("blink/ or bench/ has uncommitted changes")
    assert treedigest.tree_digest() == treedigest.commit_digest("HEAD")


def test_any_source_edit_changes_the_digest(tmp_path: Path) -> None:
    for d in treedigest.DIRS:
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__", "results"))
    base = treedigest.tree_digest(tmp_path)
    assert treedigest.tree_digest(tmp_path) == base  # deterministic
    (tmp_path / "bench" / "results").mkdir(exist_ok=True)
    (tmp_path / "bench" / "results" / "x.json").write_text("{}")  # results are not source
    assert treedigest.tree_digest(tmp_path) == base
    cu = tmp_path / "blink" / "gpu" / "engine" / "csrc" / "flash_decode.cu"
    cu.write_bytes(cu.read_bytes() + b"\n")
    assert treedigest.tree_digest(tmp_path) != base
