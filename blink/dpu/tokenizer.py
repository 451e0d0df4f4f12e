"""Tokenizer role: chat template, encoding, prompt validation, stop ids; loads no weights.

Wraps `blink.models.tokenizer.Tokenizer`. The frontend needs only the tokenizer and the
model's name and vocabulary, so for a GGUF file it reads the metadata (a memory map, no
dequantisation) instead of resolving the whole model bundle.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from blink.models.tokenizer import Tokenizer

from .detokenizer import IncrementalDetokenizer
from .tool_parsers import template_messages

if TYPE_CHECKING:
    from .structured import Grammars


class PromptError(ValueError):
    """The request's prompt or messages cannot be turned into tokens (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


_ROLES = ("system", "user", "assistant", "tool", "developer")


def _content_text(content: Any, i: int) -> str:
    """OpenAI message content: a string, or a list of parts of which only text is supported."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, Mapping) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise PromptError("only text content parts are supported", f"messages[{i}].content")
            parts.append(p["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise PromptError("content must be a string or a list of text parts", f"messages[{i}].content")


@dataclass(frozen=True)
class ModelInfo:
    name: str  # served model name
    vocab_size: int


class FrontendTokenizer:
    def __init__(self, tokenizer: Tokenizer, info: ModelInfo):
        self.tok = tokenizer
        self.info = info
        self.eos_ids = tuple(tokenizer.eos_token_ids)
        self.grammar_error = ""  # why `grammars` is None

    @property
    def name(self) -> str:
        return self.info.name

    def chat_prompt(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt ids of chat messages through the chat template; template_kwargs: extra
        variables for the template (vLLM's chat_template_kwargs, e.g. enable_thinking)."""
        return self.tok.encode(self.chat_text(messages, add_generation_prompt, template_kwargs), add_bos=False)

    def chat_text(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Chat messages through the chat template, as text (chat_prompt encodes it)."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise PromptError("messages must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise PromptError("each message must be an object", f"messages[{i}]")
            role = m.get("role")
            if role not in _ROLES:
                raise PromptError(f"unknown role {role!r}", f"messages[{i}].role")
            msg = {"role": "system" if role == "developer" else role, "content": _content_text(m.get("content"), i)}
            for k in ("tool_calls", "tool_call_id", "name"):  # tool calling (blink/dpu/tool_parsers.py)
                if m.get(k) is not None:
                    msg[k] = m[k]
            clean.append(msg)
        try:
            return self.tok.apply_chat_template(template_messages(clean), add_generation_prompt, template_kwargs)
        except ValueError as e:
            raise PromptError(str(e), "messages") from e

    def completion_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tok.encode(prompt)
        else:
            ids = list(prompt)
            self.check_ids(ids, "prompt")
        if not ids:
            raise PromptError("the prompt is empty", "prompt")
        return ids

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary [0, {self.info.vocab_size})", param)

    def stop_ids(self, extra: Sequence[int], ignore_eos: bool) -> list[int]:
        """Token ids that end generation: EOS (unless ignore_eos) plus the request's stop_token_ids."""
        bad = next((t for t in extra if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise PromptError(f"stop token id {bad} is outside the vocabulary", "stop_token_ids")
        ids = ([] if ignore_eos else list(self.eos_ids)) + [int(t) for t in extra]
        return list(dict.fromkeys(ids))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def grammars(self) -> Grammars | None:
        """The grammar engine over this tokenizer (structured output), built at first use (~0.5 s);
        None when the engine cannot read this tokenizer (grammar_error says why, and it is logged):
        the model is served without structured output."""
        from .grammar_vocab import engine_tokenizer
        from .structured import Grammars

        try:
            engine = engine_tokenizer(self.tok._tok, self.info.vocab_size, list(self.eos_ids), self.tok.bos_token_id)
        except ValueError as e:  # the engine's reader refuses the tokenizer
            self.grammar_error = f"the grammar engine cannot read this model's tokenizer: {e}"
            logging.getLogger("blink.structured").warning("structured output is off: %s", self.grammar_error)
            return None
        return Grammars(engine, self.info.vocab_size)

    def detokenizer(
        self, stop: Sequence[str] = (), include_stop: bool = False, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """include_stop: a matched stop string stays in the text; skip_special_tokens=False: special
        tokens (EOS, <|im_end|>, ...) come out as their text (vLLM's request options)."""
        decode = self.decode if skip_special_tokens else functools.partial(self.decode, skip_special_tokens=False)
        return IncrementalDetokenizer(decode, stop, include_stop)


def load_tokenizer(
    spec: str | None, served_name: str | None = None, chat_template: str | None = None
) -> FrontendTokenizer:
    """The tokenizer of a model spec (as `blink.models.registry.resolve_model` accepts), without
    weights; `chat_template` (template text) replaces the model's."""
    from blink.models import registry

    s = None if spec is None else os.fspath(spec)
    if s in (None, "", "default", registry.DEFAULT_NAME, registry.DEFAULT_NAME.lower()):
        path = registry.find_default()
        if path is None:
            raise FileNotFoundError(f"{registry.DEFAULT_NAME} is not installed; run `blink pull`")
        tok, info = _from_gguf(path, registry.DEFAULT_NAME)
    elif s.startswith("random:"):
        from blink.models.config import preset

        config = preset(s.removeprefix("random:"))
        tok, info = registry.synthetic_tokenizer(config), ModelInfo(config.name, config.vocab_size)
    else:
        p = pathlib.Path(s).expanduser()
        if p.is_file() and p.suffix == ".gguf":
            tok, info = _from_gguf(p, None)
        elif p.is_dir() and (p / "config.json").is_file():
            import json

            from blink.models.checkpoint_config import from_hf_config
            from blink.models.tokenizer import from_hf_dir

            config = from_hf_config(json.loads((p / "config.json").read_text()), name=p.name)
            tok, info = from_hf_dir(p, config.eos_token_ids), ModelInfo(p.name, config.vocab_size)
        else:
            raise FileNotFoundError(
                f"model {s!r}: expected 'default', a .gguf file, an HF directory, or random:<preset>"
            )
    if served_name:
        info = ModelInfo(served_name, info.vocab_size)
    if chat_template is not None:
        tok.set_chat_template(chat_template)
    return FrontendTokenizer(tok, info)


def _from_gguf(path: pathlib.Path, name: str | None) -> tuple[Tokenizer, ModelInfo]:
    from blink.models.checkpoint_config import from_gguf_metadata as config_from_meta
    from blink.models.gguf_file import GGUFFile
    from blink.models.gguf_weights import gguf_metadata
    from blink.models.tokenizer import from_gguf_metadata

    reader = GGUFFile(path)  # header-only parse: ~0.1 s, vs ~2 s for gguf.GGUFReader's per-string views
    meta = gguf_metadata(reader)
    config = config_from_meta(meta, {t.name for t in reader.tensors}, name=pathlib.Path(path).stem)
    return from_gguf_metadata(meta), ModelInfo(name or config.name, config.vocab_size)
