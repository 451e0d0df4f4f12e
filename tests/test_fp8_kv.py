"""The FP8 KV cache (--kv-cache-dtype fp8): the definition (blink.models.fp8.kv_round: e4m3, scale 1,
saturating), the numpy model storing K/V that way, and the flag from the command line to both devices."""

from __future__ import annotations

import numpy as np
import pytest

from blink import cli
from blink import config as C
from blink.models import fp8
from blink.models.config import preset
from blink.models.llama_numpy import LlamaNumpy
from blink.models.weights import random_weights

FINITE = fp8.E4M3_VALUES[~np.isnan(fp8.E4M3_VALUES)]


def test_kv_round_keeps_e4m3_values_and_rounds_the_rest_to_nearest_even():
    assert fp8.KV_SCALE == 1.0
    assert np.array_equal(fp8.kv_round(FINITE), FINITE)
    assert fp8.kv_round(np.float32(1.0625)) == 1.0  # tie of 1.0 (even) and 1.125
    assert fp8.kv_round(np.float32(1.1)) == 1.125
    assert fp8.kv_round(np.float32(-3.3)) == -3.25
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 8
    r = fp8.kv_round(x)
    assert np.array_equal(fp8.kv_round(r), r)  # idempotent: a stored value reads back unchanged
    assert np.all(np.abs(r - x) <= np.abs(x) / 16 + 2.0**-10)  # half an ulp of 3 mantissa bits (or subnormal)


def test_kv_round_saturates_to_448():
    got = fp8.kv_round(np.array([448.0, 464.0, 1000.0, -1e6, np.float32(3e38)], np.float32))
    assert got.tolist() == [448.0, 448.0, 448.0, -448.0, 448.0]
    assert np.isnan(fp8.kv_round(np.float32(np.nan)))


def _step(model: LlamaNumpy, T: int = 12) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    c = model.config
    ids = np.random.default_rng(0).integers(0, c.vocab_size, T)
    kc = np.zeros(model.kv_cache_shape(4, 8), np.float32)
    vc = np.zeros_like(kc)
    logits = model.forward(ids, np.arange(T), np.array([0, T]), np.array([[0, 1, 2, 3]]), kc, vc)
    return logits, kc, vc


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe"])
def test_fp8_kv_model_stores_e4m3_values_and_stays_close(name):
    c = preset(name)
    w = random_weights(c, seed=3)
    a, kc_a, _ = _step(LlamaNumpy(c, w))
    b, kc_b, vc_b = _step(LlamaNumpy(c, w, kv_cache_dtype="fp8"))
    assert np.array_equal(fp8.kv_round(kc_b), kc_b) and np.array_equal(fp8.kv_round(vc_b), vc_b)
    assert not np.array_equal(kc_a, kc_b)  # it does round
    assert np.array_equal(kc_b[0], fp8.kv_round(kc_a[0]))  # layer 0's K: the bf16 model's, rounded
    cos = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    assert 0.98 < cos < 1.0  # random weights: closeness, not accuracy


def test_unknown_kv_cache_dtype_is_refused():
    c = preset("tiny-llama")
    with pytest.raises(ValueError, match="fp8_e5m2"):
        LlamaNumpy(c, random_weights(c), kv_cache_dtype="fp8_e5m2")
    with pytest.raises(C.ConfigError, match="device.kv_cache_dtype"):
        C.DeviceConfig(kv_cache_dtype="fp8_e5m2")
    from blink.protocol.wire import DeviceSpec

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        DeviceSpec(
            ring="r", kind="emulated", model="m", scheduler="gpu", max_batch=1, max_num_batched_tokens=1, kv_block_size=1,
            num_kv_blocks=0, kv_cache_fraction=0.5, max_context=0, kv_cache_dtype="int8",
        )  # fmt: skip


def test_kv_cache_dtype_flag_reaches_both_devices():
    from blink.device.emulated import build_executor
    from blink.gpu.serve import engine_config
    from blink.launch import device_spec

    args = cli.build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8", "--device", "emulated"])
    cfg = cli.config_from_args(args)
    assert cfg.device.kv_cache_dtype == "fp8"
    spec = device_spec(cfg.replace(model={"spec": "random:tiny-llama"}), "r")
    assert spec.kv_cache_dtype == "fp8"
    assert build_executor(spec).model.kv_cache_dtype == "fp8"
    assert device_spec(C.BlinkConfig().replace(device={"kind": "emulated"}), "r").kv_cache_dtype == "auto"
    cuda = device_spec(cfg.replace(device={"kind": "cuda"}), "r")
    assert engine_config(cuda, 4096).kv_cache_dtype == "fp8"
    assert (
        engine_config(device_spec(C.BlinkConfig().replace(device={"kind": "cuda"}), "r"), 4096).kv_cache_dtype == "auto"
    )


def test_engine_config_takes_auto_or_fp8():
    from blink.gpu.engine.engine_config import EngineConfig

    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")


def test_fp8_kv_pool_holds_twice_the_blocks_per_byte():
    from blink.gpu.engine.forward import kv_element_bytes

    assert kv_element_bytes("auto") == 2 and kv_element_bytes("fp8") == 1


def test_smollm2_fp8_kv_greedy_agrees_with_the_bf16_cache():
    """Real weights (the default SmolLM2-135M-Instruct GGUF), numpy model: 4 chat prompts x 16 greedy tokens
    with the bf16-valued cache, then the fp8-KV model scoring that continuation (teacher-forced)."""
    from bench.engine.fp8_accuracy import greedy, prompts, teacher_forced
    from blink.models.registry import resolve_model

    b = resolve_model("default")
    w = {k: fp8.as_device_weight(v) for k, v in b.weights.items()}
    base, q = LlamaNumpy(b.config, w), LlamaNumpy(b.config, w, kv_cache_dtype="fp8")
    ps = prompts(b.tokenizer, 4)
    ref, ref_lp = greedy(base, ps, 16)
    got, _ = greedy(q, ps, 16)
    tf_arg, tf_lp = teacher_forced(q, ps, ref)
    agree, tf_agree = float((ref == got).mean()), float((tf_arg == ref).mean())
    print(f"SmolLM2 fp8 KV: free-running {agree:.3f}, teacher-forced {tf_agree:.3f}")
    assert tf_agree >= 0.9, tf_agree
    assert float(np.abs(tf_lp - ref_lp).mean()) < 0.1


def test_the_cuda_device_says_which_kv_cache_it_holds():
    """The CUDA device's start-up line names the KV element type and counts its bytes (it said bf16 and
    two bytes an element for an fp8 cache)."""
    from blink.gpu.serve import kv_cache_line
    from blink.models.config import preset

    cfg = preset("llama3-8b")  # 32 layers x 8 KV heads x 128: 128 KiB a token in bf16
    assert kv_cache_line(cfg, 8192, 16, "auto") == "KV cache: 8192 blocks of 16 tokens, 16.00 GiB (bf16)"
    assert kv_cache_line(cfg, 8192, 16, "fp8") == "KV cache: 8192 blocks of 16 tokens, 8.00 GiB (fp8 e4m3)"
