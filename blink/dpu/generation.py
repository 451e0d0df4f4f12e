"""One generation as text: submit a request through the backend (the request tracker, or the
data-parallel router), turn its token events into text deltas with the incremental detokenizer,
stop strings included, and cancel its ring slot whenever the consumer stops early. The HTTP
server (completions.py) runs one of these per choice of a request."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple, Protocol

from blink.protocol.layout import FinishReason, SlotError
from blink.protocol.wire import DeviceHealth, Logprob, RingStats, SubmitRequest, TokenEvent

from . import openai_api as api
from .request_tracker import DeviceDownError, QueueFullError, RequestHandle, finish_name
from .tokenizer import FrontendTokenizer

log = logging.getLogger("blink.server")


class Backend(Protocol):
    """What the server needs from the ring side (RequestTracker; a data-parallel router may stand in)."""

    async def submit(self, req: SubmitRequest) -> RequestHandle: ...
    def health(self) -> DeviceHealth: ...
    def stats(self) -> RingStats: ...
    def device_counters(self) -> dict[str, int]: ...
    def mask_latency(self) -> list[int]: ...
    def frontend_counters(self) -> dict[str, int]: ...
    def check_prompt(self, n_prompt: int, words: int | None = None) -> str | None: ...
    def new_request_id(self) -> int: ...
    def reset_prefix_cache(self) -> bool: ...

    @property
    def max_context(self) -> int: ...

    @property
    def features(self) -> int: ...


class TextEvent(NamedTuple):
    text: str  # new text (may be "")
    n_tokens: int  # tokens behind it
    finish: str | None  # OpenAI finish_reason on the last event
    token_ids: list[int] = []  # the tokens (when the request asked for logprobs)
    logprobs: list[Logprob] = []  # one per token, when asked for
    prompt_logprobs: list[Logprob] | None = None  # prompt tokens 1.., on the first event, when asked for
    cached_tokens: int = 0  # on the first event: prompt tokens served from the device's prefix cache


def out_of_vocabulary(ev: TokenEvent, vocab_size: int) -> int | None:
    """The first token id of the event outside [0, vocab_size) (its tokens or the ids of its logprob
    records), or None."""
    for ids in (ev.token_ids, *(r.top_ids for r in ev.logprobs), *(r.top_ids for r in ev.prompt_logprobs or ())):
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            return next(t for t in ids if not 0 <= t < vocab_size)
    return None


class GenerationError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def stream_text(
    backend: Backend,
    tok: FrontendTokenizer,
    req: SubmitRequest,
    stop: list[str],
    on_handle: Callable[[RequestHandle], None] | None = None,
    include_stop: bool = False,
    skip_special_tokens: bool = True,
) -> AsyncIterator[TextEvent]:
    """Submit `req` and yield text as tokens arrive. The slot is cancelled if the consumer stops early."""
    try:
        handle = await backend.submit(req)
        if on_handle is not None:
            on_handle(handle)
    except QueueFullError as e:
        raise api.APIError(429, f"server busy: {e}", code="rate_limit_exceeded") from e
    except DeviceDownError as e:
        raise api.APIError(503, f"device unavailable: {e}", type_="server_error") from e
    except ValueError as e:  # the ring cannot take this request (RequestTracker.check_prompt / check_grammar)
        raise api.APIError(400, str(e)) from e
    detok = tok.detokenizer(stop, include_stop, skip_special_tokens)
    try:
        async for ev in handle:
            if ev.finish_reason == FinishReason.ERROR:
                status = 503 if ev.error in (SlotError.DEVICE_FAULT, SlotError.NONE) else 400
                raise GenerationError(status, ev.message or "the device failed the request")
            bad = out_of_vocabulary(ev, tok.info.vocab_size)
            if bad is not None:  # a device fault: never decoded (the detokenizer would raise)
                log.error("request %d: the device returned token id %d, outside the vocabulary", req.request_id, bad)
                raise GenerationError(503, f"the device returned token id {bad}, outside the vocabulary")
            text = detok.push(ev.token_ids)
            lp = (
                (ev.token_ids, ev.logprobs, ev.prompt_logprobs) if ev.logprobs or ev.prompt_logprobs else ([], [], None)
            )
            cached = ev.cached_tokens
            if detok.stopped:
                handle.cancel()  # stop string: the device would keep generating
                yield TextEvent(text, len(ev.token_ids), "stop", *lp, cached)
                return
            if ev.finished:
                yield TextEvent(text + detok.finish(), len(ev.token_ids), finish_name(ev.finish_reason), *lp, cached)
                return
            yield TextEvent(text, len(ev.token_ids), None, *lp, cached)
    finally:
        handle.cancel()  # no-op after the last event; frees the slot when the consumer went away
