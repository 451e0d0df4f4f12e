"""bench/serving/ttft_breakdown.py on the emulated device: the ring tap traces every request's first-token
path (submit <= claim <= launch <= first <= read) and the JSON holds the stages."""

from __future__ import annotations

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ttft_breakdown_traces_every_request(tmp_path):
    from bench.serving import ttft_breakdown as mod

    out = tmp_path / "ttft.json"
    argv = ["--device", "emulated", "--model", "random:tiny-llama", "--schedulers", "host", "--rate", "50",
            "--num-prompts", "12", "--input-len", "16", "--output-len", "4", "--max-num-seqs", "8", "--out", str(out)]  # fmt: skip
    mod.main(argv)  # its exit code is the latency targets', not this test's concern
    run = json.loads(out.read_text())["runs"][0]
    assert run["bench"]["completed"] == 12 and run["traced_requests"] == 12
    st = run["stages"]
    for name in ("queue_to_claim", "claim_to_launch", "launch_to_first", "first_to_read"):
        assert 0 <= st[name]["p50"] <= st["submit_to_read"]["p99"], name
    assert st["http_to_submit"]["mean"] > 0 and st["read_to_write"]["mean"] > 0
    # the bound's parts: prompts alone after the load (their prefill step), the load's decode steps
    b = run["ttft_bound"]
    # (a one-token request's slot can be freed between two reads of the tap on a loaded CPU: not all 8)
    assert 1 <= b["alone_requests"] <= 8 and 0 < b["prefill_alone_ms"]["p50"]
    assert b["decode_steps"] > 0 and b["decode_step_ms_mean"] > 0 and b["running_mean"] >= 1
