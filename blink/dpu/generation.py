"""One generation as text: submit a request through the backend (the request tracker, or the
data-parallel router), turn its token events into text deltas with the incremental detokenizer,
stop strings included, and cancel its ring slot whenever the consumer stops early. The HTTP
server (completions.py) runs one of these per choice of a request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import NamedTuple, Protocol

from blink.protocol.layout import FinishReason, SlotError
from blink.protocol.wire import DeviceHealth, Logprob, RingStats, SubmitRequest

from . import openai_api as api
from .request_tracker import DeviceDownError, QueueFullError, RequestHandle, finish_name
from .tokenizer import FrontendTokenizer


class Backend(Protocol):
    """What the server needs from the ring side (RequestTracker; a data-parallel router may stand in)."""

    async def submit(self, req: SubmitRequest) -> RequestHandle: ...
    def health(self) -> DeviceHealth: ...
    def stats(self) -> RingStats: ...
    def device_counters(self) -> dict[str, int]: ...
    def check_prompt(self, n_prompt: int, words: int | None = None) -> str | None: ...
    def new_request_id(self) -> int: ...

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
    detok = tok.detokenizer(stop, include_stop, skip_special_tokens)
    try:
        async for ev in handle:
            if ev.finish_reason == FinishReason.ERROR:
                status = 503 if ev.error in (SlotError.DEVICE_FAULT, SlotError.NONE) else 400
                raise GenerationError(status, ev.message or "the device failed the request")
            text = detok.push(ev.token_ids)
            lp = (ev.token_ids, ev.logprobs, ev.prompt_logprobs) if ev.logprobs or ev.prompt_logprobs else ()
            if detok.stopped:
                handle.cancel()  # stop string: the device would keep generating
                yield TextEvent(text, len(ev.token_ids), "stop", *lp)
                return
            if ev.finished:
                yield TextEvent(text + detok.finish(), len(ev.token_ids), finish_name(ev.finish_reason), *lp)
                return
            yield TextEvent(text, len(ev.token_ids), None, *lp)
    finally:
        handle.cancel()  # no-op after the last event; frees the slot when the consumer went away
