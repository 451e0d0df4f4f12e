"""Prompt logprobs on the CUDA engine (plp_norm, plp_lm_head, plp_records in sampling.cu; host launch).

Chunked prefill steps (a scored prompt split over two steps, a second scored prompt, a prompt that
asks for none) on SmolLM2-135M shapes (4 layers, random bf16 weights, its 49152-token vocabulary):
- the records equal the definition (blink/device/sampling.py) and torch's log_softmax / topk on the
  very logits the graph computed for the scored rows;
- those logits equal the cuBLAS LM head's where a scored token is also a sequence's last;
- the records agree with the emulated device (NumpyExecutor on the same weights, float64 reference
  model) as closely as the logits do;
- a step without prompt logprob rows leaves the scored-row count 0 (the kernels return at once).
"""

from __future__ import annotations

import numpy as np
import pytest

from blink.device import sampling
from blink.models.config import preset
from blink.models.reference import PagedDriver

pytestmark = pytest.mark.gpu


def _ext(chunks, starts, prompts, prompt_n):
    """A SamplingExt with prompt logprobs only: packed token at position p of sequence q scores
    prompts[q][p + 1] when prompt_n[q] >= 0."""
    from blink.device.executor import SamplingExt
    from blink.protocol.sampling_params import SamplingParams

    S = len(chunks)
    targets = []
    for (q, toks), st in zip(chunks, starts, strict=True):
        for i in range(len(toks)):
            p = st + i
            ok = prompt_n[q] >= 0 and p + 1 < len(prompts[q])
            targets.append(prompts[q][p + 1] if ok else -1)
    return SamplingExt(
        params=[SamplingParams(prompt_logprobs=prompt_n[q]) for q, _ in chunks],
        slots=np.array([q for q, _ in chunks], np.int32), fresh=np.zeros(S, bool), emit=np.ones(S, bool),
        targets=np.array(targets, np.int32),
    )  # fmt: skip


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_prompt_logprobs_match_definition_torch_cublas_and_the_emulated_device():
    torch = pytest.importorskip("torch")
    from blink.device.numpy_executor import NumpyExecutor
    from blink.gpu.engine.engine import Engine, EngineConfig
    from blink.gpu.engine.weights import bf16_bits_to_f32, f32_to_bf16_bits
    from blink.models.weights import random_weights

    cfg = preset("smollm2-135m").replace(num_layers=4)
    w = {k: bf16_bits_to_f32(f32_to_bf16_bits(v)) for k, v in random_weights(cfg, seed=5).items()}
    ecfg = EngineConfig(
        max_seqs=4, max_num_batched_tokens=128, max_context=512, num_kv_blocks=64, block_size=8, batch_buckets=(1, 2, 4),
        token_buckets=(16, 128), progress=False, sampling_rows=4,
    )  # fmt: skip
    eng = Engine.create(cfg, ecfg, host_weights=w)
    eng.capture()
    ref = NumpyExecutor(
        cfg, w, num_blocks=64, block_size=8, max_batch=4, max_num_batched_tokens=128, max_blocks_per_seq=64
    )
    rng = np.random.default_rng(2)
    prompts = {q: rng.integers(0, cfg.vocab_size, n).tolist() for q, n in ((0, 70), (1, 40), (2, 30))}
    prompt_n = {0: 5, 1: 20, 2: -1}
    p0, p1, p2 = prompts[0], prompts[1], prompts[2]
    steps = [
        [(0, p0[:50]), (1, p1), (2, p2[:20])],  # seq 0's first chunk ends mid-prompt: its last row is scored
        [(0, p0[50:]), (2, p2[20:])],
    ]
    d1, d2 = PagedDriver(64, 8, 64, shuffle_seed=1), PagedDriver(64, 8, 64, shuffle_seed=1)
    done = {0: 0, 1: 0, 2: 0}
    cuda_lp, ref_lp, top1_same, n_rows = [], [], 0, 0
    for chunks in steps:
        starts = [done[q] for q, _ in chunks]
        b1, b2 = d1.step(chunks), d2.step(chunks)
        b1.ext, b2.ext = _ext(chunks, starts, prompts, prompt_n), _ext(chunks, starts, prompts, prompt_n)
        eng.step(b1)
        ref.execute(b2)
        x = b1.ext
        scored = np.flatnonzero(x.targets >= 0)
        P = scored.size
        assert int(eng.arena.host["plp_count"][0]) == P > 0
        logits = eng.fwd.plp_logits[:P].get()
        seq_of = np.repeat(np.arange(b1.num_seqs), np.diff(b1.cu_q_lens))
        # the definition and torch on the graph's own logits of the scored rows
        lp64 = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
        for j, i in enumerate(scored):
            n = x.params[seq_of[i]].prompt_logprobs
            rec = x.prompt_logprobs[i]
            want_lp, want_ids, want_top = sampling.logprob_record(logits[j], int(x.targets[i]), n)
            assert abs(float(rec["logprob"]) - want_lp) <= 1e-5, (j, float(rec["logprob"]), want_lp)
            assert rec["top_ids"][:n].tolist() == want_ids.tolist(), j
            np.testing.assert_allclose(rec["top_logprobs"][:n], want_top, rtol=0, atol=1e-5)
            assert abs(float(rec["logprob"]) - float(lp64[j, int(x.targets[i])])) <= 1e-4
            tv, ti = torch.topk(lp64[j], n)
            np.testing.assert_allclose(rec["top_logprobs"][:n], tv.numpy(), rtol=0, atol=1e-4)
            assert set(rec["top_ids"][:n].tolist()) == set(ti.tolist()) or n == 0, j
        # where a scored token is a sequence's last, the cuBLAS LM head computed the same row
        last = eng.logits(b1.num_seqs)
        for s in range(b1.num_seqs):
            i = int(b1.cu_q_lens[s + 1]) - 1
            if x.targets[i] >= 0:
                j = int(np.searchsorted(scored, i))
                assert rel_err(logits[j], last[s]) < 1e-4, (s, rel_err(logits[j], last[s]))
        # the emulated device's records on its own (float64 model) logits
        r = b2.ext.prompt_logprobs[scored]
        c = x.prompt_logprobs[scored]
        cuda_lp.append(c["logprob"])
        ref_lp.append(r["logprob"])
        for j, i in enumerate(scored):
            n = x.params[seq_of[i]].prompt_logprobs
            n_rows += 1
            top1_same += bool(n == 0 or c["top_ids"][j, 0] == r["top_ids"][j, 0])
        for q, toks in chunks:
            done[q] += len(toks)
    cl, rl = np.concatenate(cuda_lp), np.concatenate(ref_lp)
    err = rel_err(cl, rl)
    print(f"prompt logprobs vs emulated device: rel err {err:.2e}, max abs {np.abs(cl - rl).max():.3e}, "
          f"top-1 agreement {top1_same}/{n_rows}")  # fmt: skip
    assert n_rows == 69 + 39  # every prompt token but the first of the two scored prompts
    assert err < 2e-2 and top1_same >= 0.9 * n_rows
    # a step without prompt logprob rows: ext_on and plp_count say so, the step samples as before
    d1.release(0)
    b = d1.step([(0, p0[:20])])
    b.ext = _ext([(0, p0[:20])], [0], prompts, {0: -1})
    tok = eng.step(b)
    assert int(eng.arena.host["plp_count"][0]) == 0 and int(eng.arena.host["ext_on"][0]) == 1
    assert int(tok[0]) == int(np.argmax(eng.logits(1)[0]))
    eng.close()
