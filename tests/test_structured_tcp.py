"""Structured output with the frontend on the far side of TCP: `blink serve --ring-listen` (ring,
emulated device, ring agent) and a frontend-only `blink serve --ring-address --transport tcp`; the
masks the frontend writes reach the device through the ring agent's writes like every ring word."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from structured_schemas import SCHEMAS

from blink.testing import ServeProcess

ARGS = ["--device", "emulated", "--model", "random:tiny-llama", "--n-slots", "4", "--num-kv-blocks", "128"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    key = ["--ring-secret-file", str(tmp_path_factory.mktemp("agent") / "ring.secret")]  # made by the GPU host
    gpu = ServeProcess([*ARGS, *key, "--ring-listen", "127.0.0.1:0"], timeout=180)
    try:
        fe = ServeProcess([*ARGS, *key, "--ring-address", gpu.agent, "--transport", "tcp"], timeout=180)
        try:
            assert any("ring transport tcp" in ln for ln in fe.log), "".join(fe.log)
            yield openai.OpenAI(base_url=fe.url + "/v1", api_key="x", max_retries=0, timeout=120), fe.model
        finally:
            assert fe.stop() == 0, "".join(fe.log)
    finally:
        assert gpu.stop() == 0, "".join(gpu.log)


@pytest.mark.parametrize("i", [9, 15, 27])
def test_schema_outputs_validate_over_tcp(client, i):
    c, model = client
    r = c.completions.create(model=model, prompt="x", max_tokens=160, seed=i, extra_body={"guided_json": SCHEMAS[i]})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[i])


def test_regex_streamed_over_tcp(client):
    c, model = client
    stream = c.completions.create(
        model=model, prompt="x", max_tokens=20, stream=True, extra_body={"guided_regex": r"\d{3}-[xy]{4}"}
    )
    text = "".join(ch.choices[0].text for ch in stream if ch.choices)
    assert re.fullmatch(r"\d{3}-[xy]{4}", text), text
