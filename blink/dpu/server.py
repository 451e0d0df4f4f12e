"""HTTP server role: the OpenAI-compatible API (aiohttp on uvloop) with SSE streaming.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health   GET /metrics
    POST /tokenize   POST /detokenize   GET /version    (vLLM's extensions)

A handler tokenizes (tokenizer role), submits through the request tracker (slot tracker + token
reader) and streams text (generation.py: one generation per choice). Every error is
answered in OpenAI's shape with a 4xx/5xx status; the server keeps serving after any of them.
A client that disconnects mid-stream gets its handler cancelled (aiohttp handler_cancellation),
and the `finally` of the generation cancels its ring slot, so the slot is freed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from blink.config import ServerConfig

from . import openai_api as api
from .generation import Backend, GenerationError, TextEvent, stream_text
from .metrics import Metrics, MetricsShare
from .request_tracker import DeviceDownError, QueueFullError, RequestHandle
from .slot_tracker import region_words
from .tokenizer import FrontendTokenizer, PromptError

log = logging.getLogger("blink.server")
_json = msgspec.json.Encoder()
_INLINE_ENCODE_BYTES = 16 << 10  # bodies up to this size are tokenized on the event loop
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIServer:
    def __init__(
        self,
        backend: Backend,
        tokenizer: FrontendTokenizer,
        config: ServerConfig,
        share: MetricsShare | None = None,
        publish_s: float = 1.0,
    ):
        """share: with other frontend processes on this port, /metrics adds their published
        counters to this one's, and this one publishes its own every `publish_s` seconds."""
        self.backend = backend
        self.tok = tokenizer
        self.config = config
        self.metrics = Metrics(tokenizer.name)
        self.share = share
        self.publish_s = publish_s
        self._origins = config.origins  # CORS (parsed once)
        self._publisher: asyncio.Task | None = None
        # one token's text for logprobs (special tokens kept: they were generated)
        self._decode_one = functools.lru_cache(maxsize=1 << 16)(lambda i: tokenizer.decode([i], False))

    # -- app ----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[self._preflight, self._errors, self._auth]
        )
        if self.config.allowed_origins:
            app.on_response_prepare.append(self._cors_headers)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_post("/tokenize", self.tokenize)  # vLLM's extensions (unauthenticated, as there)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        if self.share is not None:
            app.on_startup.append(self._share_start)
            app.on_cleanup.append(self._share_stop)
        return app

    async def _share_start(self, app: web.Application) -> None:
        assert self.share is not None
        # left by this frontend's previous process: its counts, when this is that frontend restarted
        before = self.share.read(self.share.index) if self.share.restore else None
        if before is not None:
            self.metrics.add(before)  # counters continue instead of starting over
        self.share.publish(self.metrics.snapshot())
        self._publisher = asyncio.ensure_future(self._publish_loop())

    async def _publish_loop(self) -> None:
        assert self.share is not None
        while True:
            await asyncio.sleep(self.publish_s)
            try:
                self.share.publish(self.metrics.snapshot())
            except OSError as e:  # /dev/shm full or gone: the scrape of this process still works
                log.warning("metrics not published: %s", e)

    async def _share_stop(self, app: web.Application) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
            await asyncio.gather(self._publisher, return_exceptions=True)
        if self.share is not None:  # a clean stop: nothing to carry over
            self.share.path(self.share.index).unlink(missing_ok=True)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except api.APIError as e:
            return _error_response(e)
        except GenerationError as e:
            return _error_response(api.APIError(e.status, str(e)))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(e.status)
            msg = e.text if e.status != 413 else f"request body exceeds {self.config.max_body_bytes} bytes"
            return _error_response(api.APIError(e.status, msg or e.reason, code=code))
        except DeviceDownError as e:  # raised by the backend outside a submit (e.g. no replica up)
            return _error_response(api.APIError(503, f"device unavailable: {e}"))
        except QueueFullError as e:
            return _error_response(api.APIError(429, f"server busy: {e}", code="rate_limit_exceeded"))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # a bug: answer in the API's shape, keep serving, keep the traceback
            log.exception("%s %s failed", request.method, request.path)
            return _error_response(api.APIError(500, f"internal error: {e!r}"))

    def _origin_allowed(self, request: web.Request) -> str | None:
        """The Access-Control-Allow-Origin value for this request, or None (no CORS headers)."""
        origin = request.headers.get("Origin")
        allowed = self._origins
        if not origin or not allowed:
            return None
        return "*" if "*" in allowed else origin if origin in allowed else None

    @web.middleware
    async def _preflight(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """A browser's CORS preflight (OPTIONS, before any auth): 204 with what may follow."""
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            if self._origin_allowed(request) is None:
                return web.Response(status=403, text="origin not allowed")
            return web.Response(status=204)  # the allow-* headers come from _cors_headers
        return await handler(request)

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        allow = self._origin_allowed(request)
        if allow is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allow
        response.headers["Vary"] = "Origin"
        if request.method == "OPTIONS":
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            want = request.headers.get("Access-Control-Request-Headers")
            response.headers["Access-Control-Allow-Headers"] = want or "Authorization, Content-Type"
            response.headers["Access-Control-Max-Age"] = "600"

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key = self.config.api_key
        if key is not None and request.path.startswith("/v1/"):
            if request.headers.get("Authorization", "") != f"Bearer {key}":
                raise api.APIError(401, "invalid or missing API key", code="invalid_api_key")
        return await handler(request)

    # -- endpoints ----------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.tok.name,
            "object": "model",
            "created": 0,
            "owned_by": "blink",
            "max_model_len": self.backend.max_context,
        }
        return _json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        r = api.parse(api.TokenizeRequest, await request.read())
        self._check_model(r.model)
        if (r.prompt is None) == (r.messages is None):
            raise api.APIError(400, "give either prompt or messages", "prompt")
        try:
            if r.messages is not None:
                ids = self.tok.chat_prompt(r.messages)
            else:
                ids = self.tok.text_ids(r.prompt or "", r.add_special_tokens)
        except PromptError as e:
            raise api.APIError(400, str(e), e.param) from e
        return _json_response({"count": len(ids), "max_model_len": self.backend.max_context, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        r = api.parse(api.DetokenizeRequest, await request.read())
        self._check_model(r.model)
        try:
            self.tok.check_ids(r.tokens, "tokens")
        except PromptError as e:
            raise api.APIError(400, str(e), e.param) from e
        return _json_response({"prompt": self.tok.decode(r.tokens)})

    async def version(self, request: web.Request) -> web.Response:
        from blink import __version__

        return _json_response({"version": __version__})

    def _check_model(self, model: str) -> None:
        if model != self.tok.name:
            raise api.APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    async def health(self, request: web.Request) -> web.Response:
        h = self.backend.health()
        if h.ok:
            return _json_response({"status": "ok"})
        return _json_response({"status": "unavailable", "reason": h.message}, status=503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        st = self.backend.stats()
        ring = {"slots": st.n_slots, "busy_slots": st.busy_slots, "free_slots": st.free_slots, "queued": st.queued}
        peers = self.share.peers() if self.share is not None else []
        text = self.metrics.render(ring, self.backend.device_counters(), self.backend.health().ok, peers)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t0 = time.perf_counter()
        t_http_ns = time.time_ns()
        endpoint = "chat" if chat else "completions"
        try:
            body = await request.read()
            r = api.parse(api.ChatRequest if chat else api.CompletionRequest, body)
            self._check_model(r.model)
            if not chat and r.suffix:
                raise api.APIError(400, "suffix is not supported", "suffix")
            if not chat and (r.best_of or 1) > 1:
                raise api.APIError(400, "best_of is not supported (as in vLLM V1); use n", "best_of")
            prompts = [r.messages] if chat else api.completion_prompts(r)
            n = api.choices_per_prompt(r, len(prompts))
            encoded = [await self._encode(chat, p, len(body)) for p in prompts]
            for ids in encoded:
                why = self.backend.check_prompt(len(ids))
                if why:
                    raise api.APIError(400, why, "messages" if chat else "prompt", "context_length_exceeded")
            max_tokens = r.max_completion_tokens if chat and r.max_completion_tokens is not None else r.max_tokens
            try:
                stop_ids = self.tok.stop_ids(r.stop_token_ids or [], r.ignore_eos)
            except PromptError as e:
                raise api.APIError(400, str(e), e.param) from e
            # choice index = prompt index * n + i (vLLM's order); one ring request each
            vocab = self.tok.info.vocab_size
            subs = [
                api.sampling_params(r, self.backend.new_request_id(), ids, stop_ids, max_tokens, i, vocab)
                for ids in encoded
                for i in range(n)
            ]
            for sub in subs[::n]:
                api.check_features(sub, self.backend.features)
                why = self.backend.check_prompt(len(sub.prompt_ids), region_words(sub))
                if why:
                    raise api.APIError(400, why, "messages" if chat else "prompt", "context_length_exceeded")
            prompt_only = max_tokens == 0  # echo with max_tokens 0: the prompt (and its logprobs) only
            lps = [
                api.ChoiceLogprobs(
                    chat,
                    sub.logprobs,
                    self._decode_one,
                    sub.prompt_ids,
                    not chat and bool(r.echo),
                    -1 if r.prompt_logprobs is None else r.prompt_logprobs,
                )
                for sub in subs
            ]
            stop = api.stop_strings(r)
            # echo: each completion choice starts with its prompt (token prompts decoded)
            echo = not chat and bool(r.echo)
            prefixes = (
                [p if isinstance(p, str) else self.tok.decode(p) for p in prompts for _ in range(n)] if echo else None
            )
        except (api.APIError, web.HTTPException):
            self.metrics.request(endpoint, "rejected")
            raise
        except Exception:  # e.g. the backend has no replica up: answered by the error middleware
            self.metrics.request(endpoint, "error")
            raise
        n_prompt = sum(len(ids) for ids in encoded)  # each prompt counts once, whatever n (as OpenAI's usage)
        self.metrics.prompt_tokens += n_prompt
        handles: list[RequestHandle] = []  # choice 0's, for the first-token trace
        on_submit: list[Callable[[int], None]] = []  # _stream's: told when choice j is submitted

        def submitted(j: int, h: RequestHandle) -> None:
            if j == 0:
                handles.append(h)
            for cb in on_submit:
                cb(j)

        gens = [
            stream_text(
                self.backend,
                self.tok,
                sub,
                stop,
                functools.partial(submitted, j),
                r.include_stop_str_in_output,
                r.skip_special_tokens,
            )
            for j, sub in enumerate(subs)
        ]

        # After the first response byte for this request: where did its first token's time go?
        def trace() -> None:
            self.metrics.first_token(t_http_ns, handles[0].timing if handles else (), time.time_ns())

        include_usage = bool(r.stream_options and r.stream_options.include_usage)
        continuous = bool(r.stream_options and r.stream_options.continuous_usage_stats)
        try:
            if r.stream:
                resp = await self._stream(
                    request,
                    gens,
                    on_submit,
                    chat,
                    n_prompt,
                    include_usage,
                    continuous,
                    t0,
                    trace,
                    prefixes,
                    lps,
                    prompt_only,
                )
            else:
                resp = await self._complete(gens, chat, n_prompt, t0, prefixes, lps, prompt_only)
                trace()
        except (api.APIError, GenerationError) as e:
            self.metrics.request(endpoint, "busy" if getattr(e, "status", 0) == 429 else "error")
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.request(endpoint, "disconnected")
            self.metrics.cancelled += 1
            raise
        finally:
            for g in gens:  # frees the slot of every choice still generating (the pumps are gone)
                await g.aclose()
        self.metrics.request(endpoint, "ok")
        return resp

    async def _encode(self, chat: bool, prompt: Any, body_bytes: int) -> list[int]:
        try:
            if chat:
                encode = functools.partial(self.tok.chat_prompt, prompt)
            else:
                encode = functools.partial(self.tok.completion_prompt, prompt)
            # A long prompt would stall every stream on this event loop while it is encoded;
            # the Rust tokenizer releases the GIL, so a worker thread takes it off the loop.
            return await asyncio.to_thread(encode) if body_bytes > _INLINE_ENCODE_BYTES else encode()
        except PromptError as e:
            raise api.APIError(400, str(e), e.param) from e

    def _observe(self, t0: float, t_prev: float | None, n: int, first: bool = True) -> float:
        """Metrics of `n` new tokens of one choice; `first`: its first token counts as the
        request's time to first token (choice 0 only)."""
        now = time.perf_counter()
        if t_prev is None:
            if first:
                self.metrics.ttft.observe(now - t0)
        elif n:
            gap = (now - t_prev) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self.metrics.generation_tokens += n
        return now

    async def _complete(
        self,
        gens: list[AsyncIterator[TextEvent]],
        chat: bool,
        n_prompt: int,
        t0: float,
        prefixes: list[str] | None = None,
        lps: list[api.ChoiceLogprobs] | None = None,
        prompt_only: bool = False,
    ) -> web.Response:
        async def collect(j: int, gen: AsyncIterator[TextEvent]) -> tuple[str, str, int]:
            parts: list[str] = []
            n_gen, finish, t_prev, first = 0, "stop", None, True
            lp = lps[j] if lps else None
            async for ev in gen:
                if lp is not None and lp.wanted and first:
                    lp.prompt(ev.prompt_logprobs)
                first = False
                if prompt_only:  # the one token the device had to generate is not part of the answer
                    finish = "length"
                    continue
                if ev.n_tokens:
                    t_prev = self._observe(t0, t_prev, ev.n_tokens, j == 0)
                if lp is not None and ev.token_ids:
                    lp.add(ev.token_ids, ev.logprobs)
                parts.append(ev.text)
                n_gen += ev.n_tokens
                finish = ev.finish or finish
            return "".join(parts), finish, n_gen

        if len(gens) == 1:
            results = [await collect(0, gens[0])]
        else:  # every choice at once; the first failure fails the request and stops the others
            tasks = [asyncio.ensure_future(collect(j, g)) for j, g in enumerate(gens)]
            try:
                results = await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        self.metrics.e2e.observe(time.perf_counter() - t0)
        make = api.chat_response if chat else api.completion_response
        rid = api.new_id("chatcmpl" if chat else "cmpl")
        pre = prefixes or [""] * len(results)
        choices = [(p + text, finish) for p, (text, finish, _) in zip(pre, results, strict=True)]
        logprobs = [lp.whole() for lp in lps] if lps and lps[0].gen_n >= 0 else None
        prompt_field = [lp.prompt_field for lp in lps] if lps and lps[0].field_n >= 0 else None
        n_gen = sum(n for _, _, n in results)
        return _json_response(make(rid, self.tok.name, choices, n_prompt, n_gen, logprobs, prompt_field))

    async def _stream(
        self,
        request: web.Request,
        gens: list[AsyncIterator[TextEvent]],
        on_submit: list[Callable[[int], None]],
        chat: bool,
        n_prompt: int,
        include_usage: bool,
        continuous: bool,
        t0: float,
        trace: Callable[[], None],
        prefixes: list[str] | None = None,
        lps: list[api.ChoiceLogprobs] | None = None,
        prompt_only: bool = False,
    ) -> web.StreamResponse:
        """SSE of every choice, interleaved as their tokens arrive (chunks name their index);
        prefixes: the text each choice starts with (echo), sent before its tokens (with echo and
        logprobs: when its first event brings the prompt's logprobs)."""
        chunks = api.ChunkMaker(chat, self.tok.name, include_usage, n_prompt if continuous else None)
        # (choice, kind, payload): "sub" (submitted), "ev" (a TextEvent), "end", "err" (an exception)
        items: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()
        on_submit.append(lambda j: items.put_nowait((j, "sub", None)))

        async def pump(j: int, gen: AsyncIterator[TextEvent]) -> None:
            try:
                async for ev in gen:
                    items.put_nowait((j, "ev", ev))
                items.put_nowait((j, "end", None))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # handed to the response: an error status, or an error event
                items.put_nowait((j, "err", e))

        tasks = [asyncio.ensure_future(pump(j, g)) for j, g in enumerate(gens)]
        try:
            # Before the headers, so that a busy ring (429) or a rejected request still gets a proper
            # HTTP error status: every choice submitted, and choice 0's first event (or its end). A
            # choice queued behind a full ring does not hold the headers back.
            early: list[tuple[int, str, Any]] = []
            started, first = set(), False
            while len(started) < len(gens) or not first:
                j, kind, payload = await items.get()
                if kind == "err":
                    raise payload
                started.add(j)
                first = first or (j == 0 and kind != "sub")
                if kind != "sub":
                    early.append((j, kind, payload))
            resp = web.StreamResponse(headers=_SSE_HEADERS)
            await resp.prepare(request)
            await self._send_stream(
                resp,
                early,
                items,
                len(gens),
                chat,
                chunks,
                n_prompt,
                include_usage,
                continuous,
                t0,
                trace,
                prefixes,
                lps,
                prompt_only,
            )
            return resp
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _send_stream(
        self,
        resp: web.StreamResponse,
        early: list[tuple[int, str, Any]],
        items: asyncio.Queue[tuple[int, str, Any]],
        n_choices: int,
        chat: bool,
        chunks: api.ChunkMaker,
        n_prompt: int,
        include_usage: bool,
        continuous: bool,
        t0: float,
        trace: Callable[[], None],
        prefixes: list[str] | None,
        lps: list[api.ChoiceLogprobs] | None = None,
        prompt_only: bool = False,
    ) -> None:
        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + _json.encode(obj) + b"\n\n")

        n_gen, t_prev = 0, [None] * n_choices
        done = 0
        lps = lps or [None] * n_choices  # type: ignore[list-item]
        waiting_prompt = [lp is not None and lp.wanted for lp in lps]  # first event not seen yet
        deferred = bool(prefixes) and any(lp is not None and lp.echo for lp in lps)
        try:
            if chat:
                for j in range(n_choices):
                    await send(chunks.role(j))
            if not deferred:
                for j, pre in enumerate(prefixes or []):
                    await send(chunks.text(pre, None, 0, j))
            trace()  # headers (and the role chunks) are out: the response's first bytes
            while done < n_choices:
                j, kind, ev = early.pop(0) if early else await items.get()
                if kind == "err":
                    raise ev
                if kind == "sub":
                    continue
                if kind == "end":
                    done += 1
                    continue
                lp = lps[j]
                if waiting_prompt[j]:
                    waiting_prompt[j] = False
                    part = lp.prompt(ev.prompt_logprobs)
                    if deferred and prefixes:
                        await send(chunks.text(prefixes[j], "length" if prompt_only else None, 0, j, part))
                if prompt_only:
                    if not deferred:
                        await send(chunks.text("", "length", n_gen, j))
                    continue
                if ev.n_tokens:
                    t_prev[j] = self._observe(t0, t_prev[j], ev.n_tokens, j == 0)
                n_gen += ev.n_tokens
                part = lp.add(ev.token_ids, ev.logprobs) if lp is not None and ev.token_ids else None
                if ev.finish is not None:
                    if ev.text and chat:
                        await send(chunks.text(ev.text, None, n_gen, j, part))
                        await send(chunks.text("", ev.finish, n_gen, j))
                    else:
                        await send(chunks.text(ev.text, ev.finish, n_gen, j, part))
                elif ev.text or part is not None or (continuous and ev.n_tokens):
                    await send(chunks.text(ev.text, None, n_gen, j, part))
            self.metrics.e2e.observe(time.perf_counter() - t0)
            if include_usage:
                await send(chunks.usage(n_prompt, n_gen))
        except (api.APIError, GenerationError) as e:
            err = e if isinstance(e, api.APIError) else api.APIError(e.status, str(e))
            await send(err.body())
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # headers are out: end the stream with an error event, not a dropped socket
            log.exception("stream failed")
            await send(api.APIError(500, f"internal error: {e!r}").body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(obj), status=status, content_type="application/json")


def _error_response(e: api.APIError) -> web.Response:
    return _json_response(e.body(), status=e.status)


async def start_http(server: OpenAIServer, host: str, port: int, reuse_port: bool = False) -> tuple[web.AppRunner, int]:
    """Serve the app; returns the runner (await runner.cleanup() to stop) and the bound port.
    reuse_port: SO_REUSEPORT, so several frontend processes listen on one port and the kernel
    spreads the incoming connections over them."""
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if port == 0 else port
    return runner, bound
