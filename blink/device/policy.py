"""The scheduling policy's numbers, defined once: the constants and limits that both schedulers
apply, the Python ring interpreter (blink.device.scheduler) and the CUDA scheduler
(blink/gpu/scheduler/csrc/, whose header scheduler_policy.cuh is generated from this module by
`python -m blink.gpu.scheduler.policy_header`; a test fails while it is stale).

- step_limits(): what a device advertises and schedules with, from its executor's capacity and the
  operator's settings: batch, tokens per step (max_num_batched_tokens), context, the long-prefill cap
  and the mixed-step budget (0 when off; a budget at or above the step's tokens is off).
- step_budget(): tokens a step with decodes may carry (BACKLOG_SCAN, BACKLOG_FACTOR); group_cap():
  the running sequences one request's choices may hold (GROUP_SHARE_DIVISOR). The CUDA scheduler's
  step_budget and group_cap (scheduler_budget.cuh) are checked against them case by case on the CPU.
"""

from __future__ import annotations

from typing import NamedTuple

BACKLOG_SCAN = 64
"""Waiting sequences behind the first whose tokens count in a step's prefill backlog (step_budget)."""
BACKLOG_FACTOR = 4
"""A mixed budget doubles while the prefill backlog is at least this many times its prefill share."""


def step_budget(max_num_batched_tokens: int, mixed_tokens: int, num_decodes: int, backlog: int = 0) -> int:
    """Tokens a step with `num_decodes` decodes may carry: max_num_batched_tokens without decodes or without a
    mixed budget; else mixed_tokens * 2**k for the smallest k that leaves prefill at least
    mixed_tokens // 2 and, unless that reaches max_num_batched_tokens, more than a BACKLOG_FACTOR-th of
    `backlog`: the tokens queued behind the first waiting sequence (Scheduler._backlog). A prompt
    arriving among decodes, however long, gets mixed_tokens per step (steps little slower than a
    decode step); a queue of prompts gets larger steps, up to max_num_batched_tokens, as a whole-prompt policy
    would (throughput under saturation). mixed_budgets() lists every value it returns."""
    if mixed_tokens == 0 or num_decodes == 0 or mixed_tokens >= max_num_batched_tokens:
        return max_num_batched_tokens
    b = mixed_tokens
    while b < max_num_batched_tokens and (
        b < num_decodes + mixed_tokens // 2 or backlog >= BACKLOG_FACTOR * (b - num_decodes)
    ):
        b *= 2
    return min(b, max_num_batched_tokens)


def mixed_budgets(max_num_batched_tokens: int, mixed_tokens: int) -> tuple[int, ...]:
    """Every budget step_budget can give a mixed step (the token buckets an engine should capture so
    that a mixed step filling its budget runs a graph of exactly its size)."""
    if mixed_tokens == 0 or mixed_tokens >= max_num_batched_tokens:
        return (max_num_batched_tokens,)
    out = [max_num_batched_tokens]
    b = mixed_tokens
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 2
    return tuple(sorted(out))


GROUP_SHARE_DIVISOR = 2
"""A group (the choices of one API request) may hold 1/GROUP_SHARE_DIVISOR of the batch (group_cap)."""


def group_cap(max_batch: int) -> int:
    """Most running sequences one group (the choices of one API request, Seq.group) may hold: half
    the batch, at least one. The rest of the batch stays open to other requests, so a request with
    many choices never makes another wait for its choices to finish."""
    return max(1, max_batch // GROUP_SHARE_DIVISOR)


def default_long_prefill(max_num_batched_tokens: int) -> int:
    """A quarter of the step budget: a waiting prompt of up to 3/4 of it joins the next step."""
    return max(1, max_num_batched_tokens // 4)


class StepLimits(NamedTuple):
    """What a device schedules with (and advertises in the ring header: max_batch, max_context)."""

    max_batch: int  # running sequences (<= max_num_batched_tokens: a step carries every decode)
    max_num_batched_tokens: int  # tokens per step, decodes and prefill chunks
    max_context: int  # prompt + generated per sequence; a sequence this long fits the KV pool alone
    long_prefill_tokens: int  # most tokens a running prefill takes per step while a request waits
    mixed_tokens: int  # budget of a step with decodes (step_budget); 0: off


def step_limits(
    executor_batch: int,
    executor_tokens: int,
    executor_context: int,
    num_blocks: int,
    block_size: int,
    *,
    max_batch: int = 0,
    max_num_batched_tokens: int = 0,
    long_prefill_tokens: int = 0,
    mixed_tokens: int = 0,
    batch_cap: int = 0,
) -> StepLimits:
    """The limits of a device whose executor takes `executor_batch` sequences and `executor_tokens`
    tokens per step, holds `executor_context` per sequence and has a pool of num_blocks x
    block_size tokens. The operator's settings (0 = the executor's) never exceed the executor;
    batch_cap (0 = none) is a further bound of the device's own (the CUDA scheduler's rows).
    A sequence that fits the context must fit the pool alone (never fail it for KV), so the context
    is capped by the pool: L tokens hold L-1 K/V entries."""
    tokens = min(max_num_batched_tokens or executor_tokens, executor_tokens)
    batch = min(max_batch or executor_batch, executor_batch, tokens, *([batch_cap] if batch_cap else []))
    context = min(executor_context, num_blocks * block_size + 1)
    long_prefill = long_prefill_tokens or default_long_prefill(tokens)
    return StepLimits(batch, tokens, context, long_prefill, mixed_tokens if mixed_tokens < tokens else 0)
