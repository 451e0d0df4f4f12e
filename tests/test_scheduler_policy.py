"""Scheduler policy (blink.device.scheduler), driven without a model: schedule() -> StepPlan, update(plan, fabricated tokens).

Named apart from tests/gpu/test_scheduler.py: pytest needs unique basenames in folders without __init__.py."""

from __future__ import annotations

import numpy as np
import pytest

from blink.device.kv_blocks import BlockManager
from blink.device.policy import mixed_budgets, step_budget
from blink.device.scheduler import Scheduler, SchedulerConfig, SeqStatus, StepKind
from blink.protocol.layout import UNLIMITED, FinishReason, SlotState
from blink.protocol.step import NO_TOKEN


def make(
    max_batch=4,
    max_num_batched_tokens=64,
    max_context=256,
    output_capacity=1024,
    num_blocks=64,
    block_size=4,
    long_prefill=0,
    mixed_tokens=0,
):
    cfg = SchedulerConfig(max_batch, max_num_batched_tokens, max_context, output_capacity, long_prefill, mixed_tokens)
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


def token_for(seq_id: int, k: int) -> int:
    return 1000 * (seq_id + 1) + k  # token k of a sequence: recognisable, never a stop id by accident


def step(s: Scheduler, tok=token_for):
    plan = s.schedule()
    if plan is None:
        return None, []
    toks = [tok(c.seq.seq_id, c.seq.num_generated) for c in plan.chunks]
    return plan, s.update(plan, toks)


def drain(s: Scheduler, max_steps=10_000, tok=token_for):
    plans, events = [], []
    for _ in range(max_steps):
        plan, ev = step(s, tok)
        if plan is None:
            break
        plans.append(plan)
        events += ev
    return plans, events


def test_prefill_packs_prompts_fcfs_then_decodes():
    s = make()
    for i, n in enumerate((10, 20, 30)):
        s.add(i, range(1, n + 1), max_new_tokens=3)
    plan, ev = step(s)
    assert plan.kind is StepKind.PREFILL
    assert [c.seq.seq_id for c in plan.chunks] == [0, 1, 2]
    assert [(c.start, c.n, c.sample) for c in plan.chunks] == [(0, 10, True), (0, 20, True), (0, 30, True)]
    assert [(e.seq_id, e.index) for e in ev] == [(0, 0), (1, 0), (2, 0)]
    plan, ev = step(s)
    assert plan.kind is StepKind.DECODE and plan.num_tokens == 3
    assert [(c.start, c.n) for c in plan.chunks] == [(10, 1), (20, 1), (30, 1)]
    plans, events = drain(s)
    assert [e.finish for e in events[-3:]] == [FinishReason.LENGTH] * 3
    assert s.blocks.num_free == s.blocks.num_blocks and not s.seqs


def test_chunked_prefill_of_a_prompt_longer_than_max_tokens():
    s = make(max_num_batched_tokens=32, max_context=512, num_blocks=128)
    s.add(0, range(100), max_new_tokens=2)
    chunks = []
    for _ in range(4):
        plan, ev = step(s)
        assert plan.kind is StepKind.PREFILL and plan.num_seqs == 1
        chunks.append((plan.chunks[0].start, plan.chunks[0].n, plan.chunks[0].sample))
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert s.seqs[0].tokens[-1] == token_for(0, 0)
    plan, ev = step(s)
    assert plan.kind is StepKind.DECODE and ev[0].finish is FinishReason.LENGTH


def test_batch_capacity_admits_when_sequences_finish():
    s = make(max_batch=2)
    s.add(0, [1, 2], max_new_tokens=1)
    s.add(1, [1, 2], max_new_tokens=3)
    s.add(2, [1, 2], max_new_tokens=1)
    plan, ev = step(s)
    assert [c.seq.seq_id for c in plan.chunks] == [0, 1]
    assert ev[0].finish is FinishReason.LENGTH  # seq 0 finished in its prefill step: its place frees
    plan, _ = step(s)  # seq 1 decodes and seq 2 joins in the same step
    assert plan.kind is StepKind.MIXED and [(c.seq.seq_id, c.n) for c in plan.chunks] == [(1, 1), (2, 2)]
    assert s.num_running <= 2


def test_new_arrivals_join_the_next_step_without_stalling_decodes():
    s = make()
    s.add(0, [1, 2, 3], max_new_tokens=UNLIMITED)
    kinds = []
    for i in range(6):
        if i == 2:
            s.add(1, [4, 5], max_new_tokens=UNLIMITED)
        plan, _ = step(s)
        kinds.append((plan.kind, sorted(c.seq.seq_id for c in plan.chunks)))
    assert kinds[:4] == [
        (StepKind.PREFILL, [0]),
        (StepKind.DECODE, [0]),
        (StepKind.MIXED, [0, 1]),  # admitted at once, seq 0 decodes in the same step
        (StepKind.DECODE, [0, 1]),
    ]


def test_stop_ids_respect_min_new_tokens_and_are_published():
    s = make()
    stop = token_for(0, 1)
    s.add(0, [7], stop_ids=[stop], min_new_tokens=0)
    s.add(1, [7], stop_ids=[token_for(1, 1)], min_new_tokens=3, max_new_tokens=5)
    _, events = drain(s, tok=lambda sid, k: token_for(sid, k if k < 2 else 1))
    ev0 = [e for e in events if e.seq_id == 0]
    assert [e.token for e in ev0] == [token_for(0, 0), stop] and ev0[-1].finish is FinishReason.STOP
    ev1 = [e for e in events if e.seq_id == 1]
    # stop id sampled at k=1, 2 (ignored: k < min_new_tokens) and at k=3 (honoured)
    assert [e.index for e in ev1] == [0, 1, 2, 3] and ev1[-1].finish is FinishReason.STOP


def test_context_limit_finishes_with_context():
    s = make(max_context=12)
    s.add(0, range(8))
    _, events = drain(s)
    assert len(events) == 4  # 8 prompt + 4 generated = max_context
    assert events[-1].finish is FinishReason.CONTEXT
    with pytest.raises(ValueError):
        s.add(1, range(12))  # prompt + 1 > max_context


def test_kv_exhaustion_preempts_newest_and_recomputes():
    # 6 blocks of 2 tokens: three 3-token prompts fit (2 blocks each) but cannot all grow.
    s = make(max_batch=4, num_blocks=6, block_size=2, max_context=13)
    for i in range(3):
        s.add(i, [1, 2, 3], max_new_tokens=6)
    plans, events = drain(s)
    preempted = [v.seq_id for p in plans for v in p.preempted]
    assert preempted and preempted[0] == 2  # the newest goes first
    for sid in range(3):
        toks = [e.token for e in events if e.seq_id == sid]
        assert toks == [token_for(sid, k) for k in range(6)]  # nothing lost, nothing repeated
    # a recompute prefill covers prompt + generated and samples the next index
    recompute = [c for p in plans for c in p.chunks[p.num_decodes :] if c.start == 0 and c.n > 3]
    assert recompute and all(c.sample for c in recompute)
    assert s.blocks.num_free == 6 and not s.seqs


def test_a_sequence_that_fits_alone_never_fails():
    s = make(max_batch=8, num_blocks=4, block_size=4, max_context=17, max_num_batched_tokens=16)
    for i in range(8):
        s.add(i, [5] * (1 + i), max_new_tokens=UNLIMITED)
    _, events = drain(s)
    for i in range(8):
        ev = [e for e in events if e.seq_id == i]
        assert ev[-1].finish is FinishReason.CONTEXT and len(ev) == 17 - (1 + i)
    assert s.blocks.num_free == 4


def test_full_output_ring_pauses_until_consumed():
    s = make(output_capacity=2)
    s.add(0, [1], max_new_tokens=5)
    s.add(1, [1], max_new_tokens=5)
    step(s)  # prefill: 1 token each
    plan, _ = step(s)  # decode: 2 tokens each -> both rings full
    assert plan.num_seqs == 2
    assert s.schedule() is None
    assert s.ring_state(s.seqs[0]) == SlotState.DECODE_PAUSED
    s.set_consumed(1, 2)
    plan, ev = step(s)
    assert [c.seq.seq_id for c in plan.chunks] == [1] and ev[0].index == 2
    s.set_consumed(0, 1)
    plan, ev = step(s)
    assert [(e.seq_id, e.index) for e in ev] == [(0, 2), (1, 3)]
    assert s.schedule() is None  # both full again (0: 3 - 1, 1: 4 - 2)


def test_abort_frees_blocks_at_once():
    s = make()
    s.add(0, range(30), max_new_tokens=UNLIMITED)
    s.add(1, range(5))
    step(s)
    assert s.blocks.num_free < 64
    assert s.abort(0).finish is FinishReason.CANCELLED
    assert s.blocks.table(0) == [] and 0 not in s.seqs
    assert s.abort(1).status is SeqStatus.FINISHED
    assert s.blocks.num_free == 64 and s.schedule() is None


def test_pool_smaller_than_context_is_rejected():
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig(4, 64, 100, 16), BlockManager(4, 4))


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_every_invariant(seed):
    """Random arrivals, cancels and slow readers over a small pool: every step respects the limits,
    blocks are never shared, tokens come out in order without gaps, and everything finishes."""
    rng = np.random.default_rng(seed)
    cfg = dict(
        max_batch=int(rng.integers(1, 6)),
        max_num_batched_tokens=int(rng.integers(6, 40)),
        output_capacity=int(rng.integers(1, 6)),
        long_prefill=int(rng.integers(0, 8)),
        mixed_tokens=int(rng.integers(0, 12)),
    )
    s = make(num_blocks=12, block_size=4, max_context=40, **cfg)
    published: dict[int, list[int]] = {}
    seqs = {}
    finished: dict[int, FinishReason] = {}
    next_id = 0
    for _ in range(3000):
        if next_id < 40 and rng.random() < 0.15:
            n = int(rng.integers(1, 30))
            seqs[next_id] = s.add(
                next_id,
                rng.integers(0, 50, n).tolist(),
                max_new_tokens=int(rng.integers(1, 20)),
                stop_ids=[7],
                min_new_tokens=int(rng.integers(0, 3)),
            )
            published[next_id] = []
            next_id += 1
        if s.seqs and rng.random() < 0.02:
            victim = int(rng.choice(list(s.seqs)))
            s.abort(victim)
            finished[victim] = FinishReason.CANCELLED
        for seq in list(s.seqs.values()):  # readers catch up at random
            if rng.random() < 0.5:
                s.set_consumed(seq.seq_id, len(published[seq.seq_id]))
        plan = s.schedule()
        owned = [b for sid in s.blocks.owners() for b in s.blocks.table(sid)]
        assert len(owned) == len(set(owned)) and len(owned) + s.blocks.num_free == 12
        if plan is None:
            if next_id >= 40 and not s.seqs:
                break
            continue
        assert plan.num_seqs <= cfg["max_batch"] and s.num_running <= cfg["max_batch"]
        assert plan.num_tokens <= cfg["max_num_batched_tokens"]
        queued = sum(len(x.tokens) for x in s.seqs.values())  # >= the queue the step saw (its bound is monotone)
        assert plan.num_tokens <= step_budget(
            cfg["max_num_batched_tokens"], cfg["mixed_tokens"], plan.num_decodes, queued
        )
        assert all(c.n == 1 and c.sample for c in plan.chunks[: plan.num_decodes])
        assert [c.seq.arrival for c in plan.chunks[: plan.num_decodes]] == sorted(
            c.seq.arrival for c in plan.chunks[: plan.num_decodes]
        )
        assert len({c.seq.seq_id for c in plan.chunks}) == plan.num_seqs  # one chunk per sequence
        assert not {c.seq.seq_id for c in plan.chunks} & {v.seq_id for v in plan.preempted}
        for c in plan.chunks:
            assert len(s.blocks.table(c.seq.seq_id)) * 4 >= c.start + c.n  # KV room for the chunk
            assert c.start == c.seq.num_computed
        toks = [int(rng.integers(0, 10)) for _ in plan.chunks]
        for e in s.update(plan, toks):
            assert e.index == len(published[e.seq_id])
            published[e.seq_id].append(e.token)
            assert len(published[e.seq_id]) - seqs[e.seq_id].consumed <= cfg["output_capacity"]
            if e.finish is not FinishReason.NONE:
                finished[e.seq_id] = e.finish
    assert next_id == 40 and not s.seqs and s.blocks.num_free == 12
    assert set(finished) == set(published)
    assert sum(map(len, published.values())) > 100
    for sid, reason in finished.items():
        out = published[sid]
        if reason is FinishReason.STOP:
            assert out[-1] == 7
        if reason is not FinishReason.CANCELLED:
            assert reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.CONTEXT)


# -- mixed steps (chunked prefill piggybacked on decode) ------------------------------------------


def test_decodes_produce_a_token_every_step_while_a_long_prompt_prefills():
    s = make(max_batch=4, max_num_batched_tokens=16, max_context=512, num_blocks=128)
    for i in range(3):
        s.add(i, [1, 2], max_new_tokens=UNLIMITED)
    step(s)  # the three short prompts
    s.add(3, range(100), max_new_tokens=2)
    chunks = []
    while s.seqs[3].num_generated == 0:
        plan, ev = step(s)
        assert [c.seq.seq_id for c in plan.chunks[:3]] == [0, 1, 2] and plan.num_decodes == 3
        assert sorted(e.seq_id for e in ev if e.seq_id != 3) == [0, 1, 2]  # one token each, every step
        assert plan.num_tokens <= 16 and plan.kind is StepKind.MIXED
        chunks.append(plan.chunks[3].n)
    assert chunks == [13] * 7 + [9]  # the budget minus the three decodes


def test_token_budget_counts_decodes_and_packs_prompts_fcfs():
    s = make(max_batch=4, max_num_batched_tokens=10, max_context=256)
    s.add(0, [1, 2, 3], max_new_tokens=UNLIMITED)
    step(s)
    for i, n in ((1, 4), (2, 6), (3, 2)):
        s.add(i, range(n), max_new_tokens=UNLIMITED)
    plan, _ = step(s)
    # budget 10: the decode (1), then 1's prompt (4), then 2's prompt cut to the rest (5); 3 waits (FCFS)
    assert [(c.seq.seq_id, c.start, c.n, c.sample) for c in plan.chunks] == [
        (0, 3, 1, True),
        (1, 0, 4, True),
        (2, 0, 5, False),
    ]
    plan, _ = step(s)
    # 0 and 1 decode; 2 still prefills (its last token); 3 admitted behind it
    assert [(c.seq.seq_id, c.n) for c in plan.chunks] == [(0, 1), (1, 1), (2, 1), (3, 2)]
    assert plan.num_decodes == 2 and plan.chunks[2].sample


def test_a_waiting_request_is_served_while_a_long_prompt_prefills():
    s = make(max_batch=4, max_num_batched_tokens=16, max_context=512, num_blocks=128, long_prefill=4)
    s.add(0, range(200), max_new_tokens=1)
    plan, _ = step(s)
    assert [(c.seq.seq_id, c.n) for c in plan.chunks] == [(0, 16)]  # alone: the whole budget
    s.add(1, [5, 6, 7], max_new_tokens=3)
    plan, ev = step(s)
    # a request waits: the long prefill takes long_prefill tokens, the short prompt the rest
    assert [(c.seq.seq_id, c.start, c.n) for c in plan.chunks] == [(0, 16, 4), (1, 0, 3)]
    assert [e.seq_id for e in ev] == [1]
    plan, ev = step(s)
    assert [(c.seq.seq_id, c.n) for c in plan.chunks] == [(1, 1), (0, 15)]  # nobody waits: full budget again
    _, events = drain(s)
    assert [e.finish for e in events if e.seq_id == 1][-1] is FinishReason.LENGTH
    assert s.blocks.num_free == 128 and not s.seqs


def test_a_prefill_chunk_sharing_a_step_is_cut_to_the_free_blocks_never_preempting():
    # 10 blocks of 4: seq 0 decodes while seq 1's 36-token prompt (9 blocks) prefills in chunks of
    # up to 7; once 0 holds 2 blocks, 1 gets the 8 left and waits (no preemption for a prefill
    # chunk) until 0 needs a third block and preempts 1, the newest, as a decode may.
    s = make(max_batch=4, max_num_batched_tokens=8, max_context=41, num_blocks=10, block_size=4)
    s.add(0, [1, 2], max_new_tokens=UNLIMITED)
    s.add(1, range(36), max_new_tokens=1)
    events, cut = [], False
    for _ in range(200):
        plan, ev = step(s)
        if plan is None:
            break
        events += ev
        for c in plan.chunks[plan.num_decodes :]:
            if plan.num_decodes and c.n < min(len(c.seq.tokens) - c.start, 8 - plan.num_decodes):
                cut = True
                assert s.blocks.num_free == 0 and not plan.preempted
        if plan.num_decodes:
            assert all(v.status is SeqStatus.WAITING for v in plan.preempted)
    assert cut
    assert s.blocks.num_free == 10 and not s.seqs
    for sid in range(2):
        toks = [e.token for e in events if e.seq_id == sid]
        assert toks == [token_for(sid, k) for k in range(len(toks))] and toks


def test_half_prefilled_prompts_filling_the_pool_still_progress():
    # Two 30-token prompts over 8 blocks of 4 (32 tokens): 0 takes 12, then 6 while 1 is admitted
    # with 6; then 0 needs 3 more blocks with 1 free. No decode shares the step, so the older
    # preempts the newer and completes.
    s = make(max_batch=2, max_num_batched_tokens=12, max_context=32, num_blocks=8, block_size=4, long_prefill=6)
    s.add(0, range(30), max_new_tokens=1)
    s.add(1, range(30), max_new_tokens=1)
    plans, events = drain(s)
    assert [e.seq_id for e in events] == [0, 1]
    assert any(v.seq_id == 1 for p in plans for v in p.preempted)
    assert s.blocks.num_free == 8


def test_max_tokens_below_max_batch_is_rejected():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(8, 4, 64, 16)


# -- the token budget of a mixed step (mixed_tokens; Sarathi-Serve's budget) ----------------------


def test_step_budget_doubles_until_the_prompt_gets_half_and_lists_its_values():
    assert step_budget(2048, 0, 20) == 2048  # off
    assert step_budget(2048, 192, 0) == 2048  # no decodes: the whole step
    assert [step_budget(2048, 192, d) for d in (1, 96, 97, 256, 288, 289)] == [192, 192, 384, 384, 384, 768]
    assert step_budget(256, 192, 200) == 256  # never above max_num_batched_tokens
    assert mixed_budgets(2048, 192) == (192, 384, 768, 1536, 2048)
    assert mixed_budgets(2048, 0) == (2048,) and mixed_budgets(256, 256) == (256,)
    for d in range(1, 257):
        for backlog in (0, 256, 1000, 5000, 100_000):
            assert step_budget(2048, 192, d, backlog) in mixed_budgets(2048, 192)
            assert step_budget(2048, 192, d, backlog) - d >= 96
    # one 256-token prompt among 20 decodes: 192; a queue: larger steps, up to max_num_batched_tokens
    assert [step_budget(2048, 192, 20, n) for n in (256, 687, 688, 1455, 1456, 65536)] == [
        192, 192, 384, 384, 768, 2048,
    ]  # fmt: skip


def test_a_long_prompt_under_a_mixed_budget_fills_it_exactly_while_every_decode_advances():
    """Many decodes run, a long prompt arrives: every step carries every decode and exactly the
    budget's remainder of the prompt (the step fills its token bucket), so the prompt finishes in
    ceil(len / (budget - decodes)) steps; without decodes a step may take max_num_batched_tokens."""
    s = make(max_batch=16, max_num_batched_tokens=128, max_context=512, num_blocks=512, mixed_tokens=32)
    for i in range(10):
        s.add(i, [1, 2], max_new_tokens=UNLIMITED)
    plan, _ = step(s)
    assert plan.kind is StepKind.PREFILL and plan.num_tokens == 20  # no decodes yet: max_num_batched_tokens applies
    s.add(10, range(300), max_new_tokens=2)
    steps = 0
    while s.seqs[10].num_generated == 0:
        plan, ev = step(s)
        steps += 1
        assert plan.num_decodes == 10 and sorted(e.seq_id for e in ev if e.seq_id != 10) == list(range(10))
        # 10 decodes leave 22 of 32 (>= 16): the budget stays 32 and the step fills it
        assert plan.num_tokens == 32 or plan.chunks[-1].sample
        assert plan.num_tokens <= 32
    assert steps == -(-300 // 22)


def test_a_mixed_budget_doubles_when_decodes_would_starve_the_prompt():
    s = make(max_batch=40, max_num_batched_tokens=256, max_context=512, num_blocks=1024, mixed_tokens=32)
    for i in range(20):
        s.add(i, [1, 2], max_new_tokens=UNLIMITED)
    step(s)
    s.add(20, range(200), max_new_tokens=2)
    plan, _ = step(s)
    # 20 decodes would leave 12 of 32 (< 16): the budget doubles to 64, the prompt gets 44
    assert plan.num_decodes == 20 and plan.num_tokens == 64 and plan.chunks[-1].n == 44


def test_a_burst_while_idle_takes_the_whole_step_then_mixed_steps_take_the_budget():
    s = make(max_batch=8, max_num_batched_tokens=128, max_context=512, num_blocks=512, mixed_tokens=32)
    for i in range(4):
        s.add(i, range(40), max_new_tokens=UNLIMITED)
    plan, _ = step(s)
    assert plan.kind is StepKind.PREFILL and plan.num_tokens == 128  # 3 prompts + 8 tokens of the 4th
    plan, _ = step(s)
    assert plan.kind is StepKind.MIXED and plan.num_decodes == 3 and plan.num_tokens == 32


def test_a_queue_of_prompts_gets_large_steps_while_decodes_run():
    """The prefill backlog doubles a mixed budget while it holds BACKLOG_FACTOR of its prefill
    share: a burst of prompts behind running decodes is prefilled about as fast as without a
    mixed budget, and the steps shrink back to mixed_tokens as the queue drains."""
    s = make(max_batch=64, max_num_batched_tokens=256, max_context=512, num_blocks=4096, mixed_tokens=16)
    s.add(0, [1, 2], max_new_tokens=UNLIMITED)
    step(s)
    for i in range(1, 41):
        s.add(i, range(20), max_new_tokens=UNLIMITED)
    sizes = []
    while any(x.status is SeqStatus.WAITING for x in s.seqs.values()) or any(x.prefilling for x in s.running):
        plan, _ = step(s)
        sizes.append(plan.num_tokens)
    # 40 x 20 = 800 prompt tokens: 780 queued behind the first >= 4 x (128 - 1), so max_num_batched_tokens at once
    assert sizes == [256, 256, 128, 128, 64, 64, 64, 60]  # then down as the queue drains


# -- fair share: the choices of one request (a group) ------------------------------------------------
def _first_token_step(s: Scheduler, seq_id: int, max_steps: int = 10_000) -> int:
    """Steps until sequence seq_id publishes its first token."""
    for i in range(max_steps):
        _, ev = step(s)
        if any(e.seq_id == seq_id for e in ev):
            return i
    raise AssertionError(f"sequence {seq_id} got no token in {max_steps} steps")


@pytest.mark.parametrize("grouped", [False, True])
def test_a_request_with_many_choices_does_not_starve_another(grouped):
    """The reported case, scaled down: one request with n = 2 x max_batch long choices, then another
    user's request. As separate requests (no group) the newcomer waits for a whole wave of choices
    to end (the starvation); as a group it is admitted on the next step."""
    s = make(max_batch=4, max_num_batched_tokens=64, num_blocks=256)
    for i in range(8):
        s.add(i, [1, 2, 3], max_new_tokens=400, group=77 if grouped else 0)
    for _ in range(3):
        step(s)
    assert s.num_running == 4  # alone, the request fills the batch (beyond its share)
    s.add(100, [4, 5], max_new_tokens=2)
    wait = _first_token_step(s, 100)
    if grouped:
        assert wait == 0
        assert s.num_running == 4 and sum(x.group == 77 for x in s.running) == 3
        assert sum(x.preemptions for x in s.seqs.values()) == 1  # the group's newest choice made room
    else:
        assert wait >= 390  # behind the first four choices' 400 tokens


def test_groups_within_their_share_are_admitted_first_and_nothing_is_lost():
    s = make(max_batch=4, max_num_batched_tokens=64, num_blocks=256)
    for i in range(6):
        s.add(i, [1, 2, 3], max_new_tokens=50, group=9)
    s.add(10, [7], max_new_tokens=50, group=10)
    s.add(11, [8], max_new_tokens=50, group=10)
    plan = s.schedule()
    # group 9 takes its share (2), group 10 its share (2): 9's other choices wait although older
    assert sorted(c.seq.seq_id for c in plan.chunks) == [0, 1, 10, 11]
    s.update(plan, [token_for(c.seq.seq_id, 0) for c in plan.chunks])
    _, events = drain(s)
    done = {e.seq_id for e in events if e.finish is not FinishReason.NONE}
    assert done == set(range(6)) | {10, 11}


def test_no_preemption_without_a_waiting_request_below_its_share():
    """A full batch of one group and more of its own choices waiting: nobody is preempted."""
    s = make(max_batch=4, max_num_batched_tokens=64, num_blocks=256)
    seqs = [s.add(i, [1, 2, 3], max_new_tokens=30, group=5) for i in range(6)]
    drain(s)
    assert not s.seqs and [x.finish for x in seqs] == [FinishReason.LENGTH] * 6
    assert all(x.preemptions == 0 for x in seqs)


def test_a_gated_sequence_is_planned_and_a_late_mask_leaves_it_one_position_short():
    """Token masks: the gate is the sampler's (read when the row is sampled, at the end of the step), so a
    gated sequence is planned like any other; a NO_TOKEN sample (its mask was late) publishes nothing and
    leaves it one position short: the next step computes and samples that position again, and no
    block is registered on the strength of the K/V the late step wrote there."""
    s = make(block_size=4)
    gated = s.add(0, range(1, 9), max_new_tokens=3, block_keys=[b"k0", b"k1"])
    gated.mask = 0
    other = s.add(1, range(1, 6), max_new_tokens=3)
    plan = s.schedule()
    assert [(c.seq.seq_id, c.start, c.n, c.sample) for c in plan.chunks] == [(0, 0, 8, True), (1, 0, 5, True)]
    ev = s.update(plan, [NO_TOKEN, 50])  # the gated row's mask for token 0 was late: only the other publishes
    assert [(e.seq_id, e.index) for e in ev] == [(1, 0)]
    assert gated.num_computed == 7 and gated.num_generated == 0 and s.ring_state(gated) == SlotState.PREFILL_PROCESSING
    assert s.blocks.match([b"k0", b"k1"], 9) == s.blocks.table(0)[:1]  # the last block is not final yet
    plan = s.schedule()  # the last prompt position again, with the other's decode
    assert [(c.seq.seq_id, c.start, c.n, c.sample) for c in plan.chunks] == [(1, 5, 1, True), (0, 7, 1, True)]
    ev = s.update(plan, [51, 60])
    assert sorted((e.seq_id, e.index, e.token) for e in ev) == [(0, 0, 60), (1, 1, 51)]
    assert s.blocks.match([b"k0", b"k1"], 9) == s.blocks.table(0)[:2]
    plan = s.schedule()
    assert [(c.seq.seq_id, c.start, c.n) for c in plan.chunks] == [(0, 8, 1), (1, 6, 1)]
    ev = s.update(plan, [NO_TOKEN, 52])  # late again: a decode keeps its position, the other finishes
    assert [(e.seq_id, e.index) for e in ev] == [(1, 2)] and other.status is SeqStatus.FINISHED
    assert gated.num_computed == 8 and gated.num_generated == 1 and len(gated.tokens) == 9
    assert s.ring_state(gated) == SlotState.DECODE_PROCESSING
    plan = s.schedule()
    assert [(c.seq.seq_id, c.start, c.n, c.sample) for c in plan.chunks] == [(0, 8, 1, True)]  # same position
    assert [(e.seq_id, e.index, e.token) for e in s.update(plan, [61])] == [(0, 1, 61)]
    assert gated.num_computed == 9 and len(s.blocks.table(0)) == 3
