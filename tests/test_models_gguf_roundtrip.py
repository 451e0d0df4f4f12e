"""GGUF files written the way llama.cpp's converter writes them load back into the canonical weights.

Covers what the SmolLM2 file does not: an untied output.weight, Qwen3 (q/k norms, no rope
permutation, key_length != hidden/heads), Qwen2 (q/k/v biases), Phi-3 (llama.cpp's arch "phi3":
fused attn_qkv, ffn_up holding [gate; up], no ffn_gate), Llama-3 rope_freqs, and quantised + F16 +
F32 tensors, and Qwen3-MoE (llama.cpp's arch "qwen3moe": router ffn_gate_inp, each layer's experts
stacked in ffn_{gate,up,down}_exps, expert_* metadata).
"""

from __future__ import annotations

import numpy as np
import pytest

from blink.models.config import UnsupportedModelError, preset, rope_inv_freq
from blink.models.gguf_weights import load_gguf
from blink.models.registry import resolve_model
from blink.models.weights import random_weights, split_fused

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # phi3
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # qwen3moe router
}
_GGUF_ARCH = {"qwen3_moe": "qwen3moe"}  # ours -> llama.cpp's, where they differ


def gguf_name(name: str) -> str:
    if name.startswith("blk."):  # already llama.cpp's (stacked experts)
        return name
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if name in fixed:
        return fixed[name]
    if name == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = name.split(".", 3)
    base, kind = rest.rsplit(".", 1)  # weight | bias
    return f"blk.{i}.{_TO_GGUF[base]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stack_experts(config, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Canonical per-expert tensors stacked as llama.cpp's converter writes them: one (experts, out, in)
    tensor per projection and MoE layer, named by its GGUF name (no canonical name exists)."""
    out = dict(weights)
    for i in range(config.num_layers):
        if not config.layer_is_moe(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        for proj, gname in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            out[f"blk.{i}.{gname}.weight"] = np.stack(
                [out.pop(f"{p}{e}.{proj}.weight") for e in range(config.num_experts)]
            )
    return out


def unstack_experts(config, name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The canonical pieces of a stacked GGUF expert tensor (the inverse of stack_experts)."""
    i, gname = name.split(".")[1:3]
    proj = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}[gname]
    return [(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight", w[e]) for e in range(config.num_experts)]


def write_gguf(
    path, config, weights, rope_factors: np.ndarray | None = None, tokenizer: dict | None = None, quantize: bool = True
) -> dict[str, np.ndarray]:
    """Write a GGUF (2-D and stacked-expert weights Q8_0, embeddings F16, norms F32; all F32 when not
    `quantize`); return the weights as stored values, i.e. what a loader must give back after
    dequantisation. `tokenizer`: tokenizer.ggml.* metadata to write instead of a synthetic byte-level
    vocabulary."""
    arch = _GGUF_ARCH.get(config.arch, config.arch)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_eps)
    w.add_vocab_size(config.vocab_size)
    if arch == "phi3":
        w.add_rope_dimension_count(config.head_dim)
        w.add_sliding_window(0)  # what llama.cpp writes for Phi-4 (no window)
    if arch == "qwen3moe":  # convert_hf_to_gguf.py Qwen2MoeModel.set_gguf_parameters
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        if not config.norm_topk_prob:  # llama.cpp renormalises qwen3moe's top-k unless told otherwise
            w.add_expert_weights_norm(False)
    if tokenizer is None:
        tokens = [f"<t{i}>" for i in range(config.vocab_size)]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(
            {"qwen2": "qwen2", "qwen3": "qwen2", "qwen3moe": "qwen2", "phi3": "dbrx"}.get(arch, "llama-bpe")
        )
        w.add_token_list(tokens)
        w.add_token_merges([])
        w.add_token_types([3 if i < 3 else 1 for i in range(config.vocab_size)])
        if config.bos_token_id is not None:
            w.add_bos_token_id(config.bos_token_id)
        w.add_eos_token_id(config.eos_token_id)
    else:
        w.add_tokenizer_model(tokenizer["tokenizer.ggml.model"])
        w.add_tokenizer_pre(tokenizer.get("tokenizer.ggml.pre", "default"))
        w.add_token_list(tokenizer["tokenizer.ggml.tokens"])
        w.add_token_scores(tokenizer["tokenizer.ggml.scores"])
        w.add_token_types(tokenizer["tokenizer.ggml.token_type"])
        w.add_bos_token_id(tokenizer["tokenizer.ggml.bos_token_id"])
        w.add_eos_token_id(tokenizer["tokenizer.ggml.eos_token_id"])
        w.add_unk_token_id(tokenizer["tokenizer.ggml.unknown_token_id"])
    stored = {}
    if arch == "phi3":
        weights = fuse_phi3(config, weights)
    if arch == "qwen3moe":
        weights = stack_experts(config, weights)
    if config.rope_scaling.type == "llama3":
        d = config.head_dim
        base = 1.0 / (config.rope_theta ** (np.arange(0, d, 2) / d))
        factors = base / rope_inv_freq(config) if rope_factors is None else rope_factors
        w.add_tensor("rope_freqs.weight", np.asarray(factors, dtype=np.float32))
    for name, t in weights.items():
        n_rope = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name.split(".")[-2], 0)
        permute = arch == "llama" and n_rope  # llama.cpp's converter interleaves q/k rows for its RoPE
        src = llama_cpp_permute(t, n_rope) if permute else t
        kw = {}
        if t.ndim == 1 or not quantize:
            raw = val = src
        elif name == "model.embed_tokens.weight" or t.shape[-1] % 32:  # F16, as llama.cpp where Q8_0 blocks do not fit
            raw = src.astype(np.float16)
            val = raw.astype(np.float32)
        else:
            raw = gguf.quants.quantize(src, Q.Q8_0)
            val = gguf.quants.dequantize(raw, Q.Q8_0)
            kw = dict(raw_shape=raw.shape, raw_dtype=Q.Q8_0)
        if permute:
            val = llama_cpp_permute_inverse_ref(val, n_rope)
        stored.update(unstack_experts(config, name, val) if "_exps." in name else split_fused(config, name, val))
        w.add_tensor(gguf_name(name), raw, **kw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def fuse_phi3(config, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Canonical weights as a Phi-3 checkpoint holds them: qkv_proj = [q; k; v], gate_up_proj = [gate; up]."""
    out = dict(weights)
    for i in range(config.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[a + "qkv_proj.weight"] = np.concatenate([out.pop(a + f"{x}_proj.weight") for x in "qkv"])
        out[m + "gate_up_proj.weight"] = np.concatenate(
            [out.pop(m + "gate_proj.weight"), out.pop(m + "up_proj.weight")]
        )
    return out


def llama_cpp_permute_inverse_ref(w: np.ndarray, n_head: int) -> np.ndarray:
    # Independent inverse: index map of the forward permutation, inverted with argsort.
    rows = np.arange(w.shape[0])
    fwd = llama_cpp_permute(rows[:, None], n_head)[:, 0]
    return w[np.argsort(fwd)]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-phi3", "tiny-qwen3-moe"])
@pytest.mark.parametrize("tied", [True, False])
def test_gguf_roundtrip(tmp_path, name, tied):
    config = preset(name).replace(tie_word_embeddings=tied)
    weights = random_weights(config, seed=5)
    path = tmp_path / f"{name}.gguf"
    stored = write_gguf(path, config, weights)
    got_config, got, meta = load_gguf(path)
    for f in ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
        assert getattr(got_config, f) == getattr(config, f), f
    assert (got_config.num_kv_heads, got_config.head_dim, got_config.qk_norm, got_config.attn_bias) == (
        config.num_kv_heads,
        config.head_dim,
        config.qk_norm,
        config.attn_bias,
    )
    assert got_config.tie_word_embeddings == tied and got_config.rope_scaling == config.rope_scaling
    assert got_config.eos_token_ids == config.eos_token_ids and got_config.rope_theta == pytest.approx(
        config.rope_theta
    )
    moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
    assert [getattr(got_config, f) for f in moe] == [getattr(config, f) for f in moe]
    layers = range(config.num_layers)
    assert [got_config.layer_is_moe(i) for i in layers] == [config.layer_is_moe(i) for i in layers]
    assert set(got) == set(stored)
    for k, v in stored.items():
        assert np.array_equal(got[k], v), k
    # And the permutation really was exercised: stored q differs from the raw GGUF rows for llama.
    if config.arch == "llama":
        q = weights["model.layers.0.self_attn.q_proj.weight"]
        assert np.abs(got["model.layers.0.self_attn.q_proj.weight"] - q).max() < 0.02 * np.abs(q).max()
    bundle = resolve_model(path)
    assert bundle.tokenizer.special_tokens == {"<t0>": 0, "<t1>": 1, "<t2>": 2}


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"sliding_window": 64}, "sliding-window"),
        ({"rope_dims": 8}, "partial rotary"),
        ({"rope_factors": True}, "LongRoPE"),
    ],
)
def test_gguf_phi3_refuses_what_phi4_lacks(tmp_path, extra, match):
    """Phi-3.x GGUFs (sliding window, partial rotary, LongRoPE factor tensors) are refused, not run wrong."""
    config = preset("tiny-phi3")
    w = gguf.GGUFWriter(str(tmp_path / "p.gguf"), "phi3")
    w.add_block_count(1)
    w.add_context_length(1024)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_dimension_count(extra.get("rope_dims", config.head_dim))
    w.add_sliding_window(extra.get("sliding_window", 0))
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(config.vocab_size)
    w.add_tensor("token_embd.weight", np.zeros((config.vocab_size, config.hidden_size), dtype=np.float32))
    if extra.get("rope_factors"):
        w.add_tensor("rope_factors_long.weight", np.ones(config.head_dim // 2, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=match):
        load_gguf(tmp_path / "p.gguf")


def test_gguf_rope_freqs_mismatch_is_rejected(tmp_path):
    config = preset("tiny-llama")
    path = tmp_path / "bad.gguf"
    # Divisors that no Llama-3 parameter set produces (non-monotonic).
    write_gguf(path, config, random_weights(config), rope_factors=np.array([1, 2, 1, 8, 8, 3, 8, 8]))
    with pytest.raises(UnsupportedModelError, match="rope_freqs do not follow"):
        load_gguf(path)


@pytest.mark.parametrize("orig", [8192, 32, 100])
def test_llama3_scaling_recovered_from_rope_freqs(orig):
    from blink.models.gguf_weights import llama3_scaling_from_factors

    c = preset("llama3-8b")
    c = c.replace(rope_scaling=c.rope_scaling.__class__("llama3", 8.0, 1.0, 4.0, orig))
    base = 1.0 / (c.rope_theta ** (np.arange(0, 128, 2) / 128))
    got = llama3_scaling_from_factors(c, (base / rope_inv_freq(c)).astype(np.float32))
    np.testing.assert_allclose(rope_inv_freq(c.replace(rope_scaling=got)), rope_inv_freq(c), rtol=1e-5)


@pytest.mark.parametrize("mlp_only", [(), (1,)], ids=["all-sparse", "layer1-dense"])
def test_qwen3moe_gguf_matches_hf_safetensors(tmp_path, mlp_only):
    """A tiny Qwen3MoeForCausalLM saved by transformers (safetensors) and the same weights written as a
    llama.cpp `qwen3moe` GGUF (F32, experts stacked) load to the same config and weights, and the numpy
    engine gives the same logits from both, equal to transformers' own; transformers' GGUF reader, an
    independent reading of llama.cpp's layout, gives them too from the same file."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from blink.device.numpy_executor import NumpyExecutor
    from blink.models.hf_weights import load_hf_dir
    from blink.models.reference import PagedDriver

    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6, max_position_embeddings=512, rope_theta=1e6,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=list(mlp_only), tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(hf_config).eval()
    with torch.no_grad():  # perturbed norms; decisive routing (no near-ties between the k-th and next expert)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "hf")
    hf_cfg, hf_w = load_hf_dir(tmp_path / "hf")
    write_gguf(tmp_path / "m.gguf", hf_cfg, hf_w, quantize=False)
    cfg, w, _ = load_gguf(tmp_path / "m.gguf")
    assert cfg.arch == "qwen3_moe" and cfg.qk_norm and cfg.norm_topk_prob
    assert [cfg.layer_is_moe(i) for i in range(3)] == [i not in mlp_only for i in range(3)]
    same = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "head_dim", "num_kv_heads", "vocab_size")
    assert [getattr(cfg, f) for f in same] == [getattr(hf_cfg, f) for f in same]
    assert set(w) == set(hf_w) and all(np.array_equal(w[k], hf_w[k]) for k in w)

    ids = np.random.default_rng(0).integers(0, 300, 40).tolist()

    def logits(c, weights):
        ex = NumpyExecutor(c, weights, num_blocks=16, block_size=8, max_batch=2, max_num_batched_tokens=64)
        return ex.forward_logits(PagedDriver(16, 8, 8).step([(0, ids)]), all_tokens=True)

    ours_gguf, ours_hf = logits(cfg, w), logits(hf_cfg, hf_w)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    assert np.linalg.norm(ours_gguf - ours_hf) / np.linalg.norm(ours_hf) < 1e-6  # only rms_eps's f32 rounding differs
    assert np.linalg.norm(ours_gguf - theirs) / np.linalg.norm(theirs) < 1e-5
    assert (ours_gguf.argmax(-1) == theirs.argmax(-1)).all()
    if not mlp_only:  # transformers' own GGUF reader (llama.cpp's layout, not ours) on the same file
        (tmp_path / "m.gguf").rename(tmp_path / "hf" / "m.gguf")
        cls = transformers.Qwen3MoeForCausalLM
        # its qwen3moe key map lacks expert_feed_forward_length: the shapes come from the config
        gguf_model = cls.from_pretrained(tmp_path / "hf", gguf_file="m.gguf", config=hf_config, dtype=torch.float32)
        with torch.no_grad():
            from_gguf = gguf_model.eval()(torch.tensor([ids])).logits[0].numpy()
        assert np.linalg.norm(ours_gguf - from_gguf) / np.linalg.norm(from_gguf) < 1e-5


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-phi3", "tiny-qwen3-moe"])
def test_gguf_bf16_tensors_are_the_rounded_float32_weights(tmp_path, name):
    """What the CUDA device uploads from a GGUF (gguf_bf16, one tensor dequantised at a time) is
    f32_to_bf16_bits of load_gguf's float32 dict (what it rounded on upload before): Q8_0, F16 and
    F32 tensors, llama's q/k row permutation, Phi-3's fused tensors, stacked experts."""
    from blink.models.bf16 import f32_to_bf16_bits
    from blink.models.gguf_weights import gguf_bf16
    from blink.models.registry import resolve_bf16

    config = preset(name).replace(tie_word_embeddings=False)
    write_gguf(tmp_path / "m.gguf", config, random_weights(config, seed=6))
    ref_config, ref, ref_meta = load_gguf(tmp_path / "m.gguf")
    got_config, tensors, meta = gguf_bf16(tmp_path / "m.gguf")
    got = {}
    for n, bits in tensors:
        assert n not in got and bits.dtype == np.uint16
        got[n] = np.array(bits)
    assert got_config == ref_config and meta == ref_meta and got.keys() == ref.keys()
    for n, w in ref.items():
        assert np.array_equal(got[n], f32_to_bf16_bits(w)), n
    cfg2, _ = resolve_bf16(tmp_path / "m.gguf")
    assert cfg2 == resolve_model(tmp_path / "m.gguf").config


def test_gguf_bf16_holds_one_tensor_at_a_time(tmp_path):
    """GGUF: dequantising per tensor straight into bf16 peaks at a few float32 copies
    of the largest tensor (gguf's numpy dequantize keeps several temporaries: ~6 measured here);
    load_gguf's float32 dict holds the whole model."""
    import tracemalloc

    from blink.models.gguf_weights import gguf_bf16
    from blink.models.weights import weight_shapes

    config = preset("tiny-qwen3").replace(num_layers=12)
    write_gguf(tmp_path / "m.gguf", config, random_weights(config))
    sizes = [int(np.prod(s)) for s in weight_shapes(config).values()]
    largest, model = 4 * max(sizes), 4 * sum(sizes)
    assert model > 12 * largest
    peaks = []
    for load in (lambda p: sum(1 for _ in gguf_bf16(p)[1]), load_gguf):  # the stream consumed as the upload does
        tracemalloc.start()
        try:
            load(tmp_path / "m.gguf")
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[0] <= 8 * largest < model <= peaks[1]
