"""The FP8 LM head (--quantization fp8, blink.models.fp8.FP8_LM_HEAD): the numpy definition (per vocabulary
row like a projection, weight-only in every step, a tied embedding kept in bf16 for the lookup), the CUDA
engine's launches for it (no GPU: Forward with stand-in buffers, arguments checked against the kernels'
signatures), the streaming loader's pieces and the engine's knobs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_gpu_fusion_plan import _Arr, _forward, _fp8, signatures  # noqa: F401 (the fixture)

from blink.gpu.engine.engine_config import EngineConfig
from blink.gpu.engine.fp8_weights import (
    FP8_HEAD_CHUNK_ROWS,
    FP8_MMA_MAX_TOKENS,
    FP8_MMA_MIN_TOKENS,
    Fp8Linear,
    Fp8Loader,
    fp8_gemv_grid,
    fp8_gemv_name,
    fp8_head_scratch_elems,
    fp8_mma_grid,
    fp8_mma_name,
)
from blink.models import fp8
from blink.models.bf16 import f32_to_bf16_bits
from blink.models.config import preset
from blink.models.llama_numpy import LlamaNumpy
from blink.models.weights import random_weights


def _model(name: str, **kw) -> tuple[LlamaNumpy, dict]:
    cfg = preset(name)
    w = {k: fp8.as_device_weight(v) for k, v in random_weights(cfg, seed=3).items()}
    return LlamaNumpy(cfg, w, **kw), w


@pytest.mark.parametrize("name", ["tiny-qwen3", "smollm2-135m"])
def test_numpy_fp8_head_is_the_per_row_quantized_head_and_the_lookup_stays_bf16(name: str):
    m, w = _model(name, quantization="fp8", fp8_lm_head=True)
    cfg = m.config
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    want = fp8.quantize(head).dequantize()
    np.testing.assert_array_equal(m.lm_head, want)
    assert not np.array_equal(m.lm_head, head)  # the quantization changed it
    np.testing.assert_array_equal(m.embed, w["model.embed_tokens.weight"])  # the lookup table untouched
    assert m.fp8_lm_head


def test_numpy_fp8_head_needs_fp8_weights_and_can_be_left_bf16():
    plain, w = _model("tiny-qwen3", fp8_lm_head=True)  # no quantization: nothing is FP8
    assert not plain.fp8_lm_head and np.array_equal(plain.lm_head, w["lm_head.weight"])
    off, _ = _model("tiny-qwen3", quantization="fp8", fp8_lm_head=False)
    assert not off.fp8_lm_head and np.array_equal(off.lm_head, w["lm_head.weight"])
    assert LlamaNumpy(preset("tiny-qwen3"), w, quantization="fp8").fp8_lm_head == fp8.FP8_LM_HEAD


def _step(m: LlamaNumpy, T: int) -> np.ndarray:
    """Logits of one prefill chunk of T tokens (T > FP8_GEMV_MAX_TOKENS: a W8A8 step)."""
    bs, nb = 16, -(-T // 16)
    kc = np.zeros(m.kv_cache_shape(nb, bs), np.float32)
    ids = np.arange(T) % m.config.vocab_size
    return m.forward(ids, np.arange(T), np.array([0, T]), np.arange(nb)[None], kc, kc.copy(), np.arange(T))


def test_numpy_fp8_head_is_weight_only_in_w8a8_steps():
    """In a W8A8 step the projections' inputs are quantized per token, the head's is not: the model with
    the FP8 head is the model with a bf16 head whose weights are the FP8 head's values, exactly."""
    on, _ = _model("tiny-llama", quantization="fp8", fp8_lm_head=True)
    off, _ = _model("tiny-llama", quantization="fp8", fp8_lm_head=False)
    T = fp8.FP8_GEMV_MAX_TOKENS + 4
    assert fp8.uses_w8a8(T, False)
    before = _step(off, T)
    off.lm_head = on.lm_head
    np.testing.assert_array_equal(_step(on, T), _step(off, T))
    assert np.abs(_step(on, T) - before).max() > 0  # the head's quantization shows in the logits


def _head(f, calls):
    """f with an FP8 LM head (stand-in arrays), as GpuWeights.empty(fp8_head=True)."""
    V, H = f.c.vocab_size, f.c.hidden_size
    f.w.lm_head = Fp8Linear(_Arr(V, H), _Arr(V))
    return f


@pytest.mark.parametrize("S", [1, 2, 3, 4, 8, 16, 32, 33, 256])
def test_fp8_head_launches_the_f32_kernels_by_row_count(S: int, signatures: dict):  # noqa: F811
    f, calls = _forward("llama3-8b", 8, "all", signatures, layers=1)
    f = _head(_fp8(f, "outer", calls), calls)
    V, H = f.c.vocab_size, f.c.hidden_size
    f.linear(f.last, f.w.lm_head, f.logits, S, 0, out_f32=True)
    names = [c[0] for c in calls]
    if S < FP8_MMA_MIN_TOKENS:  # the GEMV's f32 kernels in bucket pieces: 3 = 2 + 1
        pieces = {1: [1], 2: [2], 3: [2, 1]}[S]
        assert names == [fp8_gemv_name(nt, "f32") for nt in pieces]
        assert all(c[1] == (fp8_gemv_grid(V, nt), 1, 1) for c, nt in zip(calls, pieces, strict=True))
        if S == 3:  # the second piece's X and Y: 2 rows on (bf16 in, fp32 out)
            x, y = (lambda c, i: c[2][i].value), 3
            assert x(calls[1], 2) - x(calls[0], 2) == 2 * 2 * H and x(calls[1], y) - x(calls[0], y) == 2 * 4 * V
    elif S <= FP8_MMA_MAX_TOKENS:  # the tensor-core kernel's f32 twin, every row at once
        assert names == [fp8_mma_name(S, f32=True)] and calls[0][1] == (fp8_mma_grid(V), 1, 1)
        assert calls[0][2][-1].value == S
    else:  # chunks of vocabulary rows dequantized, each followed by the bf16 GEMM into its logit columns
        n = -(-V // FP8_HEAD_CHUNK_ROWS)
        assert names == ["fp8_dequant_rows", "cublas"] * n
        gemms = [c[2] for c in calls if c[0] == "cublas"]
        assert [g[3:] for g in gemms[:1]] == [(S, FP8_HEAD_CHUNK_ROWS, H, True, V)]  # rows, n, k, f32, ldy
        assert gemms[-1][4] == V - (n - 1) * FP8_HEAD_CHUNK_ROWS
        assert gemms[1][2] - gemms[0][2] == 4 * FP8_HEAD_CHUNK_ROWS  # the next chunk's logit columns
        deq = [c for c in calls if c[0] == "fp8_dequant_rows"]
        assert deq[0][1] == (1, FP8_HEAD_CHUNK_ROWS, 1)
        assert deq[1][2][0].value - deq[0][2][0].value == FP8_HEAD_CHUNK_ROWS * H  # the codes' next rows


def test_fp8_head_in_a_decode_step_and_in_prompt_logprobs(signatures: dict):  # noqa: F811
    f, calls = _forward("llama3-8b", 8, "all", signatures, layers=1)
    f = _head(_fp8(f, "outer", calls), calls)
    f.record(0, 1, 1, True)
    names = [c[0] for c in calls]
    assert fp8_gemv_name(1, "f32") in names and "gemv_f32_t1" not in names  # no bf16 head GEMV
    calls.clear()
    f.record(0, 1, 16, False)  # a prefill graph scores prompt tokens (sampling_rows set)
    names = [c[0] for c in calls]
    assert "plp_lm_head_fp8" in names and "plp_lm_head" not in names


def test_fp8_mma_min_tokens_moves_the_line_between_the_fused_gemv_and_the_tensor_core_kernel(
    signatures: dict,  # noqa: F811
):
    f, calls = _forward("llama3-8b", 8, "all", signatures, layers=1)
    f = _fp8(f, "outer", calls)
    f.fp8_decode = True  # record() sets it: a decode step
    assert f.fusions_for(1)  # the default: the fused GEMV at one token
    f.fp8_mma_min_tokens = 1
    assert not f.fusions_for(1)
    f.record(0, 1, 1, True)
    fp8_names = [c[0] for c in calls if c[0].startswith("gemv_fp8")]
    assert fp8_names == [fp8_mma_name(1)] * 4  # every projection on tensor cores, unfused
    with pytest.raises(ValueError):
        EngineConfig(fp8_mma_min_tokens=0)
    with pytest.raises(ValueError):
        EngineConfig(fp8_mma_min_tokens=FP8_MMA_MAX_TOKENS + 2)
    assert EngineConfig().fp8_mma_min_tokens == FP8_MMA_MIN_TOKENS and EngineConfig().fp8_lm_head == fp8.FP8_LM_HEAD


class _Stage:
    """A staging buffer stand-in: slices share the numpy storage, set() copies in."""

    def __init__(self, a: np.ndarray) -> None:
        self.a, self.size = a, a.size

    def __getitem__(self, s: slice) -> _Stage:
        return _Stage(self.a[s])

    def set(self, x: np.ndarray) -> None:
        self.a[...] = x


def test_loader_quantizes_a_tensor_larger_than_its_stage_in_pieces_of_rows():
    """The LM head is larger than the staging buffer (the largest projection): it goes through in whole
    rows, each piece into its rows of the codes, every row exactly once, in order."""
    n, k, stage_elems = 10, 16, 48  # 3 rows a piece: 3 + 3 + 3 + 1
    seen: list = []
    loader = object.__new__(Fp8Loader)
    loader.stage = _Stage(np.zeros(stage_elems, np.uint16))
    # args() hands the arguments on to the launch, which records them
    loader.kernels = type("K", (), {"args": lambda self, name, a: a, "__getitem__": lambda self, name: name})()
    loader.driver = SimpleNamespace(
        launch=lambda fn, grid, block, a, stream, name="": seen.append((a["W"].a.copy(), a["codes"], a["N"], grid))
    )
    bits = f32_to_bf16_bits(np.arange(n * k, dtype=np.float32).reshape(n, k))
    dst = Fp8Linear(np.zeros((n, k), np.uint8), np.zeros(n, np.float32))
    loader.put(dst, bits)
    assert [s[2] for s in seen] == [3, 3, 3, 1] and [s[3] for s in seen] == [(3, 1, 1)] * 3 + [(1, 1, 1)]
    np.testing.assert_array_equal(np.concatenate([s[0] for s in seen]), bits.reshape(-1))
    assert seen[1][1].base is dst.codes and seen[1][1].shape == (3, k)  # rows 3-5 of the destination
    with pytest.raises(ValueError):
        loader.put(dst, bits[:-1])


def test_head_scratch_only_where_a_step_has_more_rows_than_the_tensor_core_kernel():
    c = preset("llama3-8b")
    assert fp8_head_scratch_elems(c, FP8_MMA_MAX_TOKENS) == 0
    assert fp8_head_scratch_elems(c, 256) == FP8_HEAD_CHUNK_ROWS * c.hidden_size


def test_pipelined_gemv_configurations_are_selectable_per_bucket(signatures: dict):  # noqa: F811
    """EngineConfig.fp8_gemv_config / Forward.set_fp8_gemv_config: the pipelined weight loop (r<R>p<S>) is a
    compiled configuration of buckets 1 and 2, launched (fused kernels too) with its own grid; uncompiled
    ones are refused; the default is the pipelined loop (docs/decisions.md)."""
    from blink.gpu.engine.fp8_weights import FP8_GEMV_CONFIG, FP8_GEMV_CONFIGS, fp8_config_label

    assert (2, 4, "p") in FP8_GEMV_CONFIGS[1] and (1, 8, "p") in FP8_GEMV_CONFIGS[1]
    assert fp8_config_label((1, 8, "p")) == "r1p8" and fp8_config_label((2, 4)) == "r2u4"
    assert FP8_GEMV_CONFIG[1] == FP8_GEMV_CONFIG[2] == (2, 4, "p")
    f, calls = _forward("llama3-8b", 8, "all", signatures, layers=1)
    f = _fp8(f, "outer", calls)
    f.set_fp8_gemv_config({1: (1, 8, "p")})
    assert f.fp8_gemv_config[2] == FP8_GEMV_CONFIG[2]  # the other buckets keep theirs
    f.record(0, 1, 1, True)
    fp8_calls = [c for c in calls if c[0].startswith("gemv_fp8")]
    assert [c[0] for c in fp8_calls] == [
        f"gemv_fp8_{k}_t1_r1p8" for k in ("norm_rope", "resid", "norm_swiglu", "resid")
    ]
    H = f.c.hidden_size
    assert fp8_calls[1][1] == (fp8_gemv_grid(H, 1, "resid", (1, 8, "p")), 1, 1) == (H // 8, 1, 1)
    with pytest.raises(ValueError):
        f.set_fp8_gemv_config({4: (2, 4, "p")})
    with pytest.raises(ValueError):
        EngineConfig(fp8_gemv_config=((1, (3, 3)),))
    assert EngineConfig(fp8_gemv_config=((2, (2, 4, "p")),)).fp8_gemv_config == ((2, (2, 4, "p")),)


def test_fp8_lm_head_flag_reaches_both_devices():
    """`blink serve --quantization fp8 --fp8-lm-head`: the emulated device's numpy model and the CUDA engine's
    config both take the FP8 head; without the flag both keep the default (FP8_LM_HEAD)."""
    from blink import cli
    from blink import config as C
    from blink.device.emulated import build_executor
    from blink.gpu.serve import engine_config
    from blink.launch import device_spec

    argv = ["serve", "--quantization", "fp8", "--fp8-lm-head", "--device", "emulated"]
    cfg = cli.config_from_args(cli.build_parser().parse_args(argv))
    assert cfg.device.fp8_lm_head is True
    spec = device_spec(cfg.replace(model={"spec": "random:tiny-qwen3"}), "r")
    assert spec.fp8_lm_head and build_executor(spec).model.fp8_lm_head
    assert engine_config(device_spec(cfg.replace(device={"kind": "cuda"}), "r"), 4096).fp8_lm_head
    plain = C.BlinkConfig().replace(
        device={"kind": "emulated", "quantization": "fp8"}, model={"spec": "random:tiny-qwen3"}
    )
    spec = device_spec(plain, "r")
    assert spec.fp8_lm_head is None and build_executor(spec).model.fp8_lm_head == fp8.FP8_LM_HEAD
    assert engine_config(device_spec(plain.replace(device={"kind": "cuda"}), "r"), 4096).fp8_lm_head == fp8.FP8_LM_HEAD
    off = cli.config_from_args(cli.build_parser().parse_args(["serve", "--no-fp8-lm-head"]))
    assert off.device.fp8_lm_head is False
