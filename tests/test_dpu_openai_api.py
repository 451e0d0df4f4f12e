"""Request-shape rules of blink/dpu/openai_api.py that need no server: prompt lists and n."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from blink.dpu import openai_api as api


def req(**kw) -> api.CompletionRequest:
    return api.parse(api.CompletionRequest, msgspec.json.encode({"model": "m", **kw}))


@pytest.mark.parametrize(
    "prompt,want",
    [
        ("hi", ["hi"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["a", "b"], ["a", "b"]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        (["a", [3, 4]], ["a", [3, 4]]),
        (["only"], ["only"]),
    ],
)
def test_completion_prompts(prompt, want):
    assert api.completion_prompts(req(prompt=prompt)) == want


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [True, 2], [["a"]], {"x": 1}, 5, [[1, 2], 3]])
def test_completion_prompts_rejects(prompt):
    with pytest.raises(api.APIError) as e:
        api.completion_prompts(req(prompt=prompt))
    assert e.value.status == 400 and e.value.param == "prompt"


def test_choices_per_prompt_and_seeds():
    assert api.choices_per_prompt(req(prompt="x")) == 1
    assert api.choices_per_prompt(req(prompt="x", n=4), 3) == 4
    for n, prompts in ((0, 1), (-2, 1), (api.MAX_CHOICES + 1, 1), (100, 3)):
        with pytest.raises(api.APIError) as e:
            api.choices_per_prompt(req(prompt="x", n=n), prompts)
        assert e.value.param == "n"
    r = req(prompt="x", seed=2**64 - 1)
    seeds = [api.sampling_params(r, 1, [5], [], 4, choice=i).sampling.seed for i in range(3)]
    assert seeds == [2**64 - 1, 0, 1]  # seed + i, modulo 2**64


def test_n_is_capped_by_max_n():
    assert api.choices_per_prompt(req(prompt="x", n=8), 1, max_n=8) == 8
    with pytest.raises(api.APIError) as e:
        api.choices_per_prompt(req(prompt="x", n=9), 1, max_n=8)
    assert e.value.status == 400 and e.value.param == "n" and "--max-n" in e.value.message
    assert api.choices_per_prompt(req(prompt="x", n=api.DEFAULT_MAX_N)) == api.DEFAULT_MAX_N
    with pytest.raises(api.APIError):
        api.choices_per_prompt(req(prompt="x", n=api.DEFAULT_MAX_N + 1))


@pytest.mark.parametrize("t", [0.0, 1e-40, 5e-324, 9.99e-6])
def test_a_temperature_below_the_epsilon_is_greedy_and_goes_to_the_ring_as_zero(t):
    from blink.protocol.layout import SLOT_DTYPE

    sub = api.sampling_params(req(prompt="x", temperature=t, top_p=0.9, top_k=5), 1, [5], [], 4)
    assert sub.sampling.greedy
    rec = np.zeros((), SLOT_DTYPE)
    sub.sampling.write_slot(rec)
    assert rec["temperature"] == 0.0


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1e-40),
        ("temperature", 2.0000001),
        ("top_p", 0.0),
        ("top_k", 2**31),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("logprobs", 21),
    ],
)
def test_out_of_range_sampling_fields_are_a_400_naming_them(field, value):
    with pytest.raises(api.APIError) as e:
        api.sampling_params(req(prompt="x", **{field: value}), 1, [5], [], 4)
    assert e.value.status == 400 and e.value.param == field, e.value.message


def test_logit_bias_out_of_vocabulary_or_not_finite_is_a_400():
    for bias in ({"512": 1.0}, {"-1": 1.0}, {"5": float("nan")}, {"x": 1.0}):
        with pytest.raises(api.APIError) as e:
            api.sampling_params(req(prompt="x", logit_bias=bias), 1, [5], [], 4, vocab_size=512)
        assert e.value.status == 400 and e.value.param.startswith("logit_bias")


def test_a_number_json_cannot_hold_is_a_400():
    with pytest.raises(api.APIError) as e:
        api.parse(api.CompletionRequest, b'{"model": "m", "prompt": "x", "temperature": 1e999}')
    assert e.value.status == 400 and e.value.param == "temperature"


@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_every_float_must_be_finite(field, value):
    """The one definition the frontend and both devices check (a ring writer may bypass the API)."""
    from blink.protocol.sampling_params import SamplingParams

    assert SamplingParams(**{field: value}).problem()[0] == field
    assert SamplingParams(logit_bias=((3, value),)).problem()[0] == "logit_bias"
    assert SamplingParams().problem() is None
