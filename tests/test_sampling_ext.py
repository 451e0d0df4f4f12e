"""Logprobs, penalties, min_p and logit_bias: the definition (blink/device/sampling.py) against an
independent torch implementation of vLLM V1's semantics, then the emulated device through the ring
(slot fields, prompt-arena regions, logprob arena, per-slot penalty state) against a cache-free
reference that recomputes the full sequence each step."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from blink.device.numpy_executor import NumpyExecutor
from blink.device.ring_device import RingDevice, RingDeviceConfig
from blink.device.sampling import PenaltyState, logprob_record, logprobs, process_logits, sample_row
from blink.dpu import openai_api as api
from blink.dpu.request_tracker import RequestTracker
from blink.protocol.layout import DeviceFeatures, DeviceStatus, FinishReason
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.sampling_params import SamplingParams
from blink.protocol.transport import ShmTransport
from blink.protocol.wire import SubmitRequest

torch = pytest.importorskip("torch")


# -- torch reference (vLLM V1: raw logprobs; logit_bias; repetition on prompt|output; frequency and
# presence on output counts; min_p on the tempered probabilities) --------------------------------------
def torch_process(logits, prompt, output, bias, presence, frequency, repetition):
    x = torch.tensor(logits, dtype=torch.float32)
    V = x.shape[0]
    for tok, b in bias:
        x[tok] += b
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V) if output else torch.zeros(V)
    prompt_mask = torch.zeros(V, dtype=torch.bool)
    prompt_mask[torch.tensor(prompt, dtype=torch.long)] = True
    mask = prompt_mask | (counts > 0)
    rep = torch.where(mask, torch.tensor(repetition), torch.tensor(1.0))
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - frequency * counts.float() - presence * (counts > 0).float()
    return x


def torch_min_p_keep(x, temperature, min_p):
    p = torch.softmax(x / temperature, -1)
    return (p >= min_p * p.max()).numpy()


@pytest.mark.parametrize("seed", range(4))
def test_definition_matches_torch(seed):
    rng = np.random.default_rng(seed)
    V = 300
    logits = (rng.normal(size=V) * 3).astype(np.float32)
    prompt = rng.integers(0, V, 20).tolist()
    output = rng.integers(0, V, 12).tolist() + [7, 7, 7]
    bias = [(5, 3.5), (9, -100.0), (7, 1.0)]
    presence, frequency, repetition = [(0.5, 0.3, 1.3), (-1.0, 1.5, 0.8), (0.0, 0.0, 1.0), (2.0, -2.0, 2.0)][seed]
    st = PenaltyState(V)
    st.mark(np.array(prompt))
    for t in output:
        st.add(t)
    ids = np.array([b[0] for b in bias], np.int32)
    vals = np.array([b[1] for b in bias], np.float32)
    got = process_logits(logits, ids, vals, st, presence, frequency, repetition)
    want = torch_process(logits, prompt, output, bias, presence, frequency, repetition)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-5)
    # raw logprobs (vLLM's default): of the logits before bias, penalties and temperature
    lp = logprobs(logits)
    want_lp = torch.log_softmax(torch.tensor(logits), -1).numpy()
    np.testing.assert_allclose(lp, want_lp, atol=2e-5)
    chosen, top_ids, top_lps = logprob_record(logits, 11, 20)
    vals_t, ids_t = torch.topk(torch.tensor(want_lp), 20)
    np.testing.assert_array_equal(top_ids, ids_t.numpy())  # continuous random logits: no ties
    np.testing.assert_allclose(top_lps, vals_t.numpy(), atol=2e-5)
    assert chosen == pytest.approx(float(want_lp[11]), abs=2e-5)
    # greedy takes the argmax of the processed logits
    assert sample_row(got, 0.0, 1.0, 0, 0, 0) == int(torch.argmax(want))
    # min_p: every sample lies in torch's kept set, and the kept set is sampled in proportion
    keep = torch_min_p_keep(want, 0.8, 0.05)
    draws = np.array([sample_row(got, 0.8, 1.0, 0, s, 0, min_p=0.05) for s in range(3000)])
    assert keep[draws].all()
    assert np.unique(draws).size > 1 or keep.sum() == 1


def test_logprob_record_ties_prefer_the_lower_id():
    _, ids, _ = logprob_record(np.array([1.0, 2.0, 2.0, 0.0, 2.0], np.float32), 3, 4)
    assert ids.tolist() == [1, 2, 4, 0]


def test_repetition_penalty_zero_reads_as_off():
    x = np.array([1.0, -1.0, 2.0], np.float32)
    st = PenaltyState(3)
    st.mark(np.array([0, 1]))
    np.testing.assert_array_equal(process_logits(x, state=st, repetition_penalty=0.0), x)


# -- the emulated device through the ring ---------------------------------------------------------------
class Device:
    """The emulated device (tiny random Llama) in a thread and a RequestTracker on the same ring."""

    def __init__(self, n_slots=4, max_num_batched_tokens=64, per_slot=2048):
        self.ex = NumpyExecutor.from_model(
            "random:tiny-llama", num_blocks=64, block_size=8, max_batch=4, max_num_batched_tokens=64
        )
        self.name = f"blink-test-sx-{os.getpid()}-{id(self)}"
        self.t = ShmTransport.create(self.name, RingGeometry(n_slots, n_slots * per_slot, 16))
        self.dev = RingDevice(self.t.view(), self.ex, RingDeviceConfig(max_num_batched_tokens=max_num_batched_tokens))
        self.thread = threading.Thread(target=self.dev.run, daemon=True)
        self.thread.start()

    def close(self):
        self.t.view().header["shutdown"] = 2
        self.thread.join(10)
        self.t.close()
        self.t.unlink()

    def full_logits(self, tokens):
        """Cache-free reference: logits of every position of `tokens` from a fresh forward."""
        m = self.ex.model
        n = len(tokens)
        bs = 8
        nb = -(-n // bs)
        shape = m.kv_cache_shape(nb, bs)
        k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        table = np.arange(nb, dtype=np.int32)[None, :]
        return m.forward(
            np.array(tokens), np.arange(n), np.array([0, n]), table, k, v, logits_rows=np.arange(n, dtype=np.int64)
        )


@pytest.fixture
def device():
    d = Device()
    yield d
    d.close()


async def _run(t, reqs):
    tr = RequestTracker(t)
    await tr.start()
    try:
        for _ in range(500):
            if int(tr.reader.header["device_status"]) == DeviceStatus.READY:
                break
            await asyncio.sleep(0.01)
        outs = []
        for r in reqs:  # one at a time: a slot is reused by the next request
            h = await tr.submit(r)
            ids, lps, plps, fin = [], [], None, None
            async for ev in h:
                ids += ev.token_ids
                lps += ev.logprobs
                plps = ev.prompt_logprobs if plps is None else plps
                fin = ev.finish_reason
            outs.append((ids, lps, plps, fin))
        return outs
    finally:
        await tr.close()


def test_features_are_advertised(device):
    f = DeviceFeatures(int(device.t.view().header["features"]))
    assert (
        f
        == DeviceFeatures.LOGPROBS
        | DeviceFeatures.PROMPT_LOGPROBS
        | DeviceFeatures.PENALTIES
        | DeviceFeatures.TOKEN_MASK
        | DeviceFeatures.PREFIX_CACHING
    )


@pytest.mark.parametrize("chunk", [64, 7])  # 7: the prompt is prefilled in chunks, records cross them
def test_prompt_and_generated_logprobs_match_a_full_forward(chunk):
    d = Device(max_num_batched_tokens=chunk)
    try:
        rng = np.random.default_rng(3)
        prompt = rng.integers(3, 512, 23).tolist()
        req = SubmitRequest(1, prompt, 6, sampling=SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=3))
        ((ids, lps, plps, fin),) = asyncio.run(_run(d.t, [req]))
        assert fin == FinishReason.LENGTH and len(ids) == 6 and len(lps) == 6 and len(plps) == len(prompt) - 1
        full = d.full_logits(prompt + ids)
        for j in range(1, len(prompt)):  # prompt record j scores token j from position j - 1
            want, top, top_lp = logprob_record(full[j - 1], prompt[j], 5)
            assert plps[j - 1].logprob == pytest.approx(want, abs=1e-4)
            assert plps[j - 1].top_ids == top[:3].tolist()  # the slot holds 5, prompt_logprobs asked 3
            np.testing.assert_allclose(plps[j - 1].top_logprobs, top_lp[:3], atol=1e-4)
        for k, tok in enumerate(ids):
            lp = logprobs(full[len(prompt) - 1 + k])
            assert tok == int(np.argmax(lp))
            assert lps[k].logprob == pytest.approx(float(lp[tok]), abs=1e-4)
            assert len(lps[k].top_ids) == 5 and lps[k].top_ids[0] == tok
    finally:
        d.close()


def _reference_penalized(d, prompt, n, bias, presence, frequency, repetition):
    """Greedy with penalties, each step recomputed from scratch and processed by torch."""
    toks = []
    for _ in range(n):
        logits = d.full_logits(prompt + toks)[-1]
        x = torch_process(logits, prompt, toks, bias, presence, frequency, repetition)
        toks.append(int(torch.argmax(x)))
    return toks


def test_penalties_and_logit_bias_through_the_ring(device):
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 512, 9).tolist()
    cases = [
        dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.4, logit_bias=[(44, 2.5), (90, -3.0)]),
        dict(repetition_penalty=3.0),
        dict(frequency_penalty=2.0),
        dict(presence_penalty=-2.0),  # rewards repeats: must not leak into the next request on the slot
        dict(logit_bias=[(300, 100.0)]),
    ]
    reqs = [
        SubmitRequest(i, prompt, 12, stop_ids=[], sampling=SamplingParams(temperature=0.0, **c))
        for i, c in enumerate(cases)
    ]
    outs = asyncio.run(_run(device.t, reqs))
    plain = _reference_penalized(device, prompt, 12, [], 0.0, 0.0, 1.0)
    for c, (ids, *_rest) in zip(cases, outs, strict=True):
        want = _reference_penalized(
            device,
            prompt,
            12,
            c.get("logit_bias", []),
            c.get("presence_penalty", 0.0),
            c.get("frequency_penalty", 0.0),
            c.get("repetition_penalty", 1.0),
        )
        assert ids == want, c
    assert outs[4][0] == [300] * 12
    assert any(o[0] != plain for o in outs[:4])  # the penalties change the output (the test can fail)


def test_min_p_samples_stay_in_the_kept_set(device):
    prompt = [5, 6, 7, 8]
    reqs = [SubmitRequest(i, prompt, 1, sampling=SamplingParams(temperature=1.0, seed=i, min_p=0.5)) for i in range(30)]
    outs = asyncio.run(_run(device.t, reqs))
    logits = device.full_logits(prompt)[-1]
    keep = torch_min_p_keep(torch.tensor(logits), 1.0, 0.5)
    assert all(keep[ids[0]] for ids, *_ in outs)


def test_device_without_features_rejects_bad_params():
    """A device whose executor lacks the features fails such a request (BAD_PARAMS), and the
    frontend refuses it first with a 400 naming the field."""
    sub = SubmitRequest(1, [5], 3, sampling=SamplingParams(logprobs=2))
    with pytest.raises(api.APIError) as e:
        api.check_features(sub, 0)
    assert e.value.status == 400 and e.value.param == "logprobs"
    with pytest.raises(api.APIError) as e:
        api.check_features(
            SubmitRequest(1, [5], 3, sampling=SamplingParams(repetition_penalty=1.2)), int(DeviceFeatures.LOGPROBS)
        )
    assert e.value.param == "repetition_penalty"
    api.check_features(SubmitRequest(1, [5], 3), 0)  # a plain request needs nothing


def _chat(**kw):
    return api.parse(api.ChatRequest, api.msgspec.json.encode({"model": "m", "messages": [], **kw}))


def _comp(**kw):
    return api.parse(api.CompletionRequest, api.msgspec.json.encode({"model": "m", "prompt": "x", **kw}))


@pytest.mark.parametrize(
    "req,param",
    [
        (_chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (_chat(top_logprobs=2), "top_logprobs"),
        (_chat(logprobs=3), "logprobs"),
        (_comp(logprobs=21), "logprobs"),
        (_comp(logprobs=-1), "logprobs"),
        (_comp(logprobs=True), "logprobs"),
        (_comp(prompt_logprobs=30), "prompt_logprobs"),
        (_comp(presence_penalty=2.5), "presence_penalty"),
        (_comp(frequency_penalty=-3), "frequency_penalty"),
        (_comp(repetition_penalty=0), "repetition_penalty"),
        (_comp(min_p=1.5), "min_p"),
        (_comp(logit_bias={"abc": 1}), "logit_bias"),
        (_comp(logit_bias={"600": 1}), "logit_bias"),
        (_chat(max_tokens=0), "max_tokens"),
        (_comp(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_sampling_fields_are_400s_naming_the_field(req, param):
    with pytest.raises(api.APIError) as e:
        api.sampling_params(req, 1, [5], [], req.max_tokens, vocab_size=512)
    assert e.value.status == 400 and e.value.param == param


def test_request_fields_map_to_the_ring_request():
    r = _comp(logprobs=3, echo=True, max_tokens=0, logit_bias={"7": 150}, repetition_penalty=1.1, min_p=0.2)
    sub = api.sampling_params(r, 1, [5, 6], [], 0, vocab_size=512)
    sp = sub.sampling
    assert (sp.logprobs, sp.prompt_logprobs, sub.max_new_tokens) == (3, 3, 1)  # max_tokens 0: one, dropped
    assert sp.logit_bias == ((7, 100.0),)  # clamped as in vLLM
    assert (sp.repetition_penalty, sp.min_p) == (pytest.approx(1.1), pytest.approx(0.2))
    c = api.sampling_params(_chat(logprobs=True), 1, [5], [], None)
    assert (c.sampling.logprobs, c.sampling.prompt_logprobs) == (0, -1)
    assert api.sampling_params(_chat(), 1, [5], [], None).sampling.logprobs == -1
