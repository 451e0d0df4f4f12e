"""The frontend actor's HTTP ingress: blink.dpu's OpenAI server over the data-parallel Router."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from blink.config import BlinkConfig

from .router import Router

if TYPE_CHECKING:
    from blink.dpu.tokenizer import FrontendTokenizer


@dataclass
class HttpIngress:
    url: str
    port: int  # the port bound (frontends after the first bind the same one)
    runner: Any  # aiohttp AppRunner
    server: Any  # blink.dpu.server.OpenAIServer

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_http(
    cfg: BlinkConfig, router: Router, tok: FrontendTokenizer, port: int | None = None, reuse_port: bool = False
) -> HttpIngress:
    """Serve /v1 for every replica behind `router` with the model's tokenizer `tok` (the one whose
    grammar engine the router's trackers hold). port: instead of cfg.server.port; reuse_port: this
    frontend is one of several on the same port (SO_REUSEPORT)."""
    from blink.dpu import server as dpu_server

    srv = dpu_server.OpenAIServer(router, tok, cfg.server)
    want = cfg.server.port if port is None else port
    runner, port = await dpu_server.start_http(srv, cfg.server.host, want, reuse_port=reuse_port)
    return HttpIngress(f"http://{cfg.server.host}:{port}", port, runner, srv)
