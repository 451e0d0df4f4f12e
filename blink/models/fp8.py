"""FP8 (float8 e4m3, the "fn" variant of OCP FP8) weight quantization: the one definition that the
emulated device runs and the CUDA kernels are compared against.

e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7F/0xFF are NaN; the largest
finite value is 448 (0x7E), the smallest subnormal 2**-9. Byte layout as the hardware's
(`__nv_fp8_e4m3`, torch.float8_e4m3fn): a value is its bit pattern in a uint8.

A linear layer's weight W (out, in) is quantized per output channel (row), as vLLM's dynamic FP8:

    scale[n] = amax(|W[n, :]|) / 448            float32; a row of zeros gets scale 1
    code[n, k] = e4m3(W[n, k] / scale[n])       float32 division, round to nearest even, saturating to +-448

and y[t, n] = scale[n] * sum_k x[t, k] * value(code[n, k]): the scale factors out of the dot product, so a
kernel accumulates the decoded codes against the activations and multiplies once per output.

Which steps quantize activations depends on the step's size, as on the CUDA device:
  * decode steps (one token per sequence) of at most FP8_GEMV_MAX_TOKENS tokens are weight-only
    ("W8A16"): the FP8-weight GEMV (or, from 8 tokens, its tensor-core counterpart) reads the activations
    in the compute dtype;
  * every other step is W8A8, as vLLM's dynamic FP8: each projection's input rows are quantized per token
    with the weights' arithmetic (`quantize_activations`: xs[t] = amax(|x[t, :]|) / 448, codes e4m3 of
    x / xs[t]) and the GEMM runs on FP8 tensor cores,
        y[t, n] = xs[t] * scale[n] * sum_k value(xcode[t, k]) * value(code[n, k])     (fp32 sums)
    (`w8a8_linear`). Per-token quantization is row by row, so padding rows change nothing.
  * a MoE layer's experts are weight-only in every step (their inputs stay in the compute dtype): the
    CUDA engine's FP8 expert kernels (moe.cu's _fp8 variants) decode the codes beside bf16 activations.

The KV cache (--kv-cache-dtype fp8): every K and V value the attention writes is stored as
e4m3(x / KV_SCALE) and read back as KV_SCALE * value(code), with one per-tensor scale KV_SCALE = 1 (vLLM's
default without calibration: values stored directly, saturating to +-448); `kv_round` is what a
cache slot holds. Both devices apply it (LlamaNumpy, and the CUDA kernels of kv_cache.cuh, which convert
the bf16 K/V they computed with the same rounding).

The source of the quantization is the weight as a bf16 device holds it (`as_device_weight`,
`quantize_bf16`): the CUDA loader quantizes the bf16 bits it streams on the GPU with this arithmetic
(fp8_quantize_rows in blink/gpu/engine/csrc/fp8.cu), so the numpy model and the CUDA engine hold the same
codes and scales. Which layers: blink.models.llama_numpy (q/k/v/o, gate/up/down, the experts; not
the router or the embeddings).

The LM head (FP8_LM_HEAD): quantized per vocabulary row like a projection, and weight-only in every step
(its input, the final norm's output, stays in the compute dtype; logits are the fp32 sums times the
row's scale). A tied head keeps the bf16 embedding for the lookup and gets its own FP8 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blink.models.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

E4M3_MAX = 448.0
FP8_GEMV_MAX_TOKENS = 8  # steps up to this many tokens keep bf16 activations; larger ones are W8A8
QUANTIZATIONS = ("fp8",)  # --quantization values served; None/"" = the checkpoint's dtype
KV_CACHE_DTYPES = ("auto", "fp8")  # --kv-cache-dtype values served; "auto" = the model dtype
KV_SCALE = np.float32(1.0)  # the fp8 KV cache's per-tensor scale (docs/decisions.md)
# Whether --quantization fp8 also quantizes the LM head (per vocabulary row, as the projections; weight-only
# in every step). The default of both devices (LlamaNumpy, EngineConfig.fp8_lm_head); docs/decisions.md.
FP8_LM_HEAD = False


def _decode_table() -> np.ndarray:
    """float32 value of each of the 256 codes (NaN for 0x7F and 0xFF)."""
    c = np.arange(256, dtype=np.int32)
    exp, man = (c >> 3) & 0xF, (c & 7).astype(np.float32)
    mag = np.where(exp == 0, man * np.float32(2.0**-9), (1.0 + man / 8.0) * np.exp2(exp - 7.0)).astype(np.float32)
    mag[(c & 0x7F) == 0x7F] = np.nan
    return np.where(c >= 128, -mag, mag).astype(np.float32)


E4M3_VALUES = _decode_table()


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn codes (uint8): round to nearest even, saturate to +-448; NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    nan = np.isnan(x)
    a = np.where(nan, np.float32(0), np.minimum(np.abs(x), np.float32(E4M3_MAX)))
    # The quantum of a's binade [2**b, 2**(b+1)) is 2**(b - 3); below 2**-6 (subnormals, and the first
    # normal binade, which shares their quantum) it is 2**-9. frexp: a = m * 2**e, m in [0.5, 1), b = e - 1.
    _, e = np.frexp(a)
    q = np.where(a >= np.float32(2.0**-6), e - 4, -9)
    # n = a in quanta, rounded half to even (scaling by 2**-q is exact). A normal's code is
    # 8 * (b + 7) + (n - 8) = n + 8 * (q + 9), and the same formula gives n for q = -9; n = 16 (rounded
    # up into the next binade) lands on that binade's first code.
    n = np.rint(np.ldexp(a, -q)).astype(np.int32)
    code = (n + 8 * (q + 9)).astype(np.uint8)
    code |= np.where(np.signbit(x), np.uint8(0x80), np.uint8(0))
    return np.where(nan, np.uint8(0x7F), code)


def e4m3_decode(code: np.ndarray) -> np.ndarray:
    """e4m3fn codes (uint8) -> float32 values."""
    return E4M3_VALUES[np.asarray(code, dtype=np.uint8)]


@dataclass(frozen=True)
class Fp8Weight:
    """A linear layer's weight in FP8: codes (out, in) uint8 and scales (out,) float32."""

    codes: np.ndarray  # (out, in) uint8, e4m3fn bit patterns
    scales: np.ndarray  # (out,) float32: W[n, k] ~ scales[n] * value(codes[n, k])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def __getitem__(self, rows: slice) -> Fp8Weight:
        """Rows `rows` (a slice): a fused checkpoint tensor's pieces."""
        return Fp8Weight(self.codes[rows], self.scales[rows])

    def dequantize(self) -> np.ndarray:
        """(out, in) float32: scales[n] * value(codes[n, k])."""
        return e4m3_decode(self.codes) * self.scales[:, None]


def channel_scales(w: np.ndarray) -> np.ndarray:
    """Per-output-channel scales of w (out, in): amax of each row / 448, 1 for an all-zero row."""
    amax = np.max(np.abs(np.asarray(w, dtype=np.float32)), axis=-1)
    return np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)


def quantize(w: np.ndarray) -> Fp8Weight:
    """w (out, in) float -> Fp8Weight, per output channel."""
    w = np.asarray(w, dtype=np.float32)
    s = channel_scales(w)
    return Fp8Weight(e4m3_encode(w / s[:, None]), s)


def quantize_bf16(bits: np.ndarray) -> Fp8Weight:
    """A weight given as bf16 bits (uint16, out x in) -> Fp8Weight of its values."""
    return quantize(bf16_bits_to_f32(bits))


def as_device_weight(w: np.ndarray) -> np.ndarray:
    """The float32 values a bf16 device holds for w: the source every FP8 quantization starts from."""
    return bf16_bits_to_f32(f32_to_bf16_bits(w))


def quantize_activations(x: np.ndarray) -> Fp8Weight:
    """Per-token quantization of a projection's input x (tokens, in): the rows' codes and scales, with
    the weights' arithmetic (one scale per row). On the CUDA device the rows are bf16 values."""
    return quantize(x)


def fake_quantize_activations(x: np.ndarray) -> np.ndarray:
    """x (tokens, in) float32 -> the float32 values its per-token FP8 quantization stands for."""
    x = np.asarray(x, dtype=np.float32)
    return quantize(x.reshape(-1, x.shape[-1])).dequantize().reshape(x.shape)


def w8a8_linear(x: np.ndarray, w: Fp8Weight) -> np.ndarray:
    """y (tokens, out) float32 = the W8A8 GEMM of x (tokens, in) and w: x quantized per token, the
    codes' values multiplied and summed in fp32, then scaled by xs[t] * scale[n] (before any rounding
    to the output dtype)."""
    xq = quantize_activations(x)
    acc = e4m3_decode(xq.codes) @ e4m3_decode(w.codes).T
    return (acc * xq.scales[:, None]) * w.scales[None, :]


def uses_w8a8(tokens: int, decode: bool, gemv_max_tokens: int = FP8_GEMV_MAX_TOKENS) -> bool:
    """Whether a step of `tokens` tokens quantizes its activations (the FP8 GEMM) on the CUDA device:
    every step but a decode step (one token per sequence) of at most gemv_max_tokens tokens. (A
    prefill step of few tokens runs in a graph of at least 16 rows, on the GEMM.)"""
    return not (decode and tokens <= gemv_max_tokens)


def kv_round(x: np.ndarray) -> np.ndarray:
    """float32 K or V values -> the float32 values an fp8 KV cache slot holds (scale KV_SCALE, saturating)."""
    x = np.asarray(x, dtype=np.float32)
    return e4m3_decode(e4m3_encode(x / KV_SCALE)) * KV_SCALE
