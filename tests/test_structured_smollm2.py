"""Structured output with the real SmolLM2-135M on the emulated device: the openai client's
`parse(response_format=PydanticModel)` and a choice, each one short request (this model runs at
about a token a second on the emulated device)."""

from __future__ import annotations

import openai
import pydantic
import pytest

from blink.models import registry
from blink.testing import ServeProcess

pytestmark = pytest.mark.skipif(registry.find_default() is None, reason="SmolLM2 not installed (blink pull)")


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    country: str = pydantic.Field(max_length=12)


@pytest.fixture(scope="module")
def client():
    s = ServeProcess(
        ["--device", "emulated", "--n-slots", "2", "--max-batch", "2", "--num-kv-blocks", "128"], timeout=180
    )
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300), s.model
    assert s.stop() == 0, "".join(s.log)


def test_parse_a_pydantic_model(client):
    c, model = client
    r = c.beta.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Name the capital of France as JSON."}],
        response_format=City,
        max_tokens=40,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City)


def test_choice(client):
    c, model = client
    r = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
        max_tokens=5,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].message.content in ("yes", "no")
