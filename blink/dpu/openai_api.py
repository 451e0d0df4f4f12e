"""OpenAI API requests: the bodies (typed, validated) and the ring requests they become. The
response side is openai_responses.py (response and chunk objects) and openai_logprobs.py.

Request bodies decode straight into msgspec Structs, so a wrong type is a 400 naming the field.
Structured output (response_format, structured_outputs, guided_*) becomes a grammar the frontend
enforces per token (blink/dpu/structured.py); tools go to the chat template and tool calls are parsed
out of the text (blink/dpu/tool_parsers.py). Fields OpenAI defines that Blink does not implement
(functions, suffix, best_of, ...)
are rejected with a 400 when set to a non-default value, never silently ignored. Logprobs,
penalties, min_p and logit_bias are computed on the device (blink/device/sampling.py); a device
that lacks one (header.features) gets those requests refused with a 400 too. `n` choices per
prompt and lists of prompts (completions) become one ring request per choice, as in vLLM:
choice index = prompt index * n + i. A field no struct here declares is a 400 naming it (a
silently ignored field would change the output without a word). Extensions follow vLLM: top_k,
stop_token_ids, ignore_eos, min_tokens, include_stop_str_in_output, skip_special_tokens,
request_id, and for chat add_generation_prompt and chat_template_kwargs (passed to the template).
"""

from __future__ import annotations

import math
import random
import re
from types import EllipsisType
from typing import Any

import msgspec

from blink.protocol.layout import MAX_LOGPROBS, MAX_STOP_IDS, UNLIMITED, DeviceFeatures
from blink.protocol.sampling_params import MAX_LOGIT_BIAS_VALUE, SamplingParams
from blink.protocol.wire import SubmitRequest

from .structured import GrammarError, field_constraint, json_schema_grammar
from .tool_parsers import ToolError, check_tools, required_schema


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


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far, and a chunk goes out for every
    # token batch even when it decodes to no text yet (clients can time tokens, not text).
    continuous_usage_stats: bool = False


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
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
    request_id: str | None = None  # extension: the response id (an X-Request-Id header wins)
    min_p: float | None = None  # extension
    repetition_penalty: float | None = None  # extension
    prompt_logprobs: int | None = None  # extension
    return_tokens_as_token_ids: bool = False  # extension: logprobs name tokens "token_id:ID" (vLLM's)
    # structured output (blink/dpu/structured.py): OpenAI's, vLLM's, and vLLM's older names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # the whitespace a JSON constraint allows (vLLM's older name)
    # vLLM's extensions Blink does not implement: declared so that using one is a 400
    use_beam_search: bool = False


class ChatRequest(_Sampling, kw_only=True):
    messages: list[Any]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True  # extension
    chat_template_kwargs: dict[str, Any] | None = None  # extension: extra variables of the chat template
    # tool calling (blink/dpu/tool_parsers.py); the deprecated `functions` is a 400
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /tokenize: a completion prompt, or chat messages through the chat template."""

    model: str
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True  # prompt only: the BOS the model's tokenizer adds
    add_generation_prompt: bool = True  # messages only
    chat_template_kwargs: dict[str, Any] | None = None  # messages only


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    tokens: list[int]


_decoders = {
    cls: msgspec.json.Decoder(cls) for cls in (ChatRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
}


_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")


def chat_template_kwargs(r: ChatRequest | TokenizeRequest) -> dict[str, Any]:
    """The request's extra chat-template variables, checked: they may not replace what the
    template is given by Blink (messages, the special tokens, add_generation_prompt, tools) nor jinja's
    own `self` (the template's blocks)."""
    kw = dict(r.chat_template_kwargs or {})
    taken = sorted(set(kw) & {"messages", "bos_token", "eos_token", "add_generation_prompt", "tools", "self"})
    if taken:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs")
    if isinstance(r, ChatRequest) and r.tools:
        kw["tools"] = r.tools  # as HF's apply_chat_template(tools=...)
    return kw


def chat_tools(r: ChatRequest) -> tuple[list[dict], str, str | None] | None:
    """The request's (tools, tool_choice: none | auto | required | named, the named function), or
    None without tools; a 400 naming the field when malformed."""
    if r.functions:
        raise APIError(400, "functions (deprecated) is not supported; use tools", "functions")
    if not r.tools:
        if r.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    try:
        return check_tools(r.tools, r.tool_choice)
    except ToolError as e:
        raise APIError(400, str(e), e.param) from e


def parse(cls: type[msgspec.Struct], body: bytes) -> Any:
    try:
        return _decoders[cls].decode(body)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = msg.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in msg else None
        unknown = _UNKNOWN_FIELD.search(msg)
        if unknown:
            where = f"{param}." if param else ""
            param = where + unknown.group(1)
            msg = f"unknown request field {param!r}: Blink does not implement it (remove it from the request)"
        raise APIError(400, msg, param) from e
    except msgspec.DecodeError as e:
        raise APIError(400, f"malformed JSON body: {e}") from e
    except RecursionError as e:  # msgspec's decoder recurses once per nesting level
        raise APIError(400, "JSON body nested too deeply") from e


COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


def requested_max_tokens(r: _Sampling) -> int | None:
    """The output limit a request asks for: chat's max_completion_tokens (else max_tokens; neither:
    up to the context), completions' max_tokens (neither: 16, as OpenAI and vLLM)."""
    if isinstance(r, ChatRequest):
        return r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    return COMPLETION_MAX_TOKENS if r.max_tokens is None else r.max_tokens


MAX_CHOICES = 256  # choices of one request (prompts x n): each is a ring request of its own
DEFAULT_MAX_N = 128  # blink.config.ServerConfig.max_n


def choices_per_prompt(r: _Sampling, n_prompts: int = 1, max_n: int = DEFAULT_MAX_N) -> int:
    """`n`, checked: in [1, max_n] (--max-n), and prompts x n at most MAX_CHOICES."""
    n = 1 if r.n is None else r.n
    if n < 1:
        raise APIError(400, f"n must be at least 1, got {n}", "n")
    if n > max_n:
        raise APIError(400, f"n must be at most {max_n} (the server's --max-n), got {n}", "n")
    if n * n_prompts > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} choices per request (prompts x n), got {n * n_prompts}", "n")
    return n


def logprobs_wanted(r: _Sampling) -> tuple[int, int]:
    """(alternatives per generated token, per prompt token), -1 for none; checked as vLLM does
    (at most MAX_LOGPROBS, vLLM's default --max-logprobs). Completions: `logprobs: N` (with echo,
    the prompt's too); chat: `logprobs: true` with `top_logprobs: N`. Both: vLLM's prompt_logprobs."""
    if isinstance(r, ChatRequest):
        if r.logprobs is not None and not isinstance(r.logprobs, bool):
            raise APIError(400, "logprobs must be a boolean in chat completions (use top_logprobs)", "logprobs")
        if r.top_logprobs is not None and not r.logprobs and r.top_logprobs > 0:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if r.top_logprobs is not None and r.top_logprobs < 0:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {r.top_logprobs}", "top_logprobs")
        gen = (r.top_logprobs or 0) if r.logprobs else -1
        param = "top_logprobs"
    else:
        if isinstance(r.logprobs, bool):
            raise APIError(400, "logprobs must be an integer in completions", "logprobs")
        gen = -1 if r.logprobs is None else r.logprobs
        param = "logprobs"
    if not -1 <= gen <= MAX_LOGPROBS or (gen == -1 and (r.logprobs or 0) < 0):
        raise APIError(400, f"{param} must be in [0, {MAX_LOGPROBS}], got {gen}", param)
    prompt = -1 if r.prompt_logprobs is None else r.prompt_logprobs
    if not -1 <= prompt <= MAX_LOGPROBS:
        raise APIError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt}", "prompt_logprobs")
    if isinstance(r, CompletionRequest) and r.echo and gen >= 0:
        prompt = max(prompt, gen)
    return gen, prompt


def _logit_bias(r: _Sampling) -> tuple[tuple[int, float], ...]:
    out = []
    for key, bias in (r.logit_bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not math.isfinite(bias):
            raise APIError(400, f"logit_bias of token {tok} must be finite", "logit_bias")
        out.append((tok, min(MAX_LOGIT_BIAS_VALUE, max(-MAX_LOGIT_BIAS_VALUE, float(bias)))))  # clamped as in vLLM
    return tuple(out)


def check_features(sub: SubmitRequest, features: int) -> None:
    """A 400 when the request needs something the device does not implement (header.features)."""
    f, sp = DeviceFeatures(features), sub.sampling
    if sp.logprobs >= 0 and not f & DeviceFeatures.LOGPROBS:
        raise APIError(400, "logprobs are not supported by this device", "logprobs")
    if sp.prompt_logprobs >= 0 and not f & DeviceFeatures.PROMPT_LOGPROBS:
        raise APIError(400, "prompt logprobs (echo with logprobs) are not supported by this device", "logprobs")
    if sub.grammar and not f & DeviceFeatures.TOKEN_MASK:
        raise APIError(400, "structured output is not supported by this device", "response_format")
    if not f & DeviceFeatures.PENALTIES:
        for name in ("presence_penalty", "frequency_penalty", "min_p", "logit_bias"):
            if getattr(sp, name):
                raise APIError(400, f"{name} is not supported by this device", name)
        if sp.repetition_penalty != 1.0:
            raise APIError(400, "repetition_penalty is not supported by this device", "repetition_penalty")


def _check_unsupported(r: _Sampling) -> None:
    """400 for the OpenAI / vLLM features Blink does not implement."""
    if r.use_beam_search:
        raise APIError(400, "beam search is not supported", "use_beam_search")


def sampling_params(
    r: _Sampling,
    request_id: int,
    prompt_ids: list[int],
    stop_ids: list[int],
    max_tokens: int | None,
    choice: int = 0,
    vocab_size: int = 1 << 31,
    group: int = 0,
    grammar: str | None | EllipsisType = ...,
) -> SubmitRequest:
    """Validate the sampling fields (their ranges: blink.protocol.sampling_params); build the ring
    request of one choice. Defaults follow OpenAI/vLLM: temperature 1, top_p 1, no top_k, a random
    seed when none is given; a temperature below SAMPLING_EPS is greedy. With a seed, choice i
    samples with seed + i: the choices differ, and the request is reproducible. max_tokens 0
    (completions with echo: the prompt's logprobs only) asks the device for 1 token, which the
    server drops. `group`: the API request's id when it has several choices (slot.group).
    `grammar`: request_constraint(r) when the caller has it already."""
    _check_unsupported(r)
    if grammar is ...:
        c = request_constraint(r)
        grammar = c[0] if c else None
    gen_lp, prompt_lp = logprobs_wanted(r)
    if max_tokens == 0 and not (isinstance(r, CompletionRequest) and r.echo):
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", "max_tokens")
    if max_tokens is not None and max_tokens < 0:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens == 0:
        max_tokens = 1
    if max_tokens is not None:
        max_tokens = min(max_tokens, UNLIMITED - 1)  # the device also stops at its context limit
    if not 0 <= r.min_tokens < 1 << 31 or (max_tokens is not None and r.min_tokens > max_tokens):
        raise APIError(400, "min_tokens must be in [0, max_tokens]", "min_tokens")
    if len(stop_ids) > MAX_STOP_IDS:
        raise APIError(400, f"at most {MAX_STOP_IDS} stop token ids (EOS included)", "stop_token_ids")
    if r.top_k is not None and r.top_k < -1:
        raise APIError(400, f"top_k must be >= 0 (or -1 for off), got {r.top_k}", "top_k")
    sp = SamplingParams(
        temperature=1.0 if r.temperature is None else r.temperature,
        top_p=1.0 if r.top_p is None else r.top_p,
        top_k=0 if r.top_k in (None, -1) else r.top_k,
        min_p=r.min_p or 0.0,
        seed=random.getrandbits(63) if r.seed is None else (r.seed + choice) & 0xFFFFFFFFFFFFFFFF,
        presence_penalty=r.presence_penalty or 0.0,
        frequency_penalty=r.frequency_penalty or 0.0,
        repetition_penalty=1.0 if r.repetition_penalty is None else r.repetition_penalty,
        logit_bias=_logit_bias(r),
        logprobs=gen_lp,
        prompt_logprobs=prompt_lp,
    )
    bad = sp.problem(vocab_size)
    if bad is not None:
        raise APIError(400, bad[1], bad[0])
    return SubmitRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_new_tokens=UNLIMITED if max_tokens is None else max_tokens,
        min_new_tokens=r.min_tokens,
        stop_ids=stop_ids,
        sampling=sp,
        group=group,
        grammar=grammar or "",
    )


_CONSTRAINTS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def constraint_field(r: _Sampling) -> str | None:
    """The first field that asks to constrain the request's output (request_constraint reads them),
    None when none does; cheap: it reads no schema."""
    for n in _CONSTRAINTS:
        if getattr(r, n) is not None:
            return n
    if isinstance(r, ChatRequest) and r.tools and r.tool_choice not in (None, "none", "auto"):
        return "tools"
    return None


def request_constraint(r: _Sampling) -> tuple[str, str] | None:
    """(the grammar that constrains the request's output, the field that holds it), None when
    unconstrained: a structured output field (blink/dpu/structured.py), or for tool_choice
    `required` or a named function the schema of the calls, so they always parse ("tools"). A 400
    naming the field when it is malformed or the engine cannot read it."""
    try:
        found = field_constraint({n: getattr(r, n) for n in (*_CONSTRAINTS, "guided_whitespace_pattern")})
        tools = chat_tools(r) if isinstance(r, ChatRequest) else None
        if tools is not None and tools[1] in ("required", "named"):
            if found:
                raise APIError(400, "tool_choice required or a function excludes response_format", "tool_choice")
            parallel = r.parallel_tool_calls is not False  # type: ignore[attr-defined]
            found = json_schema_grammar(required_schema(tools[0], tools[2], parallel), "tools"), "tools"
    except GrammarError as e:
        raise APIError(400, str(e), e.param) from e
    return found


def stop_strings(r: _Sampling) -> list[str]:
    """The request's non-empty stop strings (their number and length are the server's limits)."""
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
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


def check_model(model: str, served: str) -> None:
    """The request names the model this server serves, or 404 (as OpenAI and vLLM)."""
    if model != served:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
