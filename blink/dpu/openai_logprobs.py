"""The logprobs fields of OpenAI responses, built as a choice's tokens arrive: chat's
`logprobs.content`, a completion's `logprobs` (tokens, token_logprobs, top_logprobs, text_offset;
with echo, the prompt's tokens first) and vLLM's `prompt_logprobs`. The records come from the
device (blink.protocol.wire.Logprob); token texts from the server's one-token decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from blink.protocol.wire import Logprob

DecodeOne = Callable[[int], str]
_MIN_LOGPROB = -9999.0  # what -inf becomes in JSON (as vLLM / OpenAI)


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def chat_logprobs(ids: Sequence[int], lps: Sequence[Logprob], n_top: int, decode: DecodeOne) -> list[dict[str, Any]]:
    """The `logprobs.content` entries of chat tokens (OpenAI's shape: token, logprob, bytes, top_logprobs)."""
    out = []
    for tok, lp in zip(ids, lps, strict=True):
        text = decode(tok)
        top = [
            {"token": (t := decode(i)), "logprob": _lp(v), "bytes": list(t.encode())}
            for i, v in zip(lp.top_ids[:n_top], lp.top_logprobs[:n_top], strict=True)
        ]
        out.append({"token": text, "logprob": _lp(lp.logprob), "bytes": list(text.encode()), "top_logprobs": top})
    return out


class CompletionLogprobs:
    """A completion choice's `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset),
    built up as tokens arrive. top_logprobs maps token text to logprob: the chosen token and the
    n_top most likely (vLLM's shape: up to n_top + 1 entries); the first prompt token has None."""

    def __init__(self, n_top: int, decode: DecodeOne, offset: int = 0):
        self.n_top, self.decode, self.offset = n_top, decode, offset

    def add(self, ids: Sequence[int], lps: Sequence[Logprob | None]) -> dict[str, Any]:
        """The object for these tokens (text offsets continue from the previous call)."""
        d: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, lp in zip(ids, lps, strict=True):
            text = self.decode(tok)
            d["tokens"].append(text)
            d["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:
                d["token_logprobs"].append(None)
                d["top_logprobs"].append(None)
                continue
            d["token_logprobs"].append(_lp(lp.logprob))
            top = {text: _lp(lp.logprob)}
            for i, v in zip(lp.top_ids[: self.n_top], lp.top_logprobs[: self.n_top], strict=True):
                top.setdefault(self.decode(i), _lp(v))
            d["top_logprobs"].append(top)
        return d


def merge_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k] += p[k]
    return out


def prompt_logprobs_field(
    ids: Sequence[int], lps: Sequence[Logprob], n_top: int, decode: DecodeOne
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then {token id: {logprob,
    decoded_token}} holding the prompt token and the n_top most likely."""
    out: list[dict[str, Any] | None] = [None]
    for tok, lp in zip(ids[1:], lps, strict=True):
        d = {str(tok): {"logprob": _lp(lp.logprob), "decoded_token": decode(tok)}}
        for i, v in zip(lp.top_ids[:n_top], lp.top_logprobs[:n_top], strict=True):
            d.setdefault(str(i), {"logprob": _lp(v), "decoded_token": decode(i)})
        out.append(d)
    return out


class ChoiceLogprobs:
    """One choice's logprob objects as its tokens arrive: `add` gives a streamed chunk's, `whole`
    the response's. gen_n: alternatives per generated token (-1: none asked); echo_ids: the prompt
    of a completion with echo (its tokens come first, the first one scored None); field_n: vLLM's
    `prompt_logprobs` (-1: not asked)."""

    def __init__(
        self,
        chat: bool,
        gen_n: int,
        decode: DecodeOne,
        prompt_ids: Sequence[int],
        echo: bool = False,
        field_n: int = -1,
    ):
        self.chat, self.gen_n, self.decode = chat, gen_n, decode
        self.prompt_ids, self.echo, self.field_n = list(prompt_ids), echo and gen_n >= 0, field_n
        self._comp = None if chat or gen_n < 0 else CompletionLogprobs(gen_n, decode)
        self._parts: list[Any] = []
        self.prompt_field: list[Any] | None = None

    @property
    def wanted(self) -> bool:
        return self.gen_n >= 0 or self.field_n >= 0

    def prompt(self, plps: Sequence[Logprob] | None) -> Any:
        """The prompt's records arrived (first event): the echo part's object (completions)."""
        plps = list(plps or [])
        if self.field_n >= 0:
            self.prompt_field = prompt_logprobs_field(self.prompt_ids, plps, self.field_n, self.decode)
        if not self.echo or self._comp is None:
            return None
        part = self._comp.add(self.prompt_ids, [None, *plps])
        self._parts.append(part)
        return part

    def add(self, ids: Sequence[int], lps: Sequence[Logprob]) -> Any:
        """Generated tokens: their object (None when the request did not ask for logprobs)."""
        if self.gen_n < 0:
            return None
        if self.chat:
            part: Any = {"content": chat_logprobs(ids, lps, self.gen_n, self.decode)}
        else:
            assert self._comp is not None
            part = self._comp.add(ids, lps)
        self._parts.append(part)
        return part

    def whole(self) -> Any:
        if self.gen_n < 0:
            return None
        if self.chat:
            return {"content": [c for p in self._parts for c in p["content"]]}
        return merge_completion_logprobs(self._parts)
