"""What the structured output and tool calling tests share: JSON schemas (nested objects, arrays,
enums, bounded numbers, anyOf, required fields; strings and arrays bounded so that a random-weight
model finishes within a short max_tokens) and the tiny-model server they run against."""

from __future__ import annotations

from collections.abc import Iterator

import openai

from blink.testing import ServeProcess

TINY = ["--device", "emulated", "--model", "random:tiny-llama", "--n-slots", "8", "--max-batch", "8"]


def tiny_server(key: str, *extra: str) -> Iterator[ServeProcess]:
    """A module fixture's body: `blink serve` of the tiny model with API key `key`, stopped cleanly."""
    s = ServeProcess([*TINY, "--num-kv-blocks", "256", "--api-key", key, *extra], timeout=180)
    yield s
    assert s.stop() == 0, "".join(s.log)


def client_of(server: ServeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


STR = {"type": "string", "maxLength": 6}
INT = {"type": "integer", "minimum": -50, "maximum": 50}


def obj(props: dict, required: list[str] | None = None, extra: bool = False) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": extra,
    }


SCHEMAS: list[dict] = [
    obj({"a": STR}),
    obj({"n": INT}),
    obj({"b": {"type": "boolean"}}),
    obj({"z": {"type": "null"}}),
    obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    obj({"tags": {"type": "array", "items": STR, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": INT, "minItems": 1, "maxItems": 3}}),
    obj({"p": obj({"x": INT, "y": INT})}),
    obj({"outer": obj({"inner": obj({"v": STR})})}),
    obj({"v": {"anyOf": [INT, {"type": "null"}]}}),
    obj({"v": {"anyOf": [STR, {"type": "boolean"}]}}),
    obj({"a": STR, "b": INT}, required=["a"]),
    obj({"a": STR, "b": INT, "c": {"type": "boolean"}}, required=["c"]),
    obj({"items": {"type": "array", "items": obj({"k": STR, "v": INT}), "maxItems": 2}}),
    obj({"grid": {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 2}, "maxItems": 2}}),
    obj({"t": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    obj({"q": {"type": "integer", "minimum": 100, "maximum": 105}}),
    obj({"s": {"type": "string", "pattern": "^[a-z]{2,4}$"}}),
    obj({"code": {"type": "string", "minLength": 2, "maxLength": 3}}),
    obj({"mode": {"const": "fast"}}),
    obj({"pair": {"type": "array", "prefixItems": [STR, INT], "items": False}}),
    obj({"u": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 3}}),
    {"type": "array", "items": INT, "maxItems": 3},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 1, "maximum": 9},
    {"anyOf": [obj({"kind": {"const": "a"}, "a": INT}), obj({"kind": {"const": "b"}, "b": STR})]},
    obj({"meta": obj({"id": INT, "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}})}),
    obj({"a": {"$ref": "#/$defs/pt"}}) | {"$defs": {"pt": obj({"x": INT})}},
    obj(
        {"e": {"type": "string", "enum": ["x y", "z"]}, "n": {"type": ["integer", "null"], "maximum": 9, "minimum": 0}}
    ),
    obj({"deep": obj({"l1": obj({"l2": obj({"l3": INT})})})}),
]
