"""Conformance: control paths (cancel, output backpressure, rejected requests, liveness, shutdown)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conformance.rig import Rig, refused_by_the_agent

from blink.protocol.layout import (
    LOGPROB_DTYPE,
    MAX_STOP_IDS,
    UNLIMITED,
    DeviceFeatures,
    DeviceStatus,
    FinishReason,
    SlotError,
    SlotFlags,
    SlotState,
)


def _wait_tokens(rig: Rig, slot: int, n: int, timeout: float = 30.0) -> None:
    t_end = time.monotonic() + timeout
    while len(rig.client.poll(slot).tokens) < n:
        assert time.monotonic() < t_end, f"slot {slot}: fewer than {n} tokens after {timeout} s"
        time.sleep(0.001)


def test_cancel_running_and_waiting_requests_frees_slots_and_kv(clean: Rig):
    c = clean.client
    batch = clean.spec.max_batch
    running = [c.submit([5, 6, 7], max_new_tokens=UNLIMITED) for _ in range(batch)]
    for s in running:
        _wait_tokens(clean, s, 2)
    waiting = c.submit([8, 9], max_new_tokens=UNLIMITED)  # the batch is full: it cannot start
    c.h_at_least("waiting", 1)  # in the header's counts once the device has seen it
    assert c.poll(waiting).tokens == []
    h = c.header()
    assert int(h["running"]) == batch and int(h["waiting"]) == 1
    assert int(h["kv_blocks_free"]) < int(h["kv_blocks_total"])
    c.cancel(waiting)
    (r,) = c.wait([waiting], timeout=10)
    assert r.finish is FinishReason.CANCELLED and r.tokens == []
    for s in running:
        c.cancel(s)
    for r in c.wait(running, timeout=10):
        assert r.finish is FinishReason.CANCELLED and len(r.tokens) >= 2
    c.wait_idle(timeout=5)  # every KV block back at once


def test_cancel_set_before_submission_never_runs(clean: Rig):
    c = clean.client
    slot = c.submit([1, 2, 3], max_new_tokens=8, cancel=True)  # flag written with the request
    r = c.wait([slot], timeout=10)[0]
    assert r.finish is FinishReason.CANCELLED and r.tokens == []
    assert c.slot(slot)["cancel"] == 0  # the client clears it on free, as the protocol says


def test_request_without_doorbell_is_found_by_the_periodic_scan(clean: Rig):
    r = clean.client.wait([clean.client.submit([3, 4, 5], max_new_tokens=3, doorbell=False)], timeout=10)[0]
    assert r.finish is FinishReason.LENGTH and len(r.tokens) == 3


def test_full_output_ring_pauses_only_that_slot_and_loses_nothing(make_rig):
    cap = 8
    rig = make_rig(output_capacity=cap)
    c = rig.client
    alone = c.generate([11, 12, 13], max_new_tokens=5 * cap).tokens
    slow = c.submit([11, 12, 13], max_new_tokens=5 * cap)  # its reader stops reading for a while
    fast = c.submit([21, 22], max_new_tokens=5 * cap)
    (rf,) = c.wait([fast], timeout=30)  # the other slot is unaffected
    assert len(rf.tokens) == 5 * cap and rf.finish is FinishReason.LENGTH
    rec = c.slot(slow)
    assert int(rec["generated"]) == cap and int(rec["consumed"]) == 0  # stopped at the ring's capacity
    assert SlotState(int(rec["state"])) is SlotState.DECODE_PAUSED
    got = c.poll(slow).tokens  # reads 8 and stores consumed = 8: the device resumes
    assert got == alone[:cap]
    (rs,) = c.wait([slow], timeout=30)
    assert rs.tokens == alone and rs.finish is FinishReason.LENGTH  # longer than the ring, nothing lost


def _wait_generated(rig: Rig, slot: int, n: int, timeout: float = 30.0) -> None:
    """Until the device has published n tokens of the slot (without reading them)."""
    t_end = time.monotonic() + timeout
    while int(rig.client.slot(slot)["generated"]) < n:
        assert time.monotonic() < t_end, f"slot {slot}: fewer than {n} tokens after {timeout} s"
        time.sleep(0.001)


def _chosen_logprobs(rig: Rig, slot: int, ks: range) -> np.ndarray:
    c = rig.client
    return np.array(
        [c.t.read_into(c.geo.logprob_offset(slot, k), np.zeros(1, LOGPROB_DTYPE))[0]["logprob"] for k in ks]
    )


def test_logprob_records_after_a_pause_behind_a_plain_prefill(make_rig):
    """A request with logprobs pauses on a full output ring; a plain request is prefilled alone (a
    step without any extension) and decodes; the first resumes beside it in all-decode steps. Its
    records there are its own: the GPU scheduler's all-decode path kept the previous step's ext_on,
    so the logprob kernels did not run for it."""
    cap = 8
    rig = make_rig(output_capacity=cap)
    c = rig.client
    if not int(c.header()["features"]) & DeviceFeatures.LOGPROBS:
        pytest.skip("this device does not write logprob records")
    lp = dict(max_new_tokens=cap + 4, flags=SlotFlags.LOGPROBS, fields={"n_logprobs": 2})
    alone = c.submit([11, 12, 13], **lp)
    (ra,) = c.wait([alone], timeout=30, free=False)
    want = _chosen_logprobs(rig, alone, range(cap, cap + 4))
    c.free(alone)
    slow = c.submit([11, 12, 13], **lp)
    _wait_generated(rig, slow, cap)  # paused: its reader has not read
    plain = c.submit([21, 22], max_new_tokens=6 * cap)
    _wait_generated(rig, plain, 2)
    (rs,) = c.wait([slow], timeout=30, free=False)  # reads: it resumes beside the plain decodes
    assert rs.tokens == ra.tokens
    got = _chosen_logprobs(rig, slow, range(cap, cap + 4))
    c.free(slow)
    np.testing.assert_allclose(got, want, rtol=0, atol=0.05)
    c.wait([plain], timeout=30)


@pytest.mark.parametrize(
    "case, error",
    [
        ("empty prompt", SlotError.BAD_PROMPT),
        ("token id = vocab", SlotError.BAD_PROMPT),
        ("negative token id", SlotError.BAD_PROMPT),
        ("prompt outside the arena", SlotError.BAD_PROMPT),
        ("prompt fills the context", SlotError.PROMPT_TOO_LONG),
        ("negative temperature", SlotError.BAD_PARAMS),
        ("NaN temperature", SlotError.BAD_PARAMS),
        ("top_p = 0", SlotError.BAD_PARAMS),
        ("top_p > 1", SlotError.BAD_PARAMS),
        ("too many stop ids", SlotError.BAD_PARAMS),
        ("max_new_tokens = 0", SlotError.BAD_PARAMS),
        ("temperature above 2", SlotError.BAD_PARAMS),
        ("infinite temperature", SlotError.BAD_PARAMS),
        ("top_k above 2^31 - 1", SlotError.BAD_PARAMS),
        ("presence penalty above 2", SlotError.BAD_PARAMS),
        ("NaN repetition penalty", SlotError.BAD_PARAMS),
    ],
)
def test_bad_requests_finish_with_error(clean: Rig, case: str, error: SlotError):
    c = clean.client
    ctx = int(c.header()["max_context"])
    kw: dict = {"max_new_tokens": 4}
    prompt = [1, 2, 3]
    if case == "empty prompt":
        prompt = []
    elif case == "token id = vocab":
        prompt = [1, clean.vocab]
    elif case == "negative token id":
        prompt = [1, -5]
    elif case == "prompt outside the arena":
        kw["prompt_offset"] = c.geo.prompt_arena_tokens - 1
    elif case == "prompt fills the context":
        prompt = [4] * ctx
    elif case == "negative temperature":
        kw["temperature"] = -0.5
    elif case == "NaN temperature":
        kw["temperature"] = float("nan")
    elif case == "top_p = 0":
        kw["top_p"] = 0.0
    elif case == "top_p > 1":
        kw["top_p"] = 1.5
    elif case == "too many stop ids":
        kw["n_stop"] = MAX_STOP_IDS + 1
    elif case == "max_new_tokens = 0":
        kw["max_new_tokens"] = 0
    elif case == "temperature above 2":  # the ranges of blink/protocol/sampling_params.py
        kw["temperature"] = 2.5
    elif case == "infinite temperature":
        kw["temperature"] = float("inf")
    elif case == "top_k above 2^31 - 1":
        kw["top_k"] = 2**31
    elif case == "presence penalty above 2":
        kw["fields"] = {"presence_penalty": 3.0}
    elif case == "NaN repetition penalty":
        kw["fields"] = {"repetition_penalty": float("nan")}
    if case == "prompt outside the arena" and refused_by_the_agent(clean, lambda: c.submit(prompt, **kw)):
        return
    r = c.generate(prompt, timeout=10, **kw)
    assert (r.finish, r.error, r.tokens) == (FinishReason.ERROR, error, [])
    # the device keeps serving
    assert c.generate([1, 2, 3], max_new_tokens=2).finish is FinishReason.LENGTH


def test_longest_prompt_that_fits_is_served(clean: Rig):
    c = clean.client
    ctx = int(c.header()["max_context"])
    r = c.generate([4] * (ctx - 1), max_new_tokens=8, timeout=60)
    assert r.finish is FinishReason.CONTEXT and len(r.tokens) == 1


def test_heartbeat_advances_while_idle(clean: Rig):
    """An idle device beats about every millisecond (the GPU scheduler in its poll loop; the emulated
    device sleeps at most 0.5 ms between polls). Asserted with room for a loaded 2-core host, where
    sleeps overshoot by milliseconds (307 beats/s seen beside a full test run): at least 100 beats a
    second with a median gap under 10 ms, three orders of magnitude inside the frontend's 30 s stall
    timeout; a device that stops beating while idle gives 0."""
    c = clean.client
    time.sleep(0.05)
    b0, t0 = c.h("heartbeat"), time.monotonic()
    ns, gaps = c.h("heartbeat_ns"), []
    while time.monotonic() - t0 < 0.3:
        n = c.h("heartbeat_ns")
        if n != ns:
            gaps.append(n - ns)
            ns = n
        time.sleep(0.0001)
    rate = (c.h("heartbeat") - b0) / (time.monotonic() - t0)
    assert rate > 100, f"{rate:.0f} beats/s"
    assert np.median(gaps) < 10e6
    assert abs(c.h("heartbeat_ns") - time.time_ns()) < 1e9  # a wall clock, in ns since the epoch


def test_shutdown_drain_finishes_in_flight_work(make_rig):
    rig = make_rig()
    c = rig.client
    s = c.submit([1, 2, 3], max_new_tokens=40)
    _wait_tokens(rig, s, 1)
    c.shutdown(1)
    (r,) = c.wait([s], timeout=30)
    assert r.finish is FinishReason.LENGTH and len(r.tokens) == 40
    c.wait_status(DeviceStatus.STOPPED, timeout=30)
    assert rig.proc.wait(30) == 0


def test_shutdown_now_cancels_in_flight_work(make_rig):
    rig = make_rig()
    c = rig.client
    s = c.submit([1, 2, 3], max_new_tokens=UNLIMITED)
    _wait_tokens(rig, s, 1)
    c.shutdown(2)
    c.wait_status(DeviceStatus.STOPPED, timeout=30)
    (r,) = c.wait([s], timeout=5)
    assert r.finish is FinishReason.CANCELLED
    assert rig.proc.wait(30) == 0
