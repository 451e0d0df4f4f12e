"""The paper's prefix-caching part (`python -m bench.paper.evaluate --parts prefix`): the workloads of
bench/serving/prefix_cache.py against a server with caching on and one with it off, per scheduler.

  shared     a shared 2,000-token system prompt + short user turns, open loop at 8 and 16 req/s:
             TTFT p50 / p99 and CDF, on vs off
  multiturn  ShareGPT conversations replayed turn by turn: TTFT, output tok/s, the hit rate
  noreuse    prompts that share no block: output tok/s on over off
  claim      the GPU scheduler's claim-to-launch with and without a match

Written as `prefix-<device>-<commit>.json` (the evaluation's metadata, the sizes, per scheduler the
servers' flags, each run's summary and the on/off ratios); bench/paper/plots.py draws the TTFT CDFs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from bench.serving import prefix_cache

if TYPE_CHECKING:
    from bench.paper.evaluate import Run

EMULATED = dataclasses.replace(prefix_cache.EMULATED, rate_s=1.5, conversations=2, noreuse_s=1.0, claim_n=2)


def sizes(run: Run) -> prefix_cache.Sizes:
    """prefix_cache's sizes for this run (--quick: shorter), on the evaluation's model."""
    if run.a.device == "emulated":
        s = EMULATED
    else:
        s = prefix_cache.QUICK if run.a.quick else prefix_cache.FULL
    return dataclasses.replace(s, model=run.s.model)


def need_s(s: prefix_cache.Sizes, device: str) -> float:
    """Rough seconds of one scheduler's on and off runs, server start-ups included (the budget check)."""
    start, multiturn = (45.0, 20.0) if device == "cuda" else (5.0, 10.0)
    return 2 * (start + len(s.rates) * s.rate_s + multiturn + s.noreuse_s + 5.0)


def one(run: Run, s: prefix_cache.Sizes, sched: str) -> dict[str, Any]:
    sharegpt = ["--dataset-path", run.a.sharegpt] if run.a.sharegpt else []
    log = os.path.join(run.a.out, f"prefix-{sched}")
    servers, res = prefix_cache.on_off(s, [run.a.device, sched], run.cores, log, sharegpt)
    r = prefix_cache.ratios(res["on"], res["off"])
    failed = [f"{mode} {k}: {v['error']}" for mode, rs in res.items() for k, v in rs.items() if "error" in v]
    if failed:
        run.failed.append(f"prefix/{sched}: " + "; ".join(failed))
    for k, v in r.items():
        run.say(f"{sched:4s} prefix caching on / off, {k}: {'-' if v is None else f'{v:.3f}'}")
    hit = res["on"].get("multiturn", {}).get("prefix_cache_hit_rate")
    run.say(f"{sched:4s} prefix caching multi-turn hit rate: {'-' if hit is None else f'{100 * hit:.1f} %'}")
    return {"servers": servers, "results": res, "ratios_on_over_off": r}


def part(run: Run, scheds: list[str]) -> None:
    """Each scheduler's on and off runs that fit the budget; the JSON rewritten after each."""
    s = sizes(run)
    out: dict[str, Any] = {}
    for sched in scheds:
        if not run.fits(f"prefix/{sched}", need_s(s, run.a.device)):
            continue
        out[sched] = run.attempt(f"prefix/{sched}", one, run, s, sched)
        run.save("prefix", {"prefix_sizes": dataclasses.asdict(s), "results": out})
