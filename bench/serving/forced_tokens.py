"""How many device steps jump-forward would save under JSON schemas: the tokens that a schema forces
(its grammar allows one continuation only), which the frontend could write into the ring itself
instead of waiting for the device to sample them one step each.

    python -m bench.serving.forced_tokens                 # SmolLM2's tokenizer (`blink pull`)
    python -m bench.serving.forced_tokens --model PATH    # another model's tokenizer

For each schema a valid document (compact JSON, the values a model would write) is tokenized as the
tokenizer does and fed to a fresh matcher token by token. At each position the matcher reports the
forced bytes, as the tokens the tokenizer makes of them (llguidance's compute_ff_tokens). Without
jump-forward every token is one step. With it, a run of forced tokens that the document's own tokens
begin with is written ahead, and the step that reads it also samples the next token: the run costs
no step of its own. A forced run that the document tokenizes otherwise (a key whose forced bytes end
inside one of its tokens) is not taken. Reported per schema: tokens, steps without and with
jump-forward, positions where the mask allows one token only, and forced runs not taken.
The JSON holds the date, host, commit and command (default
bench/results/forced_tokens-cpu-<commit>.json); no device is involved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from bench.common import add_commit_arg, git_commit, metadata, result_path, write_json
from bench.serving.structured import schema_and_doc
from blink.dpu.structured import json_schema_grammar
from blink.dpu.tokenizer import load_tokenizer

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
            "required": ["name", "email"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer"}, "price": {"type": "number"}},
                "required": ["sku", "quantity", "price"],
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "status", "customer", "items", "gift"],
}
ORDER_DOC = {
    "order_id": 48213,
    "status": "shipped",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com"},
    "items": [{"sku": "KB-104", "quantity": 2, "price": 49.5}, {"sku": "MS-9", "quantity": 1, "price": 19.99}],
    "gift": False,
}
# the schema tool_choice "required" builds for one function (blink/dpu/tool_parsers.py), and a call
WEATHER_CALL = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
        "required": ["name", "arguments"],
    },
}
WEATHER_DOC = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]


def cases() -> dict[str, tuple[dict, str]]:
    out = {f"flat_{n}_fields": schema_and_doc(n) for n in (2, 8, 32)}
    out["order"] = (ORDER, json.dumps(ORDER_DOC, separators=(",", ":")))
    out["tool_call"] = (WEATHER_CALL, json.dumps(WEATHER_DOC, separators=(",", ":")))
    return out


def walk(tok, schema: dict, doc: str) -> dict:
    """Feed the document's tokens to a matcher; count steps without and with jump-forward."""
    grammars = tok.grammars
    m = grammars.matcher(json_schema_grammar(schema, "bench")).m
    ids = tok.tok.encode(doc, add_bos=False)
    mask = np.empty(grammars.words, "<u4")
    single = steps = not_taken = forced = 0
    i = 0
    while i < len(ids):
        ff = m.compute_ff_tokens()
        if ff and ids[i : i + len(ff)] == ff:
            assert m.consume_tokens(ff), m.get_error()
            i += len(ff)
            forced += len(ff)
            if i == len(ids):
                steps += 1  # the run ends the document: the step that reads it samples EOS
                break
        elif ff:
            not_taken += 1
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        single += int(np.unpackbits(mask.view(np.uint8)).sum()) == 1
        assert m.consume_token(ids[i]), (i, m.get_error())
        steps += 1
        i += 1
    assert m.is_accepting(), "the document does not complete its schema"
    return {
        "tokens": len(ids),
        "steps": len(ids),
        "steps_jump_forward": steps,
        "saved": round(1 - steps / len(ids), 3),
        "forced_tokens": forced,
        "single_token_masks": single,
        "forced_runs_not_taken": not_taken,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="whose tokenizer (a model spec, as blink serve --model)")
    ap.add_argument("--out", help="JSON file (default bench/results/forced_tokens-cpu-<commit>.json)")
    add_commit_arg(ap)
    a = ap.parse_args()
    tok = load_tokenizer(a.model)
    schemas = {}
    for name, (schema, doc) in cases().items():
        schemas[name] = walk(tok, schema, doc)
        print(name, schemas[name], flush=True)
    commit = a.commit or git_commit()
    result = {
        "bench": "forced_tokens",
        **metadata(commit, [os.path.basename(sys.executable), *sys.argv], gpu="cpu"),
        "model": tok.name,
        "vocab": tok.info.vocab_size,
        "schemas": schemas,
    }
    write_json(a.out or str(result_path("forced_tokens", "cpu", commit[:7])), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
