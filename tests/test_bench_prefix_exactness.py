"""bench/serving/prefix_exactness.py: caching on and off give the same greedy token ids on the emulated
device (both schedulers, through `blink serve`), and the comparison finds a difference where there is one."""

from __future__ import annotations

import json

from bench.serving import prefix_exactness as px


def test_caching_on_and_off_give_identical_greedy_tokens_on_the_emulated_device(tmp_path):
    assert px.main(["--device", "emulated", "--out", str(tmp_path), "--commit", "test"]) == 0
    body = json.loads((tmp_path / "prefix_exactness-emulated-test.json").read_text())
    assert {"date", "device", "commit", "command", "model", "results", "all_identical"} <= body.keys()
    assert body["all_identical"] and set(body["results"]) == {"gpu", "host"}
    for r in body["results"].values():
        assert r["requests"] == r["identical"] == 2 * 4 + 3 and not r["divergences"] and not r["errors"]
        assert r["generated_tokens"] > r["requests"]  # answers of more than one token were compared
        assert r["cached_tokens_off"] == 0 and 0.3 < r["cached_fraction_on"] < 1
        assert r["by_workload"]["system"]["cached_tokens"] > 0 and r["by_workload"]["sharegpt"]["cached_tokens"] > 0
        assert "--no-enable-prefix-caching" in r["servers"]["off"]


def test_compare_reports_where_outputs_first_differ():
    def turn(ids, cached=0, error=""):
        return px.Turn("sharegpt", 0, len(ids), [], list(ids), [-1.0] * len(ids), "", 100, cached, error)

    on = [[turn([1, 2, 3], 0), turn([4, 5, 6], 64), turn([7], 64)]]
    off = [[turn([1, 2, 3]), turn([4, 9, 6]), turn([7, 8])]]
    r = px.compare(on, off)
    assert r["requests"] == 3 and r["identical"] == 1 and not r["all_identical"]
    assert [d["position"] for d in r["divergences"]] == [1, 1]
    assert r["cached_tokens_on"] == 128 and r["prompt_tokens"] == 300
    assert px.first_difference([1, 2], [1, 2]) is None and px.first_difference([1], [2]) == 0
    failed = px.compare([[turn([1], error="HTTP 400")]], [[turn([1])]])
    assert failed["errors"] and not failed["all_identical"]
