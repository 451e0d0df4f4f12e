"""Conformance: mixed steps (chunked prefill piggybacked on decode; blink/device/scheduler.py).

Through the ring only: a decoding request keeps getting a token on every launch while a long
prompt prefills; the step's token budget bounds how fast a prompt is prefilled; a short request
submitted during a long prefill is answered before it; admission stays first come, first served;
under a mixed-step budget (mixed_tokens) a long prompt arriving while many requests decode is
prefilled in exactly ceil(len / (budget - decodes)) steps, every decode advancing on each.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from conformance.rig import GPU_PACED_LATE_STATS, Rig

from blink.protocol.layout import FinishReason

SPEC = dict(max_batch=4, max_num_batched_tokens=32, max_context=1024, kv_blocks=160, output_capacity=512, n_slots=16)
LONG = 900  # prompt tokens: at least ceil(900 / 31) = 30 launches under a 32-token budget


def prompt(rig: Rig, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, rig.vocab, n).tolist()


def wait_tokens(rig: Rig, slot: int, n: int, timeout: float = 60.0) -> None:
    t_end = time.monotonic() + timeout
    while len(rig.client.poll(slot).tokens) < n:
        assert time.monotonic() < t_end, f"slot {slot}: fewer than {n} tokens after {timeout} s"


def test_decodes_get_a_token_every_launch_while_a_long_prompt_prefills(make_rig):
    rig = make_rig(**SPEC)
    c = rig.client
    a = c.submit(prompt(rig, 4, 0), max_new_tokens=1000)
    wait_tokens(rig, a, 2)
    c.settled()  # a's prefill step is in the counters
    mixed0, prompt0, tokens0 = c.h("prefill_steps"), c.h("prompt_tokens"), len(c.poll(a).tokens)
    b = c.submit(prompt(rig, LONG, 1), max_new_tokens=2)
    while not c.poll(b).tokens:
        c.poll(a)  # keep a's output ring drained
        assert not c.poll(a).done, "the decoding request ended before the long prompt's first token"
    tokens1 = len(c.poll(a).tokens)
    c.h_at_least("prompt_tokens", prompt0 + LONG)  # the counters come after the tokens
    mixed = c.h("prefill_steps") - mixed0  # the launches that carried b's prompt
    assert mixed >= -(-LONG // (SPEC["max_num_batched_tokens"] - 1))  # the budget: the decode's token, the rest prefill
    # a's decode rode on every one of them; a GPU device publishes a step's tokens one launch later
    assert tokens1 - tokens0 >= mixed - 2, (tokens1 - tokens0, mixed)
    c.cancel(a)
    res = c.wait([a, b], timeout=60)
    assert res[0].finish in (FinishReason.CANCELLED, FinishReason.LENGTH)
    assert res[1].finish is FinishReason.LENGTH and len(res[1].tokens) == 2


def test_a_short_request_is_answered_while_a_long_prompt_prefills(make_rig):
    rig = make_rig(**SPEC)
    c = rig.client
    for attempt in range(5):
        # b without the doorbell, s right behind it with it: the device sees both at once, so s waits while b
        # prefills. A periodic rescan can still claim b alone; over tcp s then lands a round trip later, and on a
        # fast GPU b's whole prefill (2.6 ms for the tiny model on the H200) may end first: the case does not
        # apply, and is tried again.
        b = c.submit(prompt(rig, LONG, 2 + 10 * attempt), max_new_tokens=2, doorbell=False)
        s = c.submit(prompt(rig, 6, 3 + 10 * attempt), max_new_tokens=3)
        short, long_ = c.wait([s, b], timeout=60)
        assert short.finish is FinishReason.LENGTH and len(short.tokens) == 3
        assert long_.finish is FinishReason.LENGTH and len(long_.tokens) == 2
        if short.t_submit_ns < long_.t_launch_ns:  # s was there before the step that ends b's prefill
            break
    else:
        pytest.fail("in 5 attempts the short request never arrived before the long prompt's last prefill step")
    # FCFS admits b first, but its prefill (30 steps or more) does not hold the short prompt back
    assert long_.t_admit_ns <= short.t_admit_ns and short.t_first_ns < long_.t_first_ns


def test_admission_stays_fcfs_with_decodes_running(make_rig):
    rig = make_rig(**SPEC)
    c = rig.client
    runners = [c.submit(prompt(rig, 3, 4 + i), max_new_tokens=1000) for i in range(2)]
    for r in runners:
        wait_tokens(rig, r, 1)
    # equal 20-token prompts under a 30-token prefill budget: at most one and a half per step
    slots = [c.submit(p, max_new_tokens=4) for p in (prompt(rig, 20, 10 + i) for i in range(8))]
    pending = set(slots)
    while pending:
        for r in runners:
            c.poll(r)
        pending = {i for i in pending if not c.poll(i).done}
    results = c.wait(slots)
    firsts = [r.t_first_ns for r in results]
    assert firsts == sorted(firsts)
    assert all(r.finish is FinishReason.LENGTH and len(r.tokens) == 4 for r in results)
    for r in runners:
        c.cancel(r)
    c.wait(runners, timeout=60)


MIXED_SPEC = dict(
    max_batch=16,
    max_num_batched_tokens=64,
    mixed_tokens=16,
    max_context=1024,
    kv_blocks=256,
    output_capacity=512,
    n_slots=16,
)
DECODERS = 8
MIXED_LONG = 240  # 8 decodes leave 8 of the 16-token budget (>= 16 / 2: it does not double): 30 steps


def test_a_long_prompt_among_many_decodes_fills_the_mixed_budget_exactly(make_rig):
    """Every one of the long prompt's steps carries the 8 decodes and budget - 8 prompt tokens. The
    emulated device runs it at a GPU's step pace (GPU_PACED): at its own ~1.5 ms steps a client stalled
    for a moment on a loaded CI host let the decodes run hundreds of tokens ahead, the KV pool ran
    short and a decode left the batch, so one chunk was 9 tokens (29 steps, a CI failure). Its statistics
    reach the header a moment after the tokens (GPU_PACED_LATE_STATS), as a GPU's do: the counts are read
    once they include the step that gave the long prompt its first token.

    The case needs the 8 decodes still running when the long prompt arrives and all through its prefill.
    A GPU steps the tiny model in tens of microseconds, so a client that stalls for a few dozen
    milliseconds (this one polls over TCP in one of the transports) can find a decode already at its
    1000 tokens: that is a set-up that did not happen, not a step that broke the budget, so the case is
    set up again, at most three times."""
    rig = make_rig(**MIXED_SPEC, **GPU_PACED_LATE_STATS)
    c = rig.client
    for attempt in range(3):  # new prompts each time: none of an earlier attempt's blocks is cached
        runners = [c.submit(prompt(rig, 3, 20 + 100 * attempt + i), max_new_tokens=1000) for i in range(DECODERS)]
        for r in runners:
            wait_tokens(rig, r, 2)
        # the device's own counters (no sampling error): launches that carried prompt tokens, and those tokens
        c.settled()
        mixed0, prompt0 = c.h("prefill_steps"), c.h("prompt_tokens")
        tokens0 = [len(c.poll(r).tokens) for r in runners]
        b = c.submit(prompt(rig, MIXED_LONG, 30 + attempt), max_new_tokens=2)
        ran_out = False
        while not c.poll(b).tokens and not ran_out:
            ran_out = any(c.poll(r).done for r in runners)  # polling keeps their output rings (512) drained
        if not ran_out and not any(c.poll(r).done for r in runners):
            break
        for r in runners:
            c.cancel(r)
        c.wait([*runners, b], timeout=60)
        c.wait_idle(timeout=10)
    else:
        pytest.fail("three times a decoding request ended before the long prompt's first token")
    # the counters reach the header after the step's tokens: those of the step that gave b its first token
    assert c.h_at_least("prompt_tokens", prompt0 + MIXED_LONG) - prompt0 == MIXED_LONG
    mixed = c.h("prefill_steps") - mixed0
    tokens = [len(c.poll(r).tokens) - t0 for r, t0 in zip(runners, tokens0, strict=True)]
    # at most the budget per step and the budget filled, exactly: max_num_batched_tokens alone (64) would take 5
    # steps, a chunk of less than budget - decodes more than 30
    assert mixed == -(-MIXED_LONG // (MIXED_SPEC["mixed_tokens"] - DECODERS)), mixed
    assert all(t >= mixed for t in tokens), (tokens, mixed)  # every decode rode on every one of them
    for r in runners:
        c.cancel(r)
    res = c.wait([*runners, b], timeout=60)
    assert res[-1].finish is FinishReason.LENGTH and len(res[-1].tokens) == 2
