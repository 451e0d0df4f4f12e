"""Conformance: prompt logprob records (SlotFlags.PROMPT_LOGPROBS), read from the ring only.

What any device must write, whatever its arithmetic: record j (j >= 1) of a prompt scores prompt
token j from the logits of token j - 1; record 0 is never written; all records are in place once
the first token is published. Checked through properties that need no reference model: each record
is a log-distribution's (logprob <= 0, top alternatives descending, the target among them exactly
when it is as likely as the last one), greedy decoding agrees with them (a prompt that continues
with the greedy tokens scores each of them as the most likely), and a chunked prefill writes every
chunk's rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from conformance.rig import Rig, refused_by_the_agent

from blink.protocol.layout import FinishReason, SlotError, SlotFlags, prompt_logprob_record

SENTINEL = np.float32(np.nan).view(np.int32) ^ 0x5A5A  # a NaN bit pattern no device writes as a logprob
NEAR = 0.02  # logprob rounding between a device's decode and prefill paths (bf16 on CUDA)


def _submit(rig: Rig, prompt: list[int], n: int, **kw) -> tuple[int, int]:
    """A request with prompt logprob records of n alternatives, its record region filled with
    SENTINEL first. Returns (slot, word of record 0)."""
    c = rig.client
    rec = prompt_logprob_record(n)
    words = len(prompt) * rec.itemsize // 4
    assert len(prompt) + words <= c.region
    slot = c._free_slot()
    lo = slot * c.region + len(prompt)  # the client puts slot i's prompt at i * region
    c.t.write(c.geo.prompt_arena_offset + 4 * lo, np.full(words, SENTINEL, np.int32))
    fields = {"n_logprobs": n, "prompt_logprobs_offset": lo}
    c.submit(prompt, slot=slot, flags=SlotFlags.PROMPT_LOGPROBS | kw.pop("flags", 0), fields=fields, **kw)
    return slot, lo


def _records(rig: Rig, lo: int, prompt_len: int, n: int) -> np.ndarray:
    """The records as the device left them (through the ring's own mapping: over a ring agent a
    released slot's region is no client's to read)."""
    c = rig.client
    out = np.zeros(prompt_len, prompt_logprob_record(n))
    return rig.transport.read_into(c.geo.prompt_arena_offset + 4 * lo, out)


def _check_well_formed(recs: np.ndarray, prompt: list[int], n: int) -> None:
    raw = recs.view(np.int32).reshape(len(prompt), -1)
    assert (raw[0] == SENTINEL).all(), "record 0 (nothing scores the first prompt token) was written"
    assert not (raw[1:] == SENTINEL).any(), "a record of prompt tokens 1.. was not written"
    lp, ids, top = recs["logprob"][1:], recs["top_ids"][1:], recs["top_logprobs"][1:]
    assert np.isfinite(lp).all() and (lp <= 1e-6).all()
    if n == 0:
        return
    assert np.isfinite(top).all() and (top <= 1e-6).all()
    assert (np.diff(top, axis=1) <= 0).all(), "alternatives not most likely first"
    assert (np.exp(top.astype(np.float64)).sum(axis=1) <= 1 + 1e-4).all()
    for j, (tok, v, i, t) in enumerate(zip(prompt[1:], lp, ids, top, strict=True), start=1):
        assert len(set(i.tolist())) == n, (j, i)
        assert t[0] >= v - 1e-5, (j, v, t)
        if tok in i.tolist():
            assert abs(t[i.tolist().index(tok)] - v) <= 1e-5, (j, tok, v, t)
        else:
            assert v <= t[-1] + 1e-5, (j, tok, v, t)


def _greedy(rig: Rig, prompt: list[int], k: int) -> list[int]:
    (r,) = rig.client.wait([rig.client.submit(prompt, max_new_tokens=k, temperature=0.0)])
    assert r.finish is FinishReason.LENGTH
    return r.tokens


@pytest.mark.parametrize("length,n", [(40, 5), (23, 20), (200, 1)])  # 200 > max_num_batched_tokens: a chunked prefill
def test_prompt_records_score_every_prompt_token_and_agree_with_greedy(clean: Rig, length: int, n: int):
    c = clean.client
    rng = np.random.default_rng(length)
    prompt = rng.integers(3, clean.vocab, length).tolist()
    gen = _greedy(clean, prompt, 3)
    # the prompt, and the prompt followed by its greedy continuation (with a plain request alongside,
    # so the scored rows share steps with rows that score nothing)
    plain = c.submit(rng.integers(3, clean.vocab, 30).tolist(), max_new_tokens=4)
    a, lo_a = _submit(clean, prompt, n, max_new_tokens=2)
    b, lo_b = _submit(clean, prompt + gen, n, max_new_tokens=1)
    ra, rb, rp = c.wait([a, b, plain], free=False)
    assert ra.finish is rb.finish is rp.finish is FinishReason.LENGTH
    rec_a = _records(clean, lo_a, len(prompt), n)
    rec_b = _records(clean, lo_b, len(prompt) + 3, n)
    for s in (a, b, plain):
        c.free(s)
    _check_well_formed(rec_a, prompt, n)
    _check_well_formed(rec_b, prompt + gen, n)
    # the greedy tokens: each the most likely after its prefix (the first from the prompt's last
    # token, which record len(prompt) of the longer prompt holds)
    # (a decode step computed the greedy token, a prefill step the record: a near-tie may differ)
    for j, tok in enumerate(gen, start=len(prompt)):
        lp, ids, top = float(rec_b[j]["logprob"]), rec_b[j]["top_ids"], rec_b[j]["top_logprobs"]
        assert lp >= float(top[0]) - NEAR, (j, tok, lp, ids, top)
        if n >= 2 and top[0] - top[1] > NEAR:
            assert int(ids[0]) == tok, (j, tok, ids, top)
    # the common prefix scores alike in both requests (steps packed differently: allow rounding)
    np.testing.assert_allclose(rec_a["logprob"][1:], rec_b["logprob"][1 : len(prompt)], rtol=0, atol=0.05)
    c.wait_idle()


def test_prompt_records_outside_the_arena_are_refused(clean: Rig):
    c = clean.client
    arena = c.geo.prompt_arena_tokens
    fields = {"n_logprobs": 3, "prompt_logprobs_offset": arena - 10}  # 5 records of 7 words do not fit
    bad = dict(max_new_tokens=2, flags=SlotFlags.PROMPT_LOGPROBS, fields=fields)
    if refused_by_the_agent(clean, lambda: c.submit([5, 6, 7, 8, 9], **bad)):
        return
    (r,) = c.wait([c.submit([5, 6, 7, 8, 9], **bad)])
    assert r.finish is FinishReason.ERROR and r.error is SlotError.BAD_PARAMS
    ok = c.wait([_submit(clean, [5, 6, 7, 8, 9], 3, max_new_tokens=2)[0]])[0]  # and it still serves
    assert ok.finish is FinishReason.LENGTH and len(ok.tokens) == 2
    c.wait_idle()
