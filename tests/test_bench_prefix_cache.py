"""bench/serving/prefix_cache.py on the emulated device: the harness (both servers, every workload, the
JSON), not Blink's speed."""

from __future__ import annotations

import json

import pytest

from bench.serving import prefix_cache


@pytest.mark.slow
def test_prefix_cache_bench_end_to_end_on_the_emulated_device(tmp_path):
    assert prefix_cache.main(["--device", "emulated", "--out", str(tmp_path), "--commit", "test"]) == 0
    (path,) = tmp_path.glob("prefix_cache-emulated-test.json")
    body = json.loads(path.read_text())
    assert {"date", "device", "commit", "command", "servers", "results", "ratios_on_over_off"} <= body.keys()
    on, off = body["results"]["on"], body["results"]["off"]
    assert set(on) == set(off) == {"shared@4", "multiturn", "noreuse", "claim_to_launch"}
    assert on["claim_to_launch"]["match_ms"] is not None and on["claim_to_launch"]["no_match_ms"] is not None
    for runs in (on, off):
        assert all(r["failed"] == 0 and r["completed"] > 0 for k, r in runs.items() if k != "claim_to_launch")
    assert on["shared@4"]["prefix_cache_hit_rate"] > 0.5 and on["multiturn"]["prefix_cache_hit_rate"] > 0.2
    assert on["noreuse"]["prefix_cache_hit_rate"] == 0.0  # nothing shared: nothing found
    assert all(r["prefix_cache_hit_rate"] == 0.0 for k, r in off.items() if k != "claim_to_launch")
    assert "--no-enable-prefix-caching" in body["servers"]["off"]
