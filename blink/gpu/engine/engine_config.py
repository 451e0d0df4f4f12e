"""EngineConfig: the CUDA engine's settings (buckets, KV pool, GEMM back ends), parsed and checked
once. Why each default is what it is: docs/decisions.md, section Engine."""

from __future__ import annotations

from dataclasses import dataclass

from blink.gpu.engine.fp8_weights import FP8_GEMV_CONFIGS, FP8_LARGE_PATHS, FP8_MMA_MAX_TOKENS, FP8_MMA_MIN_TOKENS
from blink.models.fp8 import FP8_GEMV_MAX_TOKENS, FP8_LM_HEAD

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class EngineConfig:
    max_seqs: int = 256
    """Sequences per step (largest batch bucket)."""
    max_num_batched_tokens: int = 4096
    """Packed tokens per step (largest token bucket); >= max_seqs."""
    block_size: int = 16
    """Tokens per KV block."""
    max_context: int = 4096
    """Longest sequence (prompt + output); capped by the model's max_position."""
    kv_fraction: float = 0.85
    """Share of the free GPU memory (after weights, buffers and graphs' reserve) given to the KV pool."""
    num_kv_blocks: int = 0
    """Explicit KV pool size in blocks; 0 = from kv_fraction."""
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    token_buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS
    execs_per_shape: int = 2
    gemv_max_tokens: int = 1
    """Decode buckets up to this size (1, 2, 4, 8) use the weight-streaming GEMV instead of cuBLAS
    (with its fusions: forward.py's docstring). At 8 tokens the GEMV is issue-bound (fp32 FMAs on
    CUDA cores) and cuBLAS's tensor-core kernels win."""
    quantization: str = ""
    """Weight format: "fp8" = the dense layers' projections (qkv, o, gate_up, down) in FP8 e4m3 with per-output-channel
    scales, quantized on the GPU at load (blink/gpu/engine/fp8_weights.py); "" = bf16."""
    kv_cache_dtype: str = "auto"
    """The paged KV cache's element type (vLLM's --kv-cache-dtype): "auto" = the model dtype (bf16); "fp8" =
    float8 e4m3 with a per-tensor scale of 1 (values stored directly, saturating to +-448; kv_cache.cuh,
    the definition blink/models/fp8.py kv_round), half the bytes a block, so twice the blocks in the same
    memory."""
    fp8_gemv_max_tokens: int = FP8_GEMV_MAX_TOKENS
    """FP8 weights: decode steps up to this many tokens (at most FP8_MMA_MAX_TOKENS) are weight-only (fp8.cu,
    bf16 activations: the FP8 GEMV, from FP8_MMA_MIN_TOKENS tokens the tensor-core kernel), every other step
    the path of fp8_gemm. The numpy definition quantizes activations in the same steps
    (blink.models.fp8.uses_w8a8, FP8_GEMV_MAX_TOKENS: the default here)."""
    fp8_lm_head: bool = FP8_LM_HEAD
    """FP8 weights: the LM head in FP8 too (per vocabulary row, weight-only in every step, fp32 logits; a tied
    head gets an FP8 copy of the embedding, which stays bf16 for the lookup). Default: the numpy definition's
    (blink.models.fp8.FP8_LM_HEAD), which the emulated device follows; docs/decisions.md."""
    fp8_mma_min_tokens: int = FP8_MMA_MIN_TOKENS
    """FP8 weights: weight-only decode steps of at least this many tokens run the tensor-core kernel (unfused),
    fewer the FP8 GEMV with its fusions (fp8_weights.FP8_MMA_MIN_TOKENS; 1 = the tensor-core kernel everywhere,
    FP8_MMA_MAX_TOKENS + 1 = never). Speed only: both compute the definition's weight-only step."""
    fp8_gemv_config: tuple[tuple[int, tuple], ...] = ()
    """FP8 weights: (bucket, configuration) pairs overriding the FP8 GEMV's configuration of those buckets
    (fp8_weights.FP8_GEMV_CONFIG, one of FP8_GEMV_CONFIGS: e.g. ((1, (2, 4, "p")),) the pipelined weight
    loop at one token). Speed only: every configuration sums in the same order (the same bits)."""
    fp8_gemm: str = "auto"
    """FP8 weights, steps past the GEMV (fp8_gemv_max_tokens): "outer" = activations quantized per token
    and the W8A8 cuBLASLt GEMM applying the per-token x per-channel scales itself (outer-vector
    scaling, bf16 out); "epilogue" = the same GEMM with fp32 sums scaled by fp8_scale_rows; "dequant" =
    weight-only, each projection dequantized to bf16 before the bf16 GEMM (5 bytes moved a weight);
    "auto" = both W8A8 modes where this GPU's cuBLASLt supports them, each GEMM taking one by its shape
    (blink.gpu.engine.fp8_gemm.fp8_gemm_mode: "outer" from 128 rows and 256 x 6144 outputs), else
    "dequant" (measured: `python -m bench.kernels.fp8_gemm_graphs`; docs/decisions.md)."""
    fp8_fast_accum: bool = False
    """W8A8 GEMMs with cuBLASLt's FAST_ACCUM (the FP8 tensor cores' partial sums never promoted to fp32
    registers): 5-10 % faster from 1024 rows on the H200, with about 1.5x the GEMM's error against the
    fp32-sum definition (bench.kernels.fp8_gemm_graphs); off: the definition's fp32 sums."""
    pdl: bool = True
    """Programmatic dependent launch of the decode GEMVs (common.cuh): each may start while the kernel before
    it in its graph finishes, loading its first weights before it waits for that kernel's output. On GPUs
    of compute capability 9.0 and later; where a device-launched graph cannot hold it, the engine captures
    without it and says so. Speed only: the same kernels, the same bits (docs/decisions.md)."""
    gemm_sm_reserve: int = 1
    """SMs the cuBLAS GEMMs leave free (cublasSetSmCountTarget: they are sized for the others). The
    GPU-resident scheduler's block holds one SM for as long as it runs, steps included; a GEMM
    sized for every SM then needs a second, nearly empty wave of tiles."""
    workspace_mib: int = 64
    graph_reserve_mib: int = 2048
    """Memory kept free for graph execs and cuBLAS when sizing the KV pool."""
    seed: int = 0
    """Seed of random weights."""
    sampling_rows: int = 0
    """Rows of the sampling extensions' device tables (penalty state, logit_bias), one per ring slot
    (the ring's n_slots); 0: the extensions are off (the device does not advertise them). Costs
    sampling_rows * (4 * vocab + 8 * MAX_LOGIT_BIAS) bytes, plus a processed-logits buffer of max_seqs rows."""
    progress: bool = True

    def __post_init__(self) -> None:
        if self.execs_per_shape < 2:
            raise ValueError("execs_per_shape must be >= 2 (an exec cannot be relaunched right after it completes)")
        if not 0.0 < self.kv_fraction <= 0.95:
            raise ValueError("kv_fraction must be in (0, 0.95]")
        if self.max_num_batched_tokens < self.max_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_seqs")
        if not 0 <= self.gemm_sm_reserve <= 8:
            raise ValueError("gemm_sm_reserve must be in [0, 8]")
        if self.max_context % self.block_size:
            raise ValueError("max_context must be a multiple of block_size")
        if self.quantization not in ("", "fp8"):
            raise ValueError(f"quantization {self.quantization!r} not in ('', 'fp8')")
        if self.fp8_gemm not in ("auto", *FP8_LARGE_PATHS):
            raise ValueError(f"fp8_gemm {self.fp8_gemm!r} not in {('auto', *FP8_LARGE_PATHS)}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} not in ('auto', 'fp8')")
        if not 1 <= self.fp8_gemv_max_tokens <= FP8_MMA_MAX_TOKENS:
            raise ValueError(f"fp8_gemv_max_tokens must be in [1, {FP8_MMA_MAX_TOKENS}]")
        for nt, cfg in self.fp8_gemv_config:
            if tuple(cfg) not in FP8_GEMV_CONFIGS.get(nt, ()):
                raise ValueError(
                    f"fp8_gemv_config: {cfg} is no compiled configuration of bucket {nt} ({FP8_GEMV_CONFIGS})"
                )
        if not 1 <= self.fp8_mma_min_tokens <= FP8_MMA_MAX_TOKENS + 1:
            raise ValueError(f"fp8_mma_min_tokens must be in [1, {FP8_MMA_MAX_TOKENS + 1}]")
        if not 0 <= self.sampling_rows <= 1 << 16:
            raise ValueError("sampling_rows must be in [0, 65536]")
