"""The generation endpoints (/v1/chat/completions, /v1/completions): one request from its body to
its last byte.

A request is parsed, validated and tokenized into one ring request per choice (request_intake.py),
submitted through the backend's request tracker (slot tracker + token reader) and its text streamed
(generation.py: one generation per choice), as one JSON response or as SSE. A client that disconnects mid-stream gets
its handler cancelled (aiohttp handler_cancellation), and the `finally` of the generation cancels
its ring slot, so the slot is freed; a client gone while its stream is written is one INFO line
(the request's own, outcome "disconnected"), not an error. A request's state is one `Call`; when it
ends, it gives the request's log line and its metrics. abort_all() ends every request in flight
(the server's shutdown): an error event on a stream whose headers are out, a 503 otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from blink.config import ServerConfig

from . import openai_api as api
from .choice_items import OneChoice, next_item
from .generation import Backend, GenerationError, TextEvent, stream_text
from .metrics import Finished, Metrics
from .middleware import json_response, log_safe, read_body
from .openai_logprobs import ChoiceLogprobs
from .openai_responses import ChunkMaker, chat_response, completion_response, new_id
from .prompt_encoder import PromptEncoder
from .request_intake import RequestIntake
from .request_tracker import RequestHandle
from .tokenizer import FrontendTokenizer
from .tool_parsers import Parser, ToolStream

log = logging.getLogger("blink.server")
_json = msgspec.json.Encoder()
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(eq=False)
class Call:
    """One generation request, from its parsed body to its last byte: what the handler, _stream,
    _send_stream and _complete share, and what its log line and metrics are made of."""

    endpoint: str  # "chat" | "completions"
    chat: bool
    t0: float  # perf_counter when the request arrived
    t_http_ns: int  # wall clock then (the device stamps the ring with the same clock)
    rid: str  # the response id (chatcmpl-..., cmpl-...)
    n_prompt: int = 0  # each prompt counts once, whatever n (as OpenAI's usage)
    n_per_prompt: int = 1  # choices per prompt (n)
    cached: list[int] = field(default_factory=list)  # per choice: prompt tokens from the prefix cache
    gens: list[AsyncIterator[TextEvent]] = field(default_factory=list)  # one per choice
    prefixes: list[str] | None = None  # echo: the text each choice starts with
    lps: list[ChoiceLogprobs] = field(default_factory=list)  # per choice
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
    tool_parser: Parser | None = None  # tool calls are parsed out of each choice's text with this
    tool_streams: list[ToolStream] = field(default_factory=list)  # per choice, when tool_parser is set
    disconnected: bool = False  # the client went away while its stream was written
    abort: str | None = None  # abort_all's reason: the handler's cancellation is the server's, not the client's
    stop_matcher: object = None  # the stop strings' automaton, held while the request runs

    @property
    def n_cached(self) -> int:
        """Prompt tokens served from the prefix cache, each prompt once (its first choice's)."""
        return sum(self.cached[:: self.n_per_prompt])

    def submitted(self, j: int, h: RequestHandle) -> None:
        if j == 0:
            self.handles.append(h)
        for cb in self.on_submit:
            cb(j)


class CompletionHandler:
    """`handle(request, chat)`: the handler of both generation endpoints."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: FrontendTokenizer,
        config: ServerConfig,
        metrics: Metrics,
        encoder: PromptEncoder | None = None,
    ):
        self.backend = backend
        self.tok = tokenizer
        self.config = config
        self.metrics = metrics
        self.encoder = encoder or PromptEncoder(tokenizer, config.tokenizer_pool_size)
        self.intake = RequestIntake(backend, tokenizer, config, self.encoder)
        self.active: dict[Call, asyncio.Task] = {}  # requests in flight, by their handler's task
        # one token's text for logprobs (special tokens kept: they were generated)
        self._decode_one = functools.lru_cache(maxsize=1 << 16)(lambda i: tokenizer.decode([i], False))

    async def handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        call = Call(
            endpoint="chat" if chat else "completions",
            chat=chat,
            t0=time.perf_counter(),
            t_http_ns=time.time_ns(),
            rid=new_id("chatcmpl" if chat else "cmpl"),
        )
        task = asyncio.current_task()
        assert task is not None
        self.active[call] = task
        try:
            return await self._handle(request, call)
        except asyncio.CancelledError:
            if call.abort is None or task.uncancel() > 0:
                raise
            raise api.APIError(503, call.abort, code="shutting_down") from None  # before any byte went out
        finally:
            del self.active[call]

    def abort_all(self, reason: str) -> int:
        """End every request in flight (their handlers' tasks are cancelled with `reason`); how many."""
        for call, task in self.active.items():
            if call.abort is None:
                call.abort = reason
                task.cancel()
        return len(self.active)

    async def _handle(self, request: web.Request, call: Call) -> web.StreamResponse:
        try:
            body = await read_body(request, self.config.body_read_timeout_s)
            await self._prepare(call, body, request.headers.get("X-Request-Id"))
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
            outcome = "disconnected" if call.disconnected else "error" if call.error else "ok"
            return resp
        except (api.APIError, GenerationError) as e:
            outcome = "busy" if getattr(e, "status", 0) == 429 else "error"
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            # A client that closes its connection as soon as it has read `[DONE]` may cancel this
            # handler while it is still cleaning up: that request was served in full.
            outcome = "ok" if call.complete else "error" if call.abort else "disconnected"
            call.error = call.error or call.abort
            raise
        finally:
            self._end(call, outcome)
            for g in call.gens:  # frees the slot of every choice still generating (the pumps are gone)
                await g.aclose()

    async def _prepare(self, call: Call, body: bytes, request_id: str | None = None) -> None:
        """Parse, validate and tokenize (request_intake.py); one generation per choice in call.gens (not
        yet started). request_id: the X-Request-Id header, which names the response as in vLLM."""
        chat = call.chat
        r = self.intake.parse(chat, body)
        if request_id or r.request_id:  # vLLM's response id: chatcmpl-<X-Request-Id | request_id>
            call.rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id or r.request_id}"
        x = await self.intake.take(r, chat)
        subs, n, prompts = x.subs, x.n, x.prompts
        call.tool_parser, call.stop_matcher = x.tool_parser, x.stop_matcher
        call.prompt_only = x.max_tokens == 0
        decode = _token_id_name if r.return_tokens_as_token_ids else self._decode_one
        call.lps = [
            ChoiceLogprobs(
                chat,
                sub.sampling.logprobs,
                decode,
                sub.prompt_ids,
                not chat and bool(r.echo),
                -1 if r.prompt_logprobs is None else r.prompt_logprobs,
            )
            for sub in subs
        ]
        if not chat and r.echo:  # each completion choice starts with its prompt (token prompts decoded)
            call.prefixes = [p if isinstance(p, str) else self.tok.decode(p) for p in prompts for _ in range(n)]
        call.n_prompt = sum(len(ids) for ids in x.encoded)
        call.stream = bool(r.stream)
        call.include_usage = bool(r.stream_options and r.stream_options.include_usage)
        call.continuous = bool(r.stream_options and r.stream_options.continuous_usage_stats)
        call.t_prev, call.finish, call.cached = [None] * len(subs), [None] * len(subs), [0] * len(subs)
        call.n_per_prompt = n
        call.gens = [
            stream_text(
                self.backend,
                self.tok,
                sub,
                x.stop,
                functools.partial(call.submitted, j),
                r.include_stop_str_in_output,
                r.skip_special_tokens,
            )
            for j, sub in enumerate(subs)
        ]

    def _trace(self, call: Call) -> None:
        """After the first response byte: where did the first token's time go?"""
        self.metrics.first_token(call.t_http_ns, call.handles[0].timing if call.handles else (), time.time_ns())

    def _observe(self, call: Call, j: int, ev: TextEvent) -> None:
        """The tokens of one event of choice j; choice 0's first is the request's first token."""
        if ev.cached_tokens:
            call.cached[j] = ev.cached_tokens
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

    def _end(self, call: Call, outcome: str) -> None:
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
                log_safe(call.rid),
                call.endpoint,
                outcome,
                call.n_prompt,
                call.n_gen,
                ttft,
                now - call.t0,
                reason,
            )

    def _figures(self, call: Call, now: float, finish: list[str]) -> Finished:
        f = Finished(call.n_prompt, call.n_gen, now - call.t0, finish)
        timing = call.handles[0].timing if call.handles else []
        if len(timing) == 5 and timing[1] and timing[3]:  # wall-clock ns: [submit, admit, launch, first, read]
            f.queue = (timing[1] - call.t_http_ns) * 1e-9
            f.prefill = (timing[3] - timing[1]) * 1e-9
            if call.t_last is not None and call.t_first is not None:
                f.decode = call.t_last - call.t_first
        return f

    async def _complete(self, call: Call) -> web.Response:
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
        pre = call.prefixes or [""] * len(texts)
        choices = [(p + text, f or "stop") for p, text, f in zip(pre, texts, call.finish, strict=True)]
        lps = call.lps
        logprobs = [lp.whole() for lp in lps] if lps[0].gen_n >= 0 else None
        prompt_field = [lp.prompt_field for lp in lps] if lps[0].field_n >= 0 else None
        call.complete = True
        args = (call.rid, self.tok.name, choices, call.n_prompt, call.n_gen, logprobs, prompt_field)
        if not call.chat:
            return json_response(completion_response(*args, cached=call.n_cached))
        calls = None
        if call.tool_parser is not None:
            calls = []
            for j, (text, finish) in enumerate(choices):
                ts = ToolStream(call.tool_parser)
                content = ts.push(text)
                tail, found = ts.finish()
                calls.append([c.openai(i) for i, c in enumerate(found)])
                choices[j] = (content + tail, "tool_calls" if found and finish == "stop" else finish)
        return json_response(chat_response(*args, tool_calls=calls, cached=call.n_cached))

    async def _stream(self, request: web.Request, call: Call) -> web.StreamResponse:
        """SSE of every choice, interleaved as their tokens arrive (chunks name their index);
        echo prefixes go out before each choice's tokens (with echo and logprobs: when its first
        event brings the prompt's logprobs)."""
        # (choice, kind, payload): "sub" (submitted), "ev" (a TextEvent), "end", "err" (an exception)
        items: asyncio.Queue[tuple[int, str, Any]] | OneChoice
        if len(call.gens) == 1:
            # One choice (the common case): its generation is iterated by this handler itself. A
            # pump task would cost each token a second task hop, and a first token would wait
            # behind every other stream's token of the same step before its bytes go out.
            items = OneChoice(call.gens[0])
        else:
            items = asyncio.Queue()
        call.on_submit.append(lambda j: items.put_nowait((j, "sub", None)))

        async def pump(j: int, gen: AsyncIterator[TextEvent]) -> None:
            kind = "ev"
            while kind == "ev":
                kind, x = await next_item(gen)
                items.put_nowait((j, kind, x))

        tasks = (
            [] if isinstance(items, OneChoice) else [asyncio.ensure_future(pump(j, g)) for j, g in enumerate(call.gens)]
        )
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
            try:
                await self._send_stream(resp, call, early, items)
            except ConnectionResetError:  # the client went away: its request's log line says so
                call.disconnected = True
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if call.abort is None or task is None or task.uncancel() > 0:
                    raise
                call.error = call.abort  # abort_all: the stream ends with an error event
                with contextlib.suppress(ConnectionResetError):
                    err = api.APIError(503, call.abort, code="shutting_down").body()
                    await resp.write(b"data: " + _json.encode(err) + b"\n\ndata: [DONE]\n\n")
                    await resp.write_eof()
            return resp
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _send_stream(
        self,
        resp: web.StreamResponse,
        call: Call,
        early: list[tuple[int, str, Any]],
        items: asyncio.Queue[tuple[int, str, Any]] | OneChoice,
    ) -> None:
        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + _json.encode(obj) + b"\n\n")

        chat, n_choices = call.chat, len(call.gens)
        chunks = ChunkMaker(chat, self.tok.name, call.include_usage, call.n_prompt if call.continuous else None)
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
                chunks.cached_tokens = call.n_cached
                n_gen = call.n_gen
                part = lp.add(ev.token_ids, ev.logprobs) if ev.token_ids else None
                text, finish, tool_chunks = self._tool_split(call, chunks, j, ev)
                if finish is not None:
                    if (text or tool_chunks) and chat:
                        await send(chunks.text(text, None, n_gen, j, part))
                        for c in tool_chunks:
                            await send(c)
                        await send(chunks.text("", finish, n_gen, j))
                    else:
                        await send(chunks.text(text, finish, n_gen, j, part))
                elif text or part is not None or (call.continuous and ev.n_tokens):
                    await send(chunks.text(text, None, n_gen, j, part))
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

    @staticmethod
    def _tool_split(call: Call, chunks: ChunkMaker, j: int, ev: TextEvent) -> tuple[str, str | None, list]:
        """(content to send now, the finish reason, tool call chunks) of choice j's event: without
        tools, the event's own; with them, the content outside the calls, and on the last event the
        calls as OpenAI streams them (finish_reason tool_calls)."""
        if call.tool_parser is None:
            return ev.text, ev.finish, []
        if not call.tool_streams:
            call.tool_streams = [ToolStream(call.tool_parser) for _ in call.gens]
        ts = call.tool_streams[j]
        text = ts.push(ev.text)
        if ev.finish is None:
            return text, None, []
        tail, found = ts.finish()
        if not found:
            return text + tail, ev.finish, []
        calls = chunks.tool_calls([c.openai(i) for i, c in enumerate(found)], j)
        return text + tail, "tool_calls" if ev.finish == "stop" else ev.finish, calls


def _token_id_name(i: int) -> str:
    """A token as logprobs name it with return_tokens_as_token_ids (vLLM's form)."""
    return f"token_id:{i}"
