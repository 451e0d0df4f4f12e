"""The HTTP server as an operator sees it, over a scripted backend (in-process aiohttp server):
bad bodies, browser safety, outcome counting, /metrics (prometheus_client, vLLM's series,
several frontend processes), the request log line and the stats line."""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from blink.config import ServerConfig
from blink.dpu.server import OpenAIServer
from blink.dpu.tokenizer import load_tokenizer
from blink.protocol.layout import UNLIMITED, DeviceStatus, FinishReason
from blink.protocol.wire import DeviceHealth, RingStats, SubmitRequest, TokenEvent

ROOT = Path(__file__).resolve().parents[1]


class ScriptedHandle:
    def __init__(self, backend: ScriptedBackend, req: SubmitRequest):
        self.backend, self.req = backend, req
        now = time.time_ns()
        # submit, admit, launch, first, read (RequestHandle.timing)
        self.timing = [now, now + 2_000_000, now + 3_000_000, now + 5_000_000, now + 5_100_000]
        self.finished = False
        backend.active += 1

    async def __aiter__(self):
        n = min(self.req.max_new_tokens, self.backend.n_tokens)
        for i in range(n):
            await asyncio.sleep(self.backend.delay)
            last = i == n - 1
            reason = FinishReason.LENGTH if last else FinishReason.NONE
            if last:
                self.cancel()
            tok = self.backend.bad_token if i == 1 and self.backend.bad_token is not None else 71 + i % 20
            yield TokenEvent(self.req.request_id, [tok], reason)  # letters of the byte vocabulary

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self.backend.active -= 1


class ScriptedBackend:
    """Answers every request with `n_tokens` tokens, `delay` seconds apart; records submissions."""

    max_context = 4096

    def __init__(self, n_tokens: int = 4, delay: float = 0.0, bad_token: int | None = None):
        self.n_tokens, self.delay = n_tokens, delay
        self.bad_token = bad_token  # the second token of every request (a device that went wrong)
        self.subs: list[SubmitRequest] = []
        self.active = 0
        self._ids = itertools.count(1)

    async def submit(self, req: SubmitRequest) -> ScriptedHandle:
        self.subs.append(req)
        return ScriptedHandle(self, req)

    def health(self) -> DeviceHealth:
        return DeviceHealth(True, int(DeviceStatus.READY), 1, "")

    def stats(self) -> RingStats:
        return RingStats(8, self.active, 0, 8 - self.active)

    def device_counters(self) -> dict[str, int]:
        return {"running": self.active, "waiting": 0, "kv_blocks_total": 100, "kv_blocks_free": 75}

    def mask_latency(self) -> list[int]:
        return []

    def frontend_counters(self) -> dict[str, int]:
        return {}

    features = 0  # no sampling extensions (logprobs, penalties)

    def check_prompt(self, n: int, words: int | None = None) -> str | None:
        return None if n >= 1 else "the prompt is empty"

    def new_request_id(self) -> int:
        return next(self._ids)


MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": MODEL, "prompt": "hi"}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("random:tiny-llama")


def metrics(text: str) -> dict[str, float]:
    """Samples by name{labels} (labels sorted), parsed by prometheus_client's own parser."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            lab = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{lab}}}" if lab else s.name] = s.value
    return out


def serve(app) -> TestServer:
    return TestServer(app, handler_cancellation=True)  # as start_http: a client gone cancels its handler


async def scrape(c: TestClient) -> dict[str, float]:
    r = await c.get("/metrics")
    assert r.status == 200
    return metrics(await r.text())


@pytest.mark.asyncio
async def test_deeply_nested_json_is_a_400(tok):
    """Depth >= 1000 raised RecursionError -> 500."""
    app = OpenAIServer(ScriptedBackend(), tok, ServerConfig()).app()
    deep = "[" * 5000 + "]" * 5000
    async with TestClient(serve(app)) as c:
        for path, body in (
            ("/v1/completions", f'{{"model": "{MODEL}", "prompt": {deep}}}'),
            ("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": {deep}}}]}}'),
            ("/tokenize", f'{{"model": "{MODEL}", "messages": {deep}}}'),
        ):
            r = await c.post(path, data=body, headers={"Content-Type": "application/json"})
            js = await r.json()
            assert r.status == 400, (path, js)
            assert js["error"]["type"] == "invalid_request_error" and "nested" in js["error"]["message"]


@pytest.mark.asyncio
async def test_completions_default_to_16_tokens(tok):
    """/v1/completions without max_tokens stops at 16 tokens, as OpenAI and vLLM do (not without bound)."""
    be = ScriptedBackend(n_tokens=40)
    app = OpenAIServer(be, tok, ServerConfig()).app()
    async with TestClient(serve(app)) as c:
        r = await c.post("/v1/completions", json=COMPLETION)
        js = await r.json()
        assert r.status == 200 and js["usage"]["completion_tokens"] == 16
        assert js["choices"][0]["finish_reason"] == "length"
        await c.post("/v1/completions", json={**COMPLETION, "max_tokens": 3})
        await c.post("/v1/chat/completions", json=CHAT)  # chat: up to the context, as vLLM
    assert [s.max_new_tokens for s in be.subs] == [16, 3, UNLIMITED]


@pytest.mark.asyncio
async def test_finished_streams_count_as_ok(tok):
    """Clients that close the connection right after `[DONE]` were counted as
    disconnected (and cancelled); every one of them was served in full."""
    app = OpenAIServer(ScriptedBackend(n_tokens=3), tok, ServerConfig()).app()
    async with TestClient(serve(app)) as c:
        url = str(c.make_url("/v1/chat/completions"))
        for _ in range(20):
            async with aiohttp.ClientSession() as s, s.post(url, json={**CHAT, "stream": True}) as r:
                assert (await r.read()).endswith(b"data: [DONE]\n\n")
        await asyncio.sleep(0.1)  # the handlers' last steps
        m = await scrape(c)
    assert m['blink_requests_total{endpoint="chat",outcome="ok"}'] == 20
    assert 'blink_requests_total{endpoint="chat",outcome="disconnected"}' not in m
    assert m["blink_cancelled_total"] == 0
    assert m['vllm:request_success_total{finished_reason="length",model_name="tiny-llama"}'] == 20


@pytest.mark.asyncio
async def test_disconnect_mid_stream_counts_as_abort(tok):
    be = ScriptedBackend(n_tokens=1000, delay=0.01)
    app = OpenAIServer(be, tok, ServerConfig()).app()
    async with TestClient(serve(app)) as c:
        url = str(c.make_url("/v1/completions"))
        async with (
            aiohttp.ClientSession() as s,
            s.post(url, json={**COMPLETION, "max_tokens": 500, "stream": True}) as r,
        ):
            await r.content.readline()
        for _ in range(100):
            m = await scrape(c)
            if m.get("blink_cancelled_total"):
                break
            await asyncio.sleep(0.02)
    assert m["blink_cancelled_total"] == 1 and be.active == 0
    assert m['blink_requests_total{endpoint="completions",outcome="disconnected"}'] == 1
    assert m['vllm:request_success_total{finished_reason="abort",model_name="tiny-llama"}'] == 1


@pytest.mark.asyncio
async def test_post_bodies_must_be_json(tok):
    """A cross-origin text/plain POST needs no preflight; it must not run a generation."""
    be = ScriptedBackend()
    app = OpenAIServer(be, tok, ServerConfig()).app()
    body = '{"model": "tiny-llama", "prompt": "hi"}'
    async with TestClient(serve(app)) as c:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {"Content-Type": ctype} if ctype else {}
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
                r = await c.post(path, data=body.encode(), headers=headers, skip_auto_headers=["Content-Type"])
                js = await r.json()
                assert r.status == 415 and js["error"]["code"] == "unsupported_media_type", (ctype, path)
        ok = {"Content-Type": "application/json; charset=utf-8"}
        assert (await c.post("/v1/completions", data=body, headers=ok)).status == 200
    assert len(be.subs) == 1


@pytest.mark.asyncio
async def test_loopback_server_refuses_foreign_host_headers(tok):
    """DNS rebinding. Bound to loopback, Host must name loopback or --allowed-hosts."""
    cases = [
        (ServerConfig(), {"127.0.0.1:8000": 200, "localhost": 200, "[::1]:80": 200, "evil.example": 403}),
        (ServerConfig(allowed_hosts="api.example"), {"api.example:8000": 200, "localhost:1": 200, "b.example": 403}),
        (ServerConfig(allowed_hosts="*"), {"evil.example": 200}),
        (ServerConfig(host="0.0.0.0"), {"anything.example": 200}),  # not loopback: Host is not restricted
        (ServerConfig(host="0.0.0.0", allowed_hosts="a.example"), {"a.example": 200, "b.example:1": 403}),
    ]
    for cfg, want in cases:
        app = OpenAIServer(ScriptedBackend(), tok, cfg).app()
        async with TestClient(serve(app)) as c:
            for host, status in want.items():
                r = await c.get("/v1/models", headers={"Host": host})
                assert r.status == status, (cfg, host)
                if status == 403:
                    assert (await r.json())["error"]["code"] == "host_not_allowed"
            if "evil.example" in want:
                r = await c.post("/v1/completions", json=COMPLETION, headers={"Host": "evil.example"})
                assert r.status == want["evil.example"]


@pytest.mark.asyncio
async def test_metrics_escape_labels_and_carry_vllm_series():
    """/metrics parses with prometheus_client's parser even for a model name with `"` and `\\`,
    and carries vLLM's per-request series."""
    name = 'my "model" \\ v2'
    tok = load_tokenizer("random:tiny-llama", served_name=name)
    app = OpenAIServer(ScriptedBackend(n_tokens=5), tok, ServerConfig()).app()
    async with TestClient(serve(app)) as c:
        body = {"model": name, "prompt": "hi", "max_tokens": 5}
        assert (await c.post("/v1/completions", json=body)).status == 200
        assert (await c.post("/v1/completions", json={**body, "stream": True})).status == 200
        m = await scrape(c)
    lab = f'model_name="{name}"'  # as the parser unescaped it
    assert m[f'vllm:request_success_total{{finished_reason="length",{lab}}}'] == 2
    for series in ("prompt_tokens", "generation_tokens", "queue_time_seconds", "prefill_time_seconds"):
        assert m[f"vllm:request_{series}_count{{{lab}}}"] == 2, series
    assert m[f"vllm:request_decode_time_seconds_count{{{lab}}}"] == 2
    assert m[f"vllm:request_generation_tokens_sum{{{lab}}}"] == 10
    assert m[f'vllm:request_prefill_time_seconds_bucket{{le="0.01",{lab}}}'] == 2  # 3 ms from the handle's timing
    assert m[f"vllm:generation_tokens_total{{{lab}}}"] == m["blink_generation_tokens_total"] == 10
    assert m[f"vllm:kv_cache_usage_perc{{{lab}}}"] == 0.25
    assert m["blink_device_up"] == 1 and m["blink_ring_slots"] == 8
    assert m["blink_device_kv_blocks_total"] == 100


@pytest.mark.asyncio
async def test_request_log_line_and_stats_line(tok, caplog):
    caplog.set_level(logging.INFO, logger="blink.server")
    app = OpenAIServer(ScriptedBackend(n_tokens=4), tok, ServerConfig(), stats_interval_s=0.2).app()
    async with TestClient(serve(app)) as c:
        js = await (await c.post("/v1/completions", json={**COMPLETION, "max_tokens": 4})).json()
        await c.post("/v1/completions", json={**COMPLETION, "max_tokens": 0})
        await asyncio.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records]
    (done,) = [ln for ln in lines if ln.startswith(js["id"])]
    assert "completions ok: prompt " in done and "output 4 tokens" in done and "finish length" in done
    assert "ttft 0.0" in done and "total 0.0" in done
    assert any(" rejected: " in ln for ln in lines)
    stats = [ln for ln in lines if ln.startswith("prompt ") and "tok/s" in ln]
    assert stats and "running 0, waiting 0, KV cache 25.0 %" in stats[0]
    assert any("generation 0.0 tok/s" not in ln for ln in stats)  # the first interval saw the tokens
    assert len([ln for ln in stats if "generation 0.0 tok/s" in ln]) <= 1  # idle: one line, then quiet

    caplog.clear()  # --disable-log-requests / --disable-log-stats
    cfg = ServerConfig(log_requests=False, log_stats=False)
    app = OpenAIServer(ScriptedBackend(), tok, cfg, stats_interval_s=0.05).app()
    async with TestClient(serve(app)) as c:
        await c.post("/v1/completions", json=COMPLETION)
        await asyncio.sleep(0.2)
    assert not [r for r in caplog.records if r.name == "blink.server"]


_FRONTEND = """
import asyncio, sys
from aiohttp.test_utils import TestClient, TestServer
from blink.config import ServerConfig
from blink.dpu import metrics
from blink.dpu.server import OpenAIServer
from blink.dpu.tokenizer import load_tokenizer
from tests.test_dpu_server_ops import ScriptedBackend

folder, index, n, restore = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
metrics.enable_multiprocess(folder, index, restore=restore)

async def main():
    app = OpenAIServer(ScriptedBackend(), load_tokenizer("random:tiny-llama"), ServerConfig()).app()
    async with TestClient(TestServer(app)) as c:
        for _ in range(n):
            assert (await c.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x"})).status == 200
        print((await (await c.get("/metrics")).text()))

asyncio.run(main())
"""


def test_frontends_metrics_add_up_and_survive_a_restart(tmp_path):
    """Frontend processes of one port (prometheus_client multiprocess mode): whichever answers
    counts them all; a restarted frontend continues its counts, a fresh deployment does not."""
    folder = tmp_path / "metrics"

    def frontend(index: int, n: int, restore: bool = False) -> dict[str, float]:
        args = [sys.executable, "-c", _FRONTEND, str(folder), str(index), str(n), "1" if restore else "0"]
        out = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        return metrics(out.stdout)

    ok = 'blink_requests_total{endpoint="completions",outcome="ok"}'
    assert frontend(0, 3)[ok] == 3
    assert frontend(1, 2)[ok] == 5  # frontend 1's scrape counts frontend 0's requests too
    m = frontend(1, 1, restore=True)  # frontend 1 restarted after a crash: continues its 2
    assert m[ok] == 6 and m["vllm:request_success_total" + '{finished_reason="length",model_name="tiny-llama"}'] == 6
    assert m["blink_device_up"] == 1  # the live series once, from the answering frontend
    assert frontend(1, 1)[ok] == 4  # a fresh start of frontend 1: its old counts are gone


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [-1, 512, 2**31 - 1])
async def test_a_token_outside_the_vocabulary_is_an_error_event_not_a_500(tok, bad):
    """A device that publishes an id the tokenizer cannot decode: a 503 (non-streamed) or an error
    event (streamed), never a 500 from the detokenizer; the server goes on serving."""
    app = OpenAIServer(ScriptedBackend(n_tokens=4, bad_token=bad), tok, ServerConfig()).app()
    async with TestClient(serve(app)) as c:
        r = await c.post("/v1/completions", json={**COMPLETION, "max_tokens": 4})
        js = await r.json()
        assert r.status == 503 and "outside the vocabulary" in js["error"]["message"], js
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "stream": True})
        assert r.status == 200
        events = [e for e in (await r.text()).split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and "outside the vocabulary" in events[-2]
        m = await scrape(c)
        assert m['blink_requests_total{endpoint="completions",outcome="error"}'] == 1


@pytest.mark.asyncio
async def test_choices_of_one_request_share_a_group_and_n_is_capped(tok):
    be = ScriptedBackend(n_tokens=2)
    app = OpenAIServer(be, tok, ServerConfig(max_n=3)).app()
    async with TestClient(serve(app)) as c:
        r = await c.post("/v1/completions", json={**COMPLETION, "n": 3, "max_tokens": 2})
        assert r.status == 200
        r = await c.post("/v1/completions", json={**COMPLETION, "max_tokens": 2})
        assert r.status == 200
        r = await c.post("/v1/completions", json={**COMPLETION, "n": 4, "max_tokens": 2})
        js = await r.json()
        assert r.status == 400 and js["error"]["param"] == "n" and "--max-n" in js["error"]["message"]
    groups = [s.group for s in be.subs]
    assert groups[0] == groups[1] == groups[2] == be.subs[0].request_id != 0 and groups[3] == 0
