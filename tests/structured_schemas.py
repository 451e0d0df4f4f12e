"""JSON schemas for the structured output tests: nested objects, arrays, enums, bounded numbers,
anyOf, required fields. Strings and arrays are bounded so that a random-weight model finishes
within a short max_tokens."""

from __future__ import annotations

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
