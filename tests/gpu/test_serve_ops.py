"""`blink serve --device cuda` as an operator sees it: the device's start-up phases on stderr (the
CUDA device, KV cache, graph capture n/m, scheduler launch), a line per request, /metrics that
prometheus_client's parser reads, and the vLLM series filled in."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from blink.testing import ServeProcess

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("scheduler", ["gpu", "host"])
def test_cuda_serve_logs_phases_requests_and_metrics(scheduler):
    s = ServeProcess(
        ["--model", "random:tiny-llama", "--device", "cuda", "--scheduler", scheduler, "--num-kv-blocks", "512",
         "--max-batch", "16", "--max-context", "1024"], timeout=600,
    )  # fmt: skip
    try:
        log = "".join(s.log)
        assert re.search(r"blink device: CUDA device \d+: .*GiB free", log), log
        assert "blink device: KV cache: 512 blocks of 16 tokens" in log, log
        assert re.search(r"capturing graphs \[#+\] (\d+)/\1", log), log  # graph capture n/m, to the end
        want = (
            "persistent scheduler kernel launched ("
            if scheduler == "gpu"
            else "serving the ring (scheduler: the host loop; "
        )
        frozen = re.search(re.escape(want) + r"(\d+) start-up objects frozen\)", log)  # blink.protocol.gc_freeze
        assert frozen and int(frozen[1]) > 10_000, log
        for stream in (False, True):
            body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 8, "stream": stream, "ignore_eos": True}
            req = urllib.request.Request(
                s.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as r:  # read to the end: a stream left unread is a disconnect
                assert r.status == 200 and r.read()
        time.sleep(0.2)
        assert len(re.findall(r"cmpl-\w+ completions ok: prompt \d+ tokens, output 8 tokens", "".join(s.log))) == 2
        text = urllib.request.urlopen(s.url + "/metrics", timeout=10).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        lab = {"model_name": "tiny-llama"}
        count = {s.name: s.value for s in fams["vllm:request_prefill_time_seconds"].samples if s.labels == lab}
        assert count["vllm:request_prefill_time_seconds_count"] == 2
        success = fams["vllm:request_success"].samples
        assert [x.value for x in success if x.labels.get("finished_reason") == "length"] == [2.0]
        # lm-evaluation-harness's loglikelihood request (token ids, echo + logprobs, max_tokens 0) and
        # vLLM's prompt_logprobs: the prompt's logprobs, computed on the device (the CUDA graphs)
        prompt = [5, 17, 42, 99, 7, 300, 12]
        for body in (
            {"model": "tiny-llama", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1},
            {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2},
        ):
            req = urllib.request.Request(
                s.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            choice = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]
            if "echo" in body:
                lp = choice["logprobs"]
                assert len(lp["token_logprobs"]) == len(prompt) and lp["token_logprobs"][0] is None, lp
                assert all(v <= 0 for v in lp["token_logprobs"][1:])
                assert all(
                    max(t.values()) >= v - 1e-5
                    for t, v in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:], strict=True)
                )
            else:
                field = choice["prompt_logprobs"]
                assert len(field) == len(prompt) and field[0] is None, field
                assert all(str(t) in d and 2 <= len(d) <= 3 for t, d in zip(prompt[1:], field[1:], strict=True))
    finally:
        assert s.stop() == 0, "".join(s.log)
