"""The mixed-step token budget (DeviceConfig.mixed_tokens) chosen by arithmetic: an open-loop
load (Poisson arrivals, 256 -> 128 tokens, random Llama-3-8B on one H200) replayed through the real
policy (blink.device.scheduler.Scheduler) with each step's time from a cost model of measured H200
step costs, for several budgets. Prints TTFT / ITL / TPOT p50 and p99 per budget; no GPU.

    python -m bench.scheduler.mixed_budget_model [--rate 24] [--budgets 0,128,192,256,384] [--requests 2000]

Cost model (ms; H200 step times measured by bench.engine.decode, bench.engine.prefill and bench.scheduler.sm_steal):
- a decode step of batch bucket b: W(b) + 39.5e-6 x (sum of the batch's contexts). The per-context
  term is the difference of the measured steps at context 1024 and 320 (batch 128: 11.06 - 7.48 ms;
  batch 256: 18.26 - 11.15 ms: 39.7 and 39.4 ns per cached token); W is the rest: 4.42 ms at 1,
  4.95 at 8, 5.26 at 32, 5.55 at 64, 5.85 at 128, 7.90 at 256 (linear between).
- a prefill or mixed step of token bucket t (the smallest captured bucket >= its tokens): P(t)
  + the decode rows' attention as above + 17.1e-6 ms per causal query-key pair of the chunks (the
  16 x 256 prefill's 9.0 ms of attention over 526k pairs). P(t) = W(t) up to 256 rows (the GEMMs
  read the weights either way: memory-bound), then 12.1 ms at 512, 20.4 at 1024 (the 1k prompt's
  29.25 ms less its 8.8 of attention), 43.2 at 2048 (between that and the 16 x 256 step's 89 ms
  without attention at 4096), linear between.
Step boundaries: a request that arrives during a step is planned at the next one (the GPU
scheduler); its first token is published when the step that samples it ends.
"""

from __future__ import annotations

import argparse

import numpy as np

from blink.device.kv_blocks import BlockManager
from blink.device.policy import mixed_budgets
from blink.device.scheduler import Scheduler, SchedulerConfig, StepKind

W_POINTS = ((1, 4.42), (8, 4.95), (32, 5.26), (64, 5.55), (128, 5.85), (256, 7.90))
P_POINTS = ((512, 12.1), (1024, 20.4), (2048, 43.2), (4096, 89.0))
DECODE_CTX_MS = 39.5e-6
PREFILL_PAIR_MS = 17.1e-6
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def interp(points: tuple[tuple[int, float], ...], x: float) -> float:
    xs, ys = zip(*points, strict=True)
    return float(np.interp(x, xs, ys))


def bucket(buckets: tuple[int, ...], n: int) -> int:
    return next(b for b in buckets if b >= n)


def step_ms(plan, token_buckets: tuple[int, ...]) -> float:
    ctx = sum(c.start + c.n for c in plan.chunks[: plan.num_decodes])
    if plan.kind is StepKind.DECODE:
        return interp(W_POINTS, bucket(BATCH_BUCKETS, plan.num_seqs)) + DECODE_CTX_MS * ctx
    t = bucket(token_buckets, plan.num_tokens)
    base = interp(W_POINTS, t) if t <= 256 else interp(((256, W_POINTS[-1][1]), *P_POINTS), t)
    pairs = sum(c.n * (c.start + (c.n + 1) / 2) for c in plan.chunks[plan.num_decodes :])
    return base + DECODE_CTX_MS * ctx + PREFILL_PAIR_MS * pairs


def simulate(
    rate: float, mixed: int, n_req: int, prompt: int, out: int, max_batch: int, max_num_batched_tokens: int, seed: int
):
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1e3 / rate, n_req))  # ms
    tb = tuple(sorted(set(TOKEN_BUCKETS) | set(mixed_budgets(max_num_batched_tokens, mixed))))
    cfg = SchedulerConfig(max_batch, max_num_batched_tokens, 4096, 1 << 20, 0, mixed)
    s = Scheduler(cfg, BlockManager(40000, 16))
    t, nxt = 0.0, 0
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    itl: list[float] = []
    tpot: list[float] = []
    kinds = {k: 0 for k in StepKind}
    while nxt < n_req or s.has_work():
        while nxt < n_req and arrivals[nxt] <= t:
            s.add(nxt, [1] * prompt, max_new_tokens=out)
            nxt += 1
        plan = s.schedule()
        if plan is None:
            t = arrivals[nxt]
            continue
        kinds[plan.kind] += 1
        t += step_ms(plan, tb)
        for e in s.update(plan, [2] * plan.num_seqs):
            if e.index == 0:
                first[e.seq_id] = t
            else:
                itl.append(t - last[e.seq_id])
            last[e.seq_id] = t
            if e.index == out - 1:
                tpot.append((t - first[e.seq_id]) / (out - 1))
    ttft = np.array([first[i] - arrivals[i] for i in range(n_req)])
    q = lambda x, p: float(np.percentile(x, p))  # noqa: E731
    return {
        "mixed_tokens": mixed,
        "ttft_p50": q(ttft, 50),
        "ttft_p99": q(ttft, 99),
        "itl_p50": q(itl, 50),
        "itl_p99": q(itl, 99),
        "tpot_p50": q(tpot, 50),
        "steps": {k.name: v for k, v in kinds.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=24.0)
    ap.add_argument("--budgets", default="0,128,192,256,384")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(f"rate {a.rate} req/s, {a.prompt} -> {a.output}, {a.requests} requests (model of H200 step costs, ms)")
    print(f"{'mixed':>6}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'p99/p50':>8}{'TPOT p50':>10}  steps")
    for m in (int(x) for x in a.budgets.split(",")):
        r = simulate(a.rate, m, a.requests, a.prompt, a.output, a.max_batch, a.max_num_batched_tokens, a.seed)
        print(
            f"{m:>6}{r['ttft_p50']:10.2f}{r['ttft_p99']:8.2f}{r['itl_p50']:9.2f}{r['itl_p99']:8.2f}"
            f"{r['itl_p99'] / r['itl_p50']:8.2f}{r['tpot_p50']:10.2f}  {r['steps']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
