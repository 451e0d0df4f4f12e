"""Tool calling through the OpenAI API: `blink serve` (emulated device, tiny random-weight model) with
a Qwen-style chat template that renders tools, assistant tool_calls and tool results. tool_choice
required / named are enforced by the grammar (so even this model's calls parse); `auto` parsing is
driven by a structured_outputs regex that makes the model write a hermes <tool_call>. Parsers and the
streaming splitter are also checked on their own."""

from __future__ import annotations

import json

import openai
import pytest
from structured_schemas import client_of, tiny_server

from blink.dpu.tokenizer import load_tokenizer
from blink.dpu.tool_parsers import Hermes, JsonArray, Llama3Json, Phi4MiniJson, ToolStream, parser_for

KEY = "sk-tools"
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    '{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{"name": "{{ tc.function.name }}", '
    '"arguments": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}'
    "{% elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]},
    },
}
MSGS = [{"role": "user", "content": "weather in Paris?"}]


# -- parsers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "parser, chunks, content, names",
    [
        (Hermes(), ["Sure. <tool", '_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'], "Sure. ", ["f"]),
        (
            Hermes(),
            ['<tool_call>{"name":"f","arguments":{}}</tool_call>\n<tool_call>{"name":"g","arguments":{}}</tool_call>'],
            "",
            ["f", "g"],
        ),
        (Hermes(), ["no call <", "b> here"], "no call <b> here", []),
        (Hermes(), ["<tool_call>{broken"], "<tool_call>{broken", []),
        (
            Llama3Json(),
            [' {"name": "f", ', '"parameters": {"x": 1}}; {"name": "g", "parameters": {}}'],
            " ",
            ["f", "g"],
        ),
        (Llama3Json(), ["The answer {is} here"], "The answer {is} here", []),
        (Phi4MiniJson(), ['functools[{"name": "f", "arguments": {"a": 2}}]'], "", ["f"]),
        (JsonArray(), ['[{"name":"f","parameters":{"q":"x"}},', '{"name":"g","parameters":{}}]'], "", ["f", "g"]),
    ],
)
def test_parsers_split_content_and_calls(parser, chunks, content, names):
    ts = ToolStream(parser)
    out = "".join(ts.push(c) for c in chunks)
    tail, calls = ts.finish()
    assert out + tail == content
    assert [c.name for c in calls] == names
    assert all(isinstance(json.loads(c.arguments), dict) and c.id.startswith("call_") for c in calls)


def test_auto_picks_the_parser_by_template():
    assert isinstance(parser_for("auto", "... <tool_call> ..."), Hermes)
    assert isinstance(parser_for("auto", "{{ '<|python_tag|>' }} ipython"), Llama3Json)
    assert isinstance(parser_for("auto", "functools[...]"), Phi4MiniJson)
    assert isinstance(parser_for("llama3_json", "<tool_call>"), Llama3Json)


def test_tools_tool_calls_and_tool_results_go_through_the_template():
    tok = load_tokenizer("random:tiny-llama", chat_template=TEMPLATE)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
    }
    msgs = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    text = tok.decode(tok.chat_prompt(msgs, True, {"tools": [WEATHER]}), skip_special_tokens=False)
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>' in text
    assert "<tool_response>sunny</tool_response>" in text


# -- through the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "template.jinja"
    path.write_text(TEMPLATE)
    yield from tiny_server(KEY, "--chat-template", str(path))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return client_of(server, KEY)


def check_weather(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_always_parse(client, server, choice):
    tools = [WEATHER] if choice == "required" else [TIME, WEATHER]
    for seed in range(2):
        r = client.chat.completions.create(
            model=server.model, messages=MSGS, tools=tools, tool_choice=choice, max_tokens=200, seed=seed,
            parallel_tool_calls=False,
        )  # fmt: skip
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        check_weather(c.message.tool_calls[0])


def test_streamed_tool_calls_are_openai_deltas(client, server):
    stream = client.chat.completions.create(
        model=server.model, messages=MSGS, tools=[WEATHER], tool_choice="required", max_tokens=200, stream=True,
        parallel_tool_calls=False,
    )  # fmt: skip
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    args = "".join(d.function.arguments or "" for d in deltas)
    assert set(json.loads(args)) == {"city", "days"}


HERMES_RE = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}", "days": [1-7]\}\}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_hermes_call_out_of_the_text(client, server, stream):
    kw = dict(
        model=server.model, messages=MSGS, tools=[WEATHER], max_tokens=120, extra_body={"guided_regex": HERMES_RE}
    )
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls" and not c.message.content
        check_weather(c.message.tool_calls[0])
        return
    with client.chat.completions.stream(**kw) as s:  # the openai helper accumulates the deltas
        final = s.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "tool_calls"
    check_weather(c.message.tool_calls[0])


def test_tool_choice_none_returns_text(client, server):
    r = client.chat.completions.create(
        model=server.model,
        messages=MSGS,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=4,
        extra_body={"ignore_eos": True},  # a random model may sample EOS early: the finish would be "stop"
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_a_tool_result_conversation_is_accepted(client, server):
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "a", "days": 1}'},
    }
    msgs = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    r = client.chat.completions.create(
        model=server.model, messages=msgs, tools=[WEATHER], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"


DEEP_TOOL = {
    "type": "function",
    "function": {"name": "deep", "parameters": json.loads('{"type": "array", "items": ' * 300 + "{}" + "}" * 300)},
}


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        # parameters nested deeper than the grammar engine's JSON reader goes: a 500 before
        ({"tools": [DEEP_TOOL], "tool_choice": "required"}, "tools"),
        ({"tools": [DEEP_TOOL], "tool_choice": {"type": "function", "function": {"name": "deep"}}}, "tools"),
    ],
)
def test_malformed_tools_are_a_400_naming_the_field(client, server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=MSGS, max_tokens=2, **kw)
    assert e.value.body["param"] == param, e.value.body
