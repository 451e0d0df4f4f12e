"""Structured output: a request's constraint (OpenAI `response_format`, vLLM `structured_outputs` and
the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`) as a grammar of the
engine (llguidance, docs/decisions.md), checked against the model's tokenizer once per distinct
grammar (a cache), and the matcher that follows a request's tokens and fills the allowed-token
bitmask of its next position (blink/dpu/token_masks.py writes it into the ring).

A grammar is carried as llguidance's grammar text (a JSON TopLevelGrammar or Lark), so a ring
request (SubmitRequest.grammar) stays plain data. An invalid schema, regex or grammar is a 400 that
names the field and quotes the engine's reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
import numpy as np

# the engine's JSON options: no free whitespace (a model left free to emit whitespace can loop on it)
_JSON_DEFAULTS = {"whitespace_flexible": False}
_CACHE = 512  # distinct grammars kept compiled
# and at most this much grammar text among them: a compiled grammar takes ~70 bytes a byte of its
# text when large (7.8 MB for a 3,000-field schema), ~94 KB when small (docs/decisions.md)
_CACHE_TEXT = 2 << 20
_T = TypeVar("_T")


def grammar_threads() -> int:
    """Grammar threads: half the cores this process may run on (1 to 8), as vLLM sizes its grammar
    compiler's pool; the rest stay with the event loop and the token reader."""
    return max(1, min(len(os.sched_getaffinity(0)) // 2, 8))


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


async def in_grammar_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """fn(*args) in a grammar thread: the work of a request's constraint (reading its schema, converting
    it, compiling it: up to seconds for a body of megabytes) stays off the event loop, and at most
    grammar_threads() such jobs run at once however many requests bring new grammars (a compile may
    hold a hundred megabytes while it runs). Python work there still takes the GIL, in slices."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(grammar_threads(), thread_name_prefix="blink-grammar")
    return await asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)


class TextCache:
    """A thread-safe map from a text to a value, the least recently used entry dropped past `items`
    entries or past `size` bytes in all (each entry counts the size it is put with)."""

    def __init__(self, items: int, size: int):
        self.items, self.size = items, size
        self._d: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Any | None:
        with self._lock:
            hit = self._d.get(key)
            if hit is None:
                return None
            self._d.move_to_end(key)
            return hit[0]

    def put(self, key: str, value: Any, size: int) -> None:
        with self._lock:
            if key in self._d:
                return
            self._d[key] = (value, size)
            self._held += size
            while len(self._d) > self.items or (self._held > self.size and len(self._d) > 1):
                _, (_, n) = self._d.popitem(last=False)
                self._held -= n


class GrammarError(ValueError):
    """A constraint the engine cannot use (HTTP 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _engine():
    import llguidance

    return llguidance


def json_schema_grammar(schema: Any, param: str, options: Mapping[str, Any] | None = None) -> str:
    """The grammar of a JSON schema (an object, or its JSON text); options: the engine's JSON options the
    request asks for (json_options), over Blink's defaults and under the schema's own x-guidance."""
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError as e:
            raise GrammarError(f"{param} is not valid JSON: {e}", param) from e
        except RecursionError as e:  # the decoder recurses once a level
            raise GrammarError(f"{param}: the schema is nested too deeply", param) from e
    if schema is True:
        schema = {}  # any JSON value
    if schema is False:
        raise GrammarError(f"{param}: the schema false admits no value", param)
    if not isinstance(schema, Mapping):
        raise GrammarError(f"{param} must be a JSON schema object", param)
    why = _unfit(schema)
    if why is not None:
        raise GrammarError(f"{param}: the schema {why}", param)
    return schema_grammar(schema, options)


def schema_grammar(schema: Mapping[str, Any], options: Mapping[str, Any] | None = None) -> str:
    """The engine's grammar of a JSON schema object: what LLMatcher.grammar_from_json_schema(schema,
    defaults={**_JSON_DEFAULTS, **options}) gives (the options under the schema's "x-guidance", its own
    over the defaults), in one msgspec encode: the engine's conversion holds the GIL for ~40 ms a
    megabyte of schema, this about 1 ms."""
    defaults = {**_JSON_DEFAULTS, **(options or {})}
    own = schema.get("x-guidance")
    merged = {**defaults, **own} if isinstance(own, Mapping) else defaults
    top = {"grammars": [{"name": "json_schema", "json_schema": {**schema, "x-guidance": merged}}]}
    return msgspec.json.encode(top).decode()


def json_options(disable_any_whitespace: Any, whitespace_pattern: Any, param: str) -> dict[str, Any]:
    """The engine's JSON options from vLLM's request fields: disable_any_whitespace (false: whitespace
    allowed between tokens, as vLLM's default; Blink's default allows none, docs/decisions.md) and
    whitespace_pattern (a regex of the whitespace allowed there). Only the fields given count."""
    options: dict[str, Any] = {}
    if disable_any_whitespace is not None:
        if not isinstance(disable_any_whitespace, bool):
            raise GrammarError(f"{param}.disable_any_whitespace must be a boolean", param)
        options["whitespace_flexible"] = not disable_any_whitespace
    if whitespace_pattern is not None:
        if not isinstance(whitespace_pattern, str):
            raise GrammarError(f"{param}: the whitespace pattern must be a string (a regex)", param)
        options["whitespace_pattern"] = whitespace_pattern
    return options


_EXACT = 1 << 53  # the integers a 64-bit float holds exactly: |n| <= 2^53
# The deepest object or array a schema may hold (the schema itself is level 0): the engine's JSON reader
# refuses objects and arrays nested 128 deep, and its grammar holds the schema inside 3 of them
# (schema_grammar). Refused before the schema is encoded (msgspec's encoder recurses once a level), with
# the field named.
_MAX_DEPTH = 128 - 3 - 2
_NUMERIC_KEYWORDS = ("const", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _unfit(schema: Any) -> str | None:
    """Why the engine cannot read `schema` exactly, or None: nested deeper than its JSON reader goes,
    or an integer beyond 2^53 under a numeric keyword (const and enum values searched through).
    Iterative: a schema as deep as the request body may be must not exhaust Python's stack."""
    stack: list[tuple[Any, str, int]] = [(schema, "", 0)]
    while stack:
        node, key, depth = stack.pop()
        if depth > _MAX_DEPTH and isinstance(node, Mapping | list):
            return f"is nested deeper than {_MAX_DEPTH} levels (past the grammar engine's recursion limit)"
        if isinstance(node, bool):
            continue
        if isinstance(node, int):
            if key in _NUMERIC_KEYWORDS and abs(node) > _EXACT:
                return (
                    f"{key} holds the integer {node}, beyond 2^53: the grammar engine reads a schema's numbers "
                    "as 64-bit floats and would produce another number"
                )
        elif isinstance(node, Mapping):
            stack += [(v, key if key in ("const", "enum") else str(k), depth + 1) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, key, depth + 1) for v in node]
    return None


def regex_grammar(pattern: Any, param: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(f"{param} must be a non-empty string", param)
    try:
        return _engine().LLMatcher.grammar_from_regex(ascii_digit_classes(pattern))
    except ValueError as e:
        raise GrammarError(f"{param}: {e}", param) from e


def ascii_digit_classes(pattern: str) -> str:
    """`pattern` with \\d as [0-9] and \\D as [^0-9] (in a class, \\d as 0-9; \\D there is left as is):
    the meaning of JSON Schema's ECMA-262 patterns and of vLLM's grammar engines, where the engine's own
    \\d is Unicode's decimal digits (a model would fill a phone number with Osmanya digits)."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            if e == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif e == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def choice_grammar(choices: Any, param: str) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str | int | float) for c in choices):
        raise GrammarError(f"{param} must be a non-empty list of strings", param)
    return "start: " + " | ".join(json.dumps(str(c)) for c in choices)


def lark_grammar(text: Any, param: str) -> str:
    """Lark (llguidance's syntax); a GBNF grammar (`::=` rules, llama.cpp / xgrammar) is converted."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{param} must be a non-empty grammar", param)
    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return gbnf_to_lark(text)
        except Exception as e:  # the converter's parse errors
            raise GrammarError(f"{param}: {e}", param) from e
    return text


_KINDS = {
    "json": json_schema_grammar,
    "regex": regex_grammar,
    "choice": choice_grammar,
    "grammar": lark_grammar,
}


def _response_format(fmt: Any, options: Mapping[str, Any]) -> str | None:
    param = "response_format"
    if not isinstance(fmt, Mapping):
        raise GrammarError("response_format must be an object", param)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, param, options)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError("response_format.json_schema must be an object", param)
        # OpenAI's field is `schema`; a json_schema without one allows any JSON value
        return json_schema_grammar(spec.get("schema", {}), "response_format.json_schema.schema", options)
    raise GrammarError(f"response_format type {kind!r}; expected text, json_object or json_schema", param)


def _structured_outputs(so: Any) -> str | None:
    param = "structured_outputs"
    if not isinstance(so, Mapping):
        raise GrammarError("structured_outputs must be an object", param)
    kinds = ("json", "regex", "choice", "grammar")
    given = [k for k in kinds if so.get(k) is not None] + (["json_object"] if so.get("json_object") else [])
    options = {"json_object", "disable_fallback", "disable_any_whitespace", "whitespace_pattern"}
    unknown = set(so) - set(kinds) - options
    if unknown:
        raise GrammarError(f"structured_outputs: unknown field(s) {sorted(unknown)}", param)
    if len(given) > 1:
        raise GrammarError(f"structured_outputs: only one of {given} may be set", param)
    if not given:
        return None
    options = json_options(so.get("disable_any_whitespace"), so.get("whitespace_pattern"), param)
    if given[0] == "json_object":
        return json_schema_grammar({"type": "object"}, param, options)
    if given[0] == "json":
        return json_schema_grammar(so["json"], f"{param}.json", options)
    return _KINDS[given[0]](so[given[0]], f"{param}.{given[0]}")


def request_grammar(fields: Mapping[str, Any]) -> str | None:
    """The grammar text a request's fields ask for (None: unconstrained); see field_constraint."""
    c = field_constraint(fields)
    return c[0] if c else None


def field_constraint(fields: Mapping[str, Any]) -> tuple[str, str] | None:
    """(the grammar text a request's fields ask for, the field that holds it), None when
    unconstrained. `fields`: the request's response_format, structured_outputs, guided_json,
    guided_regex, guided_choice, guided_grammar and guided_whitespace_pattern (vLLM's older name of
    the JSON whitespace pattern; absent or None when not set). More than one constraint is a 400."""
    found: list[tuple[str, str]] = []
    options = json_options(None, fields.get("guided_whitespace_pattern"), "guided_whitespace_pattern")
    if fields.get("response_format") is not None:
        g = _response_format(fields["response_format"], options)
        if g is not None:
            found.append(("response_format", g))
    if fields.get("structured_outputs") is not None:
        g = _structured_outputs(fields["structured_outputs"])
        if g is not None:
            found.append(("structured_outputs", g))
    if fields.get("guided_json") is not None:
        found.append(("guided_json", json_schema_grammar(fields["guided_json"], "guided_json", options)))
    for kind in ("regex", "choice", "grammar"):
        name = f"guided_{kind}"
        if fields.get(name) is not None:
            found.append((name, _KINDS[kind](fields[name], name)))
    if len(found) > 1:
        raise GrammarError(
            f"only one structured output constraint per request, got {[n for n, _ in found]}", found[1][0]
        )
    return (found[0][1], found[0][0]) if found else None


class Grammars:
    """The engine's view of the model's tokenizer and the grammars compiled against it, cached by
    grammar text: a schema sent with every request compiles once (up to 100 ms and more for a large
    one), and each request advances its own copy of the compiled matcher (a copy costs microseconds).
    The cache keeps the `cache` most recently used grammars, within `cache_text` bytes of their text."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache: int = _CACHE, cache_text: int = _CACHE_TEXT):
        self.tokenizer = tokenizer  # the engine's (blink/dpu/grammar_vocab.py)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.compiles = 0  # grammars compiled so far (cache misses)
        # grammar text -> its compiled matcher, never advanced; compiling runs outside the cache's
        # lock, in any thread
        self._compiled = TextCache(cache, cache_text)

    def _compile(self, grammar: str) -> Any:
        """The grammar's compiled matcher (in error when the grammar does not compile: get_error says
        why), from the cache or compiled now. A new one computes its first mask before it is shared,
        so that the lexer states of the start are built once, not by every request's copy."""
        m = self._compiled.get(grammar)
        if m is not None:
            return m
        m = _engine().LLMatcher(self.tokenizer, grammar)
        if not m.is_error():
            first = np.empty(self.words, "<u4")
            m.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
        self.compiles += 1
        self._compiled.put(grammar, m, len(grammar))
        return m

    async def _compiled_off_loop(self, grammar: str) -> Any:
        """_compile from the event loop: from the cache, else in a grammar thread."""
        m = self._compiled.get(grammar)
        return m if m is not None else await in_grammar_thread(self._compile, grammar)

    def check(self, grammar: str) -> str:
        """'' when the grammar compiles against this tokenizer, else the engine's reason."""
        return _why(self._compile(grammar))

    async def prepare(self, grammar: str) -> str:
        """check(), from the event loop: a grammar not compiled yet compiles in a grammar thread (the
        engine releases the GIL while it compiles), so the loop keeps serving the other streams."""
        return _why(await self._compiled_off_loop(grammar))

    def matcher(self, grammar: str) -> Matcher:
        """A matcher of its own, at the grammar's start (compiled in the caller's thread when the cache
        does not hold it; from the event loop: request_matcher)."""
        return Matcher(self._compile(grammar).deep_copy(), self.words)

    async def request_matcher(self, grammar: str) -> Matcher:
        """A new request's matcher, from the event loop: compiled in a grammar thread when the cache no
        longer holds it. A GrammarError when the grammar does not compile."""
        m = await self._compiled_off_loop(grammar)
        if m.is_error():
            raise GrammarError(_why(m), "grammar")
        return Matcher(m.deep_copy(), self.words)


def _why(m: Any) -> str:
    return (m.get_error() or "invalid grammar") if m.is_error() else ""


def executor(threads: int | None = None):
    """The engine's parallel executor (fills many matchers' masks at once; blink/dpu/token_masks.py)."""
    return _engine().LLExecutor(threads)


class Matcher:
    """One request's position in its grammar: fill the mask of the next token, advance by tokens."""

    __slots__ = ("m", "words")

    def __init__(self, m: Any, words: int):
        self.m = m
        self.words = words

    def fill_mask(self, out: np.ndarray) -> None:
        """The allowed-token bitmask of the next position into out (uint32, >= words words; the
        words past the vocabulary are cleared). A matcher in error allows nothing but EOS."""
        out[self.words :] = 0
        head = out[: self.words]
        self.m.unsafe_compute_mask_ptr(head.ctypes.data, head.nbytes)

    def advance(self, ids: list[int]) -> bool:
        """Consume generated tokens; False when one was not allowed (the matcher is then in error)."""
        if self.m.is_stopped():
            return True  # tokens after the grammar's end (EOS) change nothing
        return all(self.m.consume_token(int(t)) for t in ids)

    @property
    def error(self) -> str:
        return self.m.get_error() or ""
