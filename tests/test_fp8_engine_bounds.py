"""The bounds the GPU tests hold the FP8 engine to (tests/fp8_steps.py), on the CPU: numpy models stand
in for the engine over the same steps. The definition computed with the engine's bf16 activations must
pass each bound, and the defects a bound is there to catch must fail it: an (E, out) expert scales layout
read as (out, E), and experts left in bf16."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from fp8_steps import (
    NUMPY_KW,
    W8A8_REL_ERR,
    check_w8a8,
    check_weight_only_moe,
    compare,
    with_bf16_experts,
)

from blink.device.numpy_executor import NumpyExecutor
from blink.models import fp8
from blink.models.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from blink.models.config import preset
from blink.models.weights import random_weights


def _rbf(a: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(a, dtype=np.float32)))


@functools.cache
def _weights(name: str) -> dict[str, np.ndarray]:
    return {k: fp8.as_device_weight(v) for k, v in random_weights(preset(name), seed=5).items()}


def _fp8(name: str, weight_only: bool = False) -> NumpyExecutor:
    ex = NumpyExecutor(preset(name), _weights(name), quantization="fp8", **NUMPY_KW)
    if weight_only:
        ex.model.fp8_gemv_max_tokens = None
    return ex


def _bf16(name: str) -> NumpyExecutor:
    return NumpyExecutor(preset(name), _weights(name), **NUMPY_KW)


def _with_bf16_activations(ex: NumpyExecutor) -> NumpyExecutor:
    """The definition as the engine holds its activations: each linear layer's input (and a MoE layer's
    input and output) rounded to bf16 before any per-token quantization."""
    m = ex.model
    quantizer, moe = m._activation_quantizer, m._moe

    def activation_quantizer(T: int, decode: bool):
        q = quantizer(T, decode)
        return lambda a: q(_rbf(a))

    m._activation_quantizer = activation_quantizer
    m._moe = lambda h, layer: _rbf(moe(_rbf(h), layer))
    return ex


def _transposed_expert_scales(ex: NumpyExecutor) -> NumpyExecutor:
    """The experts' codes with their (E, out) scales read as an (out, E) array."""
    for layer in ex.model.layers:
        if layer.w_router is None:
            continue
        for field in ("w_gate_up", "w_down"):
            w = getattr(layer, field)
            E, n_out, k = w.shape
            q = fp8.quantize(w.reshape(-1, k))  # the values are FP8 already: the same codes and scales
            wrong = q.scales.reshape(E, n_out).T.reshape(-1)
            setattr(layer, field, (fp8.e4m3_decode(q.codes) * wrong[:, None]).reshape(w.shape))
    return ex


def _logits(ex: NumpyExecutor):
    return ex.forward_logits


MOE = "tiny-qwen3-moe"


def test_w8a8_max_bound_fails_a_moe_model_with_bf16_activations_alone():
    """The H200's failure of test_fp8_engine_matches_the_numpy_fp8_model[tiny-qwen3-moe] (max 0.40 over
    W8A8_REL_ERR) reproduced without a defect: the definition with bf16 activations exceeds the dense
    models' max bound on the MoE model (routers moved across near-ties), not on a dense one; the
    median bound holds it."""
    cfg = preset(MOE)
    errs, errs_bf16 = compare(_logits(_with_bf16_activations(_fp8(MOE))), cfg, [_fp8(MOE), _bf16(MOE)])
    print(f"{MOE}: max {max(errs):.3f}, median {np.median(errs):.3f}, vs bf16 mean {np.mean(errs_bf16):.3f}")
    assert max(errs) > W8A8_REL_ERR
    check_w8a8(cfg, errs, errs_bf16)
    dense = preset("tiny-llama")
    errs, errs_bf16 = compare(
        _logits(_with_bf16_activations(_fp8("tiny-llama"))), dense, [_fp8("tiny-llama"), _bf16("tiny-llama")]
    )
    print(f"tiny-llama: max {max(errs):.3f}")
    check_w8a8(dense, errs, errs_bf16)


def test_w8a8_median_bound_catches_transposed_expert_scales():
    cfg = preset(MOE)
    wrong = _transposed_expert_scales(_with_bf16_activations(_fp8(MOE)))
    errs, errs_bf16 = compare(_logits(wrong), cfg, [_fp8(MOE), _bf16(MOE)])
    print(f"transposed expert scales: median {np.median(errs):.3f}")
    with pytest.raises(AssertionError):
        check_w8a8(cfg, errs, errs_bf16)


@pytest.mark.parametrize("defect", [None, "bf16 experts", "transposed expert scales"])
def test_weight_only_moe_bound_passes_bf16_activations_and_catches_expert_defects(defect):
    cfg = preset(MOE)
    model = _with_bf16_activations(_fp8(MOE, weight_only=True))
    if defect == "bf16 experts":
        with_bf16_experts(model, _bf16(MOE))
    elif defect == "transposed expert scales":
        _transposed_expert_scales(model)
    refs = [_fp8(MOE, weight_only=True), with_bf16_experts(_fp8(MOE, weight_only=True), _bf16(MOE))]
    errs, errs_bf16_experts = compare(_logits(model), cfg, refs)
    print(f"{defect}: median {np.median(errs):.3f}, vs bf16 experts median {np.median(errs_bf16_experts):.3f}")
    if defect is None:
        check_weight_only_moe(errs, errs_bf16_experts)
    else:
        with pytest.raises(AssertionError):
            check_weight_only_moe(errs, errs_bf16_experts)
