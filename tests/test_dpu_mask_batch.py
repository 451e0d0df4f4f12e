"""Structured output on the frontend side of the ring: the masks of one reader cycle computed together
(blink/dpu/token_masks.py MaskBatch, llguidance's parallel executor) are the single-matcher path's,
they all reach the ring in one post before any request hears of its tokens, the time they take is
counted (blink/dpu/mask_timing.py) and exported on /metrics, and the reader polls without coarse
sleeps while constrained requests are active (blink/dpu/poll_cadence.py)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from test_dpu_ring import HandDevice

from blink.dpu.mask_timing import MASK_LATENCY_EDGES_S, MaskLatency, quantile, summary
from blink.dpu.metrics import mask_latency_family
from blink.dpu.poll_cadence import PollCadence
from blink.dpu.slot_tracker import SlotTracker
from blink.dpu.structured import json_schema_grammar, regex_grammar
from blink.dpu.token_masks import Constraint, MaskBatch
from blink.dpu.token_reader import TokenReader
from blink.dpu.tokenizer import load_tokenizer
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.sampling_params import SamplingParams
from blink.protocol.transport import ShmTransport
from blink.protocol.wire import SubmitRequest, TokenEvent

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"],
}


@pytest.fixture(scope="module")
def grammars():
    return load_tokenizer("random:tiny-llama").grammars


def allowed(bits: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))


@pytest.mark.parametrize("threads", [1, 2])  # 1: one by one on the caller's thread
def test_a_cycle_of_masks_computed_together_equals_each_computed_alone(grammars, threads):
    """Eight constrained slots follow random allowed paths; at each cycle some of them read one token,
    one of them two, and once one reads a token its grammar forbids (then only EOS is allowed).
    MaskBatch's writes equal those of each slot's own matcher (the single-matcher path) every cycle, the
    bits of all slots first, then the position words that publish them."""
    geo = RingGeometry(8, 64, 8, 8, 32 * grammars.words + 64)  # masks wider than the vocabulary
    g = json_schema_grammar(SCHEMA, "t")
    batch = [Constraint(grammars.matcher(g), m, geo) for m in range(8)]
    alone = [Constraint(grammars.matcher(g), m, geo) for m in range(8)]
    rng = np.random.default_rng(1)
    k = [0] * 8
    mb = MaskBatch(threads)
    for cycle in range(12):
        items, want = [], []
        for s in rng.permutation(8)[: 2 + cycle % 7].tolist():
            ids = path(grammars, alone[s], rng, forbidden=cycle == 5 and not items, two=cycle % 3 == 0 and not items)
            k[s] += len(ids)
            want += alone[s].advance(s, ids, k[s])
            items.append((s, batch[s], ids, k[s]))
        got = mb.advance(items)
        assert len(got) == len(want) == 2 * len(items)
        # every slot's bits, then every position word: a device polling the ring sees the cycle's
        # masks published within a few word stores, not one by one behind each mask's copy
        assert [off for off, _ in got] == [off for off, _ in want[0::2] + want[1::2]]
        want = want[0::2] + want[1::2]
        for (off_g, data_g), (off_w, data_w) in zip(got, want, strict=True):
            assert off_g == off_w
            w, d = np.asarray(data_w).view("<u4"), np.asarray(data_g).view("<u4")
            assert np.array_equal(d[: grammars.words], w[: grammars.words])
            assert (
                not w[grammars.words :].any() and not d[grammars.words :].any()
            )  # the words past the vocabulary stay as the first mask left them: 0
        assert [c.failed for c in batch] == [c.failed for c in alone]
    assert sum(c.failed for c in batch) == 1


def path(grammars, c: Constraint, rng, forbidden: bool, two: bool) -> list[int]:
    """Tokens for a constraint's next read: one allowed id (two in a row with `two`), or a forbidden one."""
    bits = np.zeros(grammars.words, "<u4")
    c.matcher.fill_mask(bits)
    ok = allowed(bits)
    if forbidden:
        return [int(np.setdiff1d(np.arange(grammars.vocab_size), ok)[0])]
    ids = [int(rng.choice(ok))]
    if two:
        m2 = c.matcher.m.deep_copy()
        if m2.consume_token(ids[0]) and not m2.is_stopped():
            m2.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            ids.append(int(rng.choice(allowed(bits))))
    return ids


@pytest.fixture
def masked_dev(grammars):
    """A hand-driven ring (test_dpu_ring.HandDevice) with a mask arena covering the tiny vocabulary."""
    d = HandDevice.__new__(HandDevice)
    d.name = f"blink-test-{uuid.uuid4().hex[:12]}"
    d.t = ShmTransport.create(d.name, RingGeometry(4, 4 * 32, 8, 4, 32 * grammars.words))
    d.v = d.t.view()
    h = d.v.header
    h["vocab_size"], h["max_context"], h["max_batch"] = grammars.vocab_size, 64, 4
    h["device_status"] = 1  # READY
    yield d
    d.close()


def test_a_cycles_masks_are_in_the_ring_before_any_request_hears_of_its_tokens(grammars, masked_dev):
    """Three constrained slots read a token in the same cycle: when the first request's sink is called,
    every slot's next mask and position are already in the ring (one post, before the per-stream work),
    and the latency histogram counted one mask per slot."""
    dev = masked_dev
    geo = RingGeometry.from_header(dev.v.header)
    st = SlotTracker(ShmTransport.open(dev.name), geo)
    rd = TokenReader(st, mask_threads=2)
    g = regex_grammar("[a-z]{4,9}", "t")
    seen: list[tuple[int, list[int]]] = []
    slots, mirrors = [], []
    for i in range(3):
        c = Constraint(grammars.matcher(g), i, geo)
        s = st.claim(SubmitRequest(10 + i, [5, 6, 7], 8, sampling=SamplingParams()), constraint=c)

        def sink(ev: TokenEvent) -> None:
            seen.append((ev.request_id, dev.v.slots["mask_position"][slots].tolist()))

        rd.register(s, 10 + i, sink, constraint=c)
        slots.append(s)
        mirrors.append(grammars.matcher(g))
    assert dev.v.slots["mask_position"][slots].tolist() == [1, 1, 1]  # token 0's mask came with the requests
    bits = np.zeros(grammars.words, "<u4")
    mirrors[0].fill_mask(bits)
    first = [int(t) for t in allowed(bits)[:3]]
    for s, t in zip(slots, first, strict=True):
        dev.admit(s)
        dev.publish(s, [t])
    assert rd.poll_once() == 3
    assert [r for r, _ in seen] == [10, 11, 12]
    assert all(pos == [2, 2, 2] for _, pos in seen)  # every mask out before the first sink ran
    for i, t in enumerate(first):
        assert mirrors[i].advance([t])
        mirrors[i].fill_mask(bits)
        assert np.array_equal(dev.v.mask_arena[i][: grammars.words], bits)
    assert sum(rd.mask_latency.snapshot()[:-1]) == 3


def test_mask_latency_percentiles_come_back_from_the_histogram():
    h = MaskLatency()
    rng = np.random.default_rng(2)
    ns = rng.lognormal(np.log(40e3), 0.6, 5000)  # around 40 us
    for v in ns:
        h.observe(int(v))
    h.observe(int(3e9))  # past the last bucket
    snap = h.snapshot()
    counts = snap[:-1]  # then the latencies' sum
    assert len(counts) == len(MASK_LATENCY_EDGES_S) + 1 and sum(counts) == 5001 and counts[-1] == 1
    assert snap[-1] == sum(int(v) for v in ns) + int(3e9)
    for q in (0.5, 0.9, 0.99):
        want = np.percentile(ns, 100 * q) * 1e-9
        assert abs(quantile(counts, q) / want - 1) < 0.13, q
    s = summary(counts)
    assert s["masks"] == 5001 and 30 < s["us_p50"] < 50
    assert quantile([0] * len(counts), 0.5) is None and summary([0] * len(counts))["us_p50"] is None
    fam = mask_latency_family(snap)
    buckets = [x for x in fam.samples if x.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 5001
    (total,) = [x.value for x in fam.samples if x.name.endswith("_sum")]
    assert total == pytest.approx(snap[-1] * 1e-9)  # an average read from /metrics is the true one
    assert [x.value for x in buckets] == sorted(x.value for x in buckets)  # cumulative


def test_the_reader_polls_finely_through_the_step_while_a_mask_is_awaited():
    c = PollCadence(fine_s=200e-6, max_idle_s=1e-3, lead=0.7)
    for i in range(5):
        c.saw_step(10.0 + 0.005 * i)  # a 5 ms step cadence
    now = 10.02 + 0.001  # 1 ms into a step: the step's end is 2.5 ms before `lead`
    assert c.next_wait(now, False) == pytest.approx(1e-3)  # coarse toward the predicted end
    assert c.next_wait(now, False, awaiting_mask=True) == 200e-6
    assert c.next_wait(10.5, False, awaiting_mask=True) == 1e-3  # no cadence (nothing for 100 steps): as before


def test_a_new_requests_first_token_does_not_hold_back_a_constrained_slots_mask(grammars, masked_dev):
    """A cycle that finds first tokens delivers those apart (their consumers run before the other
    streams' news), but the constrained slots with news go with them: their next mask is posted in
    that cycle, and only the unconstrained rest waits for the next one."""
    dev = masked_dev
    geo = RingGeometry.from_header(dev.v.header)
    st = SlotTracker(ShmTransport.open(dev.name), geo)
    rd = TokenReader(st)
    got: list[int] = []
    g = regex_grammar("[a-z]{4,9}", "t")
    c = Constraint(grammars.matcher(g), 0, geo)
    bits = np.zeros(grammars.words, "<u4")
    grammars.matcher(g).fill_mask(bits)
    letter = int(allowed(bits)[0])
    masked = st.claim(SubmitRequest(1, [5, 6], 8, sampling=SamplingParams()), constraint=c)
    rd.register(masked, 1, lambda ev: got.append(ev.request_id), constraint=c)
    old = st.claim(SubmitRequest(2, [5, 6], 8, sampling=SamplingParams()))
    rd.register(old, 2, lambda ev: got.append(ev.request_id))
    for s in (masked, old):
        dev.admit(s)
        dev.publish(s, [letter])
    assert rd.poll_once(first_apart=True) == 2 and got == [1, 2]
    new = st.claim(SubmitRequest(3, [5, 6], 8, sampling=SamplingParams()))
    rd.register(new, 3, lambda ev: got.append(ev.request_id))
    dev.admit(new)
    for s in (masked, old, new):
        dev.publish(s, [letter])
    assert rd.poll_once(first_apart=True) == 2
    assert got == [1, 2, 3, 1]  # the first token, and the constrained slot's
    assert int(dev.v.slots["mask_position"][masked]) == 3  # its mask for token 2 is out
    assert rd.poll_once(first_apart=True) == 1 and got[-1] == 2
