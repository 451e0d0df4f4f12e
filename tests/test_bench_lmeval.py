"""bench/serving/lm_eval_local.py's local task and its item-by-item comparison (no lm_eval, no server)."""

from __future__ import annotations

import json
import pathlib

import pytest

from bench.serving import lm_eval_local

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_local_task_data_is_well_formed():
    yaml = (ROOT / "bench" / "serving" / "lm_eval" / "blink_mc_local.yaml").read_text()
    assert "task: blink_mc_local" in yaml and "test: bench/serving/lm_eval/mc_local.jsonl" in yaml
    items = [
        json.loads(line)
        for line in (ROOT / "bench" / "serving" / "lm_eval" / "mc_local.jsonl").read_text().splitlines()
    ]
    assert len(items) == 62
    assert len({it["question"] for it in items}) == 62
    for it in items:
        assert set(it) == {"question", "choices", "answer"}
        assert len(it["choices"]) == 4 and len(set(it["choices"])) == 4
        assert 0 <= it["answer"] < 4


def test_compare_reports_the_largest_difference_and_the_choices():
    a = [(0, 1, [-3.0, -1.0, -2.0], [False, True, False]), (1, 0, [-1.0, -2.0, -5.0], [True, False, False])]
    b = [(0, 1, [-3.0, -1.5, -1.2], [False, False, True]), (1, 0, [-1.0, -2.0, -5.0], [True, False, False])]
    r = lm_eval_local.compare(a, b)
    assert r["items"] == 2 and r["loglikelihoods"] == 6
    assert r["max_abs_diff"] == pytest.approx(0.8) and r["same_choice"] == 1 and r["same_greedy_flags"] == 1


def test_variants_are_named_by_their_flags_and_compare_with_a_baseline_without_greedy_flags():
    assert lm_eval_local.variant_name("", "auto") == "lmeval"
    assert lm_eval_local.variant_name("fp8", "auto") == "lmeval_fp8"
    assert lm_eval_local.variant_name("", "fp8") == "lmeval_fp8kv"
    assert lm_eval_local.variant_name("fp8", "fp8") == "lmeval_fp8_fp8kv"
    base = {"per_item": [{"doc_id": 0, "target": 1, "blink": [-3.0, -1.0], "hf": [-3.0, -1.0]}]}
    r = lm_eval_local.compare([(0, 1, [-2.0, -1.0], [False, True])], lm_eval_local.baseline_items(base))
    assert r["max_abs_diff"] == pytest.approx(1.0) and r["same_choice"] == 1 and "same_greedy_flags" not in r
