"""FP8 linear-layer weights on the GPU (`--quantization fp8`; the definition: blink.models.fp8).

A quantized projection is an `Fp8Linear`: codes (out, in) uint8 e4m3 bit patterns and scales (out,)
float32, per output channel. The fused projections (qkv, gate_up) are one Fp8Linear each whose row
slices are the checkpoint's tensors (the scales are per row, so fusing changes nothing). A MoE layer's
experts are one Fp8Linear each for gate_up and down, stacked: codes (E, out, in), scales (E, out).

Loading streams: each bf16 tensor the loader yields is copied into one staging buffer (the size of
the largest quantized tensor) and quantized on the GPU into its rows of codes and scales, allocated
up front (fp8_quantize_rows in engine/csrc/fp8.cu: the numpy definition's arithmetic, so the same bits).
The host holds one bf16 tensor at a time, the device the FP8 model plus one bf16 tensor.
The staging copy and the kernel run on the legacy default stream, in order: a tensor's copy waits
for the previous tensor's kernel, so one buffer serves them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blink.gpu.toolchain.cuda_api import Driver
from blink.gpu.toolchain.kernels import Kernels
from blink.models.config import ModelConfig

FP8_GEMV_BUCKETS = (1, 2, 4, 8)
# The FP8 GEMV's compiled configurations per bucket, (R, U): R weight rows a warp, U 512-byte stretches
# of each row loaded into registers before the first is used (GEMV_FP8(NT, R, U) in fp8.cu, which must list
# the same); (R, S, "p"): the pipelined weight loop, a shared-memory ring of S stretches of each row kept
# loading by cp.async while the warp computes (GEMV_FP8_PIPE(NT, R, S)). All sum in the same order.
FP8_GEMV_CONFIGS: dict[int, tuple[tuple, ...]] = {
    1: ((1, 8), (1, 4), (2, 4), (2, 4, "p"), (1, 8, "p")),
    2: ((2, 4), (4, 2), (2, 4, "p")),
    4: ((2, 4), (4, 2)),
    8: ((2, 2), (4, 2)),
}
# The engine's configuration per bucket, one of FP8_GEMV_CONFIGS (bench.kernels.fp8_gemv times them all;
# docs/decisions.md): every configuration sums in the same order, so this changes speed, never a bit.
FP8_GEMV_CONFIG: dict[int, tuple] = {1: (2, 4, "p"), 2: (2, 4, "p"), 4: (2, 4), 8: (2, 2)}
# Weight-only FP8 on tensor cores (gemv_fp8_mma_m<MT>_n<NT8> in fp8.cu: 16 MT weight rows a CTA, 8 NT8
# token columns): decode steps of FP8_MMA_MIN_TOKENS tokens or more (up to EngineConfig.fp8_gemv_max_tokens,
# at most FP8_MMA_MAX_TOKENS) run it instead of the GEMV (one launch, no fusions; the GEMV's fp32 FMAs
# are issue-bound from about 8 tokens). FP8_MMA_COMPILED: the MT compiled for each NT8.
FP8_MMA_COMPILED = {1: (1, 2, 4), 2: (1, 2), 4: (1, 2)}
FP8_MMA_ROWS = 1  # the engine's MT: the most CTAs (N / 16) for the narrow projections
FP8_MMA_MIN_TOKENS = 2
FP8_MMA_MAX_TOKENS = 32
# The FP8 LM head (EngineConfig.fp8_lm_head; weight-only in every step, fp32 logits): the plain GEMV's
# f32 kernels below FP8_MMA_MIN_TOKENS rows, the tensor-core kernel's up to FP8_MMA_MAX_TOKENS, and past
# that FP8_HEAD_CHUNK_ROWS vocabulary rows at a time dequantized to bf16 (fp8_dequant_rows) before the bf16
# GEMM writes their logits (a chunk small enough to stay in L2 between the two).
FP8_HEAD_CHUNK_ROWS = 4096
FP8_PROJECTIONS = ("qkv", "o", "gate_up", "down")  # LayerWeights fields that fp8 quantizes
FP8_EXPERTS = ("experts_gate_up", "experts_down")  # and in MoE layers, the stacked experts (E, out, in)
# Paths of FP8 projections past the GEMV (Forward.set_fp8_gemm; EngineConfig.fp8_gemm picks):
# the W8A8 cuBLASLt GEMM with outer-vector scales or with the scaling epilogue kernel, or weight-only
# dequantize + bf16 GEMM (where cuBLASLt has no FP8 GEMM).
FP8_LARGE_PATHS = ("outer", "epilogue", "dequant")
_LEGACY_STREAM = 0


def fp8_config_label(config: tuple) -> str:
    """A configuration's kernel-name suffix: r<R>u<U>, or r<R>p<S> for the pipelined loop."""
    return f"r{config[0]}{'p' if len(config) > 2 else 'u'}{config[1]}"


def fp8_gemv_name(nt: int, kind: str = "", config: tuple | None = None) -> str:
    """The FP8 GEMV kernel of bucket nt: plain (kind ""), fused (kind as the bf16 GEMV's fused kernels: norm,
    norm_swiglu, swiglu, resid, rope, norm_rope) or "f32" (fp32 logits: the LM head), in `config` (default
    FP8_GEMV_CONFIG)."""
    config = tuple(config or FP8_GEMV_CONFIG[nt])
    if config not in FP8_GEMV_CONFIGS[nt]:
        raise ValueError(f"fp8 GEMV t{nt} has no compiled configuration {config}: {FP8_GEMV_CONFIGS[nt]}")
    return f"gemv_fp8{'_' + kind if kind else ''}_t{nt}_{fp8_config_label(config)}"


def fp8_gemv_grid(n_out: int, nt: int, kind: str = "", config: tuple | None = None) -> int:
    """CTAs (of 256 threads) of fp8_gemv_name(nt, kind, config) over n_out output rows: 8 warps of R rows,
    or for the pair kernels (swiglu, rope) 4 warps of R pairs."""
    r = (config or FP8_GEMV_CONFIG[nt])[0]
    if kind.endswith(("swiglu", "rope")):
        return -(-(n_out // 2) // (4 * r))
    return -(-n_out // (8 * r))


def fp8_mma_name(tokens: int, rows: int | None = None, f32: bool = False) -> str:
    """The tensor-core FP8 kernel for `tokens` tokens (the fewest 8-token tiles that hold them), with
    `rows` = MT (default FP8_MMA_ROWS); `f32`: its fp32-output twin (the LM head's logits)."""
    if not 1 <= tokens <= FP8_MMA_MAX_TOKENS:
        raise ValueError(f"fp8 mma kernel: {tokens} tokens not in [1, {FP8_MMA_MAX_TOKENS}]")
    nt8 = next(n for n in sorted(FP8_MMA_COMPILED) if 8 * n >= tokens)
    mt = rows or FP8_MMA_ROWS
    if mt not in FP8_MMA_COMPILED[nt8]:
        raise ValueError(f"fp8 mma kernel: no MT {mt} compiled for {8 * nt8} tokens: {FP8_MMA_COMPILED[nt8]}")
    return f"gemv_fp8_mma{'_f32' if f32 else ''}_m{mt}_n{nt8}"


def fp8_mma_grid(n_out: int, rows: int | None = None) -> int:
    """CTAs (of 256 threads) of the tensor-core FP8 kernel: 16 MT output rows each."""
    return -(-n_out // (16 * (rows or FP8_MMA_ROWS)))


def fp8_gemv_pieces(rows: int) -> list[tuple[int, int]]:
    """(first row, bucket) of the plain GEMV launches over `rows` rows: the largest buckets first, a
    row count between buckets in pieces (6 = 4 + 2)."""
    out, r0 = [], 0
    for nt in sorted(FP8_GEMV_BUCKETS, reverse=True):
        while rows - r0 >= nt:
            out.append((r0, nt))
            r0 += nt
    return out


@dataclass
class Fp8Linear:
    codes: object  # (out, in) uint8 CuPy array: e4m3fn bit patterns; experts: (E, out, in)
    scales: object  # (out,) float32 CuPy array: W[n, k] ~ scales[n] * e4m3(codes[n, k]); experts: (E, out)

    @classmethod
    def empty(cls, shape: tuple[int, ...]) -> Fp8Linear:
        import cupy as cp

        if shape[-1] % 16:
            raise ValueError(f"fp8 weights need an input size that is a multiple of 16, got {shape}")
        return cls(cp.empty(shape, dtype=cp.uint8), cp.empty(shape[:-1], dtype=cp.float32))

    def rows(self) -> Fp8Linear:
        """The weight as one (rows, in) matrix of views (stacked experts: (E * out, in))."""
        k = self.shape[-1]
        return Fp8Linear(self.codes.reshape(-1, k), self.scales.reshape(-1))  # type: ignore[attr-defined]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)  # type: ignore[attr-defined]

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes) + int(self.scales.nbytes)  # type: ignore[attr-defined]

    def __getitem__(self, rows: slice | int | tuple) -> Fp8Linear:
        """The rows `rows` (a slice; stacked experts: an expert, or (expert, slice)) as an Fp8Linear of
        views: a fused projection's pieces."""
        return Fp8Linear(self.codes[rows], self.scales[rows])  # type: ignore[index]


def quantize_rows(driver: Driver, kernels: Kernels, stream: int, src: object, dst: Fp8Linear) -> None:
    """Launch fp8_quantize_rows: the bf16 rows of `src` (a CuPy uint16 array or pointer, dst.shape)
    into dst's codes and scales."""
    n, k = dst.shape
    args = kernels.args("fp8_quantize_rows", {"W": src, "codes": dst.codes, "scales": dst.scales, "N": n, "K": k})
    driver.launch(kernels["fp8_quantize_rows"], (n, 1, 1), (256, 1, 1), args, stream, name="fp8_quantize_rows")


class Fp8Loader:
    """Quantizes bf16 tensors into preallocated Fp8Linear rows through one staging buffer."""

    def __init__(self, driver: Driver, kernels: Kernels, max_elems: int) -> None:
        import cupy as cp

        self.driver, self.kernels = driver, kernels
        self.stage = cp.empty(max_elems, dtype=cp.uint16)

    def put(self, dst: Fp8Linear, bits: np.ndarray) -> None:
        """bits (uint16 bf16, dst.shape) -> dst, quantized on the GPU; a tensor larger than the staging
        buffer (the LM head) in pieces of whole rows."""
        n, k = dst.shape
        if bits.dtype != np.uint16 or bits.shape != (n, k):
            raise ValueError(f"fp8 load: {bits.dtype} {bits.shape}, expected uint16 {(n, k)}")
        step = max(1, int(self.stage.size) // k)  # type: ignore[attr-defined]
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            stage = self.stage[: (r1 - r0) * k]  # type: ignore[index]
            stage.set(np.ascontiguousarray(bits[r0:r1]).reshape(-1))  # on the legacy stream: after the last kernel
            quantize_rows(self.driver, self.kernels, _LEGACY_STREAM, stage, dst[r0:r1])


def quantize_head(weights: object, driver: Driver, kernels: Kernels) -> None:
    """The LM head of `weights` (GpuWeights, bf16) as an Fp8Linear (EngineConfig.fp8_lm_head): a tied head
    gets its own FP8 copy (the bf16 table stays for the lookup), an untied one is replaced (its bf16 array
    freed once the kernel ran: the legacy stream's order, as quantize_layers). The caller synchronizes."""
    head = weights.lm_head  # type: ignore[attr-defined]
    q = Fp8Linear.empty(tuple(head.shape))
    quantize_rows(driver, kernels, _LEGACY_STREAM, head, q)
    weights.lm_head = q  # type: ignore[attr-defined]


def quantize_layers(layers: list, driver: Driver, kernels: Kernels) -> None:
    """Replace each layer's bf16 projections (FP8_PROJECTIONS, and a MoE layer's FP8_EXPERTS, row by
    row) by their FP8 quantization, one at a time (random weights made on the GPU). On the legacy
    stream: a bf16 array freed here is reused by CuPy only for work queued after the kernel that reads
    it. The caller synchronizes."""
    for lw in layers:
        for name in (*FP8_PROJECTIONS, *FP8_EXPERTS):
            w = getattr(lw, name)
            if w is not None:
                q = Fp8Linear.empty(tuple(w.shape))
                quantize_rows(driver, kernels, _LEGACY_STREAM, w, q.rows())
                setattr(lw, name, q)


def fp8_scratch_elems(c: ModelConfig) -> int:
    """Elements of the largest projection of a dense model (Forward.fp8_scratch)."""
    qkv = c.q_size + 2 * c.kv_size
    return max(qkv * c.hidden_size, c.hidden_size * c.q_size, 2 * c.intermediate_size * c.hidden_size)


def fp8_max_outputs(c: ModelConfig) -> int:
    """Outputs of the widest projection of a dense model (rows of Forward.fp8_d32)."""
    return max(c.q_size + 2 * c.kv_size, c.hidden_size, 2 * c.intermediate_size)


def fp8_head_scratch_elems(c: ModelConfig, max_seqs: int) -> int:
    """bf16 elements of the FP8 LM head's dequantized chunk (Forward.fp8_head_scratch): none unless a
    step can have more rows than the tensor-core kernel takes."""
    return FP8_HEAD_CHUNK_ROWS * c.hidden_size if max_seqs > FP8_MMA_MAX_TOKENS else 0


def fp8_activation_bytes(c: ModelConfig, max_tokens: int, path: str) -> int:
    """Device bytes of the FP8 path's buffers (Forward.set_fp8_gemm) at max_tokens rows."""
    if path == "dequant":
        return 2 * fp8_scratch_elems(c)
    nbytes = max_tokens * (max(c.hidden_size, c.q_size, c.intermediate_size) + 4)
    return nbytes + (4 * max_tokens * fp8_max_outputs(c) if path == "epilogue" else 0)
