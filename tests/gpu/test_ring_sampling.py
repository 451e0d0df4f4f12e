"""Logprobs, prompt logprobs, penalties, min_p and logit_bias on `--device cuda` with the host loop (RingDevice +
HostExecutor), through the ring and the frontend's RequestTracker: every step's raw logits (the LM
head's fp32 output, read back after the graph) are replayed through the emulated device's
definition (blink/device/sampling.py, its per-slot PenaltyState included) and must give the tokens
the graphs sampled and the logprob records the ring delivered. A step without extensions keeps
ext_on 0 (the extension kernels return at once). Prompt logprob records are checked against the
definition on the logits the graph computed for the scored rows (plp_logits), and the GPU-resident
scheduler must deliver the host loop's records."""

from __future__ import annotations

import functools
import operator
import os
import threading

import numpy as np
import pytest
import ring_replay
from conformance.client import RingClient

from blink.device.sampling import logprob_record
from blink.protocol.layout import DeviceFeatures, DeviceStatus, FinishReason
from blink.protocol.ring_geometry import RingGeometry
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

    try:
        feats, outs = ring_replay.deliver(t, reqs, sequential, prompt)
    finally:
        if gpu is not None:
            assert gpu.stop() == DeviceStatus.STOPPED
        else:
            t.view().header["shutdown"] = 2
            th.join(30)
        t.close()
        t.unlink()
    return feats, outs, ex.steps if ex is not None else None


def test_features_and_plain_steps_keep_ext_off(engine):
    reqs = [SubmitRequest(i, [5, 6, 7, 8 + i], 6, sampling=SamplingParams(temperature=0.8, seed=i)) for i in range(3)]
    feats, outs, steps = _serve(engine, reqs)
    assert feats == EVERY
    assert all(fin == FinishReason.LENGTH and len(ids) == 6 for ids, _, fin in outs)
    assert all(b.ext is None for b, _, _ in steps)
    assert int(engine.arena.host["ext_on"][0]) == 0
    ring_replay.replay(steps, engine.config.vocab_size)


@pytest.mark.parametrize("max_num_batched_tokens", [64, 7])  # 7: prompts prefilled in chunks (fresh only on the first)
def test_extensions_match_the_definition_on_the_engines_logits(engine, max_num_batched_tokens):
    V = engine.config.vocab_size
    _, cases = ring_replay.cases(V)
    reqs = ring_replay.requests(V)
    # two rounds: the second runs on slots the first used (penalty state and logit_bias are reset)
    feats, outs, steps = _serve(engine, reqs + reqs[::-1], max_num_batched_tokens=max_num_batched_tokens)
    assert any(b.ext is not None for b, _, _ in steps)
    runs = ring_replay.replay(steps, V)  # every sampled token equals the definition's on the same logits
    assert outs[4][0] == [300] * 14  # logit_bias reaches the graph
    ring_replay.check_records(cases + cases[::-1], outs, runs)


@pytest.mark.parametrize("max_num_batched_tokens", [64, 7])
def test_gpu_scheduler_gives_the_host_loops_tokens_and_records(engine, max_num_batched_tokens):
    """The GPU-resident scheduler fills the extension fields, copies logit_bias at claim and writes the
    logprob arena itself: one request at a time (the same one-row steps in both loops), every token
    and every logprob record equals the host loop's (which test_extensions_match_... ties to the
    definition). Twice through: the second round reuses the slots."""
    reqs = ring_replay.requests(engine.config.vocab_size)
    reqs = reqs + reqs[::-1]
    f_host, host, steps = _serve(engine, reqs, max_num_batched_tokens, "host", sequential=True)
    ring_replay.replay(steps, engine.config.vocab_size)
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


def _prompt_requests(V):
    """Prompt logprob requests of every shape: alternatives 0, 5 and 20 (one with generated logprobs
    too, one sampled), and a request without, to share steps with them."""
    prompt, _ = ring_replay.cases(V)
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
        ring_replay.replay(steps, V)
    outs = host
    if scheduler == "gpu":
        _, outs, _ = _serve(engine, reqs, 64, "gpu", sequential=True)
        assert [o[0] for o in outs] == [h[0] for h in host]
    for ids, lps, fin in outs:
        assert fin == FinishReason.LENGTH and len(ids) == 8 and all(0 <= t < V for t in ids)
        assert all(0 <= i < V for rec in lps for i in rec.top_ids)
