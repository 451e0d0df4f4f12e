"""FP8 checkpoints (blink.models.fp8_checkpoint): tiny compressed-tensors (per channel, per tensor) and
quant_method fp8 checkpoints written here load with their stored scales on both loaders, run on the
emulated device as stored (not quantized again), and other quantized checkpoints are refused."""

from __future__ import annotations

import numpy as np
import pytest
from checkpoints import FP8_CONFIGS, write_fp8_hf_dir

from blink.models import fp8
from blink.models.checkpoint_config import from_hf_config
from blink.models.config import UnsupportedModelError, preset
from blink.models.hf_weights import hf_dir_bf16, load_hf_dir
from blink.models.llama_numpy import LlamaNumpy

LAYOUTS = tuple(FP8_CONFIGS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_both_loaders_give_the_stored_codes_and_scales(tmp_path, layout):
    c = preset("tiny-qwen2")  # biases, untied: every kind of tensor next to the FP8 ones
    values = write_fp8_hf_dir(tmp_path, c, layout)
    cfg, w = load_hf_dir(tmp_path)
    assert cfg.quantization == "fp8"
    assert w.keys() == values.keys()
    for name, v in values.items():
        np.testing.assert_array_equal(w[name], v, err_msg=name)
    _, tensors = hf_dir_bf16(tmp_path)
    n_fp8 = 0
    for name, t in tensors:
        if name.endswith("_proj.weight"):
            assert isinstance(t, fp8.Fp8Weight) and t.scales.shape == (t.shape[0],)
            np.testing.assert_array_equal(t.dequantize(), values[name], err_msg=name)
            n_fp8 += 1
        else:
            assert t.dtype == np.uint16
    assert n_fp8 == 7 * c.num_layers
    if layout != "channel":  # one scale a tensor, every row's
        t = dict(hf_dir_bf16(tmp_path)[1])["model.layers.0.self_attn.o_proj.weight"]
        assert len(set(t.scales.tolist())) == 1


def test_an_fp8_checkpoint_runs_as_stored_and_close_to_its_source(tmp_path):
    c = preset("tiny-llama")
    write_fp8_hf_dir(tmp_path, c, "channel", seed=3)
    cfg, w = load_hf_dir(tmp_path)
    stored, flagged = LlamaNumpy(cfg, w), LlamaNumpy(cfg, w, quantization="fp8")
    assert stored.quantization == flagged.quantization == "fp8"
    np.testing.assert_array_equal(stored.layers[0].w_qkv, flagged.layers[0].w_qkv)  # not quantized twice
    from blink.models.weights import random_weights

    src = LlamaNumpy(c, {k: fp8.as_device_weight(v) for k, v in random_weights(c, seed=3).items()})
    T = 10
    ids = np.random.default_rng(0).integers(0, c.vocab_size, T)
    outs = []
    for m in (src, stored):
        kc = np.zeros(m.kv_cache_shape(2, 8), np.float32)
        outs.append(m.forward(ids, np.arange(T), np.array([0, T]), np.array([[0, 1]]), kc, kc.copy()))
    a, b = outs
    assert 0.98 < float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) < 1.0


def test_an_fp8_tensor_needs_an_fp8_config(tmp_path):
    import json

    write_fp8_hf_dir(tmp_path, preset("tiny-llama"), "channel")
    d = json.loads((tmp_path / "config.json").read_text())
    del d["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(UnsupportedModelError, match="F8_E4M3"):
        load_hf_dir(tmp_path)


_HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
       "max_position_embeddings": 1024}  # fmt: skip
_CT_INT = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}}
_CT_BLOCK = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}},
}


@pytest.mark.parametrize(
    "q,match",
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
        (_CT_INT, "int-quantized"),
        (_CT_BLOCK, "strategy 'block'"),
        ({"quant_method": "awq", "bits": 4}, "'awq'.*--quantization fp8"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
    ],
)
def test_other_quantized_checkpoints_are_refused_with_the_reason(q, match):
    assert from_hf_config(_HF).quantization == ""
    for layout, good in FP8_CONFIGS.items():
        assert from_hf_config({**_HF, "quantization_config": good}).quantization == "fp8", layout
    with pytest.raises(UnsupportedModelError, match=match):
        from_hf_config({**_HF, "quantization_config": q})
