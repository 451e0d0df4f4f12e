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
    logits = last Wlm^T (fp32; an FP8 head: Fp8Launches.fp8_head);  sample -> out_tokens;  signal_done (st.release of *step_seq)
Buffers are sized for the largest shape and shared by all graphs: one step runs at a time.
Attention (kernel choice per bucket, splits, launches) is the AttentionLaunches mixin
(blink/gpu/engine/attention_launch.py), sampling and prompt logprobs the SamplingLaunches mixin
(blink/gpu/engine/sampling_launch.py), FP8 projections the Fp8Launches mixin (blink/gpu/engine/fp8_launch.py).

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
import re

import numpy as np

from blink.gpu.engine.attention_launch import (
    DECODE_GROUPS,
    DECODE_HEAD_DIMS,
    FLASH_VARIANTS,
    AttentionLaunches,
)
from blink.gpu.engine.fp8_gemm import Fp8Gemm
from blink.gpu.engine.fp8_launch import Fp8Launches
from blink.gpu.engine.fp8_weights import (
    FP8_GEMV_BUCKETS,
    FP8_GEMV_CONFIG,
    FP8_GEMV_CONFIGS,
    FP8_MMA_MIN_TOKENS,
    Fp8Linear,
    fp8_gemv_grid,
    fp8_gemv_name,
    fp8_head_scratch_elems,
)
from blink.gpu.engine.moe_launch import MoeLaunches
from blink.gpu.engine.sampling_launch import SamplingLaunches
from blink.gpu.engine.step_arena import Dims, StepArena
from blink.gpu.engine.weights import GpuWeights
from blink.gpu.toolchain.cuda_api import Cublas, Driver
from blink.gpu.toolchain.kernels import Kernels
from blink.models.config import ModelConfig, rope_inv_freq

GEMV_BUCKETS = (1, 2, 4, 8)
GEMV_ROWS_PER_WARP = {1: 1, 2: 4, 4: 4, 8: 4}  # must match GEMV(NT, R) in model_kernels.cu
GEMV_FUSIONS = ("norm", "swiglu", "rope")
# The kernels built on gemv_fused.cuh's gemv_fused_impl, which waits for the kernel before it itself
# (pdl_wait, common.cuh): the FP8 GEMVs (not the tensor-core gemv_fp8_mma_*) and the fused bf16 GEMVs
# (not the plain gemv_bf16/gemv_f32 of gemv_impl). Only these are launched with programmatic dependent
# launch (Forward.pdl); any other kernel would read its inputs before they are written.
_PDL_KERNEL = re.compile(r"gemv_(fp8_(?!mma_)\w+|(norm|norm_swiglu|swiglu|resid|rope|norm_rope)_t\d+)")
PDL_MIN_ARCH = 90  # griddepcontrol: compute capability 9.0 and later


def pdl_kernel(name: str) -> bool:
    return _PDL_KERNEL.fullmatch(name) is not None


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


GEMV_NORM_SMEM_MAX = 160 << 10  # fused norm: NT * hidden * 2 bytes of shared memory per CTA


class Forward(AttentionLaunches, SamplingLaunches, Fp8Launches):
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
        self.pdl = False  # programmatic dependent launch of the GEMVs (EngineConfig.pdl; pdl_kernel)
        # FP8 weights: steps past the GEMV take the path set_fp8_gemm chose (fp8_decode: record's step kind)
        self.fp8 = isinstance(weights.layers[0].qkv, Fp8Linear)
        self.fp8_gemv_max_tokens, self.fp8_decode = FP8_GEMV_BUCKETS[-1], True
        self.fp8_mma_min_tokens = FP8_MMA_MIN_TOKENS
        self.fp8_gemv_config = dict(FP8_GEMV_CONFIG)  # per bucket, one of FP8_GEMV_CONFIGS (set_fp8_gemv_config)
        head_fp8 = isinstance(weights.lm_head, Fp8Linear)  # the FP8 LM head (Fp8Launches.fp8_head)
        self.fp8_head_scratch = z(max(1, fp8_head_scratch_elems(c, Sm) if head_fp8 else 0))
        self.fp8_gemms: dict[str, Fp8Gemm] = {}
        self.fp8_path = ""
        self.fp8_scratch = self.fp8_x8 = self.fp8_xs = self.fp8_d32 = z(1)

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
        for nt in FP8_GEMV_BUCKETS:  # the FP8 GEMV's (FP8 weights): every configuration (set_fp8_gemv_config)
            smem = self.gemv_smem("norm", nt, H)
            if smem <= GEMV_NORM_SMEM_MAX:
                for kind in ("norm", "norm_swiglu", "norm_rope"):
                    for cfg in FP8_GEMV_CONFIGS[nt]:
                        driver.set_max_dynamic_smem(kernels[fp8_gemv_name(nt, kind, cfg)], smem)

    def set_gemv_fusion(self, fusion: frozenset[str]) -> None:
        """GEMV fusions (GEMV_FUSIONS) for the steps recorded from now on."""
        bad = set(fusion) - set(GEMV_FUSIONS)
        if bad:
            raise ValueError(f"gemv fusion {sorted(bad)} not in {GEMV_FUSIONS}")
        self.gemv_fusion = frozenset(fusion)

    def uses_gemv(self, rows: int) -> bool:
        return rows in GEMV_BUCKETS and rows <= self.gemv_max_tokens

    def fusions_for(self, T: int) -> frozenset[str]:
        """The fusions a step of T tokens gets: none unless its projections run on one bucket of the bf16
        GEMV (bf16 weights) or of the FP8 GEMV (FP8 weights, decode steps)."""
        gemv = self.uses_fp8_gemv_bucket(T) if self.fp8 else self.uses_gemv(T)
        if not gemv or self.moe is not None:  # MoE layers take the unfused path's delta
            return frozenset()
        out = set(self.gemv_fusion)
        rows_per_warp = self.fp8_gemv_config[T][0] if self.fp8 else GEMV_ROWS_PER_WARP[T]
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
        """Launch kernel `name` with its parameters by name (checked against its signature: Kernels.args),
        with programmatic dependent launch where `pdl` is on and the kernel waits for its predecessor itself."""
        programmatic = self.pdl and pdl_kernel(name)
        self.drv.launch(
            self.k[name], grid, block, self.k.args(name, args), stream, smem, name, programmatic=programmatic
        )

    def linear(self, x: object, w: object, y: object, rows: int, stream: int, out_f32: bool = False) -> None:
        n_out, k = int(w.shape[0]), int(w.shape[1])  # type: ignore[attr-defined]
        if isinstance(w, Fp8Linear):  # fp32 out: the LM head (weight-only in every step)
            (self.fp8_head if out_f32 else self.fp8_linear)(x, w, y, rows, stream)
        elif self.uses_gemv(rows):
            name = f"gemv_{'f32' if out_f32 else 'bf16'}_t{rows}"
            grid = (-(-n_out // (8 * GEMV_ROWS_PER_WARP[rows])), 1, 1)
            self._launch(name, grid, (256, 1, 1), stream, W=w, X=x, Y=y, N=n_out, K=k)
        else:
            self.blas.linear(int(x.data.ptr), int(w.data.ptr), int(y.data.ptr), rows, n_out, k, out_f32)  # type: ignore[attr-defined]

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
            cfg = self.fp8_gemv_config[T]
            name, grid = fp8_gemv_name(T, kind, cfg), fp8_gemv_grid(n_out, T, kind, cfg)
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
