"""Tool calls: the request's tools (validated), the grammar that enforces tool_choice `required` or a
named function, and the parsers that find tool calls in a model's text, one per model family, chosen
like vLLM's `--tool-call-parser` (`auto`: by the chat template).

Formats (what the family's chat template teaches the model):
    hermes          Hermes, Qwen2.5, Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one per call
    llama3_json     Llama 3.1-3.3: [<|python_tag|>]{"name": ..., "parameters": {...}}, calls joined by ';'
    phi4_mini_json  Phi-4-mini: functools[{"name": ..., "arguments": {...}}, ...]
    json            tool_choice required / named (any model): the grammar forces a JSON array of
                    {"name": ..., "parameters": {...}} (vLLM's form), parsed whole

A `ToolStream` follows one choice's text: text before a call's start marker passes through as
content (a possible marker prefix held back until it is decided), text from the marker on is held
and parsed when the choice ends; the calls then go out as OpenAI streams them (per call: a delta
with id, type and name and empty arguments, then one with the arguments), finish_reason tool_calls.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PARSERS = ("auto", "hermes", "llama3_json", "phi4_mini_json")


class ToolError(ValueError):
    """A malformed tools / tool_choice field (HTTP 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def openai(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call(name: Any, args: Any) -> ToolCall | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):
        text = args
    else:
        text = json.dumps({} if args is None else args, ensure_ascii=False)
    return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")


def _from_obj(obj: Any) -> ToolCall | None:
    if not isinstance(obj, Mapping):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    return _call(obj.get("name"), args)


# -- the request's tools ---------------------------------------------------------------------------
def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict], str, str | None]:
    """(the tools as the template gets them, the choice: none | auto | required | named, the named
    function or None); a ToolError naming the field when malformed."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list", "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, Mapping) and t.get("type", "function") == "function" else None
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolError("each tool must be {type: function, function: {name, parameters}}", f"tools[{i}]")
        if not isinstance(f.get("parameters", {}), Mapping):
            raise ToolError("function.parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        names.append(f["name"])
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolError(f"tool_choice {choice!r}; expected none, auto, required or a function", "tool_choice")
        return list(tools), choice, None
    name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
    if name not in names:
        raise ToolError(f"tool_choice names a function that is not among the tools: {name!r}", "tool_choice")
    return list(tools), "named", name


def required_schema(tools: list[dict], named: str | None, parallel: bool) -> dict:
    """The JSON schema the grammar enforces for tool_choice required (any tool) or named (that one):
    an array of {"name", "parameters"} objects, one item unless parallel calls are allowed."""
    alts = []
    for t in tools:
        f = t["function"]
        if named is not None and f["name"] != named:
            continue
        params = f.get("parameters") or {"type": "object"}
        alts.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    item = alts[0] if len(alts) == 1 else {"anyOf": alts}
    return {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})}


# -- parsers ---------------------------------------------------------------------------------------
class Parser(abc.ABC):
    start = ""  # the text that opens the tool calls

    @abc.abstractmethod
    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls in `text` from its start marker on; None when it does not parse."""

    def locate(self, s: str, seen_content: bool) -> tuple[int, int]:
        """(where the calls start in s, -1: not yet; how many trailing characters to hold back
        because they may begin the marker)."""
        i = s.find(self.start)
        return (i, 0) if i >= 0 else (-1, _prefix_overlap(s, self.start))


def _json_values(text: str) -> list[Any] | None:
    """Consecutive JSON values in text, separated by whitespace, ';' or ','."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(v)


class Hermes(Parser):
    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def calls(self, text: str) -> list[ToolCall] | None:
        out = []
        for body in self._CALL.findall(text):
            try:
                c = _from_obj(json.loads(body))
            except json.JSONDecodeError:
                return None
            if c is None:
                return None
            out.append(c)
        return out or None


class Llama3Json(Parser):
    start = "{"

    def locate(self, s: str, seen_content: bool) -> tuple[int, int]:
        """Calls only when the output starts with a JSON object (after whitespace)."""
        if seen_content:
            return -1, 0
        stripped = s.lstrip()
        if stripped.startswith("{"):
            return len(s) - len(stripped), 0
        return (-1, len(s)) if not stripped else (-1, 0)

    def calls(self, text: str) -> list[ToolCall] | None:
        vals = _json_values(text.replace("<|python_tag|>", ""))
        calls = [_from_obj(v) for v in vals or []]
        return calls if calls and all(calls) else None  # type: ignore[return-value]


class Phi4MiniJson(Parser):
    start = "functools["

    def calls(self, text: str) -> list[ToolCall] | None:
        vals = _json_values(text[text.find("[") :])
        if not vals or not isinstance(vals[0], list):
            return None
        calls = [_from_obj(v) for v in vals[0]]
        return calls if calls and all(calls) else None  # type: ignore[return-value]


class JsonArray(Parser):
    start = ""  # the whole output is the array (the grammar made it so)

    def calls(self, text: str) -> list[ToolCall] | None:
        try:
            vals = json.loads(text)
        except json.JSONDecodeError:
            return None
        calls = [_from_obj(v) for v in vals] if isinstance(vals, list) else []
        return calls if calls and all(calls) else None  # type: ignore[return-value]


_BY_NAME: dict[str, type[Parser]] = {"hermes": Hermes, "llama3_json": Llama3Json, "phi4_mini_json": Phi4MiniJson}


def parser_for(name: str, chat_template: str | None) -> Parser:
    """The parser `name` (PARSERS); `auto`: the one the chat template's tool format implies
    (hermes when it shows none)."""
    if name != "auto":
        return _BY_NAME[name]()
    t = chat_template or ""
    if "<|python_tag|>" in t or "ipython" in t:
        return Llama3Json()
    if "functools" in t:
        return Phi4MiniJson()
    return Hermes()


class ToolStream:
    """One choice's text split into content and tool calls (see the module docstring)."""

    def __init__(self, parser: Parser):
        self.p = parser
        self.held = ""  # text from a (possible) start marker on
        self.in_call = parser.start == ""
        self.seen_content = False

    def push(self, text: str) -> str:
        """New text -> the content that can go out now."""
        if self.in_call:
            self.held += text
            return ""
        s = self.held + text
        i, keep = self.p.locate(s, self.seen_content)
        if i >= 0:
            self.in_call, self.held = True, s[i:]
            return self._content(s[:i])
        self.held = s[len(s) - keep :] if keep else ""
        return self._content(s[: len(s) - keep])

    def _content(self, s: str) -> str:
        self.seen_content |= bool(s.strip())
        return s

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the choice's end: (content still held, the calls). Held text that does not parse as
        calls goes out as content."""
        if not self.in_call:
            held, self.held = self.held, ""
            return held, []
        calls = self.p.calls(self.held)
        if calls is None:
            held, self.held = self.held, ""
            return held, []
        self.held = ""
        return "", calls


def _prefix_overlap(s: str, marker: str) -> int:
    """The length of the longest suffix of s that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(s)), 0, -1):
        if s.endswith(marker[:n]):
            return n
    return 0


def template_messages(messages: list[Any]) -> list[Any]:
    """Assistant tool_calls with their arguments as objects (what HF chat templates iterate)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, Mapping) else None
        if calls:
            m = dict(m)
            m["tool_calls"] = [_template_call(c) for c in calls]
        out.append(m)
    return out


def _template_call(c: Any) -> Any:
    if not isinstance(c, Mapping) or not isinstance(c.get("function"), Mapping):
        return c
    f = dict(c["function"])
    if isinstance(f.get("arguments"), str):
        try:
            f["arguments"] = json.loads(f["arguments"])
        except json.JSONDecodeError:
            pass
    return {**c, "function": f, "name": f.get("name"), "arguments": f.get("arguments")}
