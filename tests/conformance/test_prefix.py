"""Conformance: prefix caching (DeviceFeatures.PREFIX_CACHING; layout.py "Block keys"), through the ring.

What a caching device must do, checked by what it publishes: slot.cached_tokens is the longest run of
leading full blocks whose keys it holds, never the block of the prompt's last token; the tokens are
the ones a computation from scratch gives (greedy, token for token: the cached KV is the right
KV); blocks held by a running request are shared, never evicted; cached blocks are evictable (the
pool stays whole: kv_blocks_free == kv_blocks_total when idle) and are evicted under pressure; the
counters add up; reset_cache_seq forgets every key. A device without the feature skips these,
except the on/off equality, which every device must pass.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from conformance.rig import Rig, refused_by_the_agent

from blink.protocol.layout import UNLIMITED, FinishReason, SlotError, SlotFlags

_seeds = itertools.count(1000)


def prompt(rig: Rig, n: int) -> list[int]:
    """A prompt no other test sends (the shared rig's cache outlives a test)."""
    return np.random.default_rng(next(_seeds)).integers(3, rig.vocab, n).tolist()


def caching(rig: Rig) -> Rig:
    if not rig.client.caching:
        pytest.skip("the device does not advertise PREFIX_CACHING")
    return rig


@pytest.fixture
def cached(clean: Rig) -> Rig:
    return caching(clean)


def counters(rig: Rig) -> tuple[int, int]:
    rig.client.wait_idle()
    h = rig.client.header()
    return int(h["prefix_cache_queries"]), int(h["prefix_cache_hits"])


def full_blocks(rig: Rig, n_prompt: int) -> int:
    """Tokens a repeated prompt of n_prompt tokens takes from the cache: the full blocks before the
    block of its last token."""
    bs = rig.client.block_size
    return (n_prompt - 1) // bs * bs


def wait_tokens(rig: Rig, slot: int, n: int, timeout: float = 30.0) -> None:
    t_end = time.monotonic() + timeout
    while len(rig.client.poll(slot).tokens) < n:
        assert time.monotonic() < t_end, f"slot {slot}: fewer than {n} tokens after {timeout} s"
        time.sleep(0.001)


@pytest.mark.parametrize("n", [100, 96, 17, 16, 5])
def test_a_repeated_prompt_reuses_its_full_blocks(cached: Rig, n: int):
    c = cached.client
    p = prompt(cached, n)
    q0, h0 = counters(cached)
    first = c.generate(p, max_new_tokens=8)
    again = c.generate(p, max_new_tokens=8)
    assert first.cached_tokens == 0
    assert again.cached_tokens == full_blocks(cached, n)  # the last token's block is computed again
    assert again.tokens == first.tokens or not cached.exact  # CUDA: the last block alone sums otherwise
    q1, h1 = counters(cached)
    assert (q1 - q0, h1 - h0) == (2 * n, full_blocks(cached, n))
    if n > c.block_size:
        assert int(c.header()["kv_blocks_cached"]) >= n // c.block_size


def test_a_shared_prefix_is_reused_up_to_the_first_differing_block(cached: Rig):
    c = cached.client
    base = prompt(cached, 150)
    a, b = base + prompt(cached, 20), base + prompt(cached, 37)
    c.generate(a, max_new_tokens=4)
    rb = c.generate(b, max_new_tokens=12)
    assert rb.cached_tokens == 150 // c.block_size * c.block_size
    assert rb.tokens == c.generate(b, max_new_tokens=12, keys=False).tokens  # from scratch


def test_keys_not_tokens_name_the_blocks(cached: Rig):
    c = cached.client
    p = prompt(cached, 80)
    c.generate(p, max_new_tokens=2, salt=b"a")
    assert c.generate(p, max_new_tokens=2, salt=b"b").cached_tokens == 0  # another chain: another cache
    assert c.generate(p, max_new_tokens=2, salt=b"a").cached_tokens == full_blocks(cached, 80)
    assert c.generate(p, max_new_tokens=2, keys=False).cached_tokens == 0


def test_a_running_requests_blocks_serve_a_new_request(cached: Rig):
    c = cached.client
    p = prompt(cached, 120)
    ref = c.generate(p, max_new_tokens=20, keys=False, salt=b"ref").tokens
    s0 = c.submit(p, max_new_tokens=UNLIMITED)
    wait_tokens(cached, s0, 1)  # its prompt blocks are computed and registered
    r1 = c.wait([c.submit(p, max_new_tokens=20)])[0]
    assert c.poll(s0).finish is FinishReason.NONE  # still running while r1 shared its blocks
    wait_tokens(cached, s0, 20)
    c.cancel(s0)
    (r0,) = c.wait([s0])
    assert r1.cached_tokens == full_blocks(cached, 120)
    assert r1.tokens == ref and r0.tokens[:20] == ref


def test_aborts_of_requests_sharing_blocks_leave_the_others_and_the_cache_intact(cached: Rig):
    c = cached.client
    p = prompt(cached, 150)
    ref = c.generate(p, max_new_tokens=24).tokens  # registers the prompt's blocks
    doomed = [c.submit(p, max_new_tokens=UNLIMITED) for _ in range(2)]
    kept = [c.submit(p, max_new_tokens=24) for _ in range(2)]
    for s in doomed:
        wait_tokens(cached, s, 2)
        c.cancel(s)
    for r in c.wait(doomed):  # the cancel may land after more than len(ref) tokens (over tcp, say)
        assert r.finish is FinishReason.CANCELLED and r.tokens[: len(ref)] == ref[: len(r.tokens)]
    for r in c.wait(kept):
        assert r.tokens == ref and r.cached_tokens == full_blocks(cached, 150)
    c.wait_idle()  # every block back: shared references all dropped
    assert c.generate(p, max_new_tokens=2).cached_tokens == full_blocks(cached, 150)


def test_eviction_under_pressure_never_touches_blocks_in_use(make_rig):
    rig = caching(make_rig(kv_blocks=24, max_context=384))
    c = rig.client
    a = prompt(rig, 200)
    ref = c.generate(a, max_new_tokens=40, keys=False).tokens
    assert c.generate(a, max_new_tokens=4).cached_tokens == 0
    s = c.submit(a, max_new_tokens=40)  # holds the 12 cached blocks while others need room
    others = [prompt(rig, 100) for _ in range(3)]  # 7 blocks each: room beside the running request
    for o in others:
        r = c.generate(o, max_new_tokens=4)
        assert r.finish is FinishReason.LENGTH
    (ra,) = c.wait([s])
    assert ra.cached_tokens == full_blocks(rig, 200) and ra.tokens == ref
    h = c.header()
    assert int(h["kv_blocks_cached"]) <= int(h["kv_blocks_total"])
    for _ in range(4):  # nothing holds a's blocks now: they go, least recently used first
        c.generate(prompt(rig, 300), max_new_tokens=2)
    again = c.generate(a, max_new_tokens=40)
    assert again.cached_tokens < full_blocks(rig, 200) and again.tokens == ref


def test_a_request_as_long_as_the_cache_evicts_everything_cached(make_rig):
    rig = caching(make_rig(kv_blocks=16, max_context=1024))
    c = rig.client
    limit = int(c.header()["max_context"])  # the pool caps it: 16 blocks
    a, b = prompt(rig, 100), prompt(rig, 200)
    ra = c.generate(a, max_new_tokens=4)
    rb = c.generate(b, max_new_tokens=UNLIMITED)  # grows to the whole pool
    assert rb.finish is FinishReason.CONTEXT and 200 + len(rb.tokens) == limit
    ra2 = c.generate(a, max_new_tokens=4)
    assert ra2.cached_tokens == 0 and ra2.tokens == ra.tokens
    rb2 = c.generate(b, max_new_tokens=UNLIMITED)
    assert rb2.tokens == rb.tokens and rb2.cached_tokens <= full_blocks(rig, 200)
    too_long = c.generate(prompt(rig, limit + 10), max_new_tokens=1)
    assert too_long.finish is FinishReason.ERROR and too_long.error is SlotError.PROMPT_TOO_LONG


def test_reset_forgets_every_key(cached: Rig):
    c = cached.client
    p = prompt(cached, 64)
    c.generate(p, max_new_tokens=2)
    assert c.generate(p, max_new_tokens=2).cached_tokens == full_blocks(cached, 64)
    resets = int(c.header()["prefix_cache_resets"])
    c.reset_prefix_cache()
    assert c.generate(p, max_new_tokens=2).cached_tokens == 0
    assert int(c.header()["prefix_cache_resets"]) == resets + 1
    assert int(c.header()["kv_blocks_cached"]) > 0  # registered again by the request after the reset


def test_prompt_logprob_requests_compute_every_token(cached: Rig):
    c = cached.client
    p = prompt(cached, 64)
    c.generate(p, max_new_tokens=2)
    slot = c._free_slot()
    lo = slot * c.region + len(p)
    r = c.wait([c.submit(p, slot=slot, flags=SlotFlags.PROMPT_LOGPROBS, fields={"prompt_logprobs_offset": lo})])[0]
    if r.error is SlotError.BAD_PARAMS:
        pytest.skip("the device does not write prompt logprobs")
    assert r.cached_tokens == 0


@pytest.mark.parametrize(
    "fields",
    [{"repetition_penalty": 1.3}, {"presence_penalty": 0.8}, {"frequency_penalty": 0.5}],
    ids=["repetition", "presence", "frequency"],
)
def test_penalized_requests_compute_every_token(cached: Rig, fields: dict):
    """A penalty sees the prompt's ids as the device computes them: such requests read no cached block,
    and their tokens are those of a computation from scratch."""
    c = cached.client
    p = prompt(cached, 64)
    ref = c.generate(p, max_new_tokens=12, keys=False, fields=fields)
    if ref.error is SlotError.BAD_PARAMS:
        pytest.skip("the device does not implement penalties")
    c.generate(p, max_new_tokens=2)  # caches the prompt's blocks
    r = c.generate(p, max_new_tokens=12, fields=fields)
    assert r.cached_tokens == 0 and r.tokens == ref.tokens


def test_bad_block_keys_are_rejected(cached: Rig):
    c = cached.client
    p = prompt(cached, 40)  # 2 full blocks: 3 keys is one too many
    slot = c._free_slot()
    too_many = {"n_block_keys": 3, "block_keys_offset": slot * c.region}  # in the slot's own region
    r = c.generate(p, max_new_tokens=1, keys=False, slot=slot, fields=too_many)
    assert r.finish is FinishReason.ERROR and r.error is SlotError.BAD_PARAMS
    outside = {"n_block_keys": 1, "block_keys_offset": 1 << 30}  # past the arena
    if refused_by_the_agent(cached, lambda: c.submit(p, max_new_tokens=1, keys=False, fields=outside)):
        return
    r = c.generate(p, max_new_tokens=1, keys=False, fields=outside)
    assert r.finish is FinishReason.ERROR and r.error is SlotError.BAD_PARAMS


def _workload(rig: Rig) -> list[list[int]]:
    """Sequential and concurrent requests sharing prefixes: what caching changes the path of."""
    c = rig.client
    rng = np.random.default_rng(7)
    system = rng.integers(3, rig.vocab, 70).tolist()
    turns = [system + rng.integers(3, rig.vocab, int(k)).tolist() for k in (5, 16, 33, 1, 60)]
    out = [c.generate(t, max_new_tokens=10).tokens for t in turns]
    slots = [c.submit(t + [9], max_new_tokens=12) for t in turns]  # together: shared blocks in one batch
    out += [r.tokens for r in c.wait(slots)]
    history = turns[0]
    for _ in range(3):  # a conversation resending its history
        reply = c.generate(history, max_new_tokens=9).tokens
        out.append(reply)
        history = history + reply + rng.integers(3, rig.vocab, 11).tolist()
    return out


def test_greedy_output_is_the_same_with_caching_on_and_off(make_rig):
    on, off = make_rig(), make_rig(prefix_caching=False)
    assert off.client.caching is False
    got_off = _workload(off)
    assert all(int(off.client.slot(i)["cached_tokens"]) == 0 for i in range(off.spec.n_slots))
    q0, h0 = counters(on)
    assert _workload(on) == got_off
    q1, h1 = counters(on)
    if on.client.caching:
        assert h1 - h0 > 0 and q1 - q0 > h1 - h0
