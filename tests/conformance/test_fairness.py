"""Conformance: the fair share of the batch (blink/device/scheduler.py, group_cap). The choices of one
API request carry its id in slot.group; one such request with more choices than the batch holds
fills an idle batch, yet another request submitted meanwhile is served at once instead of after a
whole wave of those choices (the reported case: n = 128 long choices kept another user's request
waiting a minute for its first token). Through the ring only.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from conformance.rig import Rig

from blink.protocol.layout import FinishReason

SPEC = dict(max_batch=4, max_num_batched_tokens=64, max_context=1024, kv_blocks=160, output_capacity=512, n_slots=16)
N = 8  # choices of the big request: twice the batch
LONG = 300  # tokens per choice
GROUP = 0xB11C


def _prompt(rig: Rig, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, rig.vocab, n).tolist()


def test_a_request_with_many_choices_does_not_keep_another_waiting(make_rig):
    rig = make_rig(**SPEC)
    c = rig.client
    p = _prompt(rig, 6, 0)
    group = [c.submit(p, max_new_tokens=LONG, temperature=0.0, fields={"group": GROUP}) for _ in range(N)]
    while sum(bool(c.poll(s).tokens) for s in group) < SPEC["max_batch"]:
        pass  # alone, the request fills the batch
    assert not any(c.poll(s).done for s in group)
    lone = c.submit(_prompt(rig, 5, 1), max_new_tokens=2)
    (r,) = c.wait([lone], timeout=60)
    assert r.finish is FinishReason.LENGTH and len(r.tokens) == 2
    # served while every choice of the big request still runs (without the fair share it waits for
    # the first SPEC["max_batch"] choices' LONG tokens)
    assert not any(c.poll(s).done for s in group), [len(c.poll(s).tokens) for s in group]
    res = c.wait(group, timeout=120)
    # one choice was preempted to make room and recomputed: every choice has the same greedy tokens
    # (on CUDA the recomputed one may part from the others at a near-tie: Rig.exact)
    assert all(x.finish is FinishReason.LENGTH and len(x.tokens) == LONG for x in res), [x.finish for x in res]
    parted = len(res) - max(Counter(tuple(x.tokens) for x in res).values())
    assert parted == 0 if rig.exact else parted <= 1, parted
    assert len(res[0].tokens) == LONG


def test_without_a_group_the_same_requests_are_first_come_first_served(make_rig):
    """The same load with slot.group 0 (eight separate requests, as a frontend that does not group
    choices submits them): the late request is behind the first wave. What the test above would see
    without the fair share."""
    rig = make_rig(**SPEC)
    c = rig.client
    p = _prompt(rig, 6, 0)
    many = [c.submit(p, max_new_tokens=LONG // 4, temperature=0.0) for _ in range(N)]
    while sum(bool(c.poll(s).tokens) for s in many) < SPEC["max_batch"]:
        pass
    lone = c.submit(_prompt(rig, 5, 1), max_new_tokens=2)
    (r,) = c.wait([lone], timeout=60)
    assert sum(c.poll(s).done for s in many) >= SPEC["max_batch"]
    c.wait(many, timeout=120)
