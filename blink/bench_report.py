"""`blink bench serve` results: what each request measured, the token timeline, the summary statistics
and CDFs, the printed report and the JSON result file (blink/benchmark.py runs the load)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

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


def write_result(path: str, res: dict[str, Any]) -> None:
    """JSON as strict parsers read it: NaN or Infinity anywhere is an error here, not in the reader."""
    with open(path, "w") as f:
        json.dump(res, f, indent=1, allow_nan=False)
