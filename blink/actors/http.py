"""The frontend actor's HTTP ingress: blink.dpu's OpenAI server over the data-parallel Router."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blink.config import BlinkConfig

from .router import Router


@dataclass
class HttpIngress:
    url: str
    port: int  # the port bound (frontends after the first bind the same one)
    runner: Any  # aiohttp AppRunner
    server: Any  # blink.dpu.server.OpenAIServer

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_http(
    cfg: BlinkConfig, router: Router, port: int | None = None, reuse_port: bool = False
) -> HttpIngress:
    """Load the tokenizer (no weights) and serve /v1 for every replica behind `router`.
    port: instead of cfg.server.port; reuse_port: this frontend is one of several on the same
    port (SO_REUSEPORT)."""
    from blink.dpu import server as dpu_server
    from blink.dpu.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.model.spec, cfg.model.name, cfg.model.chat_template)
    srv = dpu_server.OpenAIServer(router, tok, cfg.server)
    want = cfg.server.port if port is None else port
    runner, port = await dpu_server.start_http(srv, cfg.server.host, want, reuse_port=reuse_port)
    return HttpIngress(f"http://{cfg.server.host}:{port}", port, runner, srv)
