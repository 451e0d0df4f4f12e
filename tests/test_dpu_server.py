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
