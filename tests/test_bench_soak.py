"""bench/soak.py, short: it drives a real `blink serve` (emulated device), finds nothing lost or
leaked without a kill, and after a device kill counts the requests in flight apart and loses none."""

from __future__ import annotations

import json
import subprocess
import sys


def soak(tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "bench/soak.py", "--duration-s", "8", "--concurrency", "4", "--warmup-s", "2",
           "--max-context", "128", "--out", str(out), *args]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.exists(), r.stdout + r.stderr
    return r.returncode, json.loads(out.read_text())


def test_soak_without_a_kill_loses_and_leaks_nothing(tmp_path):
    rc, res = soak(tmp_path, "--kill-at", "0")
    assert rc == 0 and res["ok"], res
    assert res["lost"] == 0 and res["outcomes"].get("ok", 0) > 0
    assert res["leaks"]["slots_leaked"] == 0 and res["leaks"]["kv_blocks_leaked"] == 0
    assert res["rss"]["server_mb_end"] > 0 and res["tree_sha256"]


def test_soak_with_a_device_kill(tmp_path):
    rc, res = soak(tmp_path, "--kill-at", "0.5")
    kill = res["kill"]
    assert kill["done"] and kill["pid"] and kill["noticed_after_s"] is not None, kill
    assert res["lost"] == 0, res["lost_examples"]
    # blink serve restarts its device (tests/test_device_lifecycle.py): it serves again, nothing leaks
    assert kill["recovered_after_s"] is not None, kill
    assert rc == 0 and res["leaks"]["slots_leaked"] == 0 and res["leaks"]["kv_blocks_leaked"] == 0
