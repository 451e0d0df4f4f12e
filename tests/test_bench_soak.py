"""bench/serving/soak.py, short: it drives a real `blink serve` (emulated device), finds nothing lost or
leaked without a kill, and after a device kill counts the requests in flight apart and loses none."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load():
    from bench.serving import soak

    return soak


def soak(tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "bench.serving.soak", "--duration-s", "8", "--concurrency", "4", "--warmup-s", "2",
           "--max-context", "128", "--hostile", "0", "--out", str(out), *args]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.exists(), r.stdout + r.stderr
    return r.returncode, json.loads(out.read_text())


def test_soak_without_a_kill_loses_and_leaks_nothing(tmp_path):
    rc, res = soak(tmp_path, "--kill-at", "0")
    assert rc == 0 and res["ok"], res
    assert res["lost"] == 0 and res["outcomes"].get("ok", 0) > 0
    assert res["leaks"]["slots_leaked"] == 0 and res["leaks"]["kv_blocks_leaked"] == 0
    assert res["rss"]["server_mb_end"] > 0
    assert res["by_kind"].get("prefix") and res["prefix_cache_hit_rate"] > 0  # shared prefixes were found


def test_soak_with_hostile_clients_reports_health_latency(tmp_path):
    """Hostile loops (long prompts, slowloris, endless bodies, idle floods, stop floods, bad template
    variables) beside honest clients: every attack gets its expected answer, nothing honest is lost,
    and /health answers at the 99th percentile within a second on a small CI host."""
    rc, res = soak(tmp_path, "--kill-at", "0", "--hostile", "2", "--hostile-prompt-mb", "0.5",
                   "--duration-s", "12", "--", "--timeout-keep-alive", "1")  # fmt: skip
    assert res["hostile"]["unexpected"] == 0, res["hostile"]
    assert sum(sum(k.values()) for k in res["hostile"]["by_kind"].values()) >= 2
    assert res["lost"] == 0 and rc == 0, res
    # A second, not 100 ms: here the server, its tokenizer process, the device, the honest and the
    # hostile clients share what a 2-core CI host leaves beside the other test worker (p99 318 ms was
    # seen beside a kernel compile). What this bounds is a server that stops answering while it takes
    # a hostile body in; how long the event loop itself is held (under 100 ms) is
    # test_dpu_http_hardening.py's, measured without the rest of the soak around it.
    assert res["health_ms"]["n"] > 50 and res["health_ms"]["p99"] < 1000, res["health_ms"]


def test_soak_with_a_device_kill(tmp_path):
    rc, res = soak(tmp_path, "--kill-at", "0.5")
    kill = res["kill"]
    assert kill["done"] and kill["pid"] and kill["noticed_after_s"] is not None, kill
    assert res["lost"] == 0, res["lost_examples"]
    # blink serve restarts its device (tests/test_device_lifecycle.py): it serves again, nothing leaks
    assert kill["recovered_after_s"] is not None, kill
    assert rc == 0 and res["leaks"]["slots_leaked"] == 0 and res["leaks"]["kv_blocks_leaked"] == 0


def test_a_request_sent_before_the_server_knew_of_the_kill_counts_at_the_kill():
    """Sent after the SIGKILL but before /health could say so: the server accepted it in good faith, so
    its error belongs to the kill; a failure after the server knew is a plain failure, with an example."""
    soak = _load()
    t = soak.Tally()
    t.t_kill, t.t_noticed = 100.0, 100.2
    t.add("chat_stream", "failed", 99.0, 100.5, "error event")  # in flight at the kill
    t.add("chat_stream", "failed", 100.1, 100.4, "error event")  # sent before the server noticed
    t.add("chat", "failed", 101.0, 101.1, "HTTP 500")  # after
    assert t.counts == {"failed_at_kill": 2, "failed": 1}
    assert t.failed_examples == ["chat: HTTP 500, +1.00 s from the kill"]
