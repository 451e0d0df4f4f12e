"""One model step as a fixed sequence of kernel launches over preallocated device buffers.

`Forward.record(stream, S, T, decode)` issues the launches of a step for a bucket of S sequences
and T packed tokens; graph capture turns that into a graph. Every live size is read by the
kernels from the step buffers (blink.protocol.step), so the launches depend only on the bucket.

Step (T tokens, S sequences; delta = the output of the last projection, added lazily):
    embed -> resid
    per layer:  add_rmsnorm(resid += delta) -> hid;  qkv = hid Wqkv^T;  rope/qk-norm/KV write -> q
                attention(q, paged KV) -> attn;  delta = attn Wo^T;  add_rmsnorm(resid += delta) -> hid
                gate_up = hid Wgu^T;  act = swiglu(gate_up);  delta = act Wdown^T
                (MoE layers: delta = the routed experts of hid, blink/gpu/engine/moe_launch.py; MoE models
                take no GEMV fusions, their layers hand the MLP's output on as delta)
    final_norm_gather(resid + delta at each sequence's last token) -> last [S, H]
    logits = last Wlm^T (fp32);  sample -> out_tokens;  signal_done (st.release of *step_seq)
Buffers are sized for the largest shape and shared by all graphs: one step runs at a time.
Attention (kernel choice per bucket, splits, launches) is the AttentionLaunches mixin
(blink/gpu/engine/attention_launch.py).

GEMV fusions (set_gemv_fusion; only in steps whose projections use the GEMV, i.e. decode buckets
<= gemv_max_tokens, or with FP8 weights the FP8 GEMV's decode buckets below FP8_MMA_MIN_TOKENS (fp8.cu
instantiates the same fusions); prefill, cuBLAS and FP8 GEMM steps are unchanged):
    "norm":   the residual add happens in the o / down GEMV's epilogue (resid += x W^T, no delta)
              and the RMSNorm in the qkv / gate_up GEMV's prologue (each CTA normalises resid into
              shared memory): no add_rmsnorm launches.
    "swiglu": the gate_up GEMV pairs gate and up rows in one CTA and writes act = swiglu(gate, up):
              no swiglu launch, no gate_up round trip.
    "rope":   the qkv GEMV pairs rows j and j + hd/2 of a head and finishes rope_kv_write's work
              (RoPE'd q, RoPE'd k and v into the KV cache): no rope_kv_write launch, no qkv round
              trip. Models with qk-norm (Qwen3) keep rope_kv_write.
Both give the unfused path's bf16 values (same rounding points and summation orders).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from blink.gpu.engine.attention_launch import (
    DECODE_GROUPS,
    DECODE_HEAD_DIMS,
    FLASH_VARIANTS,
    AttentionLaunches,
)
from blink.gpu.engine.fp8_gemm import Fp8Gemm
from blink.gpu.engine.fp8_weights import (
    FP8_GEMV_BUCKETS,
    FP8_GEMV_CONFIG,
    FP8_LARGE_PATHS,
    FP8_MMA_MIN_TOKENS,
    Fp8Linear,
    fp8_gemv_grid,
    fp8_gemv_name,
    fp8_gemv_pieces,
    fp8_max_outputs,
    fp8_mma_grid,
    fp8_mma_name,
    fp8_scratch_elems,
)
from blink.gpu.engine.moe_launch import MoeLaunches
from blink.gpu.engine.step_arena import Dims, StepArena
from blink.gpu.engine.weights import GpuWeights
from blink.gpu.toolchain.cuda_api import Cublas, Driver
from blink.gpu.toolchain.kernels import Kernels
from blink.models.config import ModelConfig, rope_inv_freq
from blink.protocol.layout import MAX_LOGIT_BIAS, MAX_LOGPROBS

GEMV_BUCKETS = (1, 2, 4, 8)
GEMV_ROWS_PER_WARP = {1: 1, 2: 4, 4: 4, 8: 4}  # must match GEMV(NT, R) in model_kernels.cu
GEMV_FUSIONS = ("norm", "swiglu", "rope")


class RopeArgs(ctypes.Structure):
    """struct RopeArgs of model_kernels.cu (the rope-fused qkv GEMV's by-value parameter)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "q_out",
            "k_cache",
            "v_cache",
            "cos_tab",
            "sin_tab",
            "positions",
            "cu_q_lens",
            "block_tables",
            "num_tokens",
            "num_seqs",
        )
    ] + [(name, ctypes.c_int) for name in ("nq", "nkv", "hd", "bs", "mbps")]


ROPE_THREADS = 256  # rope_kv_write's largest block (ROPE_THREADS in model_kernels.cu)


def rope_launch(nh: int, hd: int, T: int, num_sms: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """rope_kv_write's (grid, block) for T tokens of nh heads of hd values: hd / 16 threads a head,
    HPB heads a block (a multiple of 32 threads, at most ROPE_THREADS), halved while that leaves
    fewer than 2 blocks an SM (small T) down to 64 threads; one block per HPB (token, head) pairs."""
    if hd % 16 or hd > 16 * ROPE_THREADS:
        raise ValueError(f"rope_kv_write needs head_dim a multiple of 16 (got {hd})")
    per_head = hd // 16
    step = 32 // math.gcd(per_head, 32)  # heads a block grows by to stay a whole number of warps
    hpb = ROPE_THREADS // per_head // step * step
    while hpb > step and hpb * per_head > 64 and -(-T * nh // hpb) < 2 * num_sms and (hpb // 2) % step == 0:
        hpb //= 2
    return (-(-T * nh // hpb), 1, 1), (hpb * per_head, 1, 1)


NORM_ROWS_MIN_TOKENS = 1024
"""Steps of at least this many tokens use add_rmsnorm_rows (model_kernels.cu), fewer add_rmsnorm: the same
sums in the same order either way; each is the faster one on its side (docs/decisions.md)."""
ROPE_WARP_MAX_TOKENS = (32, 128)
"""Steps of at most this many tokens (without, with q/k-norm) use rope_kv_write_warp, more rope_kv_write;
bit-identical; each is the faster one on its side (docs/decisions.md)."""


def norm_kernel(T: int) -> tuple[str, tuple[int, int, int], tuple[int, int, int]]:
    """The add-RMSNorm kernel of a step of T tokens and its (grid, block): a block of 256 threads a row."""
    return ("add_rmsnorm_rows" if T >= NORM_ROWS_MIN_TOKENS else "add_rmsnorm"), (T, 1, 1), (256, 1, 1)


def rope_kernel(
    nh: int, hd: int, T: int, qk_norm: bool, num_sms: int
) -> tuple[str, tuple[int, int, int], tuple[int, int, int]]:
    """The RoPE/KV-write kernel of a step of T tokens of nh heads and its (grid, block)."""
    if T <= ROPE_WARP_MAX_TOKENS[qk_norm]:
        return "rope_kv_write_warp", (T, -(-nh // 8), 1), (256, 1, 1)  # a warp per head, 8 heads a block
    return ("rope_kv_write", *rope_launch(nh, hd, T, num_sms))


KV_CACHE_DTYPES = ("auto", "fp8")  # --kv-cache-dtype: "auto" = the model dtype (bf16)


def kv_element_bytes(kv_cache_dtype: str) -> int:
    """Bytes of one KV cache value: 2 (bf16) or 1 (fp8 e4m3)."""
    return 1 if kv_cache_dtype == "fp8" else 2


def _ptr(a: object) -> int:
    return int(a.data.ptr)  # type: ignore[attr-defined]


GEMV_NORM_SMEM_MAX = 160 << 10  # fused norm: NT * hidden * 2 bytes of shared memory per CTA


class Forward(AttentionLaunches):
    def __init__(
        self,
        config: ModelConfig,
        weights: GpuWeights,
        dims: Dims,
        driver: Driver,
        kernels: Kernels,
        cublas: Cublas,
        num_sms: int,
        max_splits: int = 32,
        sampling_rows: int = 0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        import cupy as cp

        c = config
        if c.head_dim not in DECODE_HEAD_DIMS:
            raise ValueError(f"head_dim {c.head_dim} not in the compiled set {DECODE_HEAD_DIMS}")
        if c.num_heads // c.num_kv_heads not in DECODE_GROUPS:
            raise ValueError(f"GQA group {c.num_heads // c.num_kv_heads} not in the compiled set {DECODE_GROUPS}")
        if c.hidden_size % 8 or c.intermediate_size % 8:
            raise ValueError("hidden and intermediate sizes must be multiples of 8 (16-byte vectors)")
        if dims.max_num_batched_tokens < dims.max_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_seqs (a decode step has one token per sequence)")
        self.c, self.w, self.d = c, weights, dims
        self.drv, self.k, self.blas = driver, kernels, cublas
        self.num_sms, self.max_splits = num_sms, max_splits
        self.arena = StepArena(dims)
        Tm, Sm, H, inter = dims.max_num_batched_tokens, dims.max_seqs, c.hidden_size, c.intermediate_size
        nqkv = c.q_size + 2 * c.kv_size
        z = lambda *shape, dt=cp.uint16: cp.zeros(shape, dtype=dt)  # noqa: E731
        self.resid, self.hid, self.delta = z(Tm, H), z(Tm, H), z(Tm, H)
        self.qkv, self.q, self.attn = z(Tm, nqkv), z(Tm, c.q_size), z(Tm, c.q_size)
        self.gu, self.act = z(Tm, 2 * inter), z(Tm, inter)
        self.last = z(Sm, H)
        self.logits = z(Sm, c.vocab_size, dt=cp.float32)
        self.out_tokens = z(Sm, dt=cp.int32)
        self.sampling_rows = sampling_rows
        self._init_sampling_buffers(z, Sm, Tm)
        self.done_seq = z(1, dt=cp.uint64)
        ws = max(s * max(self.flash_splits(s, v) for v in FLASH_VARIANTS) for s in range(1, Sm + 1))
        self.part_o = z(ws * c.num_heads * c.head_dim, dt=cp.float32)
        self.part_ml = z(ws * c.num_heads * 2, dt=cp.float32)
        # RoPE tables as transformers computes them: fp32 inv_freq, fp32 position * inv_freq.
        inv = rope_inv_freq(c).astype(np.float32)
        ang = np.arange(dims.max_context, dtype=np.float32)[:, None] * inv[None, :]
        self.cos = cp.asarray(np.cos(ang.astype(np.float64)).astype(np.float32))
        self.sin = cp.asarray(np.sin(ang.astype(np.float64)).astype(np.float32))
        # KV pool: [layers, 2, num_blocks, block_size, nkv, hd] bf16, or fp8 e4m3 codes (kv_cache.cuh): the
        # kernels that touch it are the "_fp8kv" instantiations (kv_suffix).
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} not in {KV_CACHE_DTYPES}")
        self.kv_suffix = "_fp8kv" if kv_cache_dtype == "fp8" else ""
        kv_bytes = kv_element_bytes(kv_cache_dtype)
        kv_dt = cp.uint8 if kv_bytes == 1 else cp.uint16
        self.kv = z(c.num_layers, 2, dims.num_blocks, dims.block_size, c.num_kv_heads, c.head_dim, dt=kv_dt)
        self.kv_layer_stride = 2 * dims.num_blocks * dims.block_size * c.kv_size * kv_bytes  # bytes
        self.kv_half = dims.num_blocks * dims.block_size * c.kv_size * kv_bytes
        self._init_attention(kernels, driver)
        self._init_gemv_smem(kernels, driver)
        self.moe = MoeLaunches(c, dims.max_num_batched_tokens, driver, kernels) if c.is_moe else None
        self.gemv_fusion = frozenset(GEMV_FUSIONS)  # every fusion where it applies (fusions_for)
        self.gemv_max_tokens = 1
        # FP8 weights: steps past the GEMV take the path set_fp8_gemm chose (fp8_decode: record's step kind)
        self.fp8 = isinstance(weights.layers[0].qkv, Fp8Linear)
        self.fp8_gemv_max_tokens, self.fp8_decode = FP8_GEMV_BUCKETS[-1], True
        self.fp8_gemm: Fp8Gemm | None = None
        self.fp8_path = ""
        self.fp8_scratch = self.fp8_x8 = self.fp8_xs = self.fp8_d32 = z(1)

    def _init_sampling_buffers(self, z: Any, Sm: int, Tm: int) -> None:
        """The sampling extensions' buffers (`z` allocates zeros on the GPU)."""
        import cupy as cp

        sampling_rows, H = self.sampling_rows, self.c.hidden_size
        # Sampling extensions (sampling.cu): outputs of the step, and the per-row tables (one row per
        # ring slot; one dummy row when they are off, so the graphs' pointers stay valid).
        rows, V = max(1, sampling_rows), self.c.vocab_size
        self.proc = z(Sm if sampling_rows else 1, V, dt=cp.float32)
        self.chosen_lp = z(Sm, dt=cp.float32)
        self.top_ids = z(Sm, MAX_LOGPROBS, dt=cp.int32)
        self.top_lps = z(Sm, MAX_LOGPROBS, dt=cp.float32)
        self.lp_stats = z(2 * Sm, dt=cp.float32)
        self.pen_state = z(rows, V if sampling_rows else 1, dt=cp.uint32)
        self.logit_bias_n = z(rows, dt=cp.int32)
        self.logit_bias_ids = z(rows, MAX_LOGIT_BIAS, dt=cp.int32)
        self.logit_bias_vals = z(rows, MAX_LOGIT_BIAS, dt=cp.float32)
        self.mask_words = (V + 31) // 32  # token masks (token_mask reads them from the ring)
        self.mask_open = z(Sm, dt=cp.int32)  # the gate token_mask read for each row
        # Prompt logprobs (plp_* in sampling.cu): the final-normed hidden state, the fp32 logits and
        # the record of every scored row; up to max_num_batched_tokens rows (that many times vocab * 4
        # bytes of logits), allocated with the extension tables.
        P = Tm if sampling_rows else 1
        self.plp_hid = z(P, H)
        self.plp_logits = z(P, V if sampling_rows else 1, dt=cp.float32)
        self.plp_lp = z(P, dt=cp.float32)
        self.plp_ids = z(P, MAX_LOGPROBS, dt=cp.int32)
        self.plp_lps = z(P, MAX_LOGPROBS, dt=cp.float32)

    def _init_gemv_smem(self, kernels: Kernels, driver: Driver) -> None:
        """Dynamic shared memory of the fused GEMVs whose prologue normalises into shared memory."""
        H = self.c.hidden_size
        for nt in GEMV_BUCKETS:
            for kind in ("norm", "norm_swiglu"):
                smem = self.gemv_smem(kind, nt, H)
                if smem <= GEMV_NORM_SMEM_MAX:
                    driver.set_max_dynamic_smem(kernels[f"gemv_{kind}_t{nt}"], smem)
        for nt in GEMV_BUCKETS:
            smem = self.gemv_smem("norm_rope", nt, H)
            if smem <= GEMV_NORM_SMEM_MAX:
                driver.set_max_dynamic_smem(kernels[f"gemv_norm_rope_t{nt}"], smem)
        for nt in FP8_GEMV_BUCKETS:  # the FP8 GEMV's (FP8 weights): the engine's configuration
            smem = self.gemv_smem("norm", nt, H)
            if smem <= GEMV_NORM_SMEM_MAX:
                for kind in ("norm", "norm_swiglu", "norm_rope"):
                    driver.set_max_dynamic_smem(kernels[fp8_gemv_name(nt, kind)], smem)

    def set_fp8_gemm(self, path: str, gemm: Fp8Gemm | None) -> None:
        """The path of FP8 projections past the GEMV (FP8_LARGE_PATHS), with its buffers: "outer" and
        "epilogue" the W8A8 GEMM `gemm` (the per-token codes and scales of a step's activations; fp32
        sums for "epilogue"), "dequant" the bf16 GEMM over fp8_scratch (the largest projection)."""
        import cupy as cp

        if path not in FP8_LARGE_PATHS or (gemm is None) != (path == "dequant"):
            raise ValueError(f"fp8 path {path!r} (gemm {'given' if gemm else 'none'})")
        c, Tm = self.c, self.d.max_num_batched_tokens
        self.fp8_path, self.fp8_gemm = path, gemm
        if path == "dequant":
            self.fp8_scratch = cp.zeros(fp8_scratch_elems(c), dtype=cp.uint16)
            return
        self.fp8_x8 = cp.zeros((Tm, max(c.hidden_size, c.q_size, c.intermediate_size)), dtype=cp.uint8)
        self.fp8_xs = cp.zeros(Tm, dtype=cp.float32)
        if path == "epilogue":
            self.fp8_d32 = cp.zeros((Tm, fp8_max_outputs(c)), dtype=cp.float32)

    def set_gemv_fusion(self, fusion: frozenset[str]) -> None:
        """GEMV fusions (GEMV_FUSIONS) for the steps recorded from now on."""
        bad = set(fusion) - set(GEMV_FUSIONS)
        if bad:
            raise ValueError(f"gemv fusion {sorted(bad)} not in {GEMV_FUSIONS}")
        self.gemv_fusion = frozenset(fusion)

    def uses_gemv(self, rows: int) -> bool:
        return rows in GEMV_BUCKETS and rows <= self.gemv_max_tokens

    def uses_fp8_gemv_bucket(self, T: int) -> bool:
        """Whether a step of T tokens runs the FP8 weights on one FP8 GEMV bucket (a decode step below
        FP8_MMA_MIN_TOKENS: from there the tensor-core kernel, unfused)."""
        fp8_decode = self.fp8 and self.fp8_decode and T <= self.fp8_gemv_max_tokens
        return fp8_decode and T in FP8_GEMV_BUCKETS and T < FP8_MMA_MIN_TOKENS

    def fusions_for(self, T: int) -> frozenset[str]:
        """The fusions a step of T tokens gets: none unless its projections run on one bucket of the bf16
        GEMV (bf16 weights) or of the FP8 GEMV (FP8 weights, decode steps)."""
        gemv = self.uses_fp8_gemv_bucket(T) if self.fp8 else self.uses_gemv(T)
        if not gemv or self.moe is not None:  # MoE layers take the unfused path's delta
            return frozenset()
        out = set(self.gemv_fusion)
        rows_per_warp = FP8_GEMV_CONFIG[T][0] if self.fp8 else GEMV_ROWS_PER_WARP[T]
        if self.gemv_smem("norm", T, self.c.hidden_size) > GEMV_NORM_SMEM_MAX:
            out.discard("norm")
        if self.w.layers[0].q_norm is not None or (self.c.head_dim // 2) % rows_per_warp:
            out.discard("rope")  # qk-norm needs whole heads; a warp's rows must stay in one head
        if self.w.layers[0].qkv_bias is not None:
            out.discard("rope")  # the bias goes in between the projection and RoPE
        if self.kv_suffix:
            out.discard("rope")  # the fused epilogue writes a bf16 cache only
        return frozenset(out)

    def _launch(
        self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], stream: int, smem: int = 0, **args
    ) -> None:
        """Launch kernel `name` with its parameters by name (checked against its signature: Kernels.args)."""
        self.drv.launch(self.k[name], grid, block, self.k.args(name, args), stream, smem, name)

    def linear(self, x: object, w: object, y: object, rows: int, stream: int, out_f32: bool = False) -> None:
        n_out, k = int(w.shape[0]), int(w.shape[1])  # type: ignore[attr-defined]
        if isinstance(w, Fp8Linear):
            self.fp8_linear(x, w, y, rows, stream)
        elif self.uses_gemv(rows):
            name = f"gemv_{'f32' if out_f32 else 'bf16'}_t{rows}"
            grid = (-(-n_out // (8 * GEMV_ROWS_PER_WARP[rows])), 1, 1)
            self._launch(name, grid, (256, 1, 1), stream, W=w, X=x, Y=y, N=n_out, K=k)
        else:
            self.blas.linear(int(x.data.ptr), int(w.data.ptr), int(y.data.ptr), rows, n_out, k, out_f32)  # type: ignore[attr-defined]

    def fp8_linear(self, x: object, w: Fp8Linear, y: object, rows: int, stream: int) -> None:
        """y (bf16) = x w^T for FP8 w: in decode steps of up to fp8_gemv_max_tokens rows weight-only (bf16
        activations): the FP8 GEMV in bucket pieces below FP8_MMA_MIN_TOKENS rows, the tensor-core kernel
        from there; in every other step x quantized per token and the W8A8 GEMM
        (blink/gpu/engine/fp8_gemm.py), or on the "dequant" path w dequantized to bf16 and the bf16
        GEMM. The numpy definition draws the same line (blink.models.fp8.uses_w8a8)."""
        n_out, k = w.shape
        if self.fp8_decode and rows <= self.fp8_gemv_max_tokens:
            if rows >= FP8_MMA_MIN_TOKENS:  # the tensor-core kernel, every row at once
                self._launch(
                    fp8_mma_name(rows), (fp8_mma_grid(n_out), 1, 1), (256, 1, 1), stream, W=w.codes,
                    scales=w.scales, X=x, Y=y, N=n_out, K=k, T=rows,
                )  # fmt: skip
                return
            for r0, nt in fp8_gemv_pieces(rows):  # a row count between buckets in pieces: 6 = 4 + 2
                self._launch(
                    fp8_gemv_name(nt), (fp8_gemv_grid(n_out, nt), 1, 1), (256, 1, 1), stream, W=w.codes,
                    scales=w.scales, X=_ptr(x) + 2 * r0 * k, Y=_ptr(y) + 2 * r0 * n_out, N=n_out, K=k,
                )  # fmt: skip
            return
        if self.fp8_path == "dequant":
            self._launch(
                "fp8_dequant_rows", (-(-k // 4096), n_out, 1), (256, 1, 1), stream, codes=w.codes, scales=w.scales,
                out=self.fp8_scratch, N=n_out, K=k,
            )  # fmt: skip
            self.blas.linear(_ptr(x), _ptr(self.fp8_scratch), _ptr(y), rows, n_out, k, False)
            return
        if self.fp8_gemm is None:
            raise RuntimeError("fp8 weights: set_fp8_gemm was not called")
        x8, xs = self.fp8_x8, self.fp8_xs
        self._launch("fp8_quantize_rows", (rows, 1, 1), (256, 1, 1), stream, W=x, codes=x8, scales=xs, N=rows, K=k)
        outer = self.fp8_path == "outer"
        d = y if outer else self.fp8_d32
        self.fp8_gemm.matmul(rows, n_out, k, _ptr(x8), _ptr(w.codes), _ptr(d), _ptr(xs), _ptr(w.scales))
        if not outer:
            self._launch(
                "fp8_scale_rows", (-(-n_out // 2048), rows, 1), (256, 1, 1), stream, D=d, xs=xs, ws=w.scales, Y=y,
                T=rows, N=n_out,
            )  # fmt: skip

    @staticmethod
    def gemv_smem(kind: str, T: int, k: int) -> int:
        """Dynamic shared memory of gemv_<kind>_t<T> over k inputs (model_kernels.cu)."""
        return T * k * 2 if kind.startswith("norm") else 0

    def fused_linear(self, kind: str, x: object, w: object, y: object, T: int, stream: int, nw: object = None) -> None:
        """One fused GEMV (model_kernels.cu gemv_<kind>_t<T>, or fp8.cu's for FP8 weights): kind "norm"
        (x = resid, normed with nw), "norm_swiglu", "swiglu" (y = act) or "resid" (y = resid, added into)."""
        n_out, k = int(w.shape[0]), int(w.shape[1])  # type: ignore[attr-defined]
        out = {"ra": y} if kind.endswith("rope") else {"Y": y}
        smem = self.gemv_smem(kind, T, k)
        if isinstance(w, Fp8Linear):  # the FP8 GEMV's kernel of the same fusion (fp8.cu)
            name, grid = fp8_gemv_name(T, kind), fp8_gemv_grid(n_out, T, kind)
            out.update(W=w.codes, scales=w.scales)
        else:
            r = GEMV_ROWS_PER_WARP[T]
            pairs = kind.endswith(("swiglu", "rope"))
            name, grid = f"gemv_{kind}_t{T}", -(-(n_out // 2) // (4 * r)) if pairs else -(-n_out // (8 * r))
            out.update(W=w)
        self._launch(
            name, (grid, 1, 1), (256, 1, 1), stream, smem, X=x, nw=nw, N=n_out, K=k, eps=self.c.rms_eps, **out
        )  # fmt: skip

    def rope_args(self, kc: int, vc: int) -> RopeArgs:
        c, d, a = self.c, self.d, self.arena.ptr
        return RopeArgs(
            int(self.q.data.ptr),  # type: ignore[attr-defined]
            kc,
            vc,
            int(self.cos.data.ptr),  # type: ignore[attr-defined]
            int(self.sin.data.ptr),  # type: ignore[attr-defined]
            a["positions"],
            a["cu_q_lens"],
            a["block_tables"],
            a["num_tokens"],
            a["num_seqs"],
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            d.block_size,
            d.max_blocks_per_seq,
        )

    def record_sampling(self, stream: int, S: int) -> None:
        """Sampling over self.logits: the extension kernels (each returns at once unless the step's
        ext_on is set, and then works only on the rows that use an extension; token_mask also needs
        mask_on, and reads each masked row's gate and bits from the ring), sample_tokens."""
        V, a, ns = self.c.vocab_size, self.arena.ptr, self.arena.ptr["num_seqs"]
        on = a["ext_on"] if self.sampling_rows else None
        if on is not None:
            self._launch(
                "penalty_mark", (S, 1, 1), (256, 1, 1), stream, state=self.pen_state, V=V, pen_row=a["pen_row"],
                fresh=a["fresh"], input_ids=a["input_ids"], cu_q_lens=a["cu_q_lens"], num_seqs=ns, ext_on=on,
            )  # fmt: skip
            self._launch(
                "logits_ext", (S, 1, 1), (1024, 1, 1), stream, logits=self.logits, proc=self.proc, V=V,
                state=self.pen_state, pen_row=a["pen_row"], presence_penalty=a["presence_penalty"],
                frequency_penalty=a["frequency_penalty"], repetition_penalty=a["repetition_penalty"],
                logit_bias_n=self.logit_bias_n, logit_bias_ids=self.logit_bias_ids,
                logit_bias_vals=self.logit_bias_vals, max_logit_bias=MAX_LOGIT_BIAS, logprobs=a["logprobs"],
                max_lp=MAX_LOGPROBS, top_ids=self.top_ids, top_lps=self.top_lps, stats=self.lp_stats, num_seqs=ns,
                ext_on=on,
            )  # fmt: skip
            self._launch(
                "token_mask", (S, 1, 1), (1024, 1, 1), stream, logits=self.logits, proc=self.proc, V=V,
                pen_row=a["pen_row"], mask_gate=a["mask_gate"], mask_bits=a["mask_bits"],
                ring_mask_words=a["ring_mask_words"], sample_pos=a["sample_pos"], mask_open=self.mask_open,
                num_seqs=ns, ext_on=on, mask_on=a["mask_on"],
            )  # fmt: skip
        self._launch(
            "sample_tokens", (S, 1, 1), (1024, 1, 1), stream, logits=self.logits, V=V,
            temperature=a["temperature"], top_p=a["top_p"], top_k=a["top_k"], seed=a["seed"],
            sample_pos=a["sample_pos"], out_tokens=self.out_tokens, num_seqs=ns, proc=self.proc,
            pen_row=a["pen_row"], min_p=a["min_p"], ext_on=on, mask_on=a["mask_on"], mask_open=self.mask_open,
        )  # fmt: skip
        if on is not None:
            self._launch(
                "sample_post", (S, 1, 1), (32, 1, 1), stream, logits=self.logits, V=V, out_tokens=self.out_tokens,
                emit=a["emit"], logprobs=a["logprobs"], stats=self.lp_stats, chosen_lp=self.chosen_lp,
                state=self.pen_state, pen_row=a["pen_row"], num_seqs=ns, ext_on=on,
            )  # fmt: skip

    def record_prompt_logprobs(self, stream: int, T: int, delta: object) -> None:
        """Prompt logprob records of the step's scored rows (prefill graphs only: a step that scores
        prompt tokens is launched on one): final norm, LM head and records over rows j < plp_count,
        each kernel returning at once unless ext_on and plp_count are set."""
        c, a = self.c, self.arena.ptr
        V, H, on, cnt = c.vocab_size, c.hidden_size, a["ext_on"], a["plp_count"]
        g = min(T, self.num_sms)
        self._launch(
            "plp_norm", (g, 1, 1), (256, 1, 1), stream, residual=self.resid, delta=delta, w=self.w.final_norm,
            hid=self.plp_hid, plp_tok=a["plp_tok"], plp_count=cnt, ext_on=on, H=H, eps=c.rms_eps,
        )  # fmt: skip
        self._launch(
            "plp_lm_head", (-(-V // 64), 1, 1), (256, 1, 1), stream, hid=self.plp_hid, W=self.w.lm_head,
            logits=self.plp_logits, V=V, K=H, plp_count=cnt, ext_on=on,
        )  # fmt: skip
        self._launch(
            "plp_records", (g, 1, 1), (1024, 1, 1), stream, logits=self.plp_logits, V=V, plp_target=a["plp_target"],
            plp_prompt_logprobs=a["plp_prompt_logprobs"], max_lp=MAX_LOGPROBS, plp_lp=self.plp_lp, plp_ids=self.plp_ids,
            plp_lps=self.plp_lps, plp_count=cnt, ext_on=on,
        )  # fmt: skip

    def record(self, stream: int, S: int, T: int, decode: bool) -> None:
        """Issue every launch of one step for the bucket (S sequences, T tokens)."""
        self.fp8_decode = decode
        a = self.arena.ptr
        scale_log2 = (1.0 / self.c.head_dim**0.5) * 1.4426950408889634
        self._launch(
            "embed_tokens", (T, 1, 1), (128, 1, 1), stream, ids=a["input_ids"], table=self.w.embed, out=self.resid,
            num_tokens=a["num_tokens"], H=self.c.hidden_size,
        )  # fmt: skip
        fuse = self.fusions_for(T)
        normed = False  # hid already holds this layer's attention norm (the MoE combine before did it)
        for li, lw in enumerate(self.w.layers):
            kc = int(self.kv.data.ptr) + li * self.kv_layer_stride
            vc = kc + self.kv_half
            self._record_qkv(stream, li, lw, T, fuse, normed, kc, vc)
            self._record_attention(stream, S, T, decode, kc, vc, scale_log2)
            normed = self._record_mlp(stream, li, lw, T, fuse)
        self._record_head(stream, S, T, decode, "norm" in fuse)

    def _norm_args(self) -> dict[str, object]:
        """add_rmsnorm's arguments common to every call of a step."""
        a = self.arena.ptr
        return {"out": self.hid, "num_tokens": a["num_tokens"], "H": self.c.hidden_size, "eps": self.c.rms_eps}

    def _record_qkv(
        self, stream: int, li: int, lw: object, T: int, fuse: frozenset[str], normed: bool, kc: int, vc: int
    ) -> None:
        """A layer's attention input: add_rmsnorm (unless `normed` or fused), the qkv projection, its
        bias, RoPE (q/k-norm) and the KV write (or the fused GEMV doing both)."""
        c, d, a = self.c, self.d, self.arena.ptr
        fuse_rope = "rope" in fuse
        if "norm" in fuse:
            kind, y = ("norm_rope", self.rope_args(kc, vc)) if fuse_rope else ("norm", self.qkv)
            self.fused_linear(kind, self.resid, lw.qkv, y, T, stream, nw=lw.attn_norm)
        else:
            delta = None if li == 0 else self.delta
            if not normed:
                self._launch(
                    *norm_kernel(T), stream, residual=self.resid, delta=delta,
                    w=lw.attn_norm, **self._norm_args(),
                )  # fmt: skip
            if fuse_rope:
                self.fused_linear("rope", self.hid, lw.qkv, self.rope_args(kc, vc), T, stream)
            else:
                self.linear(self.hid, lw.qkv, self.qkv, T, stream)
        if lw.qkv_bias is not None:  # never with fuse_rope (fusions_for)
            n_qkv = c.q_size + 2 * c.kv_size
            self._launch(
                "add_bias", (-(-n_qkv // (8 * 256)), T, 1), (256, 1, 1), stream, y=self.qkv, bias=lw.qkv_bias,
                num_tokens=a["num_tokens"], n=n_qkv,
            )  # fmt: skip
        if not fuse_rope:
            rope, grid, block = rope_kernel(c.num_heads + 2 * c.num_kv_heads, c.head_dim, T, c.qk_norm, self.num_sms)
            self._launch(
                rope + self.kv_suffix, grid, block, stream,
                qkv=self.qkv, q_out=self.q, k_cache=kc, v_cache=vc, q_norm_w=lw.q_norm, k_norm_w=lw.k_norm,
                cos_tab=self.cos, sin_tab=self.sin, positions=a["positions"], cu_q_lens=a["cu_q_lens"],
                block_tables=a["block_tables"], num_tokens=a["num_tokens"], num_seqs=a["num_seqs"], nq=c.num_heads,
                nkv=c.num_kv_heads, hd=c.head_dim, bs=d.block_size, mbps=d.max_blocks_per_seq, eps=c.rms_eps,
            )  # fmt: skip

    def _record_mlp(self, stream: int, li: int, lw: object, T: int, fuse: frozenset[str]) -> bool:
        """A layer's output projection, MLP norm and MLP (dense, or the MoE layer's experts). Returns
        whether the next layer's attention norm is done already (an MoE combine did it)."""
        nt, inter = self.arena.ptr["num_tokens"], self.c.intermediate_size
        fuse_norm, fuse_swiglu = "norm" in fuse, "swiglu" in fuse
        if fuse_norm:
            self.fused_linear("resid", self.attn, lw.o, self.resid, T, stream)
            kind = "norm_swiglu" if fuse_swiglu else "norm"
            out = self.act if fuse_swiglu else self.gu
            self.fused_linear(kind, self.resid, lw.gate_up, out, T, stream, nw=lw.mlp_norm)
        else:
            self.linear(self.attn, lw.o, self.delta, T, stream)
            self._launch(
                *norm_kernel(T), stream, residual=self.resid, delta=self.delta,
                w=lw.mlp_norm, **self._norm_args(),
            )  # fmt: skip
            if lw.router is not None:  # MoE layer (no fusions: fusions_for)
                # its output goes into delta in the last layer; before, its combine does the next
                # layer's add_rmsnorm (resid += output, hid = norm), one launch fewer
                nxt = self.w.layers[li + 1] if li + 1 < len(self.w.layers) else None
                then = None if nxt is None else {"residual": self.resid, "w": nxt.attn_norm, "out": self.hid}
                self.moe.record(  # type: ignore[union-attr]
                    self, stream, T, self.hid, lw.router, lw.experts_gate_up, lw.experts_down,
                    self.delta, nt, then,
                )  # fmt: skip
                return then is not None
            if fuse_swiglu:
                self.fused_linear("swiglu", self.hid, lw.gate_up, self.act, T, stream)
            else:
                self.linear(self.hid, lw.gate_up, self.gu, T, stream)
        if not fuse_swiglu:
            self._launch(
                "swiglu", (-(-inter // (8 * 256)), T, 1), (256, 1, 1), stream, gu=self.gu, out=self.act,
                num_tokens=nt, I=inter,
            )  # fmt: skip
        if fuse_norm:
            self.fused_linear("resid", self.act, lw.down, self.resid, T, stream)
        else:
            self.linear(self.act, lw.down, self.delta, T, stream)
        return False

    def _record_head(self, stream: int, S: int, T: int, decode: bool, fuse_norm: bool) -> None:
        """The step's end: the final norm at each sequence's last token, the LM head, sampling,
        prompt logprobs (prefill steps with the extension tables) and the completion word."""
        c, a = self.c, self.arena.ptr
        self._launch(
            "final_norm_gather", (S, 1, 1), (256, 1, 1), stream, residual=self.resid,
            delta=None if fuse_norm else self.delta, w=self.w.final_norm, out=self.last, cu_q_lens=a["cu_q_lens"],
            num_seqs=a["num_seqs"], H=c.hidden_size, eps=c.rms_eps,
        )  # fmt: skip
        self.linear(self.last, self.w.lm_head, self.logits, S, stream, out_f32=True)
        self.record_sampling(stream, S)
        if self.sampling_rows and not decode:
            self.record_prompt_logprobs(stream, T, None if fuse_norm else self.delta)
        self._launch("signal_done", (1, 1, 1), (1, 1, 1), stream, step_seq=a["step_seq"], done_seq=self.done_seq)
