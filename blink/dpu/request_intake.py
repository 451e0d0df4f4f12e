"""A generation request's intake: from its parsed body to one ring request (SubmitRequest) per choice.

The fields are checked (openai_api), the stop strings bounded and their automaton built, the output
constraint read and compiled (structured, in a grammar thread), the prompts tokenized (prompt_encoder:
long ones off the event loop) and checked against the context and the ring. Whatever the request is
refused for is a 400 naming the field, and comes before anything reaches the ring: a constraint's
400 before its prompt is tokenized. The handler (completions.py) streams what this builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blink.config import ServerConfig
from blink.protocol.wire import SubmitRequest

from . import openai_api as api
from . import stop_matcher, structured
from .generation import Backend
from .prompt_encoder import PromptEncoder
from .slot_tracker import region_words
from .tokenizer import FrontendTokenizer, PromptError
from .tool_parsers import JsonArray, Parser, parser_for


@dataclass
class Intake:
    """A checked request: its prompts (as given, and tokenized), its choices' ring requests (choice
    index = prompt index * n + i, vLLM's order), and what its streams need."""

    prompts: list[Any]
    encoded: list[list[int]]
    subs: list[SubmitRequest]
    n: int  # choices per prompt
    max_tokens: int | None
    stop: list[str]
    stop_matcher: object  # the stop strings' automaton, held while the request runs
    tool_parser: Parser | None  # tool calls are parsed out of each choice's text with this


class RequestIntake:
    """`parse(chat, body)`, then `take(r, chat)`: a request as its ring requests, or a 400."""

    def __init__(self, backend: Backend, tokenizer: FrontendTokenizer, config: ServerConfig, encoder: PromptEncoder):
        self.backend = backend
        self.tok = tokenizer
        self.config = config
        self.encoder = encoder

    @staticmethod
    def parse(chat: bool, body: bytes) -> Any:
        return api.parse(api.ChatRequest if chat else api.CompletionRequest, body)

    async def take(self, r: Any, chat: bool) -> Intake:
        api.check_model(r.model, self.tok.name)
        if not chat and r.suffix:
            raise api.APIError(400, "suffix is not supported", "suffix")
        if not chat and (r.best_of or 1) > 1:
            raise api.APIError(400, "best_of is not supported (as in vLLM V1); use n", "best_of")
        tool_parser = self._tool_parser(api.chat_tools(r)) if chat else None
        prompts = [r.messages] if chat else api.completion_prompts(r)
        n = api.choices_per_prompt(r, len(prompts), self.config.max_n)
        stop = self._stop_strings(r)
        matcher = await stop_matcher.prepare(stop)  # built off the loop's critical path
        grammar = await self._constraint(r)  # a 400 about it comes before the prompt is tokenized
        encoded = [await self._encode(chat, p, r) for p in prompts]
        self._check_context(r, chat, encoded)
        try:
            stop_ids = self.tok.stop_ids(r.stop_token_ids or [], r.ignore_eos)
        except PromptError as e:
            raise api.APIError(400, str(e), e.param) from e
        max_tokens = api.requested_max_tokens(r)
        vocab = self.tok.info.vocab_size
        ids_ = [self.backend.new_request_id() for _ in range(len(encoded) * n)]
        group = ids_[0] if len(ids_) > 1 else 0  # the device caps a group's batch places (slot.group)
        subs = [
            api.sampling_params(r, ids_[j * n + i], ids, stop_ids, max_tokens, i, vocab, group, grammar)
            for j, ids in enumerate(encoded)
            for i in range(n)
        ]
        self._check_subs(subs[::n], chat)
        return Intake(prompts, encoded, subs, n, max_tokens, stop, matcher, tool_parser)

    def _check_context(self, r: Any, chat: bool, encoded: list[list[int]]) -> None:
        """Each prompt fits the context, and so do prompt + an explicit max_tokens (vLLM's 400s)."""
        for ids in encoded:
            why = self.backend.check_prompt(len(ids))
            if why:
                raise api.APIError(400, why, "messages" if chat else "prompt", "context_length_exceeded")
        asked = r.max_completion_tokens if chat and r.max_completion_tokens is not None else r.max_tokens
        limit, n_in = self.backend.max_context, max(len(ids) for ids in encoded)
        if asked is not None and limit and n_in + asked > limit:
            raise api.APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_in + asked} tokens ({n_in} in the {'messages' if chat else 'prompt'}, {asked} in the "
                "completion). Please reduce the length of the messages or completion.",
                "max_tokens",
                "context_length_exceeded",
            )

    def _tool_parser(self, tools: tuple[list[dict], str, str | None] | None) -> Parser | None:
        """How the choices' tool calls are read: none without tools or with tool_choice none; the
        grammar's JSON array for required / named; else the server's parser (auto: by template)."""
        if tools is None or tools[1] == "none":
            return None
        if tools[1] in ("required", "named"):
            return JsonArray()
        return parser_for(self.config.tool_call_parser, self.tok.tok.chat_template)

    async def _constraint(self, r: Any) -> str | None:
        """The request's grammar (openai_api.request_constraint), compiled for this model's tokenizer,
        both in a grammar thread (a schema of megabytes takes a second to read); a 400 quoting the
        engine and naming the field that holds it when it does not compile."""
        if api.constraint_field(r) is None:
            return None
        c = await structured.in_grammar_thread(api.request_constraint, r)
        if c is None:
            return None
        grammar, field = c
        if self.tok.grammars is None:
            raise api.APIError(400, f"structured output is not available: {self.tok.grammar_error}", field)
        why = await self.tok.grammars.prepare(grammar)
        if why:
            raise api.APIError(400, f"the structured output constraint does not compile: {why.strip()}", field)
        return grammar

    def _check_subs(self, subs: list[SubmitRequest], chat: bool) -> None:
        """A 400 for a ring request the device or the ring cannot serve: a feature the device lacks, a
        prompt region larger than a slot's."""
        for sub in subs:
            api.check_features(sub, self.backend.features)
            why = self.backend.check_prompt(len(sub.prompt_ids), region_words(sub))
            if why:
                raise api.APIError(400, why, "messages" if chat else "prompt", "context_length_exceeded")

    async def _encode(self, chat: bool, prompt: Any, r: Any) -> list[int]:
        """A prompt's ids (long ones off the event loop: prompt_encoder.py)."""
        try:
            if chat:
                return await self.encoder.chat(prompt, r.add_generation_prompt, api.chat_template_kwargs(r))
            return await self.encoder.completion(prompt)
        except PromptError as e:
            raise api.APIError(400, str(e), e.param) from e

    def _stop_strings(self, r: Any) -> list[str]:
        """The request's stop strings within server.max_stop_strings and max_stop_string_chars."""
        stop = api.stop_strings(r)
        cfg = self.config
        if len(stop) > cfg.max_stop_strings:
            raise api.APIError(400, f"at most {cfg.max_stop_strings} stop strings", "stop")
        longest = max(map(len, stop), default=0)
        if longest > cfg.max_stop_string_chars:
            raise api.APIError(
                400, f"a stop string is {longest} characters; at most {cfg.max_stop_string_chars}", "stop"
            )
        return stop
