"""The four-model scripts on the CPU, so a GPU run does not find the harness's bugs:
bench/engine/throughput.py --presets runs the MoE model too (not skipped), and bench/serving/serve_check.py's checks pass against the
emulated device (and fail when an answer is wrong)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from blink.testing import gone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


def test_models_bench_runs_the_moe_model(tmp_path):
    """The CUDA engine runs MoE models (blink/gpu/engine/moe_launch.py): qwen3-30b-a3b passes the device check
    and is not skipped; on a machine without a GPU it then fails at the engine, recorded as failed."""
    out = tmp_path / "models.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.engine.throughput",
        "--presets",
        "qwen3-30b-a3b",
        "--commit",
        "abc",
        "--out",
        str(out),
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    res = json.loads(out.read_text())
    assert res["commit"] == "abc" and res["date"] and res["device"] and "--presets" in res["command"]
    m = res["models"]["qwen3-30b-a3b"]
    assert "skipped" not in m
    if r.returncode:  # no GPU here
        assert "failed" in m, m


def test_serve_check_passes_on_the_emulated_device(tmp_path):
    out = tmp_path / "serve.json"
    cmd = [sys.executable, "-m", "bench.serving.serve_check", "--model", "random:tiny-qwen3", "--device", "emulated"]
    r = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert len(res["checks"]) == 13 and res["startup_s"]["health_200"] > 0 and res["memory_mib"]["device_rss"]


def test_serve_check_fails_when_a_request_fails():
    """max_tokens 0 with logprobs is vLLM's 400: the script says which request failed and exits 1."""
    cmd = [sys.executable, "-m", "bench.serving.serve_check", "--model", "random:tiny-qwen3", "--device", "emulated"]
    r = subprocess.run([*cmd, "--tokens", "0"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1 and "FAILED POST" in r.stderr and "HTTP 400" in r.stderr, r.stdout + r.stderr


def test_models_bench_child_timeout_kills_its_group_and_budget_skips(tmp_path):
    """A model's process that outlives --timeout is killed with what it started (the load generator),
    without waiting for it; models past --budget-s are recorded as not run; the JSON is written."""
    import time

    from bench.engine import throughput

    pid_file = tmp_path / "grandchild"
    code = f"import subprocess, time; open({str(pid_file)!r}, 'w').write(str(subprocess.Popen(['sleep', '60']).pid)); time.sleep(60)"
    t0 = time.monotonic()
    rc, _ = throughput.run_child([sys.executable, "-c", code], 2.0)
    assert rc is None and time.monotonic() - t0 < 10
    grandchild = int(pid_file.read_text())
    t_end = time.monotonic() + 10  # SIGKILL is delivered at once, the process exits when next scheduled
    while not gone(grandchild):
        assert time.monotonic() < t_end, f"grandchild {grandchild} outlived its process group's kill"
        time.sleep(0.02)
    out = tmp_path / "m.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.engine.throughput",
        "--presets",
        "llama3-8b,phi-4",
        "--budget-s",
        "10",
        "--out",
        str(out),
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    res = json.loads(out.read_text())
    assert r.returncode == 0 and res["complete"], r.stderr
    assert all("--budget-s 10 spent" in m["not_run"] for m in res["models"].values()), res
