"""Grammar engines for structured output, measured on this CPU: llguidance vs xgrammar.

For each JSON schema of growing size (and a regex and a choice), a valid document is tokenized with
the model's tokenizer and fed token by token to a fresh matcher: per token, the time to compute the
allowed-token bitmask for the next position (what the frontend does before each device step) and to
advance the matcher by the token. Reports compile time, mask time p50/p99 per token (µs), the import
time of each engine and whether importing it loads torch (the frontend loads no torch), and which
grammar kinds each engine accepts (JSON schema, regex, choice, EBNF/Lark).

    python -m bench.serving.grammar_engines [--model default] [--engines llguidance,xgrammar] [--commit C]

Writes bench/results/grammar_engines-emulated-<commit>.json (a CPU measurement: the frontend's side).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from bench.common import add_commit_arg, git_commit, metadata, result_path, write_json
from blink.dpu.tokenizer import load_tokenizer


def _props(n: int) -> dict:
    kinds = [{"type": "string"}, {"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "boolean"}]
    return {f"field_{i}": kinds[i % 3] for i in range(n)}


def _doc(n: int) -> dict:
    vals = ["some text", 42, True]
    return {f"field_{i}": vals[i % 3] for i in range(n)}


NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["name", "age", "tags", "address", "score"],
}
NESTED_DOC = {"name": "Ada", "age": 36, "tags": ["a", "c"], "address": {"city": "London", "zip": "12345"}, "score": 9.5}


def cases() -> list[tuple[str, str, object, str]]:
    """(name, kind, grammar spec, a text it accepts)."""
    out = []
    for n in (2, 8, 32):
        schema = {"type": "object", "properties": _props(n), "required": list(_props(n))}
        out.append((f"json_flat_{n}", "json", schema, json.dumps(_doc(n), separators=(",", ":"))))
    out.append(("json_nested", "json", NESTED, json.dumps(NESTED_DOC, separators=(",", ":"))))
    out.append(("regex_date", "regex", r"\d{4}-\d{2}-\d{2}", "2024-05-17"))
    out.append(("choice", "choice", ["positive", "negative", "neutral"], "neutral"))
    return out


class Llg:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance

        self.llg = llguidance
        self.tok = tok.grammars.tokenizer  # the engine's tokenizer as the server builds it (grammar_vocab.py)
        self.words = (tok.info.vocab_size + 31) // 32

    def compile(self, kind, spec):
        M = self.llg.LLMatcher
        if kind == "json":
            g = M.grammar_from_json_schema(json.dumps(spec), defaults={"whitespace_flexible": False})
        elif kind == "regex":
            g = M.grammar_from_regex(spec)
        elif kind == "choice":
            g = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        else:
            g = M.grammar_from_lark(spec)
        err = M.validate_grammar(g, self.tok)
        if err:
            raise ValueError(err)
        return g

    def matcher(self, g):
        return self.llg.LLMatcher(self.tok, g)

    def step(self, m, buf, token):
        m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
        assert buf[token >> 5] >> (token & 31) & 1, "the document's token is masked out"
        assert m.consume_token(token), m.get_error()


class Xgr:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar

        self.xgr = xgrammar
        vocab = [tok.tok.token_str(i) for i in range(tok.info.vocab_size)]
        info = xgrammar.TokenizerInfo(
            vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=tok.info.vocab_size, stop_token_ids=list(tok.eos_ids)
        )
        self.compiler = xgrammar.GrammarCompiler(info)
        self.words = (tok.info.vocab_size + 31) // 32

    def compile(self, kind, spec):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        return c.compile_grammar(spec)

    def matcher(self, g):
        return self.xgr.GrammarMatcher(g)

    def step(self, m, buf, token):
        m.fill_next_token_bitmask(buf)
        assert buf[0, token >> 5] >> (token & 31) & 1, "the document's token is masked out"
        assert m.accept_token(token)


def measure(engine, tok, reps: int) -> dict:
    rows = {}
    for name, kind, spec, text in cases():
        t0 = time.perf_counter()
        g = engine.compile(kind, spec)
        compile_ms = (time.perf_counter() - t0) * 1e3
        ids = tok.tok.encode(text, add_bos=False)
        times = []
        for _ in range(reps):
            m = engine.matcher(g)
            buf = _buffer(engine)
            for t in ids:
                t0 = time.perf_counter_ns()
                engine.step(m, buf, t)
                times.append((time.perf_counter_ns() - t0) / 1e3)
        a = np.array(times)
        rows[name] = {
            "tokens": len(ids),
            "compile_ms": round(compile_ms, 2),
            "mask_us_p50": round(float(np.percentile(a, 50)), 1),
            "mask_us_p99": round(float(np.percentile(a, 99)), 1),
        }
        print(f"{engine.name:11s} {name:13s} {rows[name]}", flush=True)
    return rows


def _buffer(engine):
    if engine.name == "xgrammar":
        import torch

        return torch.zeros((1, engine.words), dtype=torch.int32)
    return np.zeros(engine.words, np.int32)


def coverage(engine) -> dict:
    lark = 'start: "a" b+\nb: "x" | "y"' if engine.name == "llguidance" else 'root ::= "a" b+\nb ::= "x" | "y"'
    out = {}
    for kind, spec in (("json", {"type": "object"}), ("regex", "[a-z]+"), ("choice", ["x", "y"]), ("grammar", lark)):
        try:
            engine.compile(kind, spec)
            out[kind] = True
        except Exception as e:  # an engine without the kind
            out[kind] = f"{type(e).__name__}: {e}"[:200]
    return out


def import_cost(module: str) -> dict:
    code = (
        f"import sys,time; t=time.perf_counter(); import {module}; print(time.perf_counter()-t, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return {"import_s": round(float(out[0]), 2), "loads_torch": out[1] == "True"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--reps", type=int, default=20)
    add_commit_arg(ap)
    a = ap.parse_args(argv)
    tok = load_tokenizer(a.model)
    commit = a.commit or git_commit()
    result = metadata(commit, argv, gpu="cpu") | {"model": tok.name, "vocab": tok.info.vocab_size, "engines": {}}
    for name in a.engines.split(","):
        cls = {"llguidance": Llg, "xgrammar": Xgr}[name]
        cost = import_cost(name)
        engine = cls(tok)
        result["engines"][name] = cost | {"coverage": coverage(engine), "cases": measure(engine, tok, a.reps)}
        print(name, cost, result["engines"][name]["coverage"], flush=True)
    write_json(str(result_path("grammar_engines", "emulated", commit)), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
