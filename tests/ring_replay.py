"""The sampling-extension requests served through the ring and the frontend's RequestTracker, and the
definition (blink.device.sampling) replayed over each recorded step's raw logits: shared by the CPU
test on the emulated device (tests/test_ring_replay.py) and the CUDA loops' (tests/gpu/test_ring_sampling.py).

A recorded step is (StepBatch, raw logits (S, V), sampled tokens). A served sequence's logprob
records form one run, from its first sample (sample_pos 0) on: `fresh` cannot mark it, because a
request that starts from cached prompt blocks (prefix caching; every request here has the same
prompt) has its first chunk at a later position and `fresh` 0. Only a row with a penalty state
reads `fresh`, and such a request never starts from cached blocks."""

from __future__ import annotations

import asyncio

import numpy as np

from blink.device.sampling import PenaltyState, logprob_record, process_logits, sample_row
from blink.dpu.request_tracker import RequestTracker
from blink.protocol.layout import MAX_LOGPROBS, DeviceFeatures, DeviceStatus, FinishReason
from blink.protocol.sampling_params import SamplingParams
from blink.protocol.wire import SubmitRequest

MAX_NEW = 14


def cases(V):
    rng = np.random.default_rng(11)
    prompt = rng.integers(3, V, 19).tolist()
    out = [
        dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.4, logit_bias=[(44, 2.5), (90, -3.0)],
             logprobs=5),
        dict(repetition_penalty=3.0, temperature=1.0, seed=3, logprobs=20),
        dict(frequency_penalty=2.0, temperature=0.9, top_p=0.9, min_p=0.05, seed=4),
        dict(presence_penalty=-2.0, temperature=1.0, top_k=30),
        dict(logit_bias=[(300, 100.0)], logprobs=0),
        dict(min_p=0.3, temperature=1.0, seed=7, logprobs=2),
        dict(temperature=0.7, seed=9),  # no extension, batched with rows that have them
    ]  # fmt: skip
    return prompt, out


def requests(V):
    prompt, cs = cases(V)
    reqs = []
    for i, c in enumerate(cs):
        c = dict(c)
        t = c.pop("temperature", 0.0)
        reqs.append(SubmitRequest(i, prompt, MAX_NEW, stop_ids=[], sampling=SamplingParams(temperature=t, **c)))
    return reqs


def deliver(t, reqs, sequential=False, prompt=False):
    """reqs through a RequestTracker on transport t (a device serves its ring): (features, [(ids, logprobs,
    finish)]), with `prompt` each result also holds the prompt logprob records."""

    async def run():
        tr = RequestTracker(t)
        await tr.start()
        try:
            for _ in range(1000):
                if int(tr.reader.header["device_status"]) == DeviceStatus.READY:
                    break
                await asyncio.sleep(0.01)
            feats = DeviceFeatures(int(tr.reader.header["features"]))

            async def one(r):
                ids, lps, fin, plps = [], [], None, None
                async for ev in await tr.submit(r):
                    ids += ev.token_ids
                    lps += ev.logprobs
                    fin = ev.finish_reason
                    plps = ev.prompt_logprobs if plps is None else plps
                return (ids, lps, fin, plps) if prompt else (ids, lps, fin)

            if sequential:  # one request at a time: every step has one row, the same in both loops
                return feats, [await one(r) for r in reqs]
            return feats, await asyncio.gather(*(one(r) for r in reqs))
        finally:
            await tr.close()

    return asyncio.run(run())


def replay(steps, vocab):
    """The definition over the recorded raw logits; asserts each sampled token, returns the logprob
    records of each served sequence that asked for them: one run per (slot, first sample), a list of
    (token, logprob, ids, lps) in output order."""
    states: dict[int, PenaltyState] = {}
    runs: list[list] = []
    current: dict[int, list] = {}
    for batch, logits, toks in steps:
        x = batch.ext
        for s in range(batch.num_seqs):
            if x is None:
                assert toks[s] == sample_row(
                    logits[s], float(batch.temperature[s]), float(batch.top_p[s]), int(batch.top_k[s]),
                    int(batch.seed[s]), int(batch.sample_pos[s]),
                )  # fmt: skip
                continue
            slot, sp = int(x.slots[s]), x.params[s]
            if x.emit[s] and int(batch.sample_pos[s]) == 0:  # a sequence's first token: its run starts
                current[slot] = []
                runs.append(current[slot])
            st = None
            if sp.penalized:
                if x.fresh[s] or slot not in states:
                    states[slot] = PenaltyState(vocab)
                st = states[slot]
                st.mark(batch.input_ids[batch.cu_q_lens[s] : batch.cu_q_lens[s + 1]])
            proc = process_logits(
                logits[s], *x.logit_bias(s), st, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
            )
            want = sample_row(
                proc, float(batch.temperature[s]), float(batch.top_p[s]), int(batch.top_k[s]), int(batch.seed[s]),
                int(batch.sample_pos[s]), sp.min_p,
            )  # fmt: skip
            assert toks[s] == want, (slot, int(batch.sample_pos[s]))
            if x.emit[s]:
                if st is not None:
                    st.add(int(toks[s]))
                if sp.logprobs >= 0:
                    rec = logprob_record(logits[s], int(toks[s]), sp.logprobs)
                    current[slot].append((int(toks[s]), *rec))
    return [r for r in runs if r]


def _rec_key(r):
    return r[0], r[2].tolist()


def same_records(lps, ids, run, n) -> bool:
    """The ring's records of a sequence (with its tokens ids) equal the definition's run."""
    if len(run) != len(lps) or [t for t, *_ in run] != ids:
        return False
    for rec, (_, lp, top, top_lp) in zip(lps, run, strict=True):
        if rec.top_ids != top.tolist() or abs(rec.logprob - lp) > 1e-4:
            return False
        if not np.allclose(rec.top_logprobs, top_lp[:n], rtol=0, atol=1e-4):
            return False
    return True


def check_records(cs, outs, runs) -> None:
    """Every request of `cs` (in serving order) ended by length; each one with logprobs got the records
    the definition gives for one served sequence of its tokens, record for record. (Matching each record
    alone by its ids and logprob is ambiguous: greedy rows of a tiny random model put ~all mass on the
    chosen token at every position (logprob ~ -5e-14 within 1e-4 of any other) and keep the same top
    ids, so it compared records of different positions.)"""
    n_with = 0
    for c, (ids, lps, fin) in zip(cs, outs, strict=True):
        assert fin == FinishReason.LENGTH and len(ids) == MAX_NEW
        if "logprobs" not in c:
            assert not lps
            continue
        n = c["logprobs"]
        assert len(lps) == MAX_NEW and all(len(rec.top_ids) == n for rec in lps)
        assert any(same_records(lps, ids, run, n) for run in runs), (c, ids, [list(map(_rec_key, r)) for r in runs])
        for rec in lps:
            assert rec.logprob <= 0.0 and (n == 0 or rec.top_logprobs[0] >= rec.logprob - 1e-6)
            n_with += 1
    assert n_with == MAX_NEW * sum("logprobs" in c for c in cs) and MAX_LOGPROBS == 20
