"""bench/serving/scaleout.py end to end without Ray (--launcher procs): engines as processes, the frontend
actor's module as a standalone process, 1 then 2 replicas, results JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_scaleout_procs_launcher(tmp_path: Path) -> None:
    out = tmp_path / "scaleout.json"
    cmd = [sys.executable, "-m", "bench.serving.scaleout", "--launcher", "procs", "--device", "emulated"]
    cmd += ["--model", "random:tiny-llama", "--dataset", "random", "--input-len", "12", "--output-len", "6"]
    cmd += ["--requests", "8", "--concurrency", "4", "--per-replica", "--n-slots", "16", "--num-kv-blocks", "128"]
    cmd += ["--rate", "8", "--open-requests", "6", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["bench"] == "scaleout" and res["commit"] and "bench.serving.scaleout" in res["command"]
    assert [x["replicas"] for x in res["runs"]] == [1, 2]
    for run in res["runs"]:
        n = run["replicas"]
        assert run["failed"] == 0 and run["completed"] == 8 * n and run["mode"] == f"closed loop, {4 * n} streams"
        assert run["total_output_tokens"] == 8 * n * 6 and run["devices"] == ["emulated"] * n
        assert len(run["cpu_cores_used"]["engines"]) == n and all(c > 0 for c in run["cpu_cores_used"]["engines"])
        op = run["poisson"]  # the open-loop phase: n copies of the same 6 requests at n x 8 req/s
        assert op["mode"] == f"poisson {8 * n} req/s" and op["failed"] == 0 and op["completed"] == 6 * n
        assert sorted((q["prompt_len"], q["output_len"]) for q in op["requests"])[::n] == sorted(
            (q["prompt_len"], q["output_len"]) for q in res["runs"][0]["poisson"]["requests"]
        )
    assert res["runs"][1]["speedup_vs_first"] > 0
