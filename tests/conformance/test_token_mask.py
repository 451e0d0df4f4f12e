"""Conformance: token masks (structured output). A constrained slot samples under the bitmask the
frontend publishes in the mask arena for its next token (slot.mask_slot, slot.mask_position). The
device reads the gate when it samples the slot, at the end of a step: a mask published while the
step runs is used by that step, and a slot whose mask is still unpublished then gives no token this
step (the position is computed again next step) without delaying any other slot."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conformance.client import RingClient
from conformance.rig import GPU_PACED, Rig, refused_by_the_agent

from blink.protocol.layout import SLOT_DTYPE, DeviceFeatures, FinishReason, SlotError

_POSITION = SLOT_DTYPE.fields["mask_position"][1]
_SOFF_GENERATED = SLOT_DTYPE.fields["generated"][1]


@pytest.fixture
def masked(clean: Rig) -> Rig:
    if not int(clean.client.header()["features"]) & DeviceFeatures.TOKEN_MASK:
        pytest.skip("this device does not implement token masks (DeviceFeatures.TOKEN_MASK)")
    return clean


def publish(c: RingClient, slot: int, mask: int, k: int, allowed: list[int]) -> None:
    """The mask for generated token k of `slot` (bitmask `mask` of the arena), then its position."""
    bits = np.zeros(c.geo.mask_words, "<u4")
    for t in allowed:
        bits[t >> 5] |= np.uint32(1 << (t & 31))
    c.t.write(c.geo.mask_offset(mask), bits)
    c.t.store_u32(c.geo.slot_offset(slot) + _POSITION, k + 1)


def submit_masked(c: RingClient, prompt: list[int], mask: int, first: list[int], **kw) -> int:
    """A constrained request whose mask for token 0 allows `first` (written before the request)."""
    bits = np.zeros(c.geo.mask_words, "<u4")
    for t in first:
        bits[t >> 5] |= np.uint32(1 << (t & 31))
    c.t.write(c.geo.mask_offset(mask), bits)
    return c.submit(prompt, fields={"mask_slot": mask + 1, "mask_position": 1}, **kw)


def pump(c: RingClient, slot: int, mask: int, allowed_at, published: int) -> int:
    """One look at a constrained slot: when it has read token k - 1 and token k's mask is not out yet,
    publish it (the ids allowed_at(k); None: nothing more to publish). Returns the masks published."""
    r = c.poll(slot)
    k = len(r.tokens)
    if not r.done and k >= published and (ids := allowed_at(k)) is not None:
        publish(c, slot, mask, k, ids)
        return k + 1
    return published


def drive(
    c: RingClient, slot: int, mask: int, forced: list[int] | None, timeout: float = 30.0, allowed_at=None
) -> list[int]:
    """Read the slot's tokens, publishing the mask of each next token k as soon as token k - 1 is read
    (one allowed id forced[k], or the ids allowed_at(k))."""
    if allowed_at is None:
        allowed_at = lambda k: [forced[k]] if k < len(forced) else None  # noqa: E731
    r = c.active[slot]
    deadline = time.monotonic() + timeout
    published = 1
    while not r.done:
        assert time.monotonic() < deadline, f"slot {slot} timed out with {len(r.tokens)} tokens"
        published = pump(c, slot, mask, allowed_at, published)
        time.sleep(0)
    c.free(slot)
    return r.tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_mask_that_allows_one_token_forces_it(masked: Rig, temperature: float):
    c = masked.client
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, masked.vocab, 12).tolist()
    free = c.generate(prompt, max_new_tokens=6, temperature=temperature, seed=5).tokens
    # ids the unconstrained request did not pick at each position: only the mask can explain them
    forced = [int((t + 1 + 7 * i) % masked.vocab) for i, t in enumerate(free)]
    slot = submit_masked(c, prompt, 0, forced[:1], max_new_tokens=6, temperature=temperature, seed=5)
    assert drive(c, slot, 0, forced) == forced


def test_a_mask_published_while_the_step_runs_is_sampled_in_that_step(make_rig):
    """A frontend that publishes each mask as soon as it sees the token before: the constrained slot
    gets its next token from the step that was running meanwhile, so it keeps pace with an
    unconstrained slot beside it (a token on consecutive steps). A gate read when a step is planned,
    before the token before it is even published, lets it sample only every other step.

    The check: after each mask this client published before the other slot's next token (the step
    then running had not published: it samples after the mask is out), the constrained slot's next
    token comes with the other's next token. The device publishes a step's tokens together, the
    constrained slot's (slot 0) first; the client judges a mask once the other's token of that step is
    out (a client that read between the two publications used to drop the case, a third of them over
    TCP). The
    emulated device runs it with steps of 30 ms (conformance/slow_executor.py), as long as a GPU's at
    real sizes: its tiny model's CPU steps end before this client has read the token before."""
    masked = make_rig(**GPU_PACED)
    if not int(masked.client.header()["features"]) & DeviceFeatures.TOKEN_MASK:
        pytest.skip("this device does not implement token masks (DeviceFeatures.TOKEN_MASK)")
    c = masked.client
    rng = np.random.default_rng(6)
    n = 48  # < output_capacity: nothing needs reading until the end
    prompt = rng.integers(3, masked.vocab, 8).tolist()
    slot = submit_masked(c, prompt, 0, [11, 12], max_new_tokens=n)
    other = c.submit(prompt, max_new_tokens=n)
    bits = np.zeros(c.geo.mask_words, "<u4")
    bits[0] = (1 << 11) | (1 << 12)
    gen = lambda s: c.t.load_u32(c.geo.slot_offset(s) + _SOFF_GENERATED)  # noqa: E731
    deadline, seen, pending, hits, misses = time.monotonic() + 60, 0, None, 0, 0
    while seen < n:
        assert time.monotonic() < deadline
        g = gen(other)
        k = gen(slot)
        if pending is not None and (g > pending[1] or k > pending[0]):
            # the step that ran while the mask went out is publishing: the slot's token first, then the
            # other's; once the other's is out, the slot's count says whether that step sampled it
            while gen(other) == pending[1]:
                assert time.monotonic() < deadline
            k = gen(slot)
            hit = k > pending[0]
            hits, misses, pending = hits + hit, misses + (not hit), None
        if seen < k < n:  # token k - 1 is out: token k's mask (the same ids every time)
            c.t.write(c.geo.mask_offset(0), bits)
            c.t.store_u32(c.geo.slot_offset(slot) + _POSITION, k + 1)
            pending = (k, g) if gen(other) == g and g < n else None  # None: out too late to tell
        seen = max(seen, k)
    (got,) = c.wait([slot], timeout=30)
    (free,) = c.wait([other], timeout=30)
    assert len(got.tokens) == n and set(got.tokens) <= {11, 12} and len(free.tokens) == n
    if hits + misses < n / 4:
        pytest.skip(f"this client published only {hits + misses} of {n} masks within a step: too slow")
    assert misses <= (hits + misses) / 4, f"{misses} of {hits + misses} masks out during a step missed it"


def test_a_late_mask_gives_no_token_for_that_slot_only_and_the_output_is_that_of_an_on_time_run(masked: Rig):
    """Token 3's mask held back: the slot gives no token while the others proceed, then resumes, and
    its output is the on-time run's (the position is computed and sampled again: same K/V, same
    draw). Several ids allowed per position, temperature 1, so the draw is the device's."""
    c = masked.client
    rng = np.random.default_rng(8)
    prompt = rng.integers(3, masked.vocab, 10).tolist()
    ids = sorted(set(rng.integers(3, masked.vocab, 40).tolist()))
    allowed_at = lambda k: ids if k < 8 else None  # noqa: E731
    kw = dict(max_new_tokens=8, temperature=1.0, seed=21)
    on_time = drive(c, submit_masked(c, prompt, 1, ids, **kw), 1, None, allowed_at=allowed_at)
    slot = submit_masked(c, prompt, 1, ids, **kw)
    t0, published = time.monotonic(), 1
    while len(c.poll(slot).tokens) < 3:  # on time up to token 2
        assert time.monotonic() - t0 < 30
        published = pump(c, slot, 1, lambda k: ids if k < 3 else None, published)
    other = c.submit(rng.integers(3, masked.vocab, 8).tolist(), max_new_tokens=12)
    (r,) = c.wait([other], timeout=30)  # runs its 12 steps while the slot's mask for token 3 is late
    assert r.finish is FinishReason.LENGTH and len(r.tokens) == 12
    assert len(c.poll(slot).tokens) == 3 and not c.active[slot].done
    late = drive(c, slot, 1, None, allowed_at=allowed_at)
    assert set(late) <= set(ids) and len(late) == 8
    if masked.exact:  # a CUDA step's sums depend on what else it carries (Rig.exact)
        assert late == on_time


def _late_beside_24_steps(masked: Rig, rng) -> int:
    """A constrained slot given the mask of its token 0 only (it then waits for token 1's), and beside
    it another request run to its 24 tokens. Returns the waiting slot's request."""
    c = masked.client
    generated0 = c.h("tokens_generated")
    late = submit_masked(c, rng.integers(3, masked.vocab, 8).tolist(), 1, [7], max_new_tokens=3)
    t0 = time.monotonic()
    while len(c.poll(late).tokens) < 1:  # token 0 comes under the mask given with the request
        assert time.monotonic() - t0 < 30
        time.sleep(0.001)
    other = c.submit(rng.integers(3, masked.vocab, 8).tolist(), max_new_tokens=24)
    (r,) = c.wait([other], timeout=30)
    assert r.finish is FinishReason.LENGTH and len(r.tokens) == 24
    c.h_at_least("tokens_generated", generated0 + 1 + 24)  # the statistics reach the header after the tokens
    return late


def test_a_slot_whose_mask_is_late_does_not_delay_others(masked: Rig):
    c = masked.client
    late = _late_beside_24_steps(masked, np.random.default_rng(4))
    waiting = c.poll(late)
    assert waiting.tokens == [7] and not waiting.done  # sat out every step while its mask was late
    assert drive(c, late, 1, [7, 9, 11]) == [7, 9, 11]


def test_every_step_a_slot_sits_out_for_its_late_mask_counts_in_the_header(masked: Rig):
    """header.mask_late_rows: one per constrained row sampled before its mask was published (no token
    in that step). While another request runs its 24 steps, the slot waiting for its mask sits out each
    of them; the count never exceeds the steps run, and a mask on time adds nothing."""
    c = masked.client
    rng = np.random.default_rng(9)
    steps = lambda: c.h("steps") + c.h("prefill_steps")  # noqa: E731
    c.wait_idle()  # the counts of the requests before this one are in
    late0, generated0 = c.h("mask_late_rows"), c.h("tokens_generated")
    on_time = submit_masked(c, rng.integers(3, masked.vocab, 8).tolist(), 1, [7], max_new_tokens=1)
    assert drive(c, on_time, 1, [7]) == [7]  # its one mask came with the request
    c.h_at_least("tokens_generated", generated0 + 1)  # the statistics reach the header after the tokens
    assert c.h("mask_late_rows") == late0
    steps0 = steps()
    late = _late_beside_24_steps(masked, rng)
    sat_out, ran = c.h("mask_late_rows") - late0, steps() - steps0
    assert c.poll(late).tokens == [7]
    assert 23 <= sat_out <= ran, (sat_out, ran)
    assert drive(c, late, 1, [7, 9, 11]) == [7, 9, 11]


def test_a_mask_index_outside_the_arena_is_rejected(masked: Rig):
    c = masked.client
    bad = dict(max_new_tokens=2, fields={"mask_slot": c.geo.n_masks + 1, "mask_position": 1})
    if refused_by_the_agent(masked, lambda: c.submit([5, 6, 7], **bad)):
        return
    slot = c.submit([5, 6, 7], **bad)
    (r,) = c.wait([slot])
    assert r.finish is FinishReason.ERROR and r.error is SlotError.BAD_PARAMS


def test_a_device_without_token_masks_rejects_a_masked_request(clean: Rig):
    c = clean.client
    if int(c.header()["features"]) & DeviceFeatures.TOKEN_MASK:
        pytest.skip("this device implements token masks")
    slot = c.submit([5, 6, 7], max_new_tokens=2, fields={"mask_slot": 1, "mask_position": 1})
    (r,) = c.wait([slot])
    assert r.finish is FinishReason.ERROR and r.error is SlotError.BAD_PARAMS  # never sampled unmasked


def test_a_request_whose_first_mask_is_late_prefills_but_samples_only_once_it_is_published(masked: Rig):
    """The prompt is computed, and its last position is computed and sampled again each step while the
    mask of token 0 is unpublished (no token, nobody held back); once published, it samples under it."""
    c = masked.client
    rng = np.random.default_rng(5)
    bits = np.zeros(c.geo.mask_words, "<u4")
    c.t.write(c.geo.mask_offset(2), bits)
    late = c.submit(rng.integers(3, masked.vocab, 20).tolist(), max_new_tokens=2, fields={"mask_slot": 3})
    other = c.submit(rng.integers(3, masked.vocab, 8).tolist(), max_new_tokens=16)
    (r,) = c.wait([other], timeout=30)
    assert r.finish is FinishReason.LENGTH and len(r.tokens) == 16  # not held back by the late one
    time.sleep(0.05)
    waiting = c.poll(late)
    assert waiting.tokens == [] and not waiting.done
    publish(c, late, 2, 0, [13])
    assert drive(c, late, 2, [13, 17]) == [13, 17]
