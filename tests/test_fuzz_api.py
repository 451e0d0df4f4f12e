"""Property-based fuzzing of /v1/completions and /v1/chat/completions (hypothesis) against
`blink serve` on the emulated device: whatever the body, the answer is a 200 or an OpenAI-shaped
4xx, never a 5xx, and afterwards the server is healthy and holds no slot.

The search is derandomized and keeps no example database, so every run tries the same bodies (a
run cannot pass or fail by what an earlier run found); the bodies it once found that broke the
device are ordinary regression cases (REGRESSIONS, and @example on the property)."""

from __future__ import annotations

import functools
import http.client
import json
import time
import urllib.parse

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_e2e_openai import Server

MODEL = "tiny-llama"

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
small_ints = st.integers(-3, 12) | st.sampled_from([0, 2**31, 2**32, 2**63, -(2**63)])
floats = st.floats(allow_nan=True, allow_infinity=True) | st.floats(-1, 3)
token_ids = st.lists(st.integers(-5, 600) | st.sampled_from([2**31, 2**64]), max_size=12)
texts = st.text(max_size=40)

common = {
    "model": st.just(MODEL) | st.just(MODEL) | texts,
    "max_tokens": small_ints | st.none(),
    "temperature": floats | st.none(),
    "top_p": floats,
    "top_k": small_ints,
    "seed": st.integers() | st.none(),
    "n": st.integers(-1, 4) | st.sampled_from([300, 2**40]),
    "stop": texts | st.lists(texts, max_size=20) | st.none(),
    "stop_token_ids": token_ids,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    )
    | json_values,
    "ignore_eos": st.booleans(),
    "min_tokens": small_ints,
    "logprobs": st.booleans() | small_ints | st.none(),
    "presence_penalty": floats,
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "user": texts,
    "unknown_extension": json_values,
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"]) | json_values},
    optional={
        "content": texts | json_values | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}))
    },
)
chat_bodies = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=4) | json_values},
    optional={**common, "max_completion_tokens": small_ints, "response_format": json_values, "tools": json_values},
)
completion_bodies = st.fixed_dictionaries(
    {"prompt": texts | token_ids | st.lists(texts | token_ids, max_size=4) | json_values},
    optional={**common, "echo": st.booleans(), "best_of": small_ints, "suffix": texts | st.none()},
)
# Bodies a client means to be valid: every value in range, so most of them generate
sane = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**64 - 1),
    "n": st.integers(1, 3),
    "stop": texts | st.lists(texts, max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
sane_chat = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": texts}),
            min_size=1,
            max_size=3,
        ),
    },
    optional=sane,
)
sane_completion = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": texts
        | st.lists(st.integers(3, 500), min_size=1, max_size=12)
        | st.lists(texts, min_size=1, max_size=3),
    },
    optional={**sane, "echo": st.booleans()},
)
bodies = st.tuples(st.just("/v1/chat/completions"), sane_chat | chat_bodies | json_values) | st.tuples(
    st.just("/v1/completions"), sane_completion | completion_bodies | json_values
)


def fuzz(examples: int):
    """The same bodies every run (derandomized, no example database: module doc)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )


@pytest.fixture(scope="module")
def server():
    s = Server(
        "--model", "random:tiny-llama", "--max-context", "64", "--num-kv-blocks", "64", "--max-batch", "8",
        "--n-slots", "8", "--max-queue", "16",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, "".join(s.log)


def _post(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, bytes]:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.read()


def _check(status: int, raw: bytes, streamed: bool) -> None:
    assert status < 500, (status, raw[:500])
    if status != 200:
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["type"] == "invalid_request_error", err
        return
    if streamed:
        events = [e for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        for e in events[:-1]:
            obj = json.loads(e.removeprefix("data: "))
            assert "error" not in obj, obj
    else:
        assert json.loads(raw)["choices"]


_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
_COMP = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4}
# Bodies that once took the device down (an overflow in the sampler at a temperature of 1e-40, an
# out-of-vocabulary token and a 500 on a GPU), and their neighbours at the edges of the definition.
REGRESSIONS = [
    ("/v1/chat/completions", {**_CHAT, "temperature": 1e-40, "top_p": 0.9}),
    ("/v1/chat/completions", {**_CHAT, "temperature": 1e-40, "top_k": 5}),
    ("/v1/chat/completions", {**_CHAT, "temperature": 1e-40, "logprobs": True, "top_logprobs": 3}),
    ("/v1/completions", {**_COMP, "temperature": 1e-40, "top_p": 0.9, "logprobs": 2, "stream": True}),
    ("/v1/completions", {**_COMP, "temperature": 5e-324, "top_p": 0.5, "min_p": 0.5, "n": 2}),
    ("/v1/completions", {**_COMP, "temperature": 1e-5, "top_p": 0.9}),
    ("/v1/completions", {**_COMP, "temperature": 1e-5, "repetition_penalty": 1e-38, "top_k": 5}),
    ("/v1/completions", {**_COMP, "temperature": 2.0, "top_p": 1e-30, "logprobs": 5}),
    ("/v1/completions", {**_COMP, "temperature": 1.0, "min_p": 1.0, "top_k": 1}),
    ("/v1/chat/completions", {**_CHAT, "logit_bias": {str(i): -100 for i in range(1, 512)}, "temperature": 0.9}),
    ("/v1/chat/completions", {**_CHAT, "frequency_penalty": -2, "presence_penalty": -2, "temperature": 1e-5}),
]


def _send(server, path: str, body) -> tuple[int, bytes]:
    url = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        return _post(conn, path, json.dumps(body).encode())
    finally:
        conn.close()


@pytest.mark.parametrize("path,body", REGRESSIONS)
def test_extreme_sampling_parameters_are_served(server, path, body):
    status, raw = _send(server, path, body)
    assert status == 200, (status, raw[:500])
    _check(status, raw, bool(body.get("stream")))
    assert server.metrics()["blink_device_up"] == 1


@fuzz(250)
@given(bodies)
@example(REGRESSIONS[0])
@example(REGRESSIONS[3])
def test_fuzzed_bodies_get_200_or_an_openai_4xx(server, case):
    path, body = case
    status, raw = _send(server, path, body)
    _check(status, raw, isinstance(body, dict) and body.get("stream") is True)


@fuzz(60)
@given(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), st.binary(max_size=200) | texts.map(str.encode))
def test_fuzzed_bytes_get_a_4xx(server, path, raw_body):
    url = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        status, raw = _post(conn, path, raw_body)
    finally:
        conn.close()
    assert 400 <= status < 500, (status, raw)


def test_after_fuzzing_the_server_is_healthy_and_holds_no_slot(server):
    t_end = time.monotonic() + 10
    while True:
        m = server.metrics()
        if m["blink_ring_busy_slots"] == 0 and m["blink_device_up"] == 1:
            break
        assert time.monotonic() < t_end, m
        time.sleep(0.05)
    assert not any(k.startswith('blink_requests_total{endpoint="chat",outcome="error"') for k in m if m[k])


# -- structured output: fuzzed constraints -----------------------------------------------------------
# JSON schemas built from the keywords a client uses, with values in and out of range; regex and Lark
# texts over the characters that make their syntax. Whatever the constraint: a 200 whose output (when
# it stopped by itself) validates under the schema, or an OpenAI-shaped 400 before or during the stream.
_kw_values = {
    "type": st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null", "wrong"])
    | st.lists(st.sampled_from(["string", "integer", "null"]), max_size=3),
    "minimum": st.integers(-(10**20), 10**20) | st.floats(allow_nan=False),
    "maximum": st.integers(-(10**20), 10**20) | st.floats(allow_nan=False),
    "minLength": st.integers(-1, 6),
    "maxLength": st.integers(-1, 8),
    "minItems": st.integers(-1, 3),
    "maxItems": st.integers(-1, 4),
    "enum": st.lists(json_scalars, max_size=4),
    "const": json_scalars,
    "pattern": st.text(alphabet="ab^$()[]{}*+?|.\\d0-9,", max_size=12),
    "format": st.sampled_from(["date", "email", "uuid", "date-time", "nonsense"]),
    "additionalProperties": st.booleans(),
    "unknownKeyword": json_values,
}
schemas = st.recursive(
    st.fixed_dictionaries({}, optional=_kw_values) | st.booleans(),
    lambda inner: st.fixed_dictionaries(
        {},
        optional={
            **_kw_values,
            "properties": st.dictionaries(st.text(alphabet="abcxyz_", min_size=1, max_size=4), inner, max_size=3),
            "required": st.lists(st.text(alphabet="abcxyz_", min_size=1, max_size=4), max_size=3),
            "items": inner,
            "anyOf": st.lists(inner, max_size=3),
            "oneOf": st.lists(inner, max_size=3),
            "allOf": st.lists(inner, max_size=2),
            "$defs": st.dictionaries(st.just("d"), inner, max_size=1),
            "$ref": st.sampled_from(["#/$defs/d", "#/nowhere", "#"]),
        },
    ),
    max_leaves=8,
)
regexes = st.text(alphabet="ab()[]{}*+?|.^$\\dDwsS0-9,-", max_size=16)
larks = st.text(alphabet='start:"ab|()*+? \n/%ignore', max_size=30) | st.just('start: "a" b\nb: "b"+')
constraints = st.one_of(
    st.fixed_dictionaries({"guided_json": schemas | json_values}),
    st.fixed_dictionaries({"response_format": st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"schema": schemas})})}),
    st.fixed_dictionaries({"guided_regex": regexes}),
    st.fixed_dictionaries({"structured_outputs": st.fixed_dictionaries({}, optional={"regex": regexes, "choice": st.lists(texts, max_size=3), "json": schemas})}),
    st.fixed_dictionaries({"guided_choice": st.lists(texts, max_size=4) | json_values}),
    st.fixed_dictionaries({"guided_grammar": larks}),
    st.fixed_dictionaries(
        {
            "tools": st.lists(
                st.fixed_dictionaries(
                    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])}, optional={"parameters": schemas})}
                ),
                min_size=1,
                max_size=2,
            ),
            "tool_choice": st.sampled_from(["auto", "required", "none"]),
        }
    ),
)  # fmt: skip


def _schema_of(body: dict):
    if isinstance(body.get("guided_json"), dict | bool):
        return body["guided_json"]
    rf = body.get("response_format")
    return rf["json_schema"]["schema"] if rf else None


@fuzz(200)
@given(constraints, st.booleans(), st.booleans())
# numbers the grammar engine reads as 64-bit floats (a randomized run's findings): a large integer const
# is a 400; a large float const comes out in other digits of the same decimal value
@example(
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"const": 192106627964078391296}}}},
    True,
    False,
)
@example({"guided_json": {"const": 6.424792149695613e16}}, False, False)
@example({"guided_json": {"const": 9007199254740993}}, True, True)
def test_fuzzed_constraints_get_a_valid_output_or_an_openai_400(server, constraint, chat, stream):
    n = 96 if "tools" in constraint else 24  # a call spells its name and arguments, a byte a token
    body = {**(_CHAT if chat else _COMP), **constraint, "max_tokens": n, "seed": 1, "stream": stream}
    status, raw = _send(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert status < 500, (status, raw[:500])
    if status != 200:
        err = json.loads(raw)["error"]
        assert err["type"] == "invalid_request_error" and err["message"], err
        return
    if stream:
        events = [json.loads(e.removeprefix("data: ")) for e in raw.decode().split("\n\n") if e and e != "data: [DONE]"]
        errors = [e["error"] for e in events if "error" in e]
        assert all(e["type"] == "invalid_request_error" for e in errors), errors
        if errors:
            return
        text = "".join(
            (c.get("delta") or {}).get("content") or c.get("text") or "" for e in events for c in e.get("choices", [])
        )
        finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    else:
        choice = json.loads(raw)["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        finish = [choice["finish_reason"]]
    if chat and not stream and body.get("tool_choice") == "required" and finish == ["tool_calls"]:
        params = {t["function"]["name"]: t["function"].get("parameters", {}) for t in body["tools"]}
        for call in json.loads(raw)["choices"][0]["message"]["tool_calls"]:
            _validate(call["function"]["arguments"], params[call["function"]["name"]])
    schema = _schema_of(body)
    if schema is not None and finish == ["stop"]:
        _validate(text, schema)


def _validate(text: str, schema) -> None:
    """The JSON `text` is valid under `schema`, numbers compared as the decimals JSON writes (Python
    reads 6.424792149695613e+16 as a float and 64247921496956130 as an int, which differ by 2)."""
    import decimal

    import jsonschema

    exact = functools.partial(json.loads, parse_float=decimal.Decimal)
    schema = exact(json.dumps(schema))
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError:
        return  # not a schema by its metaschema: the engine's reading of it is all there is (as in vLLM)
    jsonschema.validate(exact(text), schema)
