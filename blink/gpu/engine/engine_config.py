"""EngineConfig: the CUDA engine's settings (buckets, KV pool, kernel choices), parsed and checked
once, and the parsers of the benchmarks' kernel-choice flags."""

from __future__ import annotations

from dataclasses import dataclass

from blink.gpu.engine.attention_launch import DECODE_VARIANTS, PREFILL_VARIANTS
from blink.gpu.engine.forward import GEMV_FUSIONS

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# flashq was the fastest of flashq / basic at every batch 1..256 on the H200 (bench/results/archive/decode_h200_run5.json).
# flashmma (tensor cores) against flashq, Llama-3-8B, H200, attention launches alone (32 layers, ms): context 1024,
# batches 1/8/64/128/256: 0.321 vs 0.331, 0.619 vs 0.747, 2.684 vs 3.345, 4.515 vs 5.888, 8.620 vs 11.415; context 320,
# batches 1/8/16/64/128/256: 0.264 vs 0.289, 0.389 vs 0.455, 0.502 vs 0.616, 1.331 vs 1.604, 1.724 vs 2.157, 3.041 vs
# 4.153 (bench/results/decode_attn1024-h200-6822f2b.json, decode_attn320*-h200-6822f2b.json,
# decode_breakdown-h200-b76a044.json; largest relative difference of the outputs 4.0e-3). Yet flashq stays below batch
# 128: with flashmma at every batch, the conformance case "KV pressure preempts but never changes greedy tokens" failed
# on the H200 (a sequence recomputed by the fa2 prefill after preemption continued with other greedy tokens than the
# same request alone; bench/results/gputests-h200-0c493b6.log), with flashq below 128 it passed (call C of session 6,
# bench/results/gputests-h200-084cd96.log). From 128 on, flashmma's speed wins (the case runs at batch <= 6).
DEFAULT_DECODE_ATTENTION: tuple[tuple[int, str], ...] = ((1, "flashq"), (128, "flashmma"))
# GEMV fusions of decode steps on the GEMV path (forward.py docstring) when EngineConfig.gemv_fusion
# is "". "all" measured 4.352 vs 4.456 ms at batch 1, logits bitwise equal to "none"
# (bench/results/archive/fused_h200.md); the GPU scheduler suite and conformance passed with it as the
# default (bench/results/archive/sched_tests_fusion_all_03deec6.log).
DEFAULT_GEMV_FUSION = "all"


def parse_decode_attention(spec: str) -> tuple[tuple[int, str], ...]:
    """A decode attention table from the command line: "flashq" (every batch) or
    "1:flashq,64:basic" (batch buckets 1..63 flashq, 64 and up basic)."""
    out: list[tuple[int, str]] = []
    for part in spec.split(","):
        part = part.strip()
        if ":" in part:
            lo, v = part.split(":", 1)
            out.append((int(lo), v.strip()))
        elif part:
            out.append((1, part))
    table = tuple(out)
    check_decode_table(table)
    return table


def parse_gemv_fusion(spec: str) -> frozenset[str]:
    """ "none" / "" -> no fusion; "all" -> every fusion; else a comma list of GEMV_FUSIONS."""
    spec = spec.strip()
    if spec in ("", "none"):
        return frozenset()
    if spec == "all":
        return frozenset(GEMV_FUSIONS)
    out = frozenset(p.strip() for p in spec.split(",") if p.strip())
    bad = out - set(GEMV_FUSIONS)
    if bad:
        raise ValueError(f"gemv fusion {sorted(bad)} not in {GEMV_FUSIONS} (or 'none', 'all')")
    return out


def check_decode_table(table: tuple[tuple[int, str], ...]) -> None:
    if not table or table[0][0] != 1:
        raise ValueError(f"decode attention table {table!r} must start at batch 1")
    if any(b[0] <= a[0] for a, b in zip(table, table[1:], strict=False)):
        raise ValueError(f"decode attention table {table!r}: min batches must ascend")
    for _, v in table:
        if v not in DECODE_VARIANTS:
            raise ValueError(f"decode attention {v!r} not in {DECODE_VARIANTS}")


@dataclass(frozen=True)
class EngineConfig:
    max_seqs: int = 256
    """Sequences per step (largest batch bucket)."""
    max_tokens: int = 4096
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
    """Decode buckets up to this size (1, 2, 4, 8) use the weight-streaming GEMV instead of cuBLAS.
    Measured on the H200 (bench/decode.py): the GEMV wins at 1 token; at 8 it is issue-bound
    (fp32 FMAs on CUDA cores) and cuBLAS's tensor-core kernels win."""
    quantization: str = ""
    """Weight format: "fp8" = the dense layers' projections (qkv, o, gate_up, down) in FP8 e4m3 with per-output-channel
    scales, quantized on the GPU at load (blink/gpu/engine/fp8_weights.py); "" = bf16."""
    fp8_gemv_max_tokens: int = 8
    """FP8 weights: steps up to this many tokens (GEMV buckets 1, 2, 4, 8) run the FP8-weight GEMV
    (fp8.cu), larger ones the bf16 GEMM over each projection dequantized just before it. Not yet
    measured on a GPU: the FP8 GEMV reads 1 byte a weight, dequantize + GEMM moves 5 (read 1, write 2, read 2)."""
    decode_attention_table: tuple[tuple[int, str], ...] = DEFAULT_DECODE_ATTENTION
    """Decode attention kernel per batch bucket: (min_batch, variant) entries, min_batch ascending
    from 1; a bucket of S sequences uses the last entry with min_batch <= S. Variants: "flashq"
    (flash_decode.cu on CUDA cores, the default below batch 128), "flashmma" (flash_decode.cu on tensor
    cores, the default from 128) and "basic" (attention.cu, the fallback). H200, Llama-3-8B
    shape, context 1024: flashq 4.46 ms/step at batch 1, 18.3 at batch 256
    (bench/results/archive/decode_h200_run5.json); basic 4.90 and 39.8 (decode_h200_run4.json).
    bench/decode.py prints the best table per batch (its `best table` line)."""
    decode_attention: str = ""
    """One decode attention variant for every bucket, overriding decode_attention_table ("" = the table)."""
    gemv_fusion: str = ""
    """Kernels folded into the decode GEMVs (buckets <= gemv_max_tokens): "none", "all" or a comma
    list of "norm" (residual add and RMSNorm into the projections), "swiglu" (SwiGLU into gate_up),
    "rope" (RoPE + KV write into qkv; not with qk-norm); "" = DEFAULT_GEMV_FUSION. Prefill and
    cuBLAS steps never fuse (forward.py's docstring)."""
    prefill_attention: str = "fa2"
    """Prefill attention kernel: "fa2" (scores and O in registers on mma.sync, cp.async double
    buffering; the default) or "rego" (WMMA, O accumulators in registers). Both in prefill_attention.cu.
    H200, Llama-3-8B, whole prefill step (bench/results/prefill-h200-6822f2b.json): one 256-token prompt
    7.45 vs 8.24 ms, 16 x 256 94.7 vs 95.8, one 4096-token prompt 117.5 vs 159.2; 256 x (256 -> 128)
    10,906 vs 10,688 tok/s (GPU scheduler, bench/results/tput_*-h200-6822f2b.json)."""
    gemm_candidates: int = 0
    """cuBLAS GEMM shapes: how many cuBLASLt heuristic algorithms the tuner times against
    cublasGemmEx before capture (blink/gpu/engine/cublaslt.py); 0 = cublasGemmEx for every shape. Off by
    default: on the H200 (bench/results/archive/SUMMARY.md, session 3, item 3) 8 candidates bought 1.5-2.5 %
    on decode steps at batch 64-256 and nothing measurable end to end (256 x 256->128: 9,649 vs
    9,586 tok/s, inside run-to-run spread), and a timing-based choice can differ between processes
    (results then differ in the last bits across restarts)."""
    gemm_sm_reserve: int = 1
    """SMs the cuBLAS GEMMs leave free (cublasSetSmCountTarget: they are sized for the others). The
    GPU-resident scheduler's block holds one SM for as long as it runs, steps included; a GEMM
    sized for every SM then needs a second, nearly empty wave of tiles. H200, Llama-3-8B
    (bench/results/archive/sm_steal_h200_280b210.json, throughput_h200_6553b47_reserve1.json): with 0, a
    16 x 256 prefill step took 7 % longer with the scheduler resident, and 256 x (256 -> 128) ran at
    9,616 tok/s; with 1, 10,480 tok/s (the host-driven loop, no resident kernel: 9,685)."""
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
        if self.max_tokens < self.max_seqs:
            raise ValueError("max_tokens must be >= max_seqs")
        if not 0 <= self.gemm_sm_reserve <= 8:
            raise ValueError("gemm_sm_reserve must be in [0, 8]")
        if not 0 <= self.gemm_candidates <= 64:
            raise ValueError("gemm_candidates must be in [0, 64]")
        if self.max_context % self.block_size:
            raise ValueError("max_context must be a multiple of block_size")
        check_decode_table(self.decode_attention_table)
        if self.prefill_attention not in PREFILL_VARIANTS:
            raise ValueError(f"prefill_attention {self.prefill_attention!r} not in {PREFILL_VARIANTS}")
        if self.decode_attention and self.decode_attention not in DECODE_VARIANTS:
            raise ValueError(f"decode_attention {self.decode_attention!r} not in {DECODE_VARIANTS}")
        parse_gemv_fusion(self.gemv_fusion)
        if self.quantization not in ("", "fp8"):
            raise ValueError(f"quantization {self.quantization!r} not in ('', 'fp8')")
        if self.quantization and self.gemm_candidates:
            raise ValueError("gemm_candidates (the cuBLASLt tuner) does not apply to fp8 weights")
        if not 1 <= self.fp8_gemv_max_tokens <= 8:
            raise ValueError("fp8_gemv_max_tokens must be in [1, 8]")
        if not 0 <= self.sampling_rows <= 1 << 16:
            raise ValueError("sampling_rows must be in [0, 65536]")

    @property
    def gemv_fusions(self) -> frozenset[str]:
        """The effective fusions (gemv_fusion, or DEFAULT_GEMV_FUSION when it is "")."""
        return parse_gemv_fusion(self.gemv_fusion or DEFAULT_GEMV_FUSION)

    @property
    def decode_table(self) -> tuple[tuple[int, str], ...]:
        """The effective table (decode_attention, when set, for every batch)."""
        return ((1, self.decode_attention),) if self.decode_attention else self.decode_attention_table
