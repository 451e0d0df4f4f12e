"""`blink bench serve`: load an OpenAI-compatible server and report what `vllm bench serve` reports.

Requests are streamed /v1/completions with token-id prompts and `ignore_eos`, so every request
produces exactly its output length, from one asyncio client (arrivals: Poisson at --request-rate,
or all at once; --max-concurrency caps the requests in flight). Datasets:

  random    prompts cut from one long tokenized text (the server's own /tokenize, so the ids are
            valid for its vocabulary), --random-input-len / --random-output-len tokens each
  sharegpt  a ShareGPT-format JSON file (--dataset-path): each conversation's first human turn is
            the prompt, the length of the reply after it the output length (as vLLM samples it)

Reported: completed and failed requests, duration, input / output tokens, request and token
throughput, TTFT, TPOT (per request: (e2e - TTFT) / (output - 1)) and ITL (gaps between token
chunks) means, medians and percentiles; --result-file writes them as JSON with every request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which be are an or had "
    "time people year way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night "
    "point home water room mother area money story fact month lot right study book eye job word business"
).split()


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    tokens: int = 0
    itl_s: list[float] = field(default_factory=list)


async def _post_json(session: Any, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as r:
        js = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {js}")
        return js


async def random_requests(
    session: Any, base: str, model: str, n: int, in_len: int, out_len: int, seed: int
) -> list[tuple[list[int], int]]:
    """n prompts of in_len token ids cut from one tokenized random text (the server's /tokenize)."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(_WORDS) for _ in range(max(64, 2 * in_len + 64)))
    ids = (
        await _post_json(session, base + "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})
    )["tokens"]
    while len(ids) < in_len + 1:
        ids = ids + ids
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(ids) - in_len + 1)
        out.append((ids[start : start + in_len], out_len))
    return out


async def sharegpt_requests(
    session: Any, base: str, model: str, path: str, n: int, seed: int, max_len: int
) -> list[tuple[list[int], int]]:
    """The first human turn of each conversation as the prompt; the reply's token count as the
    output length; pairs longer than max_len (prompt + output) or with a reply under 4 tokens skipped."""
    with open(path) as f:
        data = json.load(f)
    pairs = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) >= 2 and turns[0].get("from") in ("human", "user") and turns[1].get("value"):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(seed).shuffle(pairs)
    out: list[tuple[list[int], int]] = []
    for prompt, reply in pairs:
        if len(out) == n:
            break
        tok = base + "/tokenize"
        p = (await _post_json(session, tok, {"model": model, "prompt": prompt}))["tokens"]
        o = (await _post_json(session, tok, {"model": model, "prompt": reply, "add_special_tokens": False}))["count"]
        if o >= 4 and 4 <= len(p) and len(p) + o <= max_len:
            out.append((p, o))
    if len(out) < n:
        raise ValueError(f"{path}: only {len(out)} usable conversations for {n} prompts")
    return out


async def _one(session: Any, base: str, model: str, prompt: list[int], n_out: int) -> RequestResult:
    res = RequestResult(len(prompt), n_out)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n_out,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    t0 = time.perf_counter()
    last = t0
    try:
        async with session.post(base + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = str(ev["error"].get("message"))
                    return res
                usage = ev.get("usage") or {}
                n = int(usage.get("completion_tokens") or 0)
                if n > res.tokens:  # a chunk that carries new tokens (continuous usage counts them)
                    now = time.perf_counter()
                    if res.tokens == 0:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last, res.tokens = now, n
        res.e2e_s = time.perf_counter() - t0
        res.ok = res.tokens > 0
    except Exception as e:  # a refused connection, a reset: the request failed, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    a = np.asarray(values) * 1e3
    out = {"mean": float(a.mean()), "median": float(np.median(a))}
    out.update({f"p{p:g}": float(np.percentile(a, p)) for p in percentiles})
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=conn) as session:
        model = args.model
        if model is None:
            async with session.get(base + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        if args.dataset == "random":
            reqs = await random_requests(
                session, base, model, args.num_prompts, args.random_input_len, args.random_output_len, args.seed
            )
        else:
            if not args.dataset_path:
                raise SystemExit("--dataset sharegpt needs --dataset-path")
            reqs = await sharegpt_requests(
                session, base, model, args.dataset_path, args.num_prompts, args.seed, args.max_model_len
            )
        rng = np.random.default_rng(args.seed)
        gaps = (
            np.zeros(len(reqs))
            if args.request_rate == float("inf")
            else rng.exponential(1.0 / args.request_rate, len(reqs))
        )
        limit = asyncio.Semaphore(args.max_concurrency or len(reqs))

        async def fire(p: list[int], o: int) -> RequestResult:
            async with limit:
                return await _one(session, base, model, p, o)

        t0 = time.perf_counter()
        tasks = []
        for (p, o), gap in zip(reqs, gaps, strict=True):
            if gap:
                await asyncio.sleep(float(gap))
            tasks.append(asyncio.ensure_future(fire(p, o)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    pct = [float(x) for x in args.metric_percentiles.split(",")]
    out_tok = sum(r.tokens for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.tokens - 1) for r in ok if r.tokens > 1]
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "base_url": base,
        "model": model,
        "dataset": args.dataset,
        "num_prompts": len(reqs),
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tok / duration,
        "total_token_throughput": (out_tok + sum(r.prompt_len for r in ok)) / duration,
        "ttft_ms": _stats([r.ttft_s for r in ok], pct),
        "tpot_ms": _stats(tpot, pct),
        "itl_ms": _stats([g for r in ok for g in r.itl_s], pct),
        "e2el_ms": _stats([r.e2e_s for r in ok], pct),
        "requests": [{k: v for k, v in asdict(r).items() if k != "itl_s"} for r in results],
    }


def report(res: dict[str, Any]) -> str:
    lines = [
        "=" * 18 + " Serving Benchmark Result " + "=" * 18,
        f"{'Successful requests:':<40}{res['completed']:<10}",
        f"{'Failed requests:':<40}{res['failed']:<10}",
        f"{'Benchmark duration (s):':<40}{res['duration_s']:<10.2f}",
        f"{'Total input tokens:':<40}{res['total_input_tokens']:<10}",
        f"{'Total generated tokens:':<40}{res['total_output_tokens']:<10}",
        f"{'Request throughput (req/s):':<40}{res['request_throughput']:<10.2f}",
        f"{'Output token throughput (tok/s):':<40}{res['output_throughput']:<10.2f}",
        f"{'Total token throughput (tok/s):':<40}{res['total_token_throughput']:<10.2f}",
    ]
    for key, title in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-token Latency"),
    ):
        lines.append("-" * 20 + f" {title} " + "-" * 20)
        short = key.split("_")[0].upper()
        for stat, v in res[key].items():
            name = "Mean" if stat == "mean" else "Median" if stat == "median" else stat.upper()
            lines.append(f"{f'{name} {short} (ms):':<40}{v:<10.2f}")
    lines.append("=" * 62)
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--api-key")
    p.add_argument("--dataset", "--dataset-name", dest="dataset", choices=("random", "sharegpt"), default="random")
    p.add_argument("--dataset-path", help="ShareGPT-format JSON (--dataset sharegpt)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096, help="sharegpt: longest prompt + output kept")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all)")
    p.add_argument("--max-concurrency", type=int, default=0, help="requests in flight at most (0: no cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", default="99", help='e.g. "50,90,99"')
    p.add_argument("--result-file", help="write the results (and every request) as JSON")


def main(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        raise SystemExit("--num-prompts and the random lengths must be >= 1")
    res = asyncio.run(run(args))
    print(report(res))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["completed"] else 1
