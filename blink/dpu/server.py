"""HTTP server role: the OpenAI-compatible API (aiohttp on uvloop) with SSE streaming.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health   GET /metrics
    POST /tokenize   POST /detokenize   GET /version    (vLLM's extensions)
    POST /reset_prefix_cache   (with server.allow_reset_prefix_cache; the API key guards it too)

This module holds the app (routes, the stats line) and the small endpoints. The generation
endpoints are completions.py (one request from its body to its last byte); what every request
passes through before and after its handler (browser safety, the API key, errors in OpenAI's
shape) is middleware.py; what happens to a connection before a handler (the connection limit,
header timeouts, compact logs) is http_edge.py. Prompts are encoded off the event loop when long
(prompt_encoder.py). drain() is the graceful end: no new requests, those in flight get
server.shutdown_timeout_s to finish, then each is ended with an error event.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from blink.config import ServerConfig

from . import openai_api as api
from .completions import CompletionHandler
from .generation import Backend
from .http_edge import IdleReaper, LimitedSite, handler_options, raise_fd_limit
from .metrics import LiveState, Metrics, StatsLine
from .middleware import Middleware, json_response, read_body
from .prompt_encoder import PromptEncoder
from .tokenizer import FrontendTokenizer, PromptError

log = logging.getLogger("blink.server")
_json = msgspec.json.Encoder()
_SLICE = 1 << 16  # token ids JSON-encoded between two turns of the event loop


class OpenAIServer:
    def __init__(
        self, backend: Backend, tokenizer: FrontendTokenizer, config: ServerConfig, stats_interval_s: float = 10.0
    ):
        self.backend = backend
        self.tok = tokenizer
        self.config = config
        self.metrics = Metrics(tokenizer.name, self._live)
        self.stats_interval_s = stats_interval_s
        self.middleware = Middleware(config)
        self.reaper = IdleReaper(config.keep_alive_timeout_s)  # idle connections of start_http's site
        self.encoder = PromptEncoder(tokenizer, config.tokenizer_pool_size)
        self.completion = CompletionHandler(backend, tokenizer, config, self.metrics, self.encoder)
        self._stats_task: asyncio.Task | None = None

    # -- app ----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes,
            middlewares=[self.reaper.track, *self.middleware.middlewares],
        )
        app.on_response_prepare.extend(self.middleware.on_response_prepare)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_post("/tokenize", self.tokenize)  # vLLM's extensions
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        if self.config.log_stats:
            app.on_startup.append(self._stats_start)
            app.on_cleanup.append(self._stats_stop)
        app.on_cleanup.append(self._encoder_stop)
        return app

    async def _encoder_stop(self, app: web.Application) -> None:
        await self.encoder.close()

    async def drain(self, runner: web.AppRunner, timeout_s: float, now: asyncio.Event) -> None:
        """The graceful end: stop listening and answer new requests 503, give the requests in flight
        up to timeout_s (or until `now` is set: a second signal) to finish, then end each of them
        with an error event (a 503 before its headers)."""
        for site in list(runner.sites):
            await site.stop()
        self.middleware.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        said = -1.0
        while self.completion.active and not now.is_set() and (left := deadline - loop.time()) > 0:
            if said < 0 or said - left >= 2:
                said = left
                log.info(
                    "shutting down: waiting up to %.1f s for %d request(s) in flight", left, len(self.completion.active)
                )
            await asyncio.wait([asyncio.ensure_future(now.wait())], timeout=min(left, 0.05))
        if self.completion.active:
            n = self.completion.abort_all("the server is shutting down")
            log.warning("shutting down: ending %d request(s) still in flight with an error", n)
            for _ in range(100):  # their error events go out (a client that does not read: not waited for)
                if not self.completion.active:
                    break
                await asyncio.sleep(0.01)

    async def _stats_start(self, app: web.Application) -> None:
        self._stats_task = asyncio.ensure_future(self._stats_loop())

    async def _stats_loop(self) -> None:
        stats = StatsLine(self.metrics)
        while True:
            await asyncio.sleep(self.stats_interval_s)
            line = stats.line(self._live())
            if line is not None:
                log.info("%s", line)

    async def _stats_stop(self, app: web.Application) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            await asyncio.gather(self._stats_task, return_exceptions=True)

    # -- endpoints ----------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.tok.name,
            "object": "model",
            "created": 0,
            "owned_by": "blink",
            "max_model_len": self.backend.max_context,
        }
        return json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        r = api.parse(api.TokenizeRequest, await read_body(request, self.config.body_read_timeout_s))
        api.check_model(r.model, self.tok.name)
        if (r.prompt is None) == (r.messages is None):
            raise api.APIError(400, "give either prompt or messages", "prompt")
        try:
            if r.messages is not None:
                ids = await self.encoder.chat(r.messages, r.add_generation_prompt, api.chat_template_kwargs(r))
            else:
                ids = await self.encoder.text(r.prompt or "", None if r.add_special_tokens else False)
        except PromptError as e:
            raise api.APIError(400, str(e), e.param) from e
        head = {"count": len(ids), "max_model_len": self.backend.max_context}
        if len(ids) <= _SLICE:
            return json_response({**head, "tokens": ids})
        parts = [_json.encode(head)[:-1], b',"tokens":[']  # a long prompt's ids: encoded in slices
        for i in range(0, len(ids), _SLICE):
            parts += (b"," if i else b"", _json.encode(ids[i : i + _SLICE])[1:-1])
            await asyncio.sleep(0)
        return web.Response(body=b"".join([*parts, b"]}"]), content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        r = api.parse(api.DetokenizeRequest, await read_body(request, self.config.body_read_timeout_s))
        api.check_model(r.model, self.tok.name)
        try:
            self.tok.check_ids(r.tokens, "tokens")
        except PromptError as e:
            raise api.APIError(400, str(e), e.param) from e
        return json_response({"prompt": self.tok.decode(r.tokens)})

    async def version(self, request: web.Request) -> web.Response:
        from blink import __version__

        return json_response({"version": __version__})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.config.allow_reset_prefix_cache:
            raise api.APIError(403, "resetting the prefix cache is not allowed: start the server with "
                               "--allow-reset-prefix-cache", code="not_allowed")  # fmt: skip
        if not self.backend.reset_prefix_cache():
            raise api.APIError(400, "the device has no prefix cache (--no-enable-prefix-caching)")
        log.info("prefix cache reset")
        return json_response({"status": "ok"})

    async def health(self, request: web.Request) -> web.Response:
        h = self.backend.health()
        if h.ok:
            return json_response({"status": "ok"})
        return json_response({"status": "unavailable", "reason": h.message}, status=503)

    def _live(self) -> LiveState:
        b = self.backend
        return LiveState(b.health().ok, b.stats(), b.device_counters(), b.mask_latency(), b.frontend_counters())

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.completion.handle(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.completion.handle(request, chat=False)


async def start_http(server: OpenAIServer, host: str, port: int, reuse_port: bool = False) -> tuple[web.AppRunner, int]:
    """Serve the app; returns the runner (await runner.cleanup() to stop) and the bound port.
    reuse_port: SO_REUSEPORT, so several frontend processes listen on one port and the kernel
    spreads the incoming connections over them."""
    cfg = server.config
    raise_fd_limit(cfg.max_connections)
    runner = web.AppRunner(
        server.app(),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=cfg.shutdown_timeout_s,
        **handler_options(cfg),
    )
    await runner.setup()
    site = LimitedSite(
        runner, host, port, cfg.max_connections, server.reaper, reuse_address=True, reuse_port=reuse_port or None
    )
    await site.start()
    return runner, site.port
