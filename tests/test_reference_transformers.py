"""The numpy engine against transformers: SmolLM2 GGUF greedy tokens and logits, tiny Llama-3 / Qwen3.

transformers loads the same GGUF (dequantised to float32, its own q/k un-permutation), so the
two engines differ only in arithmetic order: prefill logits must agree to 1e-3 relative and
greedy decoding must pick the same 32 tokens. HF decodes with its KV cache one token at a time,
ours runs all prompts as one packed prefill and then batched decode steps.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

from blink.device.numpy_executor import NumpyExecutor
from blink.models import registry
from blink.models.config import rope_inv_freq
from blink.models.hf_weights import load_hf_dir
from blink.models.reference import PagedDriver, reference_logits

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "What is the capital of France?",
    "Write a short story about a robot.",
    "List three colors.",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
]
NEW_TOKENS = 32


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def ours():
    return registry.resolve_model(None, allow_pull=False)


def _memoize_gguf_parsing(mp: pytest.MonkeyPatch) -> None:
    """transformers parses the GGUF twice (config, then weights) and rebuilds gguf's tensor name map
    for every tensor: 25 of the 55 s a load takes on 2 cores. Both are pure functions of their
    arguments; computed once, the load reads the same file into the same model."""
    import functools

    import gguf

    mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=2)(gguf.GGUFReader))
    mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=8)(gguf.get_tensor_name_map))


@pytest.fixture(scope="module")
def hf_model(ours):
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_VERBOSITY", "error")
    try:
        torch.set_num_threads(min(2, torch.get_num_threads()))  # make test: OMP_NUM_THREADS=1
        _memoize_gguf_parsing(mp)
        path = ours.source
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        ).eval()
        yield model
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def prompt_ids(ours):
    return [ours.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_runs(hf_model, prompt_ids):
    """Per prompt: (prefill logits (n, vocab), 32 greedy tokens), decoding with HF's KV cache."""
    import inspect

    # transformers 5.x renamed past_key_values -> cache (argument and output field).
    cache_arg = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    runs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf_model(torch.tensor([ids]), use_cache=True)
            prefill = out.logits[0].float().numpy()
            past, toks = out[cache_arg], [int(prefill[-1].argmax())]
            while len(toks) < NEW_TOKENS:
                out = hf_model(torch.tensor([[toks[-1]]]), **{cache_arg: past}, use_cache=True)
                past = out[cache_arg]
                toks.append(int(out.logits[0, -1].argmax()))
            runs.append((prefill, toks))
    return runs


@pytest.fixture(scope="module")
def our_runs(ours, prompt_ids):
    """All prompts packed into one prefill step, then batched greedy decode steps."""
    ex = NumpyExecutor(
        ours.config, ours.weights, num_blocks=128, block_size=16, max_batch=8, max_num_batched_tokens=512
    )
    drv = PagedDriver(128, 16, 16, shuffle_seed=1)
    step = drv.step(list(enumerate(prompt_ids)))
    logits = ex.forward_logits(step, all_tokens=True)
    cu = step.cu_q_lens
    prefill = [logits[cu[i] : cu[i + 1]] for i in range(len(prompt_ids))]
    toks = [[int(logits[cu[i + 1] - 1].argmax())] for i in range(len(prompt_ids))]
    for _ in range(NEW_TOKENS - 1):
        out = ex.execute(drv.step([(i, [t[-1]]) for i, t in enumerate(toks)]))
        for t, o in zip(toks, out, strict=True):
            t.append(int(o))
    return prefill, toks


def test_gguf_weights_equal_transformers(ours, hf_model):
    sd = hf_model.state_dict()
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",
    ]:
        assert np.array_equal(ours.weights[name], sd[name].numpy()), name
    assert hf_model.config.tie_word_embeddings


def test_prefill_logits_match(our_runs, hf_runs):
    for (theirs, _), mine in zip(hf_runs, our_runs[0], strict=True):
        assert mine.shape == theirs.shape
        assert rel_err(mine, theirs) < 1e-3


def test_greedy_tokens_match(our_runs, hf_runs, ours):
    for i, (_, theirs) in enumerate(hf_runs):
        assert our_runs[1][i] == theirs, (
            PROMPTS[i],
            ours.tokenizer.decode(our_runs[1][i]),
            ours.tokenizer.decode(theirs),
        )
    assert ours.tokenizer.decode(our_runs[1][0]).startswith("The capital of France is Paris.")


def test_rope_llama3_scaling_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from blink.models.config import preset

    c = preset("llama3-8b")
    hf = transformers.LlamaConfig(
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_theta,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert attention_factor == 1.0
    np.testing.assert_allclose(rope_inv_freq(c), theirs.double().numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    ("arch", "tied", "dtype"),
    [
        ("llama3", False, "float32"),
        ("qwen3", False, "bfloat16"),
        ("qwen3", True, "float32"),
        ("qwen2", True, "bfloat16"),
        ("qwen2", False, "float32"),
        ("phi3", False, "float32"),
        ("phi3", False, "bfloat16"),
        ("phi3", True, "float32"),
        ("qwen3_moe", False, "float32"),
        ("qwen3_moe", False, "bfloat16"),
        ("qwen3_moe_step2", True, "float32"),
    ],
)
def test_tiny_random_hf_model_matches(arch, tied, dtype, tmp_path):
    """transformers' own Llama (llama3 rope scaling, GQA), Qwen3 (qk-norm, head_dim != hidden/heads)
    Qwen2 (q/k/v biases) and Phi-3 (Phi-4's fused qkv_proj / gate_up_proj, split at load), saved with
    save_pretrained and read back by our HF-directory loader (bf16 checkpoints too)."""
    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    if arch == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope["original_max_position_embeddings"] = 16
        hf_config = transformers.LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        hf_config = transformers.Qwen2Config(**common, rope_theta=1e6)
        cls = transformers.Qwen2ForCausalLM
    elif arch.startswith("qwen3_moe"):
        # qwen3_moe: layer 1 dense (mlp_only_layers), top-2 of 8 renormalised; _step2: every 2nd layer sparse, raw top-k
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=24, rope_theta=1e6)
        if arch == "qwen3_moe":
            moe |= dict(norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3)
        else:
            moe |= dict(norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=4)
        hf_config = transformers.Qwen3MoeConfig(**{**common, **moe})
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "phi3":
        hf_config = transformers.Phi3Config(**common, rope_theta=250000.0, pad_token_id=0)
        cls = transformers.Phi3ForCausalLM
    else:
        hf_config = transformers.Qwen3Config(**common, head_dim=24, rope_theta=1e6)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(hf_config).eval()
    with torch.no_grad():  # HF's init leaves norms at exactly 1; perturb them so they are tested
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # decisive routing: no near-ties between the k-th and next expert
                p.normal_(0.0, 0.5)
        for p in model.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())  # the values a bf16 checkpoint holds
    # Save a converted copy: converting `model` itself would also round its rotary inv_freq buffer.
    copy.deepcopy(model).to(getattr(torch, dtype)).save_pretrained(tmp_path)
    config, weights = load_hf_dir(tmp_path)
    (shard,) = tmp_path.glob("*.safetensors")
    header = json.loads(shard.read_bytes()[8 : 8 + int.from_bytes(shard.read_bytes()[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16" if dtype == "bfloat16" else "F32"}
    assert config.tie_word_embeddings == tied and config.qk_norm == arch.startswith("qwen3")
    if arch.startswith("qwen3_moe"):
        moe_layers = [i for i in range(config.num_layers) if config.layer_is_moe(i)]
        assert moe_layers == ([0, 2] if arch == "qwen3_moe" else [1, 3])
        assert config.norm_topk_prob == (arch == "qwen3_moe") and config.num_experts == 8
    assert config.attn_bias == (arch == "qwen2") and (arch != "qwen2" or any(k.endswith("_proj.bias") for k in weights))
    sd = model.state_dict()
    if arch == "phi3":  # ours holds the fused tensors split into the canonical pieces
        assert not any("qkv_proj" in k or "gate_up_proj" in k for k in weights)
        for i in range(hf_config.num_hidden_layers):
            p = f"model.layers.{i}."
            sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"] = (
                sd.pop(p + "self_attn.qkv_proj.weight").split([config.q_size, config.kv_size, config.kv_size])
            )
            sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = sd.pop(p + "mlp.gate_up_proj.weight").chunk(
                2
            )
    for p in [k.removesuffix("gate_up_proj") for k in list(sd) if k.endswith("mlp.experts.gate_up_proj")]:
        # transformers 5 holds the experts stacked (its checkpoints, like the Hub's, name each one)
        gate_up, down = sd.pop(p + "gate_up_proj"), sd.pop(p + "down_proj")
        for e in range(config.num_experts):
            sd[f"{p}{e}.gate_proj.weight"], sd[f"{p}{e}.up_proj.weight"] = gate_up[e].chunk(2)
            sd[f"{p}{e}.down_proj.weight"] = down[e]
    for k, v in weights.items():
        assert np.array_equal(v, sd[k].numpy()), k
    ids = np.random.default_rng(0).integers(0, 300, 60).tolist()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    ex = NumpyExecutor(config, weights, num_blocks=32, block_size=8, max_batch=2, max_num_batched_tokens=128)
    drv = PagedDriver(32, 8, 16)
    mine = np.concatenate(
        [ex.forward_logits(drv.step([(0, ids[:40])]), all_tokens=True)]
        + [ex.forward_logits(drv.step([(0, [t])])) for t in ids[40:]]
    )
    assert rel_err(mine, theirs) < 1e-5
    assert rel_err(reference_logits(config, weights, ids), theirs) < 1e-5
    # Greedy: transformers' generate (its KV cache) and our batched decode pick the same 32 tokens.
    prompt = ids[:17]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    theirs_toks = out[0, len(prompt) :].tolist()
    drv = PagedDriver(32, 8, 16)
    ex = NumpyExecutor(config, weights, num_blocks=32, block_size=8, max_batch=2, max_num_batched_tokens=128)
    toks = [int(ex.forward_logits(drv.step([(0, prompt)]))[0].argmax())]
    while len(toks) < NEW_TOKENS:
        toks.append(int(ex.forward_logits(drv.step([(0, [toks[-1]])]))[0].argmax()))
    assert toks == theirs_toks
