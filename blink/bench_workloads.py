"""`blink bench serve` workloads that reuse prompt prefixes (blink/benchmark.py runs them).

  prefix              --num-prefixes shared system prompts of --prefix-len tokens, each request one
                      of them (in turn) + its own user turn of --random-input-len tokens (vLLM's
                      random dataset with --random-prefix-len, and its prefix_repetition dataset)
  sharegpt-multiturn  ShareGPT conversations of --min-turns..--max-turns human turns replayed turn by
                      turn: turn k's prompt is the whole history (human 1, reply 1, ..., human k), its
                      output length the token count of reply k, and turn k + 1 goes once turn k is
                      answered (the replies are the dataset's, so every turn resends the same history
                      a chat client would)

Prompts are token ids of the server's /tokenize, so they are valid for its vocabulary; a history is
the concatenation of its messages' ids, so each turn's prompt starts with the previous turn's.
"""

from __future__ import annotations

import asyncio
import functools
import random
from typing import Any

Request = tuple[list[int], int]  # (prompt ids, output tokens)


async def _tokens(session: Any, base: str, model: str, text: str, special: bool) -> list[int]:
    body = {"model": model, "prompt": text, "add_special_tokens": special}
    async with session.post(base + "/tokenize", json=body) as r:
        js = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"{base}/tokenize: HTTP {r.status}: {js}")
        return js["tokens"]


async def prefix_requests(session: Any, base: str, model: str, words: list[str], args: Any, seed: int) -> list[Request]:
    """args.num_prompts requests: shared prefix i % num_prefixes + a user turn of its own."""
    rng = random.Random(seed)
    need = args.prefix_len * args.num_prefixes + args.random_input_len * args.num_prompts + 1
    ids: list[int] = []
    while len(ids) < need:
        text = " ".join(rng.choice(words) for _ in range(max(256, min(need - len(ids), 50_000))))
        ids += await _tokens(session, base, model, text, False)
    prefixes = [ids[i * args.prefix_len : (i + 1) * args.prefix_len] for i in range(args.num_prefixes)]
    tail = ids[args.prefix_len * args.num_prefixes :]
    n = args.random_input_len
    return [
        (prefixes[i % args.num_prefixes] + tail[i * n : (i + 1) * n], args.random_output_len)
        for i in range(args.num_prompts)
    ]


@functools.lru_cache(maxsize=2)
def sharegpt_conversations(path: str, min_turns: int) -> tuple[tuple[str, ...], ...]:
    """The messages (human, gpt, human, gpt, ...) of every conversation with at least min_turns
    human turns, each answered (read once per process)."""
    from blink.bench_datasets import json_array_prefix

    with open(path, encoding="utf-8") as f:
        data = json_array_prefix(f.read())
    out = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        msgs = []
        for i, t in enumerate(turns):
            if t.get("from") != ("human" if i % 2 == 0 else "gpt") or not t.get("value"):
                break
            msgs.append(t["value"])
        msgs = msgs[: len(msgs) // 2 * 2]
        if len(msgs) // 2 >= min_turns:
            out.append(tuple(msgs))
    return tuple(out)


async def multiturn_conversations(session: Any, base: str, model: str, path: str, args: Any) -> list[list[Request]]:
    """args.num_prompts conversations of min_turns..max_turns turns each (history resent every turn);
    a conversation ends early where the history and the reply would pass args.max_model_len."""
    # off the event loop: a large file takes seconds, and a connection left idle meanwhile is closed
    # by the server's keep-alive timeout before the loop can notice (the next request on it fails)
    convs = list(await asyncio.to_thread(sharegpt_conversations, path, args.min_turns))
    random.Random(args.seed).shuffle(convs)
    out: list[list[Request]] = []
    for msgs in convs:
        if len(out) == args.num_prompts:
            break
        history: list[int] = []
        turns: list[Request] = []
        for k in range(min(len(msgs) // 2, args.max_turns)):
            human = await _tokens(session, base, model, msgs[2 * k], k == 0)
            reply = await _tokens(session, base, model, msgs[2 * k + 1], False)
            prompt = history + human
            if len(prompt) + max(len(reply), 4) > args.max_model_len:
                break
            turns.append((prompt, max(len(reply), 4)))
            history = prompt + reply
        if len(turns) >= args.min_turns:
            out.append(turns)
    if len(out) < args.num_prompts:
        raise ValueError(f"{path}: only {len(out)} conversations of >= {args.min_turns} turns fit")
    return out


def describe(convs: list[list[Request]]) -> dict[str, Any]:
    """What the JSON says of a conversation workload."""
    turns = [len(c) for c in convs]
    return {"conversations": len(convs), "turns": sum(turns), "turns_min": min(turns), "turns_max": max(turns)}
