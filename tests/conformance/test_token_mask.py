"""Conformance: token masks (structured output). A constrained slot samples under the bitmask the
frontend publishes in the mask arena for its next token (slot.mask_slot, slot.mask_position), and a
slot whose mask is not published yet sits out without delaying any other slot."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conformance.client import RingClient
from conformance.rig import Rig, refused_by_the_agent

from blink.protocol.layout import SLOT_DTYPE, DeviceFeatures, FinishReason, SlotError

_POSITION = SLOT_DTYPE.fields["mask_position"][1]


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


def drive(c: RingClient, slot: int, mask: int, forced: list[int], timeout: float = 30.0) -> list[int]:
    """Read the slot's tokens, publishing the mask of each next token (one allowed id: forced[k])."""
    r = c.active[slot]
    deadline = time.monotonic() + timeout
    published = 1
    while not r.done:
        assert time.monotonic() < deadline, f"slot {slot} timed out with {len(r.tokens)} tokens"
        c.poll(slot)
        k = len(r.tokens)
        if not r.done and k >= published and k < len(forced):
            publish(c, slot, mask, k, [forced[k]])
            published = k + 1
        time.sleep(0.0005)
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


def test_a_slot_whose_mask_is_late_does_not_delay_others(masked: Rig):
    c = masked.client
    rng = np.random.default_rng(4)
    late = submit_masked(c, rng.integers(3, masked.vocab, 8).tolist(), 1, [7], max_new_tokens=3)
    t0 = time.monotonic()
    while len(c.poll(late).tokens) < 1:  # token 0 comes under the mask given with the request
        assert time.monotonic() - t0 < 30
        time.sleep(0.001)
    other = c.submit(rng.integers(3, masked.vocab, 8).tolist(), max_new_tokens=24)
    (r,) = c.wait([other], timeout=30)
    assert r.finish is FinishReason.LENGTH and len(r.tokens) == 24
    time.sleep(0.05)
    waiting = c.poll(late)
    assert waiting.tokens == [7] and not waiting.done  # sat out every step while its mask was late
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
    """The prefill chunk stops one token short of sampling while the mask of token 0 is unpublished
    (Scheduler._cut); the step that carries the last prompt token samples under the published mask."""
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
