"""Request-shape rules of blink/dpu/openai_api.py that need no server: prompt lists and n."""

from __future__ import annotations

import msgspec
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
    seeds = [api.sampling_params(r, 1, [5], [], 4, choice=i).seed for i in range(3)]
    assert seeds == [2**64 - 1, 0, 1]  # seed + i, modulo 2**64
