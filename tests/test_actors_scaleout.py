"""bench/scaleout.py end to end without Ray (--launcher procs): engines as processes, the frontend
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
    cmd = [sys.executable, str(ROOT / "bench" / "scaleout.py"), "--launcher", "procs", "--device", "emulated"]
    cmd += ["--model", "random:tiny-llama", "--scale", "0.1", "--requests", "8", "--concurrency", "4"]
    cmd += ["--n-slots", "8", "--num-kv-blocks", "128", "--out", str(out)]
    cmd += ["--rate", "8", "--open-requests", "6", "--client-procs", "2"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["bench"] == "scaleout" and res["commit"] and "scaleout.py" in res["command"]
    assert [x["replicas"] for x in res["runs"]] == [1, 2]
    for run in res["runs"]:
        assert run["errors"] == 0 and run["requests"] == 8
        assert run["output_tokens"] > 0 and run["devices"] == ["emulated"] * run["replicas"]
    assert res["runs"][0]["output_tokens"] == res["runs"][1]["output_tokens"]  # the same load both times
    for run in res["runs"]:  # the open-loop phase: every request sent on time, records per request
        op = run["poisson"]
        assert op["mode"] == "poisson 8 req/s" and op["errors"] == 0 and op["requests"] == 6
        assert op["client_procs"] == 2 and op["send_lag_max_ms"] < 250, op["send_lag_max_ms"]
        assert [r[5] for r in op["per_request"]] == [0, 1, 0, 1, 0, 1]  # request i from client i % 2
        assert all(r[2] > 0 and r[1] > 0 for r in op["per_request"])


def test_per_replica_load_is_the_same_work_per_replica() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import loadgen
    finally:
        sys.path.remove(str(ROOT / "bench"))
    one = loadgen.sharegpt_like(50, 1000, 4096, 1.0, 3)
    two = loadgen.sharegpt_like(50, 1000, 4096, 1.0, 3, copies=2)
    assert two[0::2] == one  # the first copy is the 1-replica load itself
    assert [(len(p), o) for p, o in two[1::2]] == [(len(p), o) for p, o in one]  # same lengths...
    assert all(a != b for (a, _), (b, _) in zip(one, two[1::2], strict=True))  # ...fresh prompt ids
    t1, t2 = loadgen.poisson_offsets(50, 16.0, 3), loadgen.poisson_offsets(50, 16.0, 3, copies=2)
    assert (t2[0::2] == t1).all() and not (t2[1::2] == t1).all()
    assert 0.6 < 49 / t1[-1] / 16.0 < 1.6  # about 16 arrivals per second
