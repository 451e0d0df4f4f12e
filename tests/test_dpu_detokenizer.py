"""Incremental detokenizer: UTF-8 split across tokens, emoji, stop strings across token boundaries;
the stop-string automaton against a brute-force reference, and its cost."""

from __future__ import annotations

import random
import time

import pytest

from blink.dpu.detokenizer import IncrementalDetokenizer
from blink.dpu.stop_matcher import StopMatcher
from blink.dpu.tokenizer import PromptError, load_tokenizer


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def byte_tok():
    return load_tokenizer("random:tiny-llama")


def _stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    out = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    out.append(detok.finish())
    return out


@pytest.mark.parametrize(
    "text", ["héllo wörld 🤖🚀 日本語のテキスト", "emoji 👩‍👩‍👧‍👦 family", "plain ascii, code: x = f(1)\n"]
)
def test_every_delta_is_clean_utf8_and_joins_to_decode(smol, text):
    ids = smol.tok.encode(text)
    deltas = _stream(smol.detokenizer(), ids)
    assert "".join(deltas) == smol.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_char_split_over_byte_tokens_is_held_back(byte_tok):
    # The byte-level synthetic tokenizer gives one token per byte: a 4-byte emoji is 4 tokens.
    ids = byte_tok.tok.encode("a🤖b")
    assert len(ids) == 6
    d = byte_tok.detokenizer()
    assert d.push(ids[:1]) == "a"
    assert [d.push([t]) for t in ids[1:4]] == ["", "", ""]  # incomplete emoji: nothing yet
    assert d.push(ids[4:5]) == "🤖"
    assert d.push(ids[5:]) == "b"
    assert d.finish() == ""


def test_incomplete_char_at_the_end_is_flushed(byte_tok):
    ids = byte_tok.tok.encode("ok🤖")[:-1]  # generation stopped inside the emoji
    d = byte_tok.detokenizer()
    assert "".join(_stream(d, ids)) == "ok\ufffd"


def test_stop_string_across_tokens_is_never_emitted(byte_tok):
    text = "hello STOP world"
    ids = byte_tok.tok.encode(text)
    d = byte_tok.detokenizer(stop=["STOP"])
    out = []
    for t in ids:
        out.append(d.push([t]))
        if d.stopped:
            break
    assert "".join(out) == "hello "
    assert d.stopped and d.finish() == ""
    # the held-back partial "ST" was not sent before the match was known
    assert out[-3:] == ["", "", ""]


def test_partial_stop_prefix_is_released_when_it_does_not_match(byte_tok):
    ids = byte_tok.tok.encode("a STOrm")
    d = byte_tok.detokenizer(stop=["STOP"])
    deltas = [d.push([t]) for t in ids]
    assert deltas[2:5] == ["", "", ""]  # "S", "T", "O" held back
    assert deltas[5] == "STOr"
    assert "".join(deltas) + d.finish() == "a STOrm" and not d.stopped


def test_earliest_of_several_stop_strings_wins_with_multi_token_push(smol):
    ids = smol.tok.encode("one, two. three! four")
    d = smol.detokenizer(stop=["!", ". t"])
    assert d.push(ids) == "one, two"
    assert d.stopped


def test_stop_string_in_held_tail_at_finish(byte_tok):
    d = byte_tok.detokenizer(stop=["xyz"])
    ids = byte_tok.tok.encode("abxy")
    assert d.push(ids) == "ab"
    assert d.finish() == "xy"  # generation ended: the partial prefix is real text


def test_special_tokens_are_not_text(smol):
    d = smol.detokenizer()
    ids = smol.tok.encode("Paris.") + [smol.eos_ids[0]]
    assert "".join(_stream(d, ids)) == "Paris."
    # vLLM's skip_special_tokens=False: they are text
    d = smol.detokenizer(skip_special_tokens=False)
    eos_text = smol.tok.decode([smol.eos_ids[0]], skip_special_tokens=False)
    assert eos_text and "".join(_stream(d, ids)) == "Paris." + eos_text


def test_include_stop_string_in_output(byte_tok):
    """vLLM's include_stop_str_in_output: the text ends with the stop string, and nothing after it."""
    ids = byte_tok.tok.encode("hello STOP world")
    d = byte_tok.detokenizer(stop=["STOP", "wor"], include_stop=True)
    out = []
    for t in ids:
        out.append(d.push([t]))
        if d.stopped:
            break
    assert "".join(out) == "hello STOP" and d.stopped and d.finish() == ""


def test_chat_prompt_validation(smol):
    ids = smol.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    assert len(ids) == 37  # the SmolLM2 chat prompt of this question (env-facts §4)
    for bad in ([], "x", [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}], [3]):
        with pytest.raises(PromptError):
            smol.chat_prompt(bad)
    with pytest.raises(PromptError):
        smol.completion_prompt([1, 2, 10**9])
    with pytest.raises(PromptError):
        smol.completion_prompt("")
    assert smol.stop_ids([7, 2], ignore_eos=False) == [2, 7]
    assert smol.stop_ids([], ignore_eos=True) == []


def _first_stop(text: str, stops: list[str]) -> tuple[int, int] | None:
    """Reference: (end, length) of the first stop string to end in `text`, the longest of those."""
    for end in range(1, len(text) + 1):
        hits = [len(s) for s in stops if text[:end].endswith(s)]
        if hits:
            return end, max(hits)
    return None


def test_stop_matcher_agrees_with_the_reference():
    rng = random.Random(7)
    for _ in range(400):
        stops = list({"".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 4))})
        text = "".join(rng.choices("abc", k=rng.randint(0, 30)))
        m = StopMatcher(tuple(stops))
        state, got, pos = 0, None, 0
        for piece in (text[i : i + 3] for i in range(0, len(text), 3)):  # fed in pieces, as tokens come
            r = m.feed(piece, state)
            if r.end != -1:
                got = (pos + r.end, r.length)
                break
            state, pos = r.state, pos + len(piece)
            held = m.depth[state]
            seen = text[:pos]
            assert held == max((k for s in stops for k in range(len(s)) if k and seen.endswith(s[:k])), default=0)
        assert got == _first_stop(text, stops), (stops, text)


def test_stop_matching_is_linear_in_the_output(byte_tok):
    """16 stop strings of 1024 characters and 4000 one-character tokens: the old matcher re-sliced
    every stop prefix per token (seconds); each character is now looked at once."""
    stops = [chr(ord("A") + i) + "a" * 1023 for i in range(16)]
    d = byte_tok.detokenizer(stop=stops)
    ids = byte_tok.tok.encode("a" * 4000, add_bos=False)
    t0 = time.perf_counter()
    out = "".join(d.push([i]) for i in ids) + d.finish()
    took = time.perf_counter() - t0
    assert out == "a" * 4000 and not d.stopped
    assert took < 0.5, f"{took:.2f} s"
