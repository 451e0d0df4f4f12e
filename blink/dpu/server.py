"""HTTP server role: the OpenAI-compatible API (aiohttp on uvloop) with SSE streaming.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health   GET /metrics
    POST /tokenize   POST /detokenize   GET /version    (vLLM's extensions)

A handler tokenizes (tokenizer role), submits through the request tracker (slot tracker + token
reader) and streams text (generation.py: one generation per choice). Every error is
answered in OpenAI's shape with a 4xx/5xx status; the server keeps serving after any of them.
A client that disconnects mid-stream gets its handler cancelled (aiohttp handler_cancellation),
and the `finally` of the generation cancels its ring slot, so the slot is freed. A generation
request's state, from its parsed body to its last byte, is one `_Call`; when it ends, it gives
the request's log line and its metrics.

Browser safety: a POST body must be declared application/json (otherwise 415: a page may send
text/plain cross-origin without a preflight), and a server bound to loopback answers only Host
headers naming loopback or server.allowed_hosts (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from blink.config import ServerConfig

from . import openai_api as api
from .generation import Backend, GenerationError, TextEvent, stream_text
from .metrics import Finished, LiveState, Metrics, StatsLine
from .request_tracker import DeviceDownError, QueueFullError, RequestHandle
from .slot_tracker import region_words
from .tokenizer import FrontendTokenizer, PromptError

log = logging.getLogger("blink.server")
_json = msgspec.json.Encoder()
_INLINE_ENCODE_BYTES = 16 << 10  # bodies up to this size are tokenized on the event loop
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """A bind address or Host name that only this machine reaches."""
    h = host.strip("[]").lower()
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The name of a Host header without its port: "a:80" -> "a", "[::1]:80" -> "::1"."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


@dataclass(eq=False)
class _Call:
    """One generation request, from its parsed body to its last byte: what the handler, _stream,
    _send_stream and _complete share, and what its log line and metrics are made of."""

    endpoint: str  # "chat" | "completions"
    chat: bool
    t0: float  # perf_counter when the request arrived
    t_http_ns: int  # wall clock then (the device stamps the ring with the same clock)
    rid: str  # the response id (chatcmpl-..., cmpl-...)
    n_prompt: int = 0  # each prompt counts once, whatever n (as OpenAI's usage)
    gens: list[AsyncIterator[TextEvent]] = field(default_factory=list)  # one per choice
    prefixes: list[str] | None = None  # echo: the text each choice starts with
    lps: list[api.ChoiceLogprobs] = field(default_factory=list)  # per choice
    prompt_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs) only
    stream: bool = False
    include_usage: bool = False
    continuous: bool = False  # vLLM's continuous_usage_stats
    handles: list[RequestHandle] = field(default_factory=list)  # choice 0's, once submitted
    on_submit: list[Callable[[int], None]] = field(default_factory=list)  # told when choice j is submitted
    n_gen: int = 0
    t_first: float | None = None  # perf_counter of choice 0's first token
    t_last: float | None = None  # of the last token of any choice
    t_prev: list[float | None] = field(default_factory=list)  # per choice: its latest tokens' time
    finish: list[str | None] = field(default_factory=list)  # per choice
    complete: bool = False  # the whole response is out: a disconnect after this is not one
    error: str | None = None  # an error event ended the stream

    def submitted(self, j: int, h: RequestHandle) -> None:
        if j == 0:
            self.handles.append(h)
        for cb in self.on_submit:
            cb(j)


class OpenAIServer:
    def __init__(
        self, backend: Backend, tokenizer: FrontendTokenizer, config: ServerConfig, stats_interval_s: float = 10.0
    ):
        self.backend = backend
        self.tok = tokenizer
        self.config = config
        self.metrics = Metrics(tokenizer.name, self._live)
        self.stats_interval_s = stats_interval_s
        self._origins = config.origins  # CORS (parsed once)
        # Host names accepted (None: any); loopback binds accept loopback names by default
        hosts = config.hosts
        self._hosts: frozenset[str] | None = None
        if "*" not in hosts and (hosts or is_loopback(config.host)):
            self._hosts = _LOOPBACK_NAMES | hosts
        self._stats_task: asyncio.Task | None = None
        # one token's text for logprobs (special tokens kept: they were generated)
        self._decode_one = functools.lru_cache(maxsize=1 << 16)(lambda i: tokenizer.decode([i], False))

    # -- app ----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes,
            middlewares=[self._host_check, self._preflight, self._errors, self._auth, self._json_only],
        )
        if self.config.allowed_origins:
            app.on_response_prepare.append(self._cors_headers)
        app.on_response_prepare.append(_echo_request_id)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_post("/tokenize", self.tokenize)  # vLLM's extensions (unauthenticated, as there)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        if self.config.log_stats:
            app.on_startup.append(self._stats_start)
            app.on_cleanup.append(self._stats_stop)
        return app

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

    @web.middleware
    async def _host_check(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 sends
        `Host: evil.example`; a loopback server answers only its own names."""
        host = request.headers.get("Host")
        if self._hosts is not None and host is not None and _host_name(host) not in self._hosts:
            err = api.APIError(403, f"Host {host!r} is not allowed (see --allowed-hosts)", code="host_not_allowed")
            return _error_response(err)
        return await handler(request)

    @web.middleware
    async def _json_only(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """POST bodies are JSON and must say so: a browser sends text/plain (or form) bodies
        cross-origin without a preflight, so accepting them would let any page run generations."""
        if request.method == "POST" and request.content_type != "application/json":
            raise api.APIError(
                415,
                f"Content-Type must be application/json, got {request.headers.get('Content-Type', 'none')!r}",
                code="unsupported_media_type",
            )
        return await handler(request)

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
                ids = self.tok.chat_prompt(r.messages, r.add_generation_prompt, api.chat_template_kwargs(r))
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

    def _live(self) -> LiveState:
        return LiveState(self.backend.health().ok, self.backend.stats(), self.backend.device_counters())

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        call = _Call(
            endpoint="chat" if chat else "completions",
            chat=chat,
            t0=time.perf_counter(),
            t_http_ns=time.time_ns(),
            rid=api.new_id("chatcmpl" if chat else "cmpl"),
        )
        try:
            await self._prepare(call, await request.read(), request.headers.get("X-Request-Id"))
        except (api.APIError, web.HTTPException):
            self._end(call, "rejected")
            raise
        except Exception:  # e.g. the backend has no replica up: answered by the error middleware
            self._end(call, "error")
            raise
        self.metrics.prompt(call.n_prompt)
        outcome = "error"
        try:
            if call.stream:
                resp = await self._stream(request, call)
            else:
                resp = await self._complete(call)
                self._trace(call)
            outcome = "error" if call.error else "ok"
            return resp
        except (api.APIError, GenerationError) as e:
            outcome = "busy" if getattr(e, "status", 0) == 429 else "error"
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            # A client that closes its connection as soon as it has read `[DONE]` may cancel this
            # handler while it is still cleaning up: that request was served in full.
            outcome = "ok" if call.complete else "disconnected"
            raise
        finally:
            self._end(call, outcome)
            for g in call.gens:  # frees the slot of every choice still generating (the pumps are gone)
                await g.aclose()

    async def _prepare(self, call: _Call, body: bytes, request_id: str | None = None) -> None:
        """Parse, validate and tokenize; one generation per choice in call.gens (not yet started).
        request_id: the X-Request-Id header, which names the response as in vLLM."""
        chat = call.chat
        r = api.parse(api.ChatRequest if chat else api.CompletionRequest, body)
        if request_id or r.request_id:  # vLLM's response id: chatcmpl-<X-Request-Id | request_id>
            call.rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id or r.request_id}"
        self._check_model(r.model)
        if not chat and r.suffix:
            raise api.APIError(400, "suffix is not supported", "suffix")
        if not chat and (r.best_of or 1) > 1:
            raise api.APIError(400, "best_of is not supported (as in vLLM V1); use n", "best_of")
        prompts = [r.messages] if chat else api.completion_prompts(r)
        n = api.choices_per_prompt(r, len(prompts))
        encoded = [await self._encode(chat, p, len(body), r) for p in prompts]
        for ids in encoded:
            why = self.backend.check_prompt(len(ids))
            if why:
                raise api.APIError(400, why, "messages" if chat else "prompt", "context_length_exceeded")
        asked = r.max_completion_tokens if chat and r.max_completion_tokens is not None else r.max_tokens
        limit, n_in = self.backend.max_context, max(len(ids) for ids in encoded)
        if asked is not None and limit and n_in + asked > limit:  # an explicit max_tokens: vLLM's 400
            raise api.APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_in + asked} tokens ({n_in} in the {'messages' if chat else 'prompt'}, {asked} in the "
                "completion). Please reduce the length of the messages or completion.",
                "max_tokens",
                "context_length_exceeded",
            )
        try:
            stop_ids = self.tok.stop_ids(r.stop_token_ids or [], r.ignore_eos)
        except PromptError as e:
            raise api.APIError(400, str(e), e.param) from e
        # choice index = prompt index * n + i (vLLM's order); one ring request each
        max_tokens = api.requested_max_tokens(r)
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
        call.prompt_only = max_tokens == 0
        call.lps = [
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
        if not chat and r.echo:  # each completion choice starts with its prompt (token prompts decoded)
            call.prefixes = [p if isinstance(p, str) else self.tok.decode(p) for p in prompts for _ in range(n)]
        call.n_prompt = sum(len(ids) for ids in encoded)
        call.stream = bool(r.stream)
        call.include_usage = bool(r.stream_options and r.stream_options.include_usage)
        call.continuous = bool(r.stream_options and r.stream_options.continuous_usage_stats)
        call.t_prev = [None] * len(subs)
        call.finish = [None] * len(subs)
        call.gens = [
            stream_text(
                self.backend,
                self.tok,
                sub,
                stop,
                functools.partial(call.submitted, j),
                r.include_stop_str_in_output,
                r.skip_special_tokens,
            )
            for j, sub in enumerate(subs)
        ]

    async def _encode(self, chat: bool, prompt: Any, body_bytes: int, r: Any = None) -> list[int]:
        try:
            if chat:
                extra = (r.add_generation_prompt, api.chat_template_kwargs(r)) if r is not None else ()
                encode = functools.partial(self.tok.chat_prompt, prompt, *extra)
            else:
                encode = functools.partial(self.tok.completion_prompt, prompt)
            # A long prompt would stall every stream on this event loop while it is encoded;
            # the Rust tokenizer releases the GIL, so a worker thread takes it off the loop.
            return await asyncio.to_thread(encode) if body_bytes > _INLINE_ENCODE_BYTES else encode()
        except PromptError as e:
            raise api.APIError(400, str(e), e.param) from e

    def _trace(self, call: _Call) -> None:
        """After the first response byte: where did the first token's time go?"""
        self.metrics.first_token(call.t_http_ns, call.handles[0].timing if call.handles else (), time.time_ns())

    def _observe(self, call: _Call, j: int, ev: TextEvent) -> None:
        """The tokens of one event of choice j; choice 0's first is the request's first token."""
        if ev.finish is not None:
            call.finish[j] = ev.finish
        if not ev.n_tokens:
            return
        now = time.perf_counter()
        prev = call.t_prev[j]
        if prev is None and j == 0:
            call.t_first = now
            self.metrics.first(now - call.t0)
        self.metrics.tokens(ev.n_tokens, None if prev is None else now - prev)
        call.t_prev[j] = call.t_last = now
        call.n_gen += ev.n_tokens

    def _end(self, call: _Call, outcome: str) -> None:
        """The request is over: its outcome, its figures, its log line."""
        self.metrics.request(call.endpoint, outcome)
        now = time.perf_counter()
        finish = [f or "stop" for f in call.finish]
        if outcome == "ok":
            self.metrics.finished(self._figures(call, now, finish))
        elif outcome == "disconnected":
            self.metrics.aborted(len(call.gens))
        if self.config.log_requests:
            ttft = "-" if call.t_first is None else f"{call.t_first - call.t0:.3f} s"
            reason = ",".join(finish) if outcome == "ok" else (call.error or outcome)
            log.info(
                "%s %s %s: prompt %d tokens, output %d tokens, ttft %s, total %.3f s, finish %s",
                call.rid,
                call.endpoint,
                outcome,
                call.n_prompt,
                call.n_gen,
                ttft,
                now - call.t0,
                reason,
            )

    def _figures(self, call: _Call, now: float, finish: list[str]) -> Finished:
        f = Finished(call.n_prompt, call.n_gen, now - call.t0, finish)
        timing = call.handles[0].timing if call.handles else []
        if len(timing) == 5 and timing[1] and timing[3]:  # wall-clock ns: [submit, admit, launch, first, read]
            f.queue = (timing[1] - call.t_http_ns) * 1e-9
            f.prefill = (timing[3] - timing[1]) * 1e-9
            if call.t_last is not None and call.t_first is not None:
                f.decode = call.t_last - call.t_first
        return f

    async def _complete(self, call: _Call) -> web.Response:
        async def collect(j: int, gen: AsyncIterator[TextEvent]) -> str:
            parts: list[str] = []
            first, lp = True, call.lps[j]
            async for ev in gen:
                if lp.wanted and first:
                    lp.prompt(ev.prompt_logprobs)
                first = False
                if call.prompt_only:  # the one token the device had to generate is not part of the answer
                    call.finish[j] = "length"
                    continue
                self._observe(call, j, ev)
                if ev.token_ids:
                    lp.add(ev.token_ids, ev.logprobs)
                parts.append(ev.text)
            return "".join(parts)

        if len(call.gens) == 1:
            texts = [await collect(0, call.gens[0])]
        else:  # every choice at once; the first failure fails the request and stops the others
            tasks = [asyncio.ensure_future(collect(j, g)) for j, g in enumerate(call.gens)]
            try:
                texts = await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        make = api.chat_response if call.chat else api.completion_response
        pre = call.prefixes or [""] * len(texts)
        choices = [(p + text, f or "stop") for p, text, f in zip(pre, texts, call.finish, strict=True)]
        lps = call.lps
        logprobs = [lp.whole() for lp in lps] if lps[0].gen_n >= 0 else None
        prompt_field = [lp.prompt_field for lp in lps] if lps[0].field_n >= 0 else None
        call.complete = True
        return _json_response(make(call.rid, self.tok.name, choices, call.n_prompt, call.n_gen, logprobs, prompt_field))

    async def _stream(self, request: web.Request, call: _Call) -> web.StreamResponse:
        """SSE of every choice, interleaved as their tokens arrive (chunks name their index);
        echo prefixes go out before each choice's tokens (with echo and logprobs: when its first
        event brings the prompt's logprobs)."""
        # (choice, kind, payload): "sub" (submitted), "ev" (a TextEvent), "end", "err" (an exception)
        items: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()
        call.on_submit.append(lambda j: items.put_nowait((j, "sub", None)))

        async def pump(j: int, gen: AsyncIterator[TextEvent]) -> None:
            try:
                async for ev in gen:
                    items.put_nowait((j, "ev", ev))
                items.put_nowait((j, "end", None))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # handed to the response: an error status, or an error event
                items.put_nowait((j, "err", e))

        tasks = [asyncio.ensure_future(pump(j, g)) for j, g in enumerate(call.gens)]
        try:
            # Before the headers, so that a busy ring (429) or a rejected request still gets a proper
            # HTTP error status: every choice submitted, and choice 0's first event (or its end). A
            # choice queued behind a full ring does not hold the headers back.
            early: list[tuple[int, str, Any]] = []
            started, first = set(), False
            while len(started) < len(call.gens) or not first:
                j, kind, payload = await items.get()
                if kind == "err":
                    raise payload
                started.add(j)
                first = first or (j == 0 and kind != "sub")
                if kind != "sub":
                    early.append((j, kind, payload))
            resp = web.StreamResponse(headers=_SSE_HEADERS)
            await resp.prepare(request)
            await self._send_stream(resp, call, early, items)
            return resp
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _send_stream(
        self,
        resp: web.StreamResponse,
        call: _Call,
        early: list[tuple[int, str, Any]],
        items: asyncio.Queue[tuple[int, str, Any]],
    ) -> None:
        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + _json.encode(obj) + b"\n\n")

        chat, n_choices = call.chat, len(call.gens)
        chunks = api.ChunkMaker(chat, self.tok.name, call.include_usage, call.n_prompt if call.continuous else None)
        chunks.id = call.rid
        done = 0
        lps, prefixes, prompt_only = call.lps, call.prefixes, call.prompt_only
        waiting_prompt = [lp.wanted for lp in lps]  # first event not seen yet
        deferred = bool(prefixes) and any(lp.echo for lp in lps)
        try:
            if chat:
                for j in range(n_choices):
                    await send(chunks.role(j))
            if not deferred:
                for j, pre in enumerate(prefixes or []):
                    await send(chunks.text(pre, None, 0, j))
            self._trace(call)  # headers (and the role chunks) are out: the response's first bytes
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
                    call.finish[j] = "length"
                    if not deferred:
                        await send(chunks.text("", "length", call.n_gen, j))
                    continue
                self._observe(call, j, ev)
                n_gen = call.n_gen
                part = lp.add(ev.token_ids, ev.logprobs) if ev.token_ids else None
                if ev.finish is not None:
                    if ev.text and chat:
                        await send(chunks.text(ev.text, None, n_gen, j, part))
                        await send(chunks.text("", ev.finish, n_gen, j))
                    else:
                        await send(chunks.text(ev.text, ev.finish, n_gen, j, part))
                elif ev.text or part is not None or (call.continuous and ev.n_tokens):
                    await send(chunks.text(ev.text, None, n_gen, j, part))
            if call.include_usage:
                await send(chunks.usage(call.n_prompt, call.n_gen))
        except (api.APIError, GenerationError) as e:
            err = e if isinstance(e, api.APIError) else api.APIError(e.status, str(e))
            call.error = err.message
            await send(err.body())
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # headers are out: end the stream with an error event, not a dropped socket
            log.exception("stream failed")
            call.error = f"internal error: {e!r}"
            await send(api.APIError(500, call.error).body())
        await resp.write(b"data: [DONE]\n\n")
        call.complete = True
        await resp.write_eof()


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """A client's X-Request-Id comes back on the response (every endpoint, errors and streams too)."""
    rid = request.headers.get("X-Request-Id")
    if rid:
        response.headers["X-Request-Id"] = rid


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
    return runner, runner.addresses[0][1]
