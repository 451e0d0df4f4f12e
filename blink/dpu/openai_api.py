"""OpenAI API shapes: request bodies (typed, validated) and response / chunk objects.

Request bodies decode straight into msgspec Structs, so a wrong type is a 400 naming the field.
Fields OpenAI defines that Blink does not implement (logprobs, penalties, suffix, best_of, ...) are
rejected with a 400 when set to a non-default value, never silently ignored. `n` choices per
prompt and lists of prompts (completions) become one ring request per choice, as in vLLM:
choice index = prompt index * n + i. Unknown
fields are ignored (clients send vendor extensions). Extensions follow vLLM: top_k,
stop_token_ids, ignore_eos, min_tokens, include_stop_str_in_output, skip_special_tokens.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from typing import Any

import msgspec

from blink.protocol.layout import MAX_STOP_IDS, UNLIMITED
from blink.protocol.wire import SubmitRequest


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type_: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far, and a chunk goes out for every
    # token batch even when it decodes to no text yet (clients can time tokens, not text).
    continuous_usage_stats: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    min_tokens: int = 0  # extension
    include_stop_str_in_output: bool = False  # extension
    skip_special_tokens: bool = True  # extension
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's sampling extensions Blink does not implement: declared so that using one is a 400
    # (a silently ignored min_p or repetition_penalty would change outputs without a word)
    min_p: float | None = None
    repetition_penalty: float | None = None
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[Any]
    max_completion_tokens: int | None = None
    # Declared so that asking for them is a 400, not silently unconstrained output:
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a completion prompt, or chat messages through the chat template."""

    model: str
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True  # prompt only: the BOS the model's tokenizer adds


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str
    tokens: list[int]


_decoders = {
    cls: msgspec.json.Decoder(cls) for cls in (ChatRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
}


def parse(cls: type[msgspec.Struct], body: bytes) -> Any:
    try:
        return _decoders[cls].decode(body)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = msg.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in msg else None
        raise APIError(400, msg, param) from e
    except msgspec.DecodeError as e:
        raise APIError(400, f"malformed JSON body: {e}") from e


MAX_STOP_STRINGS = 16
MAX_CHOICES = 256  # choices of one request (prompts x n): each is a ring request of its own


def choices_per_prompt(r: _Sampling, n_prompts: int = 1) -> int:
    """`n`, checked: at least 1, and prompts x n at most MAX_CHOICES."""
    n = 1 if r.n is None else r.n
    if n < 1:
        raise APIError(400, f"n must be at least 1, got {n}", "n")
    if n * n_prompts > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} choices per request (prompts x n), got {n * n_prompts}", "n")
    return n


def sampling_params(
    r: _Sampling, request_id: int, prompt_ids: list[int], stop_ids: list[int], max_tokens: int | None, choice: int = 0
) -> SubmitRequest:
    """Validate the sampling fields; build the ring request of one choice. Defaults follow
    OpenAI/vLLM: temperature 1, top_p 1, no top_k, a random seed when none is given. With a seed,
    choice i samples with seed + i: the choices differ, and the request is reproducible."""
    if r.logprobs or r.top_logprobs:
        raise APIError(400, "logprobs are not supported", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(r, name):
            raise APIError(400, f"{name} is not supported", name)
    if r.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if r.min_p not in (None, 0, 0.0):
        raise APIError(400, "min_p is not supported", "min_p")
    if r.repetition_penalty not in (None, 1, 1.0):
        raise APIError(400, "repetition_penalty is not supported", "repetition_penalty")
    if r.use_beam_search:
        raise APIError(400, "beam search is not supported", "use_beam_search")
    if r.prompt_logprobs:
        raise APIError(400, "prompt_logprobs are not supported", "prompt_logprobs")
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(r, name) is not None:
            raise APIError(400, f"{name} (structured output) is not supported", name)
    if isinstance(r, ChatRequest):
        fmt = (r.response_format or {}).get("type", "text")
        if fmt != "text":
            raise APIError(400, f"response_format {fmt!r} is not supported (structured output)", "response_format")
        if (r.tools or r.functions) and r.tool_choice != "none":
            raise APIError(400, "tool calling is not supported", "tools")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens is not None:
        max_tokens = min(max_tokens, UNLIMITED - 1)  # the device also stops at its context limit
    t = 1.0 if r.temperature is None else r.temperature
    if not (math.isfinite(t) and 0.0 <= t <= 2.0):
        raise APIError(400, f"temperature must be in [0, 2], got {t}", "temperature")
    p = 1.0 if r.top_p is None else r.top_p
    if not (math.isfinite(p) and 0.0 < p <= 1.0):
        raise APIError(400, f"top_p must be in (0, 1], got {p}", "top_p")
    k = 0 if r.top_k in (None, -1) else r.top_k
    if not 0 <= k < 1 << 31:
        raise APIError(400, f"top_k must be >= 0 (or -1 for off), got {k}", "top_k")
    if not 0 <= r.min_tokens < 1 << 31 or (max_tokens is not None and r.min_tokens > max_tokens):
        raise APIError(400, "min_tokens must be in [0, max_tokens]", "min_tokens")
    if len(stop_ids) > MAX_STOP_IDS:
        raise APIError(400, f"at most {MAX_STOP_IDS} stop token ids (EOS included)", "stop_token_ids")
    seed = random.getrandbits(63) if r.seed is None else (r.seed + choice) & 0xFFFFFFFFFFFFFFFF
    return SubmitRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_new_tokens=UNLIMITED if max_tokens is None else max_tokens,
        min_new_tokens=r.min_tokens,
        temperature=t,
        top_p=p,
        top_k=k,
        seed=seed,
        stop_ids=stop_ids,
        greedy=t == 0.0,
    )


def stop_strings(r: _Sampling) -> list[str]:
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    return [s for s in stop if s]


def _token_list(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(x, int) and not isinstance(x, bool) for x in p)


def completion_prompts(r: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: a string, a list of token ids, or a list of either
    (a batch: each prompt gets its own choices)."""
    p = r.prompt
    if isinstance(p, str) or _token_list(p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) or _token_list(x) for x in p):
        if len(p) > MAX_CHOICES:
            raise APIError(400, f"at most {MAX_CHOICES} prompts per request", "prompt")
        return list(p)
    raise APIError(400, "prompt must be a non-empty string, a list of token ids, or a list of those", "prompt")


# -- responses ---------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(n_prompt: int, n_gen: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def chat_response(rid: str, model: str, choices: list[tuple[str, str]], n_prompt: int, n_gen: int) -> dict[str, Any]:
    """choices: (text, finish_reason) per choice index."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            for i, (text, finish) in enumerate(choices)
        ],
        "usage": usage(n_prompt, n_gen),
    }


def completion_response(
    rid: str, model: str, choices: list[tuple[str, str]], n_prompt: int, n_gen: int
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
            for i, (text, finish) in enumerate(choices)
        ],
        "usage": usage(n_prompt, n_gen),
    }


class ChunkMaker:
    """Streaming chunks of one response (chat.completion.chunk or text_completion)."""

    def __init__(self, chat: bool, model: str, include_usage: bool, continuous_usage: int | None = None):
        """continuous_usage: the prompt's token count when every chunk carries usage so far."""
        self.chat = chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        c = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            c["usage"] = None
        return c

    def role(self, index: int = 0) -> dict[str, Any]:
        return self._chunk(
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        )

    def text(self, text: str, finish: str | None = None, n_gen: int = 0, index: int = 0) -> dict[str, Any]:
        """n_gen: the tokens generated so far (all choices), for continuous usage."""
        if self.chat:
            delta = {"content": text} if text else {}
            c = self._chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": finish})
        else:
            c = self._chunk({"index": index, "text": text, "logprobs": None, "finish_reason": finish})
        if self.continuous_usage is not None:
            c["usage"] = usage(self.continuous_usage, n_gen)
        return c

    def usage(self, n_prompt: int, n_gen: int) -> dict[str, Any]:
        c = self._chunk({})
        c["choices"] = []
        c["usage"] = usage(n_prompt, n_gen)
        return c
