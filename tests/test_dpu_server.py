"""The HTTP server's error paths with a backend that misbehaves (in-process aiohttp test server)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from blink.config import ServerConfig
from blink.dpu.request_tracker import DeviceDownError
from blink.dpu.server import OpenAIServer
from blink.dpu.tokenizer import load_tokenizer
from blink.protocol.layout import DeviceStatus
from blink.protocol.wire import DeviceHealth, RingStats


class BrokenBackend:
    """Raises what a data-parallel router may raise outside submit()."""

    def __init__(self) -> None:
        self.error: Exception = DeviceDownError("no replica is serving")

    max_context = 1024

    async def submit(self, req):
        raise AssertionError("not reached")

    def health(self) -> DeviceHealth:
        return DeviceHealth(False, int(DeviceStatus.FAILED), 0, "down")

    def stats(self) -> RingStats:
        return RingStats(0, 0, 0, 0)

    def device_counters(self) -> dict[str, int]:
        return {}

    def mask_latency(self) -> list[int]:
        return []

    def frontend_counters(self) -> dict[str, int]:
        return {}

    def check_prompt(self, n: int) -> str | None:
        raise self.error

    def new_request_id(self) -> int:
        return 1


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("random:tiny-llama")


@pytest.mark.asyncio
async def test_backend_exceptions_become_openai_errors(tok):
    backend = BrokenBackend()
    app = OpenAIServer(backend, tok, ServerConfig()).app()
    async with TestClient(TestServer(app)) as c:
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2}
        r = await c.post("/v1/completions", json=body)
        assert r.status == 503
        assert (await r.json())["error"]["type"] == "server_error"
        backend.error = RuntimeError("a bug")
        r = await c.post("/v1/completions", json=body)
        js = await r.json()
        assert r.status == 500 and "a bug" in js["error"]["message"] and js["error"]["type"] == "server_error"
        r = await c.get("/health")
        assert r.status == 503 and (await r.json())["reason"] == "down"
        r = await c.get("/v1/models")  # still serving
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny-llama"
        r = await c.get("/v1/completions")
        assert r.status == 405 and "error" in await r.json()


@pytest.mark.asyncio
async def test_cors_preflight_and_headers(tok):
    """--allowed-origins: browsers' preflight is answered before auth; every response to an
    allowed origin (errors too) names it; other origins get no CORS headers."""
    cfg = ServerConfig(api_key="k", allowed_origins="https://a.example")
    app = OpenAIServer(BrokenBackend(), tok, cfg).app()
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    async with TestClient(TestServer(app)) as c:
        r = await c.options("/v1/completions", headers={"Origin": "https://a.example", **pre})
        assert r.status == 204
        assert r.headers["Access-Control-Allow-Origin"] == "https://a.example"
        assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        r = await c.options("/v1/completions", headers={"Origin": "https://b.example", **pre})
        assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
        body = {"model": "tiny-llama", "prompt": "x"}
        r = await c.post("/v1/completions", json=body, headers={"Origin": "https://a.example"})
        assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == "https://a.example"
        r = await c.post("/v1/completions", json=body, headers={"Origin": "https://b.example"})
        assert r.status == 401 and "Access-Control-Allow-Origin" not in r.headers
    app = OpenAIServer(BrokenBackend(), tok, ServerConfig(allowed_origins="*")).app()
    async with TestClient(TestServer(app)) as c:
        r = await c.get("/v1/models", headers={"Origin": "https://any.example"})
        assert r.headers["Access-Control-Allow-Origin"] == "*"
    app = OpenAIServer(BrokenBackend(), tok, ServerConfig()).app()  # the default: no CORS at all
    async with TestClient(TestServer(app)) as c:
        r = await c.get("/v1/models", headers={"Origin": "https://any.example"})
        assert "Access-Control-Allow-Origin" not in r.headers


def test_allowed_origins_flag_takes_vllm_json_lists():
    from blink import cli

    a = cli.build_parser().parse_args(["serve", "--allowed-origins", '["https://a.example", "https://b.example"]'])
    assert cli.config_from_args(a).server.origins == {"https://a.example", "https://b.example"}
    a = cli.build_parser().parse_args(["serve", "--allowed-origins", "*"])
    assert cli.config_from_args(a).server.origins == {"*"}
