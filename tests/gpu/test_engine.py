"""The CUDA engine against transformers (same bf16 weights) and against the numpy executor.

Random weights of real shapes (Llama-3-8B, Qwen3-8B, Qwen3-32B, Qwen2.5-7B and Phi-4 layer shapes and vocabularies, 2 layers)
are made on the GPU and copied into transformers' model. One prefill step packs a whole prompt
and the first chunk of a second prompt; the next step prefills the second chunk on top of its
cached context; then 32 greedy decode steps. transformers sees each sequence once, teacher-forced
with our tokens, so every step is compared on the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from blink.gpu.engine.attention_launch import FLASH_VARIANTS
from blink.gpu.engine.forward import GEMV_FUSIONS
from blink.models.config import ModelConfig, preset
from blink.models.reference import PagedDriver

pytestmark = pytest.mark.gpu

DECODE_STEPS = 32


def _fusion(spec: str) -> frozenset[str]:
    """A GEMV fusion set: "none", "all" (what serves) or a comma list of GEMV_FUSIONS."""
    if spec == "all":
        return frozenset(GEMV_FUSIONS)
    return frozenset(p.strip() for p in spec.split(",") if p.strip() not in ("", "none"))


def _with_kernels(eng, decode_attention: str | None, gemv_fusion: str | None):
    """Before capture: every decode bucket on one attention kernel (None: the serving choice, flashq
    below 128 sequences, flashmma from there) and a GEMV fusion set (None: every fusion, as served)."""
    eng.fwd.set_decode_attention(decode_attention)
    if gemv_fusion is not None:
        eng.fwd.set_gemv_fusion(_fusion(gemv_fusion))
    return eng


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def small_engine(cfg: ModelConfig, decode_attention: str | None = None, gemv_fusion: str | None = None, **kw):
    from blink.gpu.engine.engine import Engine, EngineConfig

    ecfg = EngineConfig(
        max_seqs=8,
        max_num_batched_tokens=256,
        max_context=1024,
        num_kv_blocks=256,
        batch_buckets=(1, 2, 4, 8),
        token_buckets=(16, 64, 128, 256),
        progress=False,
        **kw,
    )
    eng = _with_kernels(Engine.create(cfg, ecfg), decode_attention, gemv_fusion)
    eng.capture()
    return eng


def hf_model(cfg: ModelConfig, eng):
    import cupy as cp
    import torch
    import transformers

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_eps,
        max_position_embeddings=4096,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_theta=cfg.rope_theta,
    )
    if cfg.arch == "llama":
        rs = cfg.rope_scaling
        scaling = None
        if rs.type == "llama3":
            scaling = {
                "rope_type": "llama3",
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position,
            }
        hf_cfg = transformers.LlamaConfig(**common, rope_scaling=scaling)
        cls = transformers.LlamaForCausalLM
    elif cfg.arch == "qwen2":
        hf_cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif cfg.arch == "phi3":
        hf_cfg = transformers.Phi3Config(**common, pad_token_id=0)
        cls = transformers.Phi3ForCausalLM
    elif cfg.arch == "qwen3_moe":
        hf_cfg = transformers.Qwen3MoeConfig(
            **common,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        hf_cfg = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = cls(hf_cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    sd = model.state_dict()
    ours = {
        name: torch.from_dlpack(cp.ascontiguousarray(arr).view(cp.int16)).view(torch.bfloat16)
        for name, arr in eng.weights.hf_tensors()
    }
    if cfg.arch == "phi3":  # Phi3ForCausalLM holds [q; k; v] and [gate; up] fused
        for i in range(cfg.num_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            ours[a + "qkv_proj.weight"] = torch.cat([ours.pop(a + f"{x}_proj.weight") for x in "qkv"])
            ours[m + "gate_up_proj.weight"] = torch.cat(
                [ours.pop(m + "gate_proj.weight"), ours.pop(m + "up_proj.weight")]
            )
    if cfg.arch == "qwen3_moe" and any(k.endswith("mlp.experts.gate_up_proj") for k in sd):
        # transformers >= 5 holds each layer's experts as two 3-D tensors, our own layout
        bf = lambda a: torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16)  # noqa: E731
        for i, lw in enumerate(eng.weights.layers):
            if lw.router is None:
                continue
            m = f"model.layers.{i}.mlp.experts."
            for name in [n for n in ours if n.startswith(m)]:
                del ours[name]
            ours[m + "gate_up_proj"], ours[m + "down_proj"] = bf(lw.experts_gate_up), bf(lw.experts_down)
    with torch.no_grad():
        for name, src in ours.items():
            assert sd[name].shape == src.shape, name
            sd[name].copy_(src)
    return model


def run_script(eng, drv: PagedDriver, prompts: list[list[int]], split: int):
    """Prefill (prompt 0 whole + prompt 1 chunk 1), prefill (prompt 1 chunk 2), then greedy decode.
    Returns per-sequence lists of (position, logits row) and the generated tokens."""
    rows: dict[int, list[tuple[int, np.ndarray]]] = {0: [], 1: []}
    gen: dict[int, list[int]] = {0: [], 1: []}
    b = drv.step([(0, prompts[0]), (1, prompts[1][:split])])
    tok = eng.step(b)
    lg = eng.logits(2)
    assert tok[0] == int(np.argmax(lg[0])) and tok[1] == int(np.argmax(lg[1]))
    rows[0].append((len(prompts[0]) - 1, lg[0]))
    rows[1].append((split - 1, lg[1]))
    gen[0].append(int(tok[0]))
    b = drv.step([(1, prompts[1][split:])])
    tok = eng.step(b)
    lg = eng.logits(1)
    rows[1].append((len(prompts[1]) - 1, lg[0]))
    gen[1].append(int(tok[0]))
    for _ in range(DECODE_STEPS):
        b = drv.step([(0, [gen[0][-1]]), (1, [gen[1][-1]])])
        tok = eng.step(b)
        lg = eng.logits(2)
        np.testing.assert_array_equal(tok, np.argmax(lg, axis=1))  # greedy sampling on the GPU = argmax
        for s in (0, 1):
            rows[s].append((int(b.positions[s]), lg[s]))
            gen[s].append(int(tok[s]))
    return rows, gen


def prompts_for(cfg: ModelConfig) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, cfg.vocab_size, 100).tolist(), rng.integers(0, cfg.vocab_size, 57).tolist()]


@pytest.mark.parametrize(
    "name,attn",
    [
        ("llama3-8b", "flashmma"),
        ("qwen3-8b", "flashmma"),
        ("llama3-8b", "flashq"),
        ("qwen3-8b", "flashq"),
        ("qwen2.5-7b", "flashq"),
        ("qwen2.5-7b", "flashmma"),
        ("phi-4", "flashmma"),
        ("phi-4", "flashq"),
        ("qwen3-32b", "flashmma"),  # q_size 8192 > hidden 5120, GQA group 8, intermediate 25600
        ("qwen3-32b", "flashq"),
    ],
)
def test_engine_matches_transformers(name, attn):
    """Both decode attention kernels at every bucket (the prefill kernel is fa2) against transformers."""
    cfg = preset(name).replace(num_layers=2)
    eng = small_engine(cfg, decode_attention=attn)
    _compare_transformers(cfg, eng, name)
    eng.close()


def _compare_transformers(cfg: ModelConfig, eng, name: str):
    """run_script on `eng` against transformers on the same weights; returns (rows, gen)."""
    import torch

    model = hf_model(cfg, eng)
    prompts = prompts_for(cfg)
    rows, gen = run_script(eng, PagedDriver(256, 16, 64, shuffle_seed=3), prompts, split=21)
    errs, agree, n = [], 0, 0
    for s in (0, 1):
        ids = prompts[s] + gen[s][:-1]
        with torch.no_grad():
            # transformers' bf16 forward up to the final norm; the LM head in fp32 as ours (its bf16
            # logits are quantised in steps of 1/16..1/8 at |logit| ~ 10, which makes near-ties coin flips)
            hid = model.model(torch.tensor([ids], device="cuda")).last_hidden_state[0].float()
            ref = (hid @ model.lm_head.weight.float().T).cpu().numpy()
        for pos, lg in rows[s]:
            errs.append(rel_err(lg, ref[pos]))
            agree += int(np.argmax(lg) == np.argmax(ref[pos]))
            n += 1
    print(f"{name}: max rel err {max(errs):.2e}, mean {np.mean(errs):.2e}, greedy agreement {agree}/{n}")
    assert max(errs) <= 2e-2, errs
    assert agree >= 0.95 * n
    del model
    return rows, gen


def test_shuffled_block_tables_match_contiguous():
    cfg = preset("llama3-8b").replace(num_layers=2)
    eng = small_engine(cfg)
    prompts = prompts_for(cfg)
    a_rows, a_gen = run_script(eng, PagedDriver(256, 16, 64, shuffle_seed=None), prompts, split=30)
    b_rows, b_gen = run_script(eng, PagedDriver(256, 16, 64, shuffle_seed=11), prompts, split=30)
    assert a_gen == b_gen
    for s in (0, 1):
        for (pa, la), (pb, lb) in zip(a_rows[s], b_rows[s], strict=True):
            assert pa == pb
            np.testing.assert_array_equal(la, lb)
    eng.close()


@pytest.mark.parametrize("attn", list(FLASH_VARIANTS))
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "smollm2-135m"])
def test_engine_matches_numpy_executor(name, attn):
    """Small head dims (16, 32, 64), GQA groups 2/3, tied and untied heads, against the float64
    reference engine on the same (bf16-rounded) weights; chunked prefill and decode, teacher-forced."""
    _check_numpy_executor(name, decode_attention=attn)


def _check_numpy_executor(
    name: str, decode_attention: str | None = None, gemv_fusion: str | None = None, **ecfg_kw
) -> None:
    from blink.device.numpy_executor import NumpyExecutor
    from blink.gpu.engine.engine import Engine, EngineConfig
    from blink.gpu.engine.weights import bf16_bits_to_f32, f32_to_bf16_bits
    from blink.models.weights import random_weights

    cfg = preset(name)
    if name == "smollm2-135m":
        cfg = cfg.replace(num_layers=4)
    w = {k: bf16_bits_to_f32(f32_to_bf16_bits(v)) for k, v in random_weights(cfg, seed=5).items()}
    ecfg = EngineConfig(
        max_seqs=4,
        max_num_batched_tokens=128,
        max_context=512,
        num_kv_blocks=64,
        block_size=8,
        batch_buckets=(1, 2, 4),
        token_buckets=(16, 128),
        progress=False,
        **ecfg_kw,
    )
    eng = _with_kernels(Engine.create(cfg, ecfg, host_weights=w), decode_attention, gemv_fusion)
    eng.capture()
    ref = NumpyExecutor(
        cfg, w, num_blocks=64, block_size=8, max_batch=4, max_num_batched_tokens=128, max_blocks_per_seq=64
    )
    rng = np.random.default_rng(2)
    p0, p1 = rng.integers(0, cfg.vocab_size, 70).tolist(), rng.integers(0, cfg.vocab_size, 40).tolist()
    d1, d2 = PagedDriver(64, 8, 64, shuffle_seed=1), PagedDriver(64, 8, 64, shuffle_seed=1)
    steps = [[(0, p0[:50]), (1, p1)], [(0, p0[50:])]] + [
        [(0, [t]), (1, [u])] for t, u in zip(p0[:12], p1[:12], strict=True)
    ]
    errs = []
    for chunks in steps:
        b1, b2 = d1.step(chunks), d2.step(chunks)
        eng.step(b1)
        mine = eng.logits(b1.num_seqs)
        theirs = ref.forward_logits(b2)
        errs.append(rel_err(mine, theirs))
    print(f"{name} {decode_attention} {gemv_fusion} {ecfg_kw}: rel err max {max(errs):.2e}")
    assert max(errs) < 2e-2, errs
    eng.close()


@pytest.mark.parametrize("name", ["tiny-llama", "smollm2-135m"])
def test_mixed_steps_match_numpy_executor(name):
    """Mixed steps (blink/device/scheduler.py): one-token decode rows with cached context first,
    then prefill chunks (a cached prefix, a new prompt), in one prefill graph. Logits match the
    reference row by row and every row, decode rows included, samples argmax."""
    from blink.device.numpy_executor import NumpyExecutor
    from blink.gpu.engine.engine import Engine, EngineConfig
    from blink.gpu.engine.weights import bf16_bits_to_f32, f32_to_bf16_bits
    from blink.models.weights import random_weights

    cfg = preset(name)
    if name == "smollm2-135m":
        cfg = cfg.replace(num_layers=4)
    w = {k: bf16_bits_to_f32(f32_to_bf16_bits(v)) for k, v in random_weights(cfg, seed=7).items()}
    ecfg = EngineConfig(
        max_seqs=4,
        max_num_batched_tokens=128,
        max_context=512,
        num_kv_blocks=64,
        block_size=8,
        batch_buckets=(1, 2, 4),
        token_buckets=(16, 128),
        progress=False,
    )
    eng = Engine.create(cfg, ecfg, host_weights=w)
    eng.capture()
    ref = NumpyExecutor(
        cfg, w, num_blocks=64, block_size=8, max_batch=4, max_num_batched_tokens=128, max_blocks_per_seq=64
    )
    rng = np.random.default_rng(3)
    p0, p1, p2 = (rng.integers(0, cfg.vocab_size, n).tolist() for n in (150, 90, 70))
    d1, d2 = PagedDriver(64, 8, 64, shuffle_seed=2), PagedDriver(64, 8, 64, shuffle_seed=2)
    steps = [
        [(0, p0[:100])],
        [(0, [p0[100]]), (1, p1[:60])],  # decode row + a new prompt's first chunk
        [(0, [p0[101]]), (1, p1[60:]), (2, p2[:1]), (3, p2[1:50])],  # two one-token rows among chunks
        [(0, [p0[102]]), (1, [p1[0]]), (2, p2[1:2]), (3, p2[50:])],
        [(0, [p0[103]]), (1, [p1[1]]), (2, p2[2:3]), (3, [p2[0]])],  # decodes only: a decode graph
    ]
    for chunks in steps:
        b1, b2 = d1.step(chunks), d2.step(chunks)
        tok = eng.step(b1)
        mine = eng.logits(b1.num_seqs)
        theirs = ref.forward_logits(b2)
        assert rel_err(mine, theirs) < 2e-2, (chunks, rel_err(mine, theirs))
        np.testing.assert_array_equal(tok, np.argmax(mine, axis=1))
    eng.close()


def test_graph_table_and_done_seq():
    import cupy as cp

    from blink.gpu.engine.abi import ENGINE_DTYPE

    cfg = preset("tiny-llama")
    from blink.gpu.engine.engine import Engine, EngineConfig

    ecfg = EngineConfig(
        max_seqs=8,
        max_num_batched_tokens=64,
        max_context=256,
        num_kv_blocks=64,
        block_size=16,
        batch_buckets=(1, 2, 4, 8),
        token_buckets=(16, 32, 64),
        progress=False,
    )
    eng = Engine.create(cfg, ecfg)
    rep = eng.capture()
    host = np.empty(ENGINE_DTYPE.itemsize, np.uint8)
    cp.cuda.runtime.memcpy(host.ctypes.data, eng.abi_ptr, host.nbytes, 2)  # device -> host
    rec = host.view(ENGINE_DTYPE)[0]
    assert rec["max_seqs"] == 8 and rec["max_num_batched_tokens"] == 64 and rec["execs_per_shape"] == 2
    assert rec["input_ids"] == eng.arena.ptr["input_ids"] and rec["done_seq"] == eng.fwd.done_seq.data.ptr
    dec = eng._tables["decode_execs"].get()
    pre = eng._tables["prefill_execs"].get()
    assert (dec != 0).all()
    for bi, b in enumerate(eng.batch_buckets):
        for ti, t in enumerate(eng.token_buckets):
            assert ((pre[bi, ti] != 0).all()) == (t >= b)
    bof = eng._tables["batch_bucket_of"].get()
    assert [eng.batch_buckets[bof[n]] for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert rep.graphs == 4 + sum(t >= b for b in eng.batch_buckets for t in eng.token_buckets)
    drv = PagedDriver(64, 16, eng.dims.max_blocks_per_seq)
    b = drv.step([(0, list(range(10)))])
    eng.load_step(b, step_seq=42)
    eng.arena.upload(eng.s, 1)
    eng.driver.graph_launch(eng.pick_exec(1, 10, False), eng.s)
    eng.stream.synchronize()
    assert int(eng.fwd.done_seq.get()[0]) == 42
    eng.close()


def test_flashmma_matches_flashq_long_contexts():
    """The two decode attention kernels on one engine and one KV cache: contexts 1..1000 (one split,
    many splits), fewer live sequences than the bucket."""
    variant = "flashmma"
    cfg = preset("llama3-8b").replace(num_layers=2)
    eng = small_engine(cfg, decode_attention="flashq")
    rng = np.random.default_rng(4)
    lens = [1000, 300, 17, 1]
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    drv = PagedDriver(256, 16, eng.dims.max_blocks_per_seq, shuffle_seed=5)
    for s, p in enumerate(prompts[:3]):
        for i in range(0, len(p), 256):
            eng.step(drv.step([(s, p[i : i + 256])]))
    # decode: three sequences in the bucket of 4, then all four (the last one's first token)
    for chunks in ([(0, [7]), (1, [8]), (2, [9])], [(0, [1]), (1, [2]), (2, [3]), (3, prompts[3])]):
        b = drv.step(chunks)
        bucket = eng.batch_buckets[int(np.searchsorted(eng.batch_buckets, b.num_seqs))]
        out = {}
        for v in ("flashq", variant):
            eng.fwd.set_decode_attention(v)
            execs = eng.capture_variant(bucket, bucket, True)
            eng.fwd.set_decode_attention(None)
            assert eng.load_step(b)
            eng.arena.upload(eng.s, b.num_seqs)
            eng.driver.graph_launch(execs[0], eng.s)
            out[v] = eng.logits(b.num_seqs)
        err = rel_err(out[variant], out["flashq"])
        print(f"{variant} vs flashq, lens {b.seq_lens.tolist()}: rel err {err:.2e}")
        assert err < 1e-2, err
    eng.close()


# ---- GEMV fusions (Forward.gemv_fusion: every fusion serves). Test ids name "fusion_on" / "fusion_off" so that
# bench/fused_gpu.sh runs each setting in its own process (a kernel fault poisons the CUDA context).
FUSION_BATCHES = (1, 2, 3, 8)  # 3: a dead row in the bucket of 4


def fusion_script(eng, n: int, cfg: ModelConfig):
    """n sequences on the GEMV path: packed prefill, greedy decode steps, a prefill+decode mix (the
    last sequence gets a 5-token chunk on its cached context), more decode steps.
    Returns per-sequence fed tokens, (position, logits) rows and the decode steps' (tokens, logits)."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.vocab_size, 12 + 5 * i).tolist() for i in range(n)]  # <= 256 tokens packed
    steps = max(6, -(-20 // n))  # >= 40 compared rows: greedy agreement >= 95 % allows 2 near-tie flips
    drv = PagedDriver(256, 16, eng.dims.max_blocks_per_seq, shuffle_seed=9)
    fed = {s: list(p) for s, p in enumerate(prompts)}
    rows: dict[int, list[tuple[int, np.ndarray]]] = {s: [] for s in range(n)}
    decode_out = []

    def run(chunks):
        b = drv.step(chunks)
        tok = eng.step(b)
        lg = eng.logits(b.num_seqs)
        np.testing.assert_array_equal(tok, np.argmax(lg, axis=1))  # greedy sampling on the GPU = argmax
        for r, (s, _) in enumerate(chunks):  # the caller has appended the chunk to fed[s]
            rows[s].append((len(fed[s]) - 1, lg[r]))
        return tok, lg

    tok, _ = run([(s, prompts[s]) for s in range(n)])
    for phase in range(2):
        for _ in range(steps):
            chunks = [(s, [int(tok[s])]) for s in range(n)]
            for s, t in chunks:
                fed[s] += t
            tok, lg = run(chunks)
            decode_out.append((tok.copy(), lg))
        if phase == 0:  # the mix: a 5-token chunk for the last sequence, one token for the others
            extra = rng.integers(0, cfg.vocab_size, 5).tolist()
            chunks = [(s, [int(tok[s])]) for s in range(n - 1)] + [(n - 1, extra)]
            for s, t in chunks:
                fed[s] += t
            tok, _ = run(chunks)
    return fed, rows, decode_out


def fusion_engine(cfg: ModelConfig, fusion: str):
    return small_engine(cfg, gemv_max_tokens=8, gemv_fusion=fusion)


@pytest.mark.parametrize("n", FUSION_BATCHES, ids=lambda n: f"b{n}")
@pytest.mark.parametrize("fusion", ["all", "none"], ids=lambda f: "fusion_on" if f == "all" else "fusion_off")
def test_gemv_fusion_matches_transformers(fusion, n):
    """Decode on the GEMV path (batch 1, 2, 3, 8), fused or not, against transformers' bf16 model."""
    import torch

    cfg = preset("llama3-8b").replace(num_layers=2)
    eng = fusion_engine(cfg, fusion)
    assert eng.fwd.fusions_for(n if n != 3 else 4) == _fusion(fusion)
    model = hf_model(cfg, eng)
    fed, rows, _ = fusion_script(eng, n, cfg)
    errs, agree, total = [], 0, 0
    for s in range(n):
        with torch.no_grad():
            hid = model.model(torch.tensor([fed[s]], device="cuda")).last_hidden_state[0].float()
            ref = (hid @ model.lm_head.weight.float().T).cpu().numpy()
        for pos, lg in rows[s]:
            errs.append(rel_err(lg, ref[pos]))
            agree += int(np.argmax(lg) == np.argmax(ref[pos]))
            total += 1
    print(f"gemv fusion {fusion}, batch {n}: max rel err {max(errs):.2e}, greedy agreement {agree}/{total}")
    assert max(errs) <= 2e-2, errs
    assert agree >= 0.95 * total
    eng.close()


@pytest.mark.parametrize("quantization", ["", "fp8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n", FUSION_BATCHES, ids=lambda n: f"fusion_on-b{n}")
def test_gemv_fusion_matches_unfused(n, quantization):
    """Fused and unfused decode graphs of one engine on the same KV cache: the fused kernels keep
    every bf16 rounding point, so logits agree to fp32 reduction-order noise at most. FP8 weights:
    the FP8 GEMV's fusions (fp8.cu) below 8 tokens; 8 tokens run the tensor-core kernel, unfused."""
    cfg = preset("llama3-8b").replace(num_layers=2)
    eng = small_engine(cfg, gemv_max_tokens=8, gemv_fusion="all", quantization=quantization)
    rng = np.random.default_rng(8)
    drv = PagedDriver(256, 16, eng.dims.max_blocks_per_seq, shuffle_seed=2)
    eng.step(drv.step([(s, rng.integers(0, cfg.vocab_size, 16 + 4 * s).tolist()) for s in range(n)]))
    bucket = eng.batch_buckets[int(np.searchsorted(eng.batch_buckets, n))]
    b = drv.step([(s, [int(rng.integers(0, cfg.vocab_size))]) for s in range(n)])
    out = {}
    for f in ("all", "none", "norm", "swiglu", "rope", "norm,rope"):
        eng.fwd.set_gemv_fusion(_fusion(f))
        execs = eng.capture_variant(bucket, bucket, True)
        assert eng.load_step(b)
        eng.arena.upload(eng.s, b.num_seqs)
        eng.driver.graph_launch(execs[0], eng.s)
        out[f] = eng.logits(b.num_seqs)
    for f in ("all", "norm", "swiglu", "rope", "norm,rope"):
        err = rel_err(out[f], out["none"])
        same = bool(np.array_equal(out[f], out["none"]))
        print(f"batch {n}: fusion {f} vs none: rel err {err:.2e}, bitwise equal {same}")
        assert err < 1e-3, (f, err)
        np.testing.assert_array_equal(np.argmax(out[f], axis=1), np.argmax(out["none"], axis=1))
    eng.close()


@pytest.mark.parametrize("fusion", ["all", "none"], ids=lambda f: "fusion_on" if f == "all" else "fusion_off")
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "smollm2-135m"])
def test_gemv_fusion_matches_numpy_executor(name, fusion):
    """Small hidden sizes (64, 96, 576: fewer 8-vectors than threads), odd intermediate sizes,
    qk-norm and qkv biases on the fused path (GEMV for batches 1-4) against the float64 reference."""
    _check_numpy_executor(name, gemv_max_tokens=4, gemv_fusion=fusion)
