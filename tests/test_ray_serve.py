"""`blink serve --ray`: the deployment's actors on an embedded local Ray, from the command line."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[1]


def test_blink_serve_ray_two_replicas(tmp_path: Path) -> None:
    name = f"servetest-{os.getpid()}"
    conf = tmp_path / "serve.toml"
    conf.write_text(f'[deploy]\nname = "{name}"\nnamespace = "{name}"\n[ring]\nn_slots = 8\n')
    raytmp = tempfile.mkdtemp(prefix="rays", dir="/tmp")
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=raytmp, RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--ray", "--config", str(conf), "--replicas", "2"]
    cmd += ["--model", "random:tiny-llama", "--device", "emulated", "--port", "0", "--num-kv-blocks", "256"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = None
        t_end = time.monotonic() + 120
        lines = []
        while url is None:
            assert time.monotonic() < t_end and proc.poll() is None, "".join(lines)
            line = proc.stderr.readline()
            lines.append(line)
            m = re.search(r"serving \S+ on (http://\S+)/v1 \(2 replica", line)
            url = m and m.group(1)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny-llama"]
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 5
        assert all(os.path.exists(f"/dev/shm/{name}-{name}-ring-{i}") for i in range(2))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert not any(os.path.exists(f"/dev/shm/{name}-{name}-ring-{i}") for i in range(2))  # stop unlinked the rings
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(raytmp, ignore_errors=True)
