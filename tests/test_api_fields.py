"""Request fields are honoured or refused, never silently ignored: an unknown field is a 400 naming
it; vLLM's chat_template_kwargs and add_generation_prompt reach the chat template; logprobs: 0 is
the sampled token's logprob; X-Request-Id comes back as the response header and the response id."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from blink.config import ServerConfig
from blink.dpu import openai_api as api
from blink.dpu.server import OpenAIServer
from blink.dpu.tokenizer import load_tokenizer
from blink.protocol.layout import DeviceStatus
from blink.protocol.wire import DeviceHealth, RingStats

TEMPLATE = (
    "{% if enable_thinking %}<think>{% endif %}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.mark.parametrize(
    "cls, body, param",
    [
        (api.ChatRequest, {"model": "m", "messages": [], "reasoning_effort": "high"}, "reasoning_effort"),
        (
            api.ChatRequest,
            {"model": "m", "messages": [], "stream_options": {"include_usag": True}},
            "stream_options.include_usag",
        ),
        (api.CompletionRequest, {"model": "m", "prompt": "x", "chat_template_kwargs": {}}, "chat_template_kwargs"),
        (api.CompletionRequest, {"model": "m", "prompt": "x", "presence_penalt": 1}, "presence_penalt"),
        (api.TokenizeRequest, {"model": "m", "prompt": "x", "foo": 1}, "foo"),
        (api.DetokenizeRequest, {"model": "m", "tokens": [1], "bar": 1}, "bar"),
    ],
)
def test_unknown_fields_are_a_400_naming_them(cls, body, param):
    with pytest.raises(api.APIError) as e:
        api.parse(cls, json.dumps(body).encode())
    assert e.value.status == 400 and e.value.param == param and repr(param) in e.value.message


def test_vllm_extension_fields_are_declared():
    r = api.parse(
        api.ChatRequest,
        b'{"model": "m", "messages": [], "chat_template_kwargs": {"enable_thinking": true},'
        b' "add_generation_prompt": false, "request_id": "r1"}',
    )
    assert r.chat_template_kwargs == {"enable_thinking": True} and r.add_generation_prompt is False
    assert api.chat_template_kwargs(r) == {"enable_thinking": True}
    r = api.parse(api.ChatRequest, b'{"model": "m", "messages": [], "chat_template_kwargs": {"messages": []}}')
    with pytest.raises(api.APIError, match="may not set messages"):
        api.chat_template_kwargs(r)


def test_logprobs_zero_asks_for_the_sampled_tokens_logprob():
    """Completions' logprobs: 0 is vLLM's "the chosen token's logprob, no alternatives", not "off"."""
    r = api.parse(api.CompletionRequest, b'{"model": "m", "prompt": "x", "logprobs": 0}')
    assert api.sampling_params(r, 1, [5], [2], 4).sampling.logprobs == 0
    r = api.parse(api.CompletionRequest, b'{"model": "m", "prompt": "x", "logprobs": null}')
    assert api.sampling_params(r, 1, [5], [2], 4).sampling.logprobs == -1


class PromptLengthBackend:
    """Records the prompt lengths the server checks, then refuses them (no device needed)."""

    max_context = 1024

    def __init__(self) -> None:
        self.lengths: list[int] = []

    features = 0

    def check_prompt(self, n: int, *region: int) -> str | None:
        self.lengths.append(n)
        return "recorded"

    def health(self) -> DeviceHealth:
        return DeviceHealth(True, int(DeviceStatus.READY), 0, "")

    def stats(self) -> RingStats:
        return RingStats(0, 0, 0, 0)

    def device_counters(self) -> dict[str, int]:
        return {}

    def mask_latency(self) -> list[int]:
        return []

    def frontend_counters(self) -> dict[str, int]:
        return {}

    def new_request_id(self) -> int:
        return 1


@pytest.mark.asyncio
async def test_chat_template_kwargs_reach_the_template_and_request_id_is_echoed():
    tok = load_tokenizer("random:tiny-llama", None, TEMPLATE)
    backend = PromptLengthBackend()
    app = OpenAIServer(backend, tok, ServerConfig()).app()
    msgs = [{"role": "user", "content": "hi"}]
    async with TestClient(TestServer(app)) as c:
        ids = {}
        for name, extra in (
            ("plain", {}),
            ("thinking", {"chat_template_kwargs": {"enable_thinking": True}}),
            ("no_gen", {"add_generation_prompt": False}),
        ):
            r = await c.post("/tokenize", json={"model": "tiny-llama", "messages": msgs, **extra})
            assert r.status == 200, await r.text()
            ids[name] = (await r.json())["tokens"]
            r = await c.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": msgs, **extra})
            assert r.status == 400 and (await r.json())["error"]["message"] == "recorded"
        assert tok.decode(ids["thinking"]) == "<think>" + tok.decode(ids["plain"])
        assert tok.decode(ids["plain"]) == tok.decode(ids["no_gen"]) + "assistant:"
        assert backend.lengths == [len(ids["plain"]), len(ids["thinking"]), len(ids["no_gen"])]
        # X-Request-Id comes back on every response, errors included
        for method, path in (("post", "/v1/chat/completions"), ("get", "/v1/models")):
            body = {"model": "tiny-llama", "messages": msgs} if method == "post" else None
            r = await getattr(c, method)(path, json=body, headers={"X-Request-Id": "req-42"})
            assert r.headers.get("X-Request-Id") == "req-42"
        r = await c.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": msgs, "foo": 1})
        assert r.status == 400 and (await r.json())["error"]["param"] == "foo"


def test_request_id_is_the_response_id_end_to_end(request):
    """On a served model (emulated device): X-Request-Id (or the request_id field) names the
    response, streamed chunks included, and comes back as a header."""
    import urllib.request

    from test_e2e_openai import API_KEY, Server

    s = Server("--model", "random:tiny-llama", "--num-kv-blocks", "256", "--n-slots", "4", "--api-key", API_KEY)
    request.addfinalizer(s.stop)
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    hdrs = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}

    def post(body: dict, extra: dict) -> tuple[str, bytes]:
        req = urllib.request.Request(s.url + "/v1/chat/completions", json.dumps(body).encode(), {**hdrs, **extra})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.headers.get("X-Request-Id"), r.read()

    hdr, out = post(chat, {"X-Request-Id": "abc-1"})
    assert hdr == "abc-1" and json.loads(out)["id"] == "chatcmpl-abc-1"
    hdr, out = post({**chat, "stream": True}, {"X-Request-Id": "abc-2"})
    chunks = [json.loads(ln[6:]) for ln in out.decode().splitlines() if ln.startswith("data: {")]
    assert hdr == "abc-2" and chunks and all(ch["id"] == "chatcmpl-abc-2" for ch in chunks)
    hdr, out = post({**chat, "request_id": "field-3"}, {})
    assert hdr is None and json.loads(out)["id"] == "chatcmpl-field-3"
    completion = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
    req = urllib.request.Request(
        s.url + "/v1/completions", json.dumps(completion).encode(), hdrs | {"X-Request-Id": "c4"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert json.loads(r.read())["id"] == "cmpl-c4"
