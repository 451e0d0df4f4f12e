"""OpenAI response objects: a whole chat.completion / text_completion, and the streamed chunks of
one (chat.completion.chunk / text_completion), with usage as OpenAI and vLLM give it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(n_prompt: int, n_gen: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached: prompt tokens served from the prefix cache (OpenAI's
    prompt_tokens_details.cached_tokens)."""
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_gen,
        "total_tokens": n_prompt + n_gen,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _response(rid: str, obj: str, model: str, choices: list[dict[str, Any]], n_prompt: int, n_gen: int,
              cached: int = 0, **extra: Any) -> dict[str, Any]:  # fmt: skip
    """The envelope chat and text completions share around their choices."""
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(n_prompt, n_gen, cached),
        **extra,
    }


def chat_response(
    rid: str,
    model: str,
    choices: list[tuple[str, str]],
    n_prompt: int,
    n_gen: int,
    logprobs: list[Any] | None = None,
    prompt_logprobs: list[Any] | None = None,
    tool_calls: list[list[dict[str, Any]]] | None = None,
    cached: int = 0,
) -> dict[str, Any]:
    """choices: (text, finish_reason) per choice index; logprobs: each choice's `logprobs` object;
    tool_calls: each choice's calls (OpenAI tool_call objects; content null when there are some)."""
    return _response(
        rid,
        "chat.completion",
        model,
        [
            {
                "index": i,
                "message": _message(text, tool_calls[i] if tool_calls else []),
                "logprobs": logprobs[i] if logprobs else None,
                "finish_reason": finish,
            }
            for i, (text, finish) in enumerate(choices)
        ],
        n_prompt,
        n_gen,
        cached,
        **({"prompt_logprobs": prompt_logprobs[0]} if prompt_logprobs else {}),
    )


def _message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    if not calls:
        return {"role": "assistant", "content": text}
    calls = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return {"role": "assistant", "content": text.strip() or None, "tool_calls": calls}


def completion_response(
    rid: str,
    model: str,
    choices: list[tuple[str, str]],
    n_prompt: int,
    n_gen: int,
    logprobs: list[Any] | None = None,
    prompt_logprobs: list[Any] | None = None,
    cached: int = 0,
) -> dict[str, Any]:
    return _response(
        rid,
        "text_completion",
        model,
        [
            {
                "index": i,
                "text": text,
                "logprobs": logprobs[i] if logprobs else None,
                "finish_reason": finish,
                **({"prompt_logprobs": prompt_logprobs[i]} if prompt_logprobs else {}),
            }
            for i, (text, finish) in enumerate(choices)
        ],
        n_prompt,
        n_gen,
        cached,
    )


class ChunkMaker:
    """Streaming chunks of one response (chat.completion.chunk or text_completion)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        include_usage: bool,
        continuous_usage: int | None = None,
        rid: str | None = None,
    ):
        """continuous_usage: the prompt's token count when every chunk carries usage so far;
        rid: the response id (default: a new one)."""
        self.chat = chat
        self.id = rid or new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.cached_tokens = 0  # prompt tokens from the prefix cache, once the first tokens tell

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

    def text(
        self, text: str, finish: str | None = None, n_gen: int = 0, index: int = 0, logprobs: Any = None
    ) -> dict[str, Any]:
        """n_gen: the tokens generated so far (all choices), for continuous usage; logprobs: the
        chunk's `logprobs` object (its tokens')."""
        if self.chat:
            delta = {"content": text} if text else {}
            c = self._chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        else:
            c = self._chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
        if self.continuous_usage is not None:
            c["usage"] = usage(self.continuous_usage, n_gen, self.cached_tokens)
        return c

    def tool_calls(self, calls: list[dict[str, Any]], index: int = 0) -> list[dict[str, Any]]:
        """A choice's tool calls as OpenAI streams them: per call, a delta with its index, id, type,
        name and empty arguments, then one with the arguments."""
        out = []
        for c in calls:
            head = {**c, "function": {"name": c["function"]["name"], "arguments": ""}}
            args = {"index": c["index"], "function": {"arguments": c["function"]["arguments"]}}
            for tc in (head, args):
                out.append(self._chunk({"index": index, "delta": {"tool_calls": [tc]}, "logprobs": None,
                                        "finish_reason": None}))  # fmt: skip
        return out

    def usage(self, n_prompt: int, n_gen: int) -> dict[str, Any]:
        c = self._chunk({})
        c["choices"] = []
        c["usage"] = usage(n_prompt, n_gen, self.cached_tokens)
        return c
