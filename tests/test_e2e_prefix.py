"""End to end, prefix caching's operator surface: `blink serve` (emulated device, tiny model) with
caching on (the default) and off: usage.prompt_tokens_details.cached_tokens (whole and streamed
responses), the vllm:prefix_cache_* metrics, POST /reset_prefix_cache only when allowed, and the
same greedy text either way."""

from __future__ import annotations

import json

import pytest
from test_e2e_openai import API_KEY, Server, _post, _sse

from blink.testing import ServeProcess

MODEL = "tiny-llama"
BASE = ("--model", "random:tiny-llama", "--num-kv-blocks", "256", "--n-slots", "8", "--api-key", API_KEY)
PROMPT = list(range(5, 5 + 150))  # token ids: 150 tokens, 9 full blocks of 16 before the last one's


@pytest.fixture(scope="module")
def on():
    s = Server(*BASE, "--allow-reset-prefix-cache")
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def off():
    s = Server(*BASE, "--no-enable-prefix-caching")
    yield s
    assert s.stop() == 0, "".join(s.log)


def complete(server: Server, prompt=PROMPT, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **kw}
    status, r = _post(server.url + "/v1/completions", json.dumps(body))
    assert status == 200, r
    return r


def test_a_repeated_prompt_reports_its_cached_tokens(on):
    first = complete(on, PROMPT[:140] + [3] * 10)
    again = complete(on, PROMPT[:140] + [3] * 10)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 144}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    m = on.metrics()
    lab = f'{{model_name="{MODEL}"}}'
    assert m["vllm:prefix_cache_hits_total" + lab] >= 144
    assert m["vllm:prefix_cache_queries_total" + lab] >= 300
    assert m["blink_device_prefix_cache_hits_total"] == m["vllm:prefix_cache_hits_total" + lab]


def test_streamed_usage_carries_cached_tokens(on):
    complete(on, PROMPT[:100])
    body = {"model": MODEL, "prompt": PROMPT[:100], "max_tokens": 4, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    ev = _sse(on.url + "/v1/completions", body)
    assert ev[-1] == "[DONE]"
    assert ev[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}
    assert all(c["usage"]["prompt_tokens_details"]["cached_tokens"] == 96 for c in ev[:-2] if c["choices"])


def test_reset_prefix_cache_when_allowed(on, off):
    complete(on, PROMPT[:64])
    assert complete(on, PROMPT[:64])["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    status, r = _post(on.url + "/reset_prefix_cache", b"{}", {"Authorization": "Bearer wrong"})
    assert status == 401, r
    status, r = _post(on.url + "/reset_prefix_cache", b"{}")
    assert status == 200 and r == {"status": "ok"}
    assert complete(on, PROMPT[:64])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, r = _post(off.url + "/reset_prefix_cache", b"{}")
    assert status == 403 and r["error"]["code"] == "not_allowed"


def test_caching_off_caches_nothing_and_says_the_same(on, off):
    for _ in range(2):
        r_off = complete(off, PROMPT[:120], max_tokens=12)
        assert r_off["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    r_on = complete(on, PROMPT[:120], max_tokens=12)
    r_on2 = complete(on, PROMPT[:120], max_tokens=12)
    assert r_on2["usage"]["prompt_tokens_details"]["cached_tokens"] == 112
    assert r_on["choices"][0]["text"] == r_on2["choices"][0]["text"] == r_off["choices"][0]["text"]
    lab = f'{{model_name="{MODEL}"}}'
    assert off.metrics()["vllm:prefix_cache_hits_total" + lab] == 0


def _bench(server: Server, *argv: str) -> dict:
    import asyncio

    from blink import benchmark

    args = benchmark.parse_args(["--base-url", server.url, "--api-key", API_KEY, *argv])
    return asyncio.run(benchmark.run(args))


def test_bench_prefix_dataset_reports_its_hit_rate(on, off):
    argv = ("--dataset", "prefix", "--prefix-len", "64", "--num-prefixes", "2", "--random-input-len", "8")
    argv += ("--random-output-len", "3", "--num-prompts", "8", "--max-concurrency", "1", "--seed", "5")
    res = _bench(on, *argv)
    assert res["completed"] == 8 and res["total_input_tokens"] == 8 * 72
    assert len(res["requests"]) == 8
    # each prefix's first request computes it: the 6 after them find its 4 blocks (64 tokens)
    assert res["total_cached_tokens"] >= 6 * 64 and 0 < res["prefix_cache_hit_rate"] < 1
    assert _bench(off, *argv)["total_cached_tokens"] == 0


def test_bench_multiturn_replay_resends_the_history(on):
    argv = ("--dataset", "sharegpt-multiturn", "--num-prompts", "2", "--min-turns", "2", "--max-turns", "3")
    res = _bench(on, *argv, "--max-model-len", "1500", "--output-len-range", "2:4", "--max-concurrency", "2")
    w = res["workload"]
    assert w["conversations"] == 2 and res["completed"] == w["turns"] >= 4
    reqs = res["requests"]
    assert sum(r["cached_tokens"] for r in reqs) > 0  # later turns find the history cached


def test_a_frontend_through_the_ring_agent_hits_and_resets_the_cache(tmp_path):
    """A frontend of a remote ring (`--ring-address`: the tcp transport through the ring agent, which
    checks every store): its block keys pass the agent's publish check, so its repeated prompt
    reports cached tokens, and its operator's reset rings reset_cache_seq through the agent."""
    key = str(tmp_path / "ring.secret")
    gpu = ServeProcess([*BASE, "--device", "emulated", "--ring-listen", "127.0.0.1:0", "--ring-secret-file", key])
    try:
        remote = ("--ring-address", gpu.agent, "--ring-secret-file", key, "--transport", "tcp")
        fe = ServeProcess([*BASE, *remote, "--allow-reset-prefix-cache"])
        try:
            assert any("ring transport tcp" in ln and "partition 1 of 2" in ln for ln in fe.log), "".join(fe.log)
            p = PROMPT[:100]
            assert complete(fe, p)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            again = complete(fe, p)
            assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}, "".join(gpu.log[-20:])
            status, r = _post(fe.url + "/reset_prefix_cache", b"{}")
            assert status == 200 and r == {"status": "ok"}, r
            assert complete(fe, p)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            assert complete(fe, p)["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}
        finally:
            assert fe.stop() == 0, "".join(fe.log[-20:])
    finally:
        assert gpu.stop() == 0, "".join(gpu.log[-20:])


def test_bench_multiturn_reads_its_dataset_without_losing_an_idle_connection(tmp_path, monkeypatch):
    """Reading a large ShareGPT file takes seconds: done on the event loop, the connection of the
    /v1/models request went idle past the server's keep-alive timeout, was closed, and the first
    /tokenize on it failed ("Can not write request body"). The file is read off the loop."""
    import time

    from blink import bench_workloads

    slow = bench_workloads.sharegpt_conversations

    def read_slowly(path: str, min_turns: int):
        time.sleep(1.5)  # a 125 MB file on a busy host
        return slow(path, min_turns)

    monkeypatch.setattr(bench_workloads, "sharegpt_conversations", read_slowly)
    turns = [{"from": f, "value": f"{f} {k} " * 5} for k in range(3) for f in ("human", "gpt")]
    (tmp_path / "sg.json").write_text(json.dumps([{"conversations": turns}] * 2))
    s = Server("--model", "random:tiny-llama", "--num-kv-blocks", "256", "--n-slots", "8", "--api-key", API_KEY,
               "--timeout-keep-alive", "0.5")  # fmt: skip
    try:
        argv = ("--dataset", "sharegpt-multiturn", "--dataset-path", str(tmp_path / "sg.json"), "--num-prompts", "2")
        res = _bench(s, *argv, "--min-turns", "2", "--max-turns", "3", "--output-len-range", "2:3")
        assert res["workload"]["conversations"] == 2 and res["completed"] == 6 and res["failed"] == 0
    finally:
        assert s.stop() == 0, "".join(s.log)
