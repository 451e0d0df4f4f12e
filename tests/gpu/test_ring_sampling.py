"""Logprobs, prompt logprobs, penalties, min_p and logit_bias on `--device cuda` with the host loop (RingDevice +
HostExecutor), through the ring and the frontend's RequestTracker: every step's raw logits (the LM
head's fp32 output, read back after the graph) are replayed through the emulated device's
definition (blink/device/sampling.py, its per-slot PenaltyState included) and must give the tokens
the graphs sampled and the logprob records the ring delivered. A step without extensions keeps
ext_on 0 (the extension kernels return at once). Prompt logprob records are checked against the
definition on the logits the graph computed for the scored rows (plp_logits), and the GPU-resident
scheduler must deliver the host loop's records."""

from __future__ import annotations

import asyncio
import functools
import operator
import os
import threading

import numpy as np
import pytest
from conformance.client import RingClient

from blink.device.sampling import PenaltyState, logprob_record, process_logits, sample_row
from blink.dpu.request_tracker import RequestTracker
from blink.protocol.layout import MAX_LOGPROBS, DeviceFeatures, DeviceStatus, FinishReason, RingGeometry
from blink.protocol.sampling_params import SamplingParams
from blink.protocol.transport import ShmTransport
from blink.protocol.wire import SubmitRequest

pytestmark = pytest.mark.gpu

N_SLOTS = 4
EVERY = functools.reduce(operator.or_, DeviceFeatures)  # both loops advertise every feature of the ring


@pytest.fixture(scope="module")
def engine():
    from blink.gpu.engine.engine import Engine, EngineConfig
    from blink.models.config import preset

    ecfg = EngineConfig(
        max_seqs=4, max_num_batched_tokens=64, block_size=16, max_context=512, num_kv_blocks=64, batch_buckets=(1, 2, 4),
        token_buckets=(16, 32, 64), progress=False, sampling_rows=N_SLOTS,
    )  # fmt: skip
    eng = Engine.create(preset("tiny-llama"), ecfg)
    eng.capture()
    yield eng
    eng.close()


def _recording_executor(engine):
    from blink.gpu.engine.host_executor import HostExecutor

    class Recording(HostExecutor):
        def __init__(self, e):
            super().__init__(e)
            self.steps = []
            self.scored = []  # (batch, logits of its scored rows) of the steps with prompt logprob rows

        def execute(self, batch):
            toks = super().execute(batch)
            self.steps.append((batch, self.engine.logits(batch.num_seqs).copy(), toks.copy()))
            P = 0 if batch.ext is None else int((batch.ext.targets >= 0).sum())
            if P:
                self.scored.append((batch, self.engine.fwd.plp_logits[:P].get()))
            return toks

    return Recording(engine)


def _serve(engine, reqs, max_num_batched_tokens=64, scheduler="host", sequential=False, prompt=False, recorder=None):
    """reqs through the frontend's RequestTracker on a fresh ring served by the host loop (with every
    step recorded) or the GPU-resident scheduler. Returns (features, [(ids, logprobs, finish)], steps);
    with `prompt`, each result also holds the prompt logprob records; `recorder`: a list that gets
    the host loop's executor."""
    from blink.device.ring_device import RingDevice, RingDeviceConfig

    name = f"blink-gpu-rs-{os.getpid()}-{id(reqs)}"
    t = ShmTransport.create(name, RingGeometry(N_SLOTS, N_SLOTS * 2048, 16))
    ex, gpu, th = None, None, None
    if scheduler == "host":
        ex = _recording_executor(engine)
        if recorder is not None:
            recorder.append(ex)
        dev = RingDevice(t.view(), ex, RingDeviceConfig(max_num_batched_tokens=max_num_batched_tokens))
        th = threading.Thread(target=dev.run, daemon=True)
        th.start()
    else:
        from blink.gpu.scheduler.scheduler import GpuScheduler, GpuSchedulerConfig

        gpu = GpuScheduler(engine, t.view(), GpuSchedulerConfig(max_num_batched_tokens=max_num_batched_tokens))
        gpu.start()

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

    try:
        feats, outs = asyncio.run(run())
    finally:
        if gpu is not None:
            assert gpu.stop() == DeviceStatus.STOPPED
        else:
            t.view().header["shutdown"] = 2
            th.join(30)
        t.close()
        t.unlink()
    return feats, outs, ex.steps if ex is not None else None


def _replay(steps, vocab):
    """The definition over the recorded raw logits; asserts each sampled token, returns the logprob
    records of each served sequence that asked for them: one run per (slot, fresh start), a list of
    (token, logprob, ids, lps) in output order."""
    states: dict[int, PenaltyState] = {}
    runs: list[list] = []
    current: dict[int, list] = {}
    for batch, logits, toks in steps:
        x = batch.ext
        for s in range(batch.num_seqs):
            if x is not None and x.fresh[s]:
                current[int(x.slots[s])] = []
                runs.append(current[int(x.slots[s])])
            if x is None:
                assert toks[s] == sample_row(
                    logits[s], float(batch.temperature[s]), float(batch.top_p[s]), int(batch.top_k[s]),
                    int(batch.seed[s]), int(batch.sample_pos[s]),
                )  # fmt: skip
                continue
            slot, sp = int(x.slots[s]), x.params[s]
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


def test_features_and_plain_steps_keep_ext_off(engine):
    reqs = [SubmitRequest(i, [5, 6, 7, 8 + i], 6, sampling=SamplingParams(temperature=0.8, seed=i)) for i in range(3)]
    feats, outs, steps = _serve(engine, reqs)
    assert feats == EVERY
    assert all(fin == FinishReason.LENGTH and len(ids) == 6 for ids, _, fin in outs)
    assert all(b.ext is None for b, _, _ in steps)
    assert int(engine.arena.host["ext_on"][0]) == 0
    _replay(steps, engine.config.vocab_size)


@pytest.mark.parametrize("max_num_batched_tokens", [64, 7])  # 7: prompts prefilled in chunks (fresh only on the first)
def test_extensions_match_the_definition_on_the_engines_logits(engine, max_num_batched_tokens):
    V = engine.config.vocab_size
    _, cases = _cases(V)
    reqs = _requests(V)
    # two rounds: the second runs on slots the first used (penalty state and logit_bias are reset)
    feats, outs, steps = _serve(engine, reqs + reqs[::-1], max_num_batched_tokens=max_num_batched_tokens)
    assert any(b.ext is not None for b, _, _ in steps)
    runs = _replay(steps, V)  # every sampled token equals the definition's on the same logits
    assert outs[4][0] == [300] * 14  # logit_bias reaches the graph
    n_with = 0
    for c, (ids, lps, fin) in zip(cases + cases[::-1], outs, strict=True):
        assert fin == FinishReason.LENGTH and len(ids) == 14
        if "logprobs" not in c:
            assert not lps
            continue
        n = c["logprobs"]
        assert len(lps) == 14 and all(len(rec.top_ids) == n for rec in lps)
        # The delivered records are those the definition gives for one served sequence of these tokens,
        # record for record. (Matching each record alone by its ids and logprob is ambiguous: greedy rows
        # of the tiny model put ~all mass on the chosen token at every position (logprob ~ -5e-14 within
        # 1e-4 of any other) and keep the same top ids, so it compared records of different positions.)
        assert any(_same_records(lps, ids, run, n) for run in runs), (c, ids, [list(map(_rec_key, r)) for r in runs])
        for rec in lps:
            assert rec.logprob <= 0.0 and (n == 0 or rec.top_logprobs[0] >= rec.logprob - 1e-6)
            n_with += 1
    assert n_with == 2 * 14 * 4 and MAX_LOGPROBS == 20


def _rec_key(r):
    return r[0], r[2].tolist()


def _same_records(lps, ids, run, n) -> bool:
    """The ring's records of a sequence (with its tokens ids) equal the definition's run."""
    if len(run) != len(lps) or [t for t, *_ in run] != ids:
        return False
    for rec, (_, lp, top, top_lp) in zip(lps, run, strict=True):
        if rec.top_ids != top.tolist() or abs(rec.logprob - lp) > 1e-4:
            return False
        if not np.allclose(rec.top_logprobs, top_lp[:n], rtol=0, atol=1e-4):
            return False
    return True


def _requests(V):
    prompt, cases = _cases(V)
    reqs = []
    for i, c in enumerate(cases):
        c = dict(c)
        t = c.pop("temperature", 0.0)
        reqs.append(SubmitRequest(i, prompt, 14, stop_ids=[], sampling=SamplingParams(temperature=t, **c)))
    return reqs


@pytest.mark.parametrize("max_num_batched_tokens", [64, 7])
def test_gpu_scheduler_gives_the_host_loops_tokens_and_records(engine, max_num_batched_tokens):
    """The GPU-resident scheduler fills the extension fields, copies logit_bias at claim and writes the
    logprob arena itself: one request at a time (the same one-row steps in both loops), every token
    and every logprob record equals the host loop's (which test_extensions_match_... ties to the
    definition). Twice through: the second round reuses the slots."""
    reqs = _requests(engine.config.vocab_size)
    reqs = reqs + reqs[::-1]
    f_host, host, steps = _serve(engine, reqs, max_num_batched_tokens, "host", sequential=True)
    _replay(steps, engine.config.vocab_size)
    f_gpu, gpu, _ = _serve(engine, reqs, max_num_batched_tokens, "gpu", sequential=True)
    assert f_gpu == f_host == EVERY
    assert gpu[4][0] == [300] * 14
    for (ids_h, lps_h, fin_h), (ids_g, lps_g, fin_g) in zip(host, gpu, strict=True):
        assert ids_g == ids_h and fin_g == fin_h
        assert len(lps_g) == len(lps_h)
        for a, b in zip(lps_g, lps_h, strict=True):
            assert a.top_ids == b.top_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
            np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, atol=1e-6)
    assert sum(len(x[1]) for x in gpu) == 2 * 14 * 4


def test_gpu_scheduler_refuses_bad_prompt_records_and_bad_bias(engine):
    """What the frontend would refuse reaches the device only from a broken client: the scheduler
    finishes it with an error instead of reading (or writing) out of bounds."""
    from blink.gpu.scheduler.scheduler import GpuScheduler, GpuSchedulerConfig
    from blink.protocol.layout import SlotError, SlotFlags

    name = f"blink-gpu-rs-bad-{os.getpid()}"
    t = ShmTransport.create(name, RingGeometry(N_SLOTS, N_SLOTS * 2048, 16))
    gpu = GpuScheduler(engine, t.view(), GpuSchedulerConfig())
    gpu.start()
    try:
        c = RingClient(t)
        c.wait_status(DeviceStatus.READY, 10)
        assert DeviceFeatures(int(t.view().header["features"])) == EVERY
        arena = t.view().geo.prompt_arena_tokens
        fields = {"n_logprobs": 3, "prompt_logprobs_offset": arena - 10}  # 3 records of 7 words do not fit
        r = c.generate([5, 6, 7], max_new_tokens=3, flags=SlotFlags.PROMPT_LOGPROBS, fields=fields)
        assert r.finish is FinishReason.ERROR and r.error is SlotError.BAD_PARAMS
        bad = [5, 6, 7, engine.config.vocab_size + 5, int(np.float32(1.0).view(np.int32))]  # prompt, bias entry
        i = c.submit(bad, prompt_len=3, max_new_tokens=3, fields={"n_logit_bias": 1})
        (r,) = c.wait([i], 10)
        assert r.finish is FinishReason.ERROR and r.error is SlotError.BAD_PARAMS
        ok = c.generate([5, 6, 7], max_new_tokens=3, flags=SlotFlags.LOGPROBS)  # and it still serves
        assert ok.finish is FinishReason.LENGTH and len(ok.tokens) == 3
    finally:
        assert gpu.stop() == DeviceStatus.STOPPED
        t.close()
        t.unlink()


def _cases(V):
    rng = np.random.default_rng(11)
    prompt = rng.integers(3, V, 19).tolist()
    cases = [
        dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.4, logit_bias=[(44, 2.5), (90, -3.0)],
             logprobs=5),
        dict(repetition_penalty=3.0, temperature=1.0, seed=3, logprobs=20),
        dict(frequency_penalty=2.0, temperature=0.9, top_p=0.9, min_p=0.05, seed=4),
        dict(presence_penalty=-2.0, temperature=1.0, top_k=30),
        dict(logit_bias=[(300, 100.0)], logprobs=0),
        dict(min_p=0.3, temperature=1.0, seed=7, logprobs=2),
        dict(temperature=0.7, seed=9),  # no extension, batched with rows that have them
    ]  # fmt: skip
    return prompt, cases


def _prompt_requests(V):
    """Prompt logprob requests of every shape: alternatives 0, 5 and 20 (one with generated logprobs
    too, one sampled), and a request without, to share steps with them."""
    prompt, _ = _cases(V)
    rng = np.random.default_rng(12)
    long = rng.integers(3, V, 45).tolist()
    return [
        SubmitRequest(0, prompt, 4, stop_ids=[], sampling=SamplingParams(temperature=0.0, prompt_logprobs=5)),
        SubmitRequest(
            1, long, 3, stop_ids=[], sampling=SamplingParams(temperature=0.9, seed=2, logprobs=2, prompt_logprobs=0)
        ),
        SubmitRequest(2, prompt[:7], 2, stop_ids=[], sampling=SamplingParams(temperature=0.0, prompt_logprobs=20)),
        SubmitRequest(3, long[:30], 3, stop_ids=[], sampling=SamplingParams(temperature=0.7, seed=5)),
        SubmitRequest(
            4, [prompt[0]], 2, stop_ids=[], sampling=SamplingParams(temperature=0.0, prompt_logprobs=3)
        ),  # none
    ]


def _check_scored_steps(scored) -> int:
    """Every recorded step's prompt records equal the definition on the graph's logits of its scored
    rows (blink.device.sampling.logprob_record). Returns the rows checked."""
    n_rows = 0
    for batch, logits in scored:
        x = batch.ext
        seq_of = np.repeat(np.arange(batch.num_seqs), np.diff(batch.cu_q_lens))
        for j, i in enumerate(np.flatnonzero(x.targets >= 0)):
            n = x.params[seq_of[i]].prompt_logprobs
            lp, ids, top = logprob_record(logits[j], int(x.targets[i]), n)
            rec = x.prompt_logprobs[i]
            assert abs(float(rec["logprob"]) - lp) <= 1e-5, (i, float(rec["logprob"]), lp)
            assert rec["top_ids"][:n].tolist() == ids.tolist()
            np.testing.assert_allclose(rec["top_logprobs"][:n], top, rtol=0, atol=1e-5)
            n_rows += 1
    return n_rows


@pytest.mark.parametrize(
    "max_num_batched_tokens", [64, 7]
)  # 7: prompts prefilled in chunks, each chunk scoring its rows
def test_prompt_logprobs_host_loop_and_gpu_scheduler(engine, max_num_batched_tokens):
    """Prompt logprob records through the ring on both CUDA loops: the host loop's equal the definition
    on the graph's logits of the scored rows and reach the frontend (one per prompt token but the
    first, with the alternatives asked); the GPU-resident scheduler, which builds the scored rows
    and writes the records into the prompt arena itself, delivers the same records and tokens (one
    request at a time: the same steps in both loops). Batched, the host loop's records are those of
    the sequential run up to rounding (other step shapes)."""
    reqs = _prompt_requests(engine.config.vocab_size)
    rec: list = []
    f_host, host, _ = _serve(engine, reqs, max_num_batched_tokens, "host", sequential=True, prompt=True, recorder=rec)
    assert f_host == EVERY
    assert _check_scored_steps(rec[0].scored) == 18 + 44 + 6
    for r, (ids, _, fin, plps) in zip(reqs, host, strict=True):
        assert fin == FinishReason.LENGTH and len(ids) == r.max_new_tokens
        if r.sampling.prompt_logprobs < 0:
            assert not plps
            continue
        assert len(plps) == len(r.prompt_ids) - 1
        assert all(len(p.top_ids) == r.sampling.prompt_logprobs and p.logprob <= 0.0 for p in plps)
    _, gpu, _ = _serve(engine, reqs, max_num_batched_tokens, "gpu", sequential=True, prompt=True)
    for (ids_h, lps_h, fin_h, plps_h), (ids_g, lps_g, fin_g, plps_g) in zip(host, gpu, strict=True):
        assert ids_g == ids_h and fin_g == fin_h and len(lps_g) == len(lps_h)
        assert len(plps_g or []) == len(plps_h or [])
        for a, b in zip(plps_g or [], plps_h or [], strict=True):
            assert a.top_ids == b.top_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
            np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, atol=1e-6)
    # other step shapes, other bf16 rounding: the random tiny model's logprobs reach -45 (H200: -45.64
    # batched vs -45.56 sequential), so the bound is relative
    _, batched, _ = _serve(engine, reqs, max_num_batched_tokens, "gpu", prompt=True)
    for (_, _, _, plps_h), (_, _, _, plps_b) in zip(host, batched, strict=True):
        assert len(plps_b or []) == len(plps_h or [])
        for a, b in zip(plps_b or [], plps_h or [], strict=True):
            assert a.logprob == pytest.approx(b.logprob, rel=1e-2, abs=2e-2)


# Valid requests at the edges of the sampling definition (blink/device/sampling.py): the smallest
# temperature that samples, a repetition penalty that overflows seen logits to +inf (the greedy
# fallback), thresholds that keep one token, most of the vocabulary masked by logit_bias.
EXTREME = [
    dict(temperature=1e-5, top_p=0.9, logprobs=5, seed=1),
    dict(temperature=1e-5, repetition_penalty=1e-38, top_k=5, seed=2, logprobs=3),
    dict(temperature=2.0, top_p=1e-30, seed=3),
    dict(temperature=1.0, min_p=1.0, logprobs=20, seed=4),
    dict(temperature=0.7, logit_bias="all but the last token", top_k=5, seed=5),
    dict(temperature=9.99e-6, top_p=0.5, top_k=2, min_p=0.3, seed=6),  # below SAMPLING_EPS: greedy
]


@pytest.mark.parametrize("scheduler", ["host", "gpu"])
def test_extreme_parameters_through_the_ring(engine, scheduler):
    """Both schedulers through the ring: every token in the vocabulary, finished by length; the host
    loop's tokens are the definition's on the engine's logits, and the GPU scheduler's equal them."""
    V = engine.config.vocab_size
    prompt = np.random.default_rng(5).integers(3, V, 11).tolist()
    cases = [c | {"logit_bias": [(t, -100.0) for t in range(V - 1)]} if "logit_bias" in c else c for c in EXTREME]
    reqs = [SubmitRequest(i, prompt, 8, stop_ids=[], sampling=SamplingParams(**c)) for i, c in enumerate(cases)]
    _, host, steps = _serve(engine, reqs, 64, "host", sequential=True)
    with np.errstate(over="ignore"):
        _replay(steps, V)
    outs = host
    if scheduler == "gpu":
        _, outs, _ = _serve(engine, reqs, 64, "gpu", sequential=True)
        assert [o[0] for o in outs] == [h[0] for h in host]
    for ids, lps, fin in outs:
        assert fin == FinishReason.LENGTH and len(ids) == 8 and all(0 <= t < V for t in ids)
        assert all(0 <= i < V for rec in lps for i in rec.top_ids)
