"""Structured output through the OpenAI API: `blink serve` with the emulated device and the tiny
random-weight model (its choices are noise, so only the token masks make the outputs valid), driven
by the official openai client; and the request parsing of blink/dpu/structured.py without a server."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import openai
import pydantic
import pytest
from structured_schemas import SCHEMAS, client_of, tiny_server

from blink.dpu.structured import GrammarError, ascii_digit_classes, request_grammar
from blink.dpu.tokenizer import load_tokenizer

KEY = "sk-structured"
DEEP = json.loads('{"type": "array", "items": ' * 300 + "{}" + "}" * 300)
# anyOf 300 objects of 5 optional fields: after "{" the engine's parser holds more items in a row than
# its limit (2,000), and the matcher fails while the request generates (not when the grammar compiles)
WIDE = {
    "anyOf": [
        {"type": "object", "properties": {f"k{i}_{j}": {"type": "integer"} for j in range(5)}} for i in range(300)
    ]
}


# -- request parsing -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMAS[4], "strict": True},
            }
        },
        {"structured_outputs": {"json": SCHEMAS[0]}},
        {"structured_outputs": {"regex": "[ab]+"}},
        {"structured_outputs": {"choice": ["a", "b"]}},
        {"structured_outputs": {"grammar": 'start: "x" | "y"'}},
        {"guided_json": json.dumps(SCHEMAS[1])},
        {"guided_regex": r"\d+"},
        {"guided_choice": ["yes", "no"]},
        {"guided_grammar": 'root ::= "a" | "b"'},  # GBNF: converted to Lark
    ],
)
def test_each_constraint_field_becomes_a_grammar_the_engine_accepts(fields):
    g = request_grammar(fields)
    assert g
    assert load_tokenizer("random:tiny-llama").grammars.check(g) == ""


def test_text_format_and_no_fields_are_unconstrained():
    assert request_grammar({"response_format": {"type": "text"}}) is None
    assert request_grammar({}) is None


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        # nested deeper than the engine's JSON reader goes: its ValueError was a 500
        ({"guided_json": json.loads('{"items":' * 200 + "{}" + "}" * 200)}, "guided_json"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"anyOf": [DEEP]}}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_malformed_constraints_name_their_field(fields, param):
    with pytest.raises(GrammarError) as e:
        request_grammar(fields)
    assert e.value.param == param


def test_a_grammar_compiles_once_and_each_request_gets_its_own_matcher():
    """Compiled grammars are cached by their text: every request of one schema copies the compiled
    matcher (a copy costs microseconds, a compile up to 100 ms for a large schema) and advances only
    its own copy; the least recently used grammar is dropped past the cache's size."""
    from blink.dpu.structured import Grammars

    tok = load_tokenizer("random:tiny-llama")
    gs = Grammars(tok.grammars.tokenizer, tok.info.vocab_size, cache=2)
    a = request_grammar({"guided_choice": ["ab", "cd"]})
    assert gs.check(a) == "" and gs.compiles == 1
    m1, m2 = gs.matcher(a), gs.matcher(a)
    assert gs.compiles == 1
    start = np.zeros(gs.words, np.uint32)
    m2.fill_mask(start)
    first = int(np.flatnonzero(np.unpackbits(start.view(np.uint8), bitorder="little"))[0])
    assert m1.advance([first])
    again = np.zeros(gs.words, np.uint32)
    m2.fill_mask(again)
    assert np.array_equal(again, start)  # m1's token did not move m2
    gs.matcher(a).fill_mask(again)
    assert np.array_equal(again, start)  # nor the compiled grammar a later request copies
    b, c = request_grammar({"guided_regex": "x+"}), request_grammar({"guided_regex": "y+"})
    gs.check(b)
    gs.check(c)  # a is the least recently used of three: dropped
    assert gs.compiles == 3
    gs.matcher(c)
    assert gs.compiles == 3
    gs.matcher(a)
    assert gs.compiles == 4
    # and within cache_text bytes of grammar text: the least recently used goes first, the newest stays
    gt = Grammars(tok.grammars.tokenizer, tok.info.vocab_size, cache=10, cache_text=len(a + b + c) - 1)
    for g in (b, c, a):
        gt.check(g)
    gt.check(c)
    assert gt.compiles == 3
    gt.check(b)
    assert gt.compiles == 4


@pytest.mark.parametrize(
    "schema",
    [
        {"const": 9007199254740993},  # 2^53 + 1: the engine wrote 9007199254740992
        {"type": "integer", "minimum": 12345678901234567891},  # past int64: it wrote 9223372036854775807
        {"properties": {"id": {"enum": [1, -(2**60)]}}},
        {"anyOf": [{"maximum": 2**70}]},
    ],
)
def test_an_integer_the_engine_cannot_hold_exactly_is_a_400(schema):
    """The grammar engine reads a schema's numbers as 64-bit floats: an integer const, enum value or
    bound beyond 2^53 came out as another number. Refused, naming the keyword; the floats a client
    writes (a double already) and integers up to 2^53 are exact."""
    with pytest.raises(GrammarError, match="2\\^53") as e:
        request_grammar({"guided_json": schema})
    assert e.value.param == "guided_json"
    for fine in ({"const": 2**53}, {"const": 6.424792149695613e16}, {"enum": [0.1, -(2**53)]}, {"maxLength": 9}):
        assert request_grammar({"guided_json": fine})


def test_a_schema_nested_as_deep_as_a_body_may_be_is_a_400_not_a_recursion_error():
    """A schema about 970 levels deep passed the body parser and overflowed Python's stack in the
    frontend's own walk of it (a 500); the walk is iterative now, and so deep a schema is refused
    before anything recursive (the encoder) sees it."""
    deep: dict = {}
    for _ in range(5000):
        deep = {"items": deep}
    for fields in ({"guided_json": deep}, {"structured_outputs": {"json": {"enum": [deep]}}}):
        with pytest.raises(GrammarError, match="nested deeper than") as e:
            request_grammar(fields)
        assert e.value.param.startswith(next(iter(fields)))


@pytest.mark.parametrize("schema", [*SCHEMAS, {"x-guidance": {"whitespace_flexible": True}}, {"x-guidance": 5}])
def test_a_schema_becomes_the_grammar_the_engine_makes_of_it(schema):
    """schema_grammar builds in one encode what the engine's own conversion gives (which holds the GIL
    ~40 ms a megabyte): the same grammar, the schema's x-guidance options over ours."""
    import llguidance

    from blink.dpu.structured import _JSON_DEFAULTS, schema_grammar

    engine = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_DEFAULTS)
    drop_nulls = lambda d: {k: v for k, v in d.items() if v is not None}  # noqa: E731
    theirs = json.loads(engine, object_hook=drop_nulls)
    assert json.loads(schema_grammar(schema), object_hook=drop_nulls) == theirs


def test_the_deepest_schema_the_engine_reads_compiles_and_one_level_more_is_a_400():
    from blink.dpu.structured import _MAX_DEPTH

    def nested(n: int) -> dict:
        d: dict = {"type": "string"}
        for _ in range(n):
            d = {"items": d}
        return d

    grammars = load_tokenizer("random:tiny-llama").grammars
    assert grammars.check(request_grammar({"guided_json": nested(_MAX_DEPTH)})) == ""
    with pytest.raises(GrammarError, match=f"nested deeper than {_MAX_DEPTH} levels") as e:
        request_grammar({"guided_json": nested(_MAX_DEPTH + 1)})
    assert e.value.param == "guided_json"


def test_text_cache_drops_the_least_recently_used_past_its_bounds():
    from blink.dpu.structured import TextCache

    c = TextCache(2, 10)
    c.put("a", 1, 4)
    c.put("b", 2, 4)
    c.put("c", 3, 4)  # 12 bytes > 10: "a", the least recently used, goes
    assert (c.get("a"), c.get("b"), c.get("c")) == (None, 2, 3)


def test_a_new_grammar_compiles_off_the_event_loop_and_a_known_one_on_it(monkeypatch):
    """The HTTP handler awaits Grammars.prepare: a grammar not seen before compiles in a worker thread
    (a large schema takes 100 ms and more, which on the loop would stall every stream); one already
    compiled is answered on the loop without a thread."""
    import asyncio
    import threading

    grammars = load_tokenizer("random:tiny-llama").grammars
    threads = []
    compile_ = grammars._compile

    def spy(text):
        threads.append(threading.current_thread())
        return compile_(text)

    monkeypatch.setattr(grammars, "_compile", spy)
    g = request_grammar({"guided_regex": "[a-c]{3,9}z"})

    async def main():
        loop_thread = threading.current_thread()
        assert await grammars.prepare(g) == ""
        assert threads[-1] is not loop_thread
        n = len(threads)
        assert await grammars.prepare(g) == ""
        assert len(threads) == n or threads[-1] is loop_thread
        bad = await grammars.prepare(request_grammar({"guided_regex": "(ab"}))
        assert "unclosed group" in bad

    asyncio.run(main())


def test_a_choice_mask_allows_exactly_the_first_tokens_of_the_choices():
    tok = load_tokenizer("random:tiny-llama")
    g = tok.grammars
    m = g.matcher(request_grammar({"guided_choice": ["ab", "cd"]}))
    import numpy as np

    bits = np.zeros(g.words, "<u4")
    m.fill_mask(bits)
    allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
    assert sorted(allowed.tolist()) == sorted(tok.tok.encode("a", add_bos=False) + tok.tok.encode("c", add_bos=False))


def _allowed(g, grammar: str, prefix: list[int]) -> list[int]:
    import numpy as np

    m = g.matcher(grammar)
    assert m.advance(prefix)
    bits = np.zeros(g.words, "<u4")
    m.fill_mask(bits)
    return np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")).tolist()


@pytest.mark.parametrize(
    "fields, ascii_fields",
    [
        ({"guided_regex": r"\d{3}-[\dx]"}, {"guided_regex": r"[0-9]{3}-[0-9x]"}),
        ({"guided_regex": r"\D+"}, {"guided_regex": r"[^0-9]+"}),
        (
            {"guided_json": {"type": "string", "pattern": r"^\d\d$"}},
            {"guided_json": {"type": "string", "pattern": r"^[0-9][0-9]$"}},
        ),
    ],
)
def test_a_digit_class_in_a_regex_means_ascii_digits(fields, ascii_fields):
    """\\d is [0-9], as in JSON Schema's ECMA-262 patterns and vLLM's grammar engines: the engine's own
    \\d is Unicode's, so a random model filled a `\\d{3}` with Osmanya and Kirat Rai digits (a CI run),
    which a client's [0-9] or ECMA check rejects. The masks equal those of the [0-9] spelling."""
    tok = load_tokenizer("random:tiny-llama")
    g = tok.grammars
    prefix = tok.tok.encode('"', add_bos=False) if "guided_json" in fields else []
    assert _allowed(g, request_grammar(fields), prefix) == _allowed(g, request_grammar(ascii_fields), prefix)


@pytest.mark.parametrize(
    "pattern, ascii_pattern",
    [
        (r"\d{3}", r"[0-9]{3}"),
        (r"[\d,]\D", r"[0-9,][^0-9]"),
        (r"\\d", r"\\d"),  # an escaped backslash, then the letter d
        (r"\\\d", r"\\[0-9]"),
        (r"[\]\d]", r"[\]0-9]"),  # an escaped bracket inside a class
        (r"[^\D]", r"[^\D]"),  # \D inside a class has no class spelling: left to the engine
    ],
)
def test_ascii_digit_classes_rewrites_only_unescaped_digit_classes(pattern, ascii_pattern):
    assert ascii_digit_classes(pattern) == ascii_pattern


@pytest.mark.parametrize(
    "masks, vocab, why",
    [(0, 0, "not enabled"), (2, 64, "exceeds the ring's masks"), (2, 4096, "")],
)
def test_the_ring_must_have_masks_that_cover_the_vocabulary(masks, vocab, why):
    import os

    from blink.dpu.request_tracker import RequestTracker
    from blink.protocol.ring_geometry import RingGeometry
    from blink.protocol.transport import ShmTransport
    from blink.protocol.wire import SubmitRequest

    tok = load_tokenizer("random:tiny-llama")  # vocabulary 512
    t = ShmTransport.create(f"blink-test-masks-{os.getpid()}", RingGeometry(4, 64, 8, masks, vocab))
    try:
        tracker = RequestTracker(t, grammars=tok.grammars)
        req = SubmitRequest(1, [1, 2], 4, grammar=request_grammar({"guided_regex": "a+"}))
        got = tracker.check_grammar(req)
        assert (why in got) if why else got is None
        assert tracker.masks.n_owned == masks
    finally:
        t.close()
        t.unlink()


# -- through the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    yield from tiny_server(KEY)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return client_of(server, KEY)


def valid_or_truncated(text: str, finish: str, schema: dict) -> None:
    if finish == "length":
        return  # cut by max_tokens: reported as such, not checked
    assert finish == "stop", finish
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_output_validates_under_its_schema(client, server, i):
    r = client.completions.create(
        model=server.model,
        prompt="data:",
        max_tokens=160,
        temperature=1.0,
        seed=i,
        extra_body={"guided_json": SCHEMAS[i]},
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", "the test schemas are bounded: a truncated output means a runaway"
    valid_or_truncated(c.text, c.finish_reason, SCHEMAS[i])


def test_chat_response_format_json_schema_strict_and_json_object(client, server):
    msgs = [{"role": "user", "content": "a point"}]
    schema = SCHEMAS[9]
    rf = {"type": "json_schema", "json_schema": {"name": "point", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=80, response_format=rf)
    valid_or_truncated(r.choices[0].message.content, r.choices[0].finish_reason, schema)
    r = client.chat.completions.create(
        model=server.model, messages=msgs, max_tokens=200, seed=1, response_format={"type": "json_object"}
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_and_choice_outputs_match(client, server):
    pattern = r"[a-c]{2}-\d{3}"
    for seed in range(3):
        r = client.completions.create(
            model=server.model, prompt="x", max_tokens=20, seed=seed, extra_body={"guided_regex": pattern}
        )
        assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
        r = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "pick"}],
            max_tokens=10,
            seed=seed,
            extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
        )
        assert r.choices[0].message.content in ("alpha", "beta", "gamma")


def test_a_lark_grammar_and_n_choices_streamed(client, server):
    stream = client.completions.create(
        model=server.model,
        prompt="x",
        max_tokens=30,
        n=2,
        stream=True,
        extra_body={"guided_grammar": 'start: "(" item ("," item)* ")"\nitem: /[0-9]/'},
    )
    text = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.text
    for t in text:
        assert re.fullmatch(r"\(\d(,\d)*\)", t) or len(t) >= 29, t


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=99)
    pets: list[str] = pydantic.Field(max_length=2)


def test_openai_parse_with_a_pydantic_model(client, server):
    r = client.beta.chat.completions.parse(
        model=server.model,
        messages=[{"role": "user", "content": "a person"}],
        response_format=Person,
        max_tokens=120,
        seed=7,
    )
    assert r.choices[0].finish_reason == "stop"
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and 0 <= p.age <= 99


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "wrong"}}}}, "wrong"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"guided_regex": "(ab"}, "unclosed group"),
        ({"guided_grammar": "start: undefined_rule"}, "undefined_rule"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{bad"}}},
            "not valid JSON",
        ),
        ({"guided_json": DEEP}, "recursion limit"),  # was a 500
    ],
)
def test_an_invalid_constraint_is_a_400_naming_what_is_wrong(client, server, extra, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="x", max_tokens=5, extra_body=extra)
    assert needle in str(e.value)
    field = next(iter(extra))  # the field that holds the constraint (was always "response_format")
    assert e.value.param is not None and e.value.param.startswith(field), e.value.param
    # the server is fine afterwards
    assert client.completions.create(model=server.model, prompt="x", max_tokens=2).choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_the_engine_fails_while_generating_ends_the_request_with_a_400(client, server, stream):
    """WIDE compiles, but the engine's parser gives up at the first token (its row limit). The request
    ends with a 400 that quotes the engine, streamed or not; before, the matcher's error left only EOS
    allowed and the client got a 200 of "{" with finish_reason "stop" (invalid under its schema)."""
    kw = dict(model=server.model, prompt="x", max_tokens=8, extra_body={"guided_json": WIDE})
    failures = server.metrics()["blink_frontend_constraint_failures_total"]
    if not stream:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw)
        assert "structured output" in str(e.value) and "max is 2000" in str(e.value)
    else:
        with pytest.raises(openai.APIError) as e:
            for _ in client.completions.create(stream=True, **kw):
                pass
        assert "max is 2000" in str(e.value)
    assert client.completions.create(model=server.model, prompt="x", max_tokens=2).choices[0].finish_reason
    assert server.get("/health")[0] == 200
    m = server.metrics()  # operators see it counted apart from other errors
    assert m["blink_frontend_constraint_failures_total"] == failures + 1 and m["blink_frontend_slot_faults_total"] == 0


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:llama3-8b", "default"])
def test_the_engine_reads_every_token_as_the_tokenizer_spells_it(model):
    """The grammar engine's bytes of every id are the tokenizer's, and its EOS is the model's. The
    synthetic tokenizer has holes in its ids (no id 0; BOS/EOS at 128,000 and up for Llama 3), which
    the engine's own reader numbered in order: it allowed id 258 (byte 0xad) in a mask and refused it
    when consumed, ending a guided_choice of "\u00a96\u00ad" in error (a fuzz finding), and it
    had no EOS for llama3-8b."""
    from blink.dpu.grammar_vocab import byte_level_chars

    tok = load_tokenizer(model)
    engine, chars = tok.grammars.tokenizer, byte_level_chars()
    vocab = tok.tok._tok.get_vocab(with_added_tokens=False)
    specials = set(tok.tok._tok.get_added_tokens_decoder())
    have = set(vocab.values()) | specials
    assert engine.eos_tokens == [t for t in tok.eos_ids if t in have] != []  # those the tokenizer spells
    for s, i in vocab.items():
        if i not in specials and i < tok.info.vocab_size and s != "\u00ff":  # byte 0xff: the engine's own marker
            assert engine.decode_bytes([i]) == bytes(chars[c] for c in s), (i, s)
    m = tok.grammars.matcher(request_grammar({"guided_choice": ["f", "\u00a96\u00ad"]}))
    assert m.advance(tok.tok.encode("\u00a96\u00ad", add_bos=False)), m.error
    end = np.zeros(tok.grammars.words, np.uint32)
    m.fill_mask(end)
    assert np.flatnonzero(np.unpackbits(end.view(np.uint8), bitorder="little")).tolist() == engine.eos_tokens


def test_a_tokenizer_the_engine_cannot_read_disables_structured_output_with_a_400(caplog):
    """A tokenizer llguidance cannot read (here a word-level one without a decoder: "can't determine
    decoder type") used to raise where the frontend's request tracker is built, so `blink serve` did
    not start for that model. Structured output is an option: the frontend serves without it, logs
    why, and a constrained request gets a 400 naming that reason."""
    import asyncio

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from blink.dpu import openai_api as api
    from blink.dpu.request_intake import RequestIntake
    from blink.dpu.tokenizer import FrontendTokenizer, ModelInfo
    from blink.models.tokenizer import Tokenizer

    hf = HFTokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok = FrontendTokenizer(Tokenizer(hf, None, None, [2]), ModelInfo("words", 8))
    with caplog.at_level("WARNING", logger="blink.structured"):
        assert tok.grammars is None
    assert "structured output is off" in caplog.text and "decoder" in caplog.text
    intake = RequestIntake.__new__(RequestIntake)
    intake.tok = tok
    r = api.parse(api.CompletionRequest, json.dumps({"model": "words", "prompt": "a", "guided_regex": "a+"}).encode())
    with pytest.raises(api.APIError) as e:
        asyncio.run(intake._constraint(r))
    assert e.value.status == 400 and e.value.param == "guided_regex" and "decoder" in e.value.message
    unconstrained = api.parse(api.CompletionRequest, b'{"model": "words", "prompt": "a"}')
    assert asyncio.run(intake._constraint(unconstrained)) is None


def test_grammars_of_a_synthetic_tokenizer_whose_eos_lies_past_its_tokens():
    """random:llama3-8b's byte tokenizer has 258 tokens and EOS 128009: `blink serve` built its grammar
    engine at start and died with llguidance's "EOS token ID 128009 is out of range"."""
    from blink.dpu.tokenizer import load_tokenizer

    tok = load_tokenizer("random:llama3-8b")
    assert tok.grammars.vocab_size == 128256


def test_the_structured_benchmark_times_masks_on_a_model_tokenizer():
    """bench.serving.structured's frontend part (it called a tokenizer method that no longer exists)."""
    from bench.serving.structured import mask_times

    out = mask_times("random:tiny-llama", 1)
    assert out["schemas"] and all(s["us_p50"] > 0 for s in out["schemas"].values())


def test_the_forced_tokens_benchmark_walks_each_document_through_its_schema():
    """bench.serving.forced_tokens: every document completes its schema; jump-forward saves steps
    (the keys and punctuation are forced) and never costs any."""
    from bench.serving.forced_tokens import cases, walk

    tok = load_tokenizer("random:tiny-llama")
    for schema, doc in cases().values():
        r = walk(tok, schema, doc)
        assert r["tokens"] == len(doc.encode())  # one byte a token
        assert 0 < r["steps_jump_forward"] < r["steps"] and r["forced_tokens"] > 0


def test_metrics_count_the_masks_of_constrained_tokens_and_the_rows_that_sat_out(client, server):
    """/metrics: blink_mask_latency_seconds counts a mask per constrained token read (reader cycle ->
    mask posted; after the last one too when the reader reads it before its slot shows completed: the
    device stores the count before the state), and the device's mask_late_rows is exported; the
    structured benchmark reads both back (bench.serving.structured.scrape)."""
    from bench.serving.structured import masks_between, scrape

    before = scrape(server.url, KEY)
    r = client.completions.create(
        model=server.model, prompt="x", max_tokens=40, extra_body={"guided_regex": "[a-z]{24}"}
    )
    n = r.usage.completion_tokens
    after = scrape(server.url, KEY)
    got = masks_between(before, after, n)
    assert n - 1 <= got["frontend"]["masks"] <= n, (got, n)
    assert got["frontend"]["us_p50"] > 0 and got["sat_out_rows"] >= 0
    free = scrape(server.url, KEY)
    client.completions.create(model=server.model, prompt="x", max_tokens=8)
    assert masks_between(free, scrape(server.url, KEY), 8)["frontend"]["masks"] == 0  # unconstrained: none


def test_the_boolean_schemas():
    """`true` admits any JSON value (the engine's conversion refused it: a 400); `false` admits none."""
    grammars = load_tokenizer("random:tiny-llama").grammars
    assert grammars.check(request_grammar({"guided_json": True})) == ""
    assert request_grammar({"guided_json": True}) == request_grammar({"guided_json": {}})
    with pytest.raises(GrammarError, match="admits no value") as e:
        request_grammar({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": False}}})
    assert e.value.param == "response_format.json_schema.schema"


def _allowed_after(grammar: str, text: str) -> set[str]:
    """The texts of the tokens the grammar allows after `text` (tiny-llama's byte-level tokenizer)."""
    tok = load_tokenizer("random:tiny-llama")
    m = tok.grammars.matcher(grammar)
    assert m.advance(tok.tok.encode(text, False))
    bits = np.zeros(tok.grammars.words, "<u4")
    m.fill_mask(bits)
    return {tok.decode([i]) for i in np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))}


@pytest.mark.parametrize(
    "fields, after_brace",
    [
        ({"guided_json": {"type": "object"}}, {'"', "}"}),  # Blink's default: no whitespace (docs/decisions.md)
        ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": False}}, None),
        ({"structured_outputs": {"json_object": True, "whitespace_pattern": "[ ]?"}}, {'"', "}", " "}),
        ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]?"}, {'"', "}", " "}),
        ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": "\n?"}, {'"', "}", "\n"}),
    ],
)
def test_the_whitespace_a_json_constraint_allows_follows_the_request(fields, after_brace):
    """vLLM's disable_any_whitespace and whitespace_pattern (structured_outputs), and its older
    guided_whitespace_pattern, set the whitespace allowed between JSON tokens (the first two were
    accepted and ignored, the third refused as an unknown field). disable_any_whitespace false allows
    the engine's whitespace (space, tab, newlines)."""
    allowed = _allowed_after(request_grammar(fields), "{")
    assert allowed == (after_brace or {'"', "}", " ", "\t", "\n", "\r"}), allowed


def test_a_bad_whitespace_option_is_a_400_naming_its_field():
    with pytest.raises(GrammarError) as e:
        request_grammar({"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}})
    assert e.value.param == "structured_outputs"
    grammars = load_tokenizer("random:tiny-llama").grammars
    bad = request_grammar({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "(("})
    assert "unclosed group" in grammars.check(bad)


def test_guided_whitespace_pattern_is_served(client, server):
    r = client.completions.create(
        model=server.model,
        prompt="x",
        max_tokens=40,
        extra_body={"guided_json": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"],
                                    "additionalProperties": False},
                    "guided_whitespace_pattern": "[ ]?"},
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "length" or json.loads(c.text).keys() == {"b"}, c
