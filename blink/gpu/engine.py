"""The CUDA model engine: weights, paged KV pool, step buffers and a device-launchable graph cache.

Usage (the GPU scheduler reads the ABI record; the host path calls `step`):

    from blink.gpu.engine import Engine, EngineConfig
    from blink.models.config import preset
    eng = Engine.create(preset("llama3-8b"), EngineConfig(max_seqs=256, max_tokens=4096))  # random weights
    # or Engine.create(cfg, EngineConfig(...), host_weights=hf_named_float32_dict)
    eng.capture()                       # decode + prefill graphs, 2 execs per shape, DeviceLaunch + uploaded
    eng.abi_ptr                         # device address of the ENGINE_DTYPE record (blink/gpu/abi.py)
    eng.arena.ptr["input_ids"], ...     # device addresses of the step buffers (also in the record)
    tokens = eng.step(batch)            # host launch of the matching graph (blink.device.executor.StepBatch)

Graph choice: decode graphs (every sequence has one query token) per batch bucket; prefill graphs
(any mix of chunk lengths, cached context allowed) per (batch bucket, token bucket) with
token bucket >= batch bucket. Shapes not captured are 0 in the table; a driver falls back to the
largest shape. One step may be in flight at a time: all graphs share the activation buffers and
the cuBLAS workspace.

Decode attention is chosen per batch bucket at capture time from
EngineConfig.decode_attention_table (e.g. parse_decode_attention("1:flash,64:flashq"); the
benchmarks' --decode-attention); a graph never bakes in lengths, the flash kernels size their
splits from the live num_seqs and seq_lens (blink/gpu/csrc/flash_decode.cu).

Why two execs per shape: relaunching an exec right after its completion token is seen fails with
cudaErrorInvalidValue about half the time (the exec still counts as running), so the scheduler
alternates between them (/work/shared/gpu-probe/REPORT.md, Q4).
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from blink.device.executor import StepBatch
from blink.gpu.abi import ENGINE_DTYPE
from blink.gpu.attention_launch import DECODE_VARIANTS, PREFILL_VARIANTS
from blink.gpu.cuda_api import Cublas, Driver
from blink.gpu.forward import GEMV_FUSIONS, Dims, Forward
from blink.gpu.kernels import DEFAULT_CACHE, Kernels
from blink.gpu.weights import GpuWeights
from blink.models.config import ModelConfig

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# flashq was the fastest at every batch 1..256 on the H200 (bench/results/decode_h200_run5.json)
DEFAULT_DECODE_ATTENTION: tuple[tuple[int, str], ...] = ((1, "flashq"),)
# GEMV fusions of decode steps on the GEMV path (forward.py docstring) when EngineConfig.gemv_fusion
# is "". "all" measured 4.352 vs 4.456 ms at batch 1, logits bitwise equal to "none"
# (bench/results/fused_h200.md); the GPU scheduler suite and conformance passed with it as the
# default (bench/results/sched_tests_fusion_all_03deec6.log).
DEFAULT_GEMV_FUSION = "all"
# a cuBLASLt algorithm replaces cublasGemmEx for a shape only when this much faster (blink/gpu/cublaslt.py)
GEMM_MARGIN = 0.03


def parse_decode_attention(spec: str) -> tuple[tuple[int, str], ...]:
    """A decode attention table from the command line: "flash" (every batch) or
    "1:flash,64:basic" (batch buckets 1..63 flash, 64 and up basic)."""
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
    decode_attention_table: tuple[tuple[int, str], ...] = DEFAULT_DECODE_ATTENTION
    """Decode attention kernel per batch bucket: (min_batch, variant) entries, min_batch ascending
    from 1; a bucket of S sequences uses the last entry with min_batch <= S. Variants: "basic",
    "pipe" (attention.cu), "flash", "flash8", "flashq", "flashq8" (flash_decode.cu). H200,
    Llama-3-8B shape, context 1024 (bench/results/decode_h200_run4.json): basic 4.90 ms/step at
    batch 1, 39.8 at batch 256; pipe 53.2 at 256. The flash kernels are the default before their
    first timing: bench/decode.py prints the best table per batch (its `best table` line)."""
    decode_attention: str = ""
    """One decode attention variant for every bucket, overriding decode_attention_table ("" = the table)."""
    gemv_fusion: str = ""
    """Kernels folded into the decode GEMVs (buckets <= gemv_max_tokens): "none", "all" or a comma
    list of "norm" (residual add and RMSNorm into the projections), "swiglu" (SwiGLU into gate_up),
    "rope" (RoPE + KV write into qkv; not with qk-norm); "" = DEFAULT_GEMV_FUSION. Prefill and
    cuBLAS steps never fuse (forward.py's docstring)."""
    prefill_attention: str = "rego"
    """Prefill attention kernel: "rego" (O accumulators in registers) or "smem" (O tile in shared
    memory, K/V prefetched), both WMMA; H200 (bench/results/prefill_h200_run4.json): 4k prompt
    160.7 vs 181.5 ms. "fa2": scores and O in registers on mma.sync, cp.async double buffering
    (attention.cu); written for the H200 but not yet run on one."""
    gemm_candidates: int = 0
    """cuBLAS GEMM shapes: how many cuBLASLt heuristic algorithms the tuner times against
    cublasGemmEx before capture (blink/gpu/cublaslt.py); 0 = cublasGemmEx for every shape. Off by
    default: on the H200 (bench/results/gemm_tuning_h200_e3962d3.md) 8 candidates bought 1.5-2.5 %
    on decode steps at batch 64-256 and nothing measurable end to end (256 x 256->128: 9,649 vs
    9,586 tok/s, inside run-to-run spread), and a timing-based choice can differ between processes
    (results then differ in the last bits across restarts)."""
    gemm_sm_reserve: int = 1
    """SMs the cuBLAS GEMMs leave free (cublasSetSmCountTarget: they are sized for the others). The
    GPU-resident scheduler's block holds one SM for as long as it runs, steps included; a GEMM
    sized for every SM then needs a second, nearly empty wave of tiles. H200, Llama-3-8B
    (bench/results/sm_steal_h200_280b210.json, throughput_h200_6553b47_reserve1.json): with 0, a
    16 x 256 prefill step took 7 % longer with the scheduler resident, and 256 x (256 -> 128) ran at
    9,616 tok/s; with 1, 10,480 tok/s (the host-driven loop, no resident kernel: 9,685)."""
    workspace_mib: int = 64
    graph_reserve_mib: int = 2048
    """Memory kept free for graph execs and cuBLAS when sizing the KV pool."""
    seed: int = 0
    """Seed of random weights."""
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

    @property
    def gemv_fusions(self) -> frozenset[str]:
        """The effective fusions (gemv_fusion, or DEFAULT_GEMV_FUSION when it is "")."""
        return parse_gemv_fusion(self.gemv_fusion or DEFAULT_GEMV_FUSION)

    @property
    def decode_table(self) -> tuple[tuple[int, str], ...]:
        """The effective table (decode_attention, when set, for every batch)."""
        return ((1, self.decode_attention),) if self.decode_attention else self.decode_attention_table


def _buckets(values: tuple[int, ...], cap: int) -> tuple[int, ...]:
    """The configured bucket sizes up to `cap`, plus `cap` itself (the largest shape)."""
    out = sorted({v for v in values if v <= cap} | {cap})
    return tuple(out)


def bucket_of(buckets: tuple[int, ...], n_max: int) -> np.ndarray:
    """(n_max+1,) u16: index of the smallest bucket >= n, the O(1) lookup table of the ABI."""
    if list(buckets) != sorted(buckets) or buckets[-1] < n_max:
        raise ValueError(f"buckets {buckets} must ascend and reach {n_max}")
    return np.searchsorted(np.asarray(buckets), np.arange(n_max + 1), side="left").astype(np.uint16)


@dataclass
class CaptureReport:
    graphs: int = 0
    execs: int = 0
    seconds: float = 0.0
    device_bytes: int = 0
    nodes_decode_max: int = 0
    shapes: list[tuple[str, int, int]] = field(default_factory=list)
    gemm_tuning: list[dict] = field(default_factory=list)
    """Per cuBLAS GEMM shape: cublasGemmEx vs the best cuBLASLt candidate (ms), and which one runs."""
    tune_seconds: float = 0.0


class Engine:
    def __init__(
        self,
        config: ModelConfig,
        ecfg: EngineConfig,
        weights: GpuWeights,
        driver: Driver,
        kernels: Kernels,
        stream: object,
    ) -> None:
        import cupy as cp

        self.config, self.ecfg = config, ecfg
        self.driver, self.kernels, self.stream = driver, kernels, stream
        self.s = int(stream.ptr)  # type: ignore[attr-defined]
        self.weights = weights
        self.workspace = cp.empty(ecfg.workspace_mib << 20, dtype=cp.uint8)
        self.cublas = Cublas(self.s, int(self.workspace.data.ptr), int(self.workspace.nbytes))
        max_context = min(ecfg.max_context, config.max_position)
        max_context -= max_context % ecfg.block_size
        mbps = max_context // ecfg.block_size
        self.batch_buckets = _buckets(ecfg.batch_buckets, ecfg.max_seqs)
        self.token_buckets = _buckets(ecfg.token_buckets, ecfg.max_tokens)
        num_blocks = ecfg.num_kv_blocks or self._pool_blocks(ecfg, config, max_context)
        self.dims = Dims(ecfg.max_seqs, ecfg.max_tokens, mbps, ecfg.block_size, num_blocks, max_context)
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.num_sms = int(sms)
        self.fwd = Forward(config, weights, self.dims, driver, kernels, self.cublas, sms)
        self.fwd.gemv_max_tokens = ecfg.gemv_max_tokens
        self.fwd.set_decode_table(ecfg.decode_table)
        self.fwd.set_gemv_fusion(ecfg.gemv_fusions)
        self.fwd.set_prefill_attention(ecfg.prefill_attention)
        self.arena = self.fwd.arena
        nb, nt, E = len(self.batch_buckets), len(self.token_buckets), ecfg.execs_per_shape
        self.decode_execs = np.zeros((nb, E), np.uint64)
        self.prefill_execs = np.zeros((nb, nt, E), np.uint64)
        self._graphs: list[int] = []
        self._next_exec: dict[tuple, int] = {}
        self.report = CaptureReport()
        self._abi_dev = None
        self._tuned = False
        self._tables: dict[str, object] = {}
        # Buffers were zeroed on CuPy's (legacy) stream; ours is non-blocking: order them once.
        cp.cuda.Device().synchronize()

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        ecfg: EngineConfig = EngineConfig(),
        host_weights: dict[str, np.ndarray] | None = None,
        kernel_cache: object = DEFAULT_CACHE,
    ) -> Engine:
        """Engine over `host_weights` (HF names, float arrays) or random weights made on the GPU."""
        import cupy as cp

        cp.cuda.Device().use()
        cp.zeros(1)  # creates the primary context the driver API calls run in
        driver = Driver()
        kernels = Kernels(driver, kernel_cache)  # type: ignore[arg-type]
        stream = cp.cuda.Stream(non_blocking=True)
        if host_weights is None:
            weights = GpuWeights.random(config, driver, kernels, int(stream.ptr), seed=ecfg.seed)
        else:
            weights = GpuWeights.from_host(config, host_weights)
        stream.synchronize()
        return cls(config, ecfg, weights, driver, kernels, stream)

    @staticmethod
    def _pool_blocks(ecfg: EngineConfig, c: ModelConfig, max_context: int) -> int:
        import cupy as cp

        # Activation buffers are allocated after this; estimate them to leave room.
        Tm, Sm = ecfg.max_tokens, ecfg.max_seqs
        act = 2 * Tm * (3 * c.hidden_size + (c.q_size + 2 * c.kv_size) + 2 * c.q_size + 3 * c.intermediate_size)
        act += 4 * Sm * c.vocab_size + 8 * Sm * 32 * c.q_size * 4
        free = cp.cuda.runtime.memGetInfo()[0] - act - (ecfg.graph_reserve_mib << 20)
        per_block = c.num_layers * 2 * ecfg.block_size * c.kv_size * 2
        n = int(free * ecfg.kv_fraction) // per_block
        if n < max_context // ecfg.block_size:
            raise MemoryError(f"KV pool of {n} blocks cannot hold one {max_context}-token sequence")
        return n

    # ------------------------------------------------------------------ graph cache

    def _capture_one(
        self, S: int, T: int, decode: bool, execs: int, use_gemv: bool = True, only: set[str] | None = None
    ) -> list[int]:
        d = self.driver
        self._gemm_sm_target()
        d.begin_capture(self.s)
        try:
            self.fwd.record(self.s, S, T, decode, use_gemv=use_gemv, only=only)
        finally:
            graph = d.end_capture(self.s)
        self._graphs.append(graph)
        if decode:
            self.report.nodes_decode_max = max(self.report.nodes_decode_max, d.graph_node_count(graph))
        out = []
        for _ in range(execs):
            ex = d.instantiate_device_launch(graph)
            d.graph_upload(ex, self.s)
            out.append(ex)
        self.report.graphs += 1
        self.report.execs += execs
        return out

    def _gemm_sm_target(self) -> None:
        r = self.ecfg.gemm_sm_reserve
        self.cublas.set_sm_count_target(self.num_sms - r if r else 0)

    def _time_ms(self, fn: Callable[[], None], iters: int = 6) -> float:
        """GPU milliseconds per fn() (work enqueued on the engine's stream), behind a spin kernel
        so that the launch calls are all enqueued before the timed work starts."""
        import cupy as cp

        fn()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        self.driver.launch(self.kernels["spin_ns"], (1, 1, 1), (1, 1, 1), [ctypes.c_uint64(300_000)], self.s)
        a.record(self.stream)
        for _ in range(iters):
            fn()
        b.record(self.stream)
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) / iters

    def _tune_gemms(self, rows: list[int]) -> None:
        """Choose cublasGemmEx or a cuBLASLt algorithm for every cuBLAS shape of the steps
        (blink/gpu/cublaslt.py), on layer 0's weights and random activations."""
        import cupy as cp

        if not self.ecfg.gemm_candidates:
            return
        from blink.gpu.cublaslt import GemmTuner

        t0 = time.perf_counter()
        if self.cublas.tuner is None:
            r = self.ecfg.gemm_sm_reserve
            self.cublas.tuner = GemmTuner(
                self.s, int(self.workspace.data.ptr), int(self.workspace.nbytes), self.num_sms - r if r else 0
            )
        f, lw = self.fwd, self.weights.layers[0]
        jobs = []
        for r in rows:
            if f.uses_gemv(r):
                continue
            jobs += [(f.hid, lw.qkv, f.qkv, r, False), (f.attn, lw.o, f.delta, r, False)]
            jobs += [(f.hid, lw.gate_up, f.gu, r, False), (f.act, lw.down, f.delta, r, False)]
            if r <= self.dims.max_seqs:
                jobs.append((f.last, self.weights.lm_head, f.logits, r, True))
        inputs = (f.hid, f.attn, f.act, f.last)
        rng = cp.random.RandomState(self.ecfg.seed)
        for buf in inputs:  # bf16 N(0, 1) bit patterns (timing on zeros would flatter every kernel)
            buf[...] = (rng.standard_normal(buf.shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
        cp.cuda.Device().synchronize()  # CuPy wrote on its own stream; the GEMMs run on ours
        for n, (x, w, y, r, f32) in enumerate(jobs):
            n_out, k = int(w.shape[0]), int(w.shape[1])
            px, pw, py = int(x.data.ptr), int(w.data.ptr), int(y.data.ptr)
            res = self.cublas.tuner.tune(
                (r, n_out, k, f32),
                px,
                pw,
                y,
                lambda px=px, pw=pw, py=py, r=r, n_out=n_out, k=k, f32=f32: self.cublas.linear(
                    px, pw, py, r, n_out, k, f32, tuned=False
                ),
                self.driver,
                self._time_ms,
                self.ecfg.gemm_candidates,
                GEMM_MARGIN,
            )
            self.report.gemm_tuning.append(res.as_dict())
            if self.ecfg.progress:
                _bar(n + 1, len(jobs), time.perf_counter() - t0, "tuning GEMMs")
        self.stream.synchronize()  # type: ignore[attr-defined]
        for buf in inputs:
            buf[...] = 0
        cp.cuda.Device().synchronize()
        self.report.tune_seconds += time.perf_counter() - t0
        if self.ecfg.progress and jobs:
            lt = sum(1 for g in self.report.gemm_tuning if g["lt"])
            print(f"\n{lt} of {len(jobs)} GEMM shapes on cuBLASLt", file=sys.stderr)

    def _warmup(self) -> None:
        """Run each distinct GEMM row count once outside capture (cuBLAS loads its kernels and
        picks algorithms), with live counts 0 so the other kernels return at once; then tune."""
        self._gemm_sm_target()
        self.arena.host_bytes[:] = 0
        self.arena.upload(self.s, 0)
        rows = sorted(set(self.batch_buckets) | set(self.token_buckets))
        for r in rows:
            for lw in self.weights.layers[:1]:
                self.fwd.linear(self.fwd.hid, lw.qkv, self.fwd.qkv, r, self.s)
                self.fwd.linear(self.fwd.attn, lw.o, self.fwd.delta, r, self.s)
                self.fwd.linear(self.fwd.hid, lw.gate_up, self.fwd.gu, r, self.s)
                self.fwd.linear(self.fwd.act, lw.down, self.fwd.delta, r, self.s)
            if r <= self.dims.max_seqs:
                self.fwd.linear(self.fwd.last, self.weights.lm_head, self.fwd.logits, r, self.s, out_f32=True)
        self.fwd.record(self.s, self.batch_buckets[0], self.batch_buckets[0], True)
        self.fwd.record(self.s, 1, self.token_buckets[0], False)
        self.stream.synchronize()  # type: ignore[attr-defined]
        if not self._tuned:
            self._tune_gemms(rows)
            self._tuned = True

    def capture(
        self, decode: bool = True, prefill: bool = True, prefill_shapes: list[tuple[int, int]] | None = None
    ) -> CaptureReport:
        """Capture the graph grid (or only `prefill_shapes`), fill the lookup tables and the ABI record."""
        import cupy as cp

        self._warmup()
        free0 = cp.cuda.runtime.memGetInfo()[0]
        t0 = time.perf_counter()
        E = self.ecfg.execs_per_shape
        jobs: list[tuple[str, int, int, int, int]] = []
        if decode:
            jobs += [("decode", bi, -1, b, b) for bi, b in enumerate(self.batch_buckets)]
        if prefill:
            for bi, b in enumerate(self.batch_buckets):
                for ti, t in enumerate(self.token_buckets):
                    if t >= b and (prefill_shapes is None or (b, t) in prefill_shapes):
                        jobs.append(("prefill", bi, ti, b, t))
        for n, (kind, bi, ti, b, t) in enumerate(jobs):
            execs = self._capture_one(b, t, kind == "decode", E)
            if kind == "decode":
                self.decode_execs[bi] = execs
            else:
                self.prefill_execs[bi, ti] = execs
            self.report.shapes.append((kind, b, t))
            if self.ecfg.progress:
                _bar(n + 1, len(jobs), time.perf_counter() - t0)
        self.stream.synchronize()  # type: ignore[attr-defined]
        self.report.seconds += time.perf_counter() - t0
        self.report.device_bytes += free0 - cp.cuda.runtime.memGetInfo()[0]
        self._write_abi()
        if self.ecfg.progress:
            print(
                f"\ncaptured {self.report.graphs} graphs / {self.report.execs} execs in "
                f"{self.report.seconds:.1f} s, {self.report.device_bytes / 2**20:.0f} MiB",
                file=sys.stderr,
            )
        return self.report

    def capture_variant(
        self, S: int, T: int, decode: bool, use_gemv: bool = True, only: set[str] | None = None
    ) -> list[int]:
        """Extra execs of one shape outside the table: benchmarks compare GEMM back ends and time
        kernel categories on their own (`only`, see Forward.record)."""
        return self._capture_one(S, T, decode, self.ecfg.execs_per_shape, use_gemv=use_gemv, only=only)

    def _write_abi(self) -> None:
        import cupy as cp

        bb = np.array(self.batch_buckets, np.uint32)
        tb = np.array(self.token_buckets, np.uint32)
        bof = bucket_of(self.batch_buckets, self.dims.max_seqs)
        tof = bucket_of(self.token_buckets, self.dims.max_tokens)
        self._tables = {
            k: cp.asarray(v)
            for k, v in dict(
                batch_buckets=bb,
                token_buckets=tb,
                batch_bucket_of=bof,
                token_bucket_of=tof,
                decode_execs=self.decode_execs,
                prefill_execs=self.prefill_execs,
            ).items()
        }
        rec = np.zeros((), ENGINE_DTYPE)
        d, a = self.dims, self.arena.ptr
        rec["max_seqs"], rec["max_tokens"] = d.max_seqs, d.max_tokens
        rec["max_blocks_per_seq"], rec["block_size"] = d.max_blocks_per_seq, d.block_size
        rec["num_kv_blocks"], rec["vocab_size"], rec["max_context"] = (
            d.num_blocks,
            self.config.vocab_size,
            d.max_context,
        )
        rec["n_batch_buckets"], rec["n_token_buckets"] = len(bb), len(tb)
        rec["execs_per_shape"] = self.ecfg.execs_per_shape
        for name in (
            "num_seqs",
            "num_tokens",
            "input_ids",
            "positions",
            "cu_q_lens",
            "seq_lens",
            "block_tables",
            "temperature",
            "top_p",
            "top_k",
            "seeds",
            "sample_pos",
            "step_seq",
        ):
            rec[name] = a[name]
        rec["out_tokens"] = int(self.fwd.out_tokens.data.ptr)
        rec["done_seq"] = int(self.fwd.done_seq.data.ptr)
        for name, arr in self._tables.items():
            rec[name] = int(arr.data.ptr)  # type: ignore[attr-defined]
        self._abi_dev = cp.asarray(np.frombuffer(rec.tobytes(), np.uint8))

    @property
    def abi_ptr(self) -> int:
        if self._abi_dev is None:
            raise RuntimeError("capture() first: the ABI record lists the graph execs")
        return int(self._abi_dev.data.ptr)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ host launch

    def pick_exec(self, S: int, T: int, decode: bool) -> int:
        bi = int(np.searchsorted(self.batch_buckets, S))
        key: tuple
        if decode and bi < len(self.batch_buckets) and self.decode_execs[bi, 0]:
            row, key = self.decode_execs[bi], ("d", bi)
        else:
            ti = int(np.searchsorted(self.token_buckets, T))
            row = None
            for b in range(bi, len(self.batch_buckets)):  # smallest captured (b, t) that holds the step
                for t in range(ti, len(self.token_buckets)):
                    if self.prefill_execs[b, t, 0]:
                        row, key = self.prefill_execs[b, t], ("p", b, t)
                        break
                if row is not None:
                    break
            if row is None:
                raise RuntimeError(f"no captured graph holds S={S}, T={T}")
        e = self._next_exec.get(key, 0)
        self._next_exec[key] = (e + 1) % len(row)
        return int(row[e])

    def load_step(self, b: StepBatch, step_seq: int = 0) -> bool:
        """Write a StepBatch into the host mirror of the step arena; returns whether it is a decode step."""
        S, T, d = b.num_seqs, b.num_tokens, self.dims
        if S > d.max_seqs or T > d.max_tokens or S == 0:
            raise ValueError(f"step of {S} sequences / {T} tokens exceeds the engine ({d.max_seqs}, {d.max_tokens})")
        if int(np.max(b.seq_lens)) > d.max_context:
            raise ValueError(f"sequence longer than max_context {d.max_context}")
        h = self.arena.host
        h["num_seqs"][0], h["num_tokens"][0], h["step_seq"][0] = S, T, step_seq
        h["input_ids"][:T] = b.input_ids
        h["positions"][:T] = b.positions
        h["cu_q_lens"][: S + 1] = b.cu_q_lens
        h["seq_lens"][:S] = b.seq_lens
        h["temperature"][:S] = b.temperature
        h["top_p"][:S] = b.top_p
        h["top_k"][:S] = b.top_k
        h["seeds"][:S] = b.seeds
        h["sample_pos"][:S] = b.sample_pos
        bt = h["block_tables"].reshape(d.max_seqs, d.max_blocks_per_seq)
        w = min(b.block_tables.shape[1], d.max_blocks_per_seq)
        bt[:S, :w] = b.block_tables[:, :w]
        return T == S

    def step(self, b: StepBatch) -> np.ndarray:
        """Run one step through its graph from the host; returns (S,) int32 sampled tokens."""
        decode = self.load_step(b)
        self.arena.upload(self.s, b.num_seqs)
        self.driver.graph_launch(self.pick_exec(b.num_seqs, b.num_tokens, decode), self.s)
        out = self.fwd.out_tokens[: b.num_seqs].get(stream=self.stream)
        self.stream.synchronize()  # type: ignore[attr-defined]
        return out

    def logits(self, num_seqs: int) -> np.ndarray:
        """fp32 logits of the last step's sampled rows (S, vocab)."""
        self.stream.synchronize()  # type: ignore[attr-defined]
        return self.fwd.logits[:num_seqs].get()

    def close(self) -> None:
        for ex in {int(x) for x in self.decode_execs.ravel()} | {int(x) for x in self.prefill_execs.ravel()}:
            if ex:
                self.driver.graph_exec_destroy(ex)
        for g in self._graphs:
            self.driver.graph_destroy(g)
        self._graphs.clear()
        self.decode_execs[:] = 0
        self.prefill_execs[:] = 0
        if self.cublas.tuner is not None:
            self.cublas.tuner.close()
            self.cublas.tuner = None


def _bar(done: int, total: int, elapsed: float, what: str = "capturing graphs") -> None:
    width = 30
    fill = width * done // total
    print(
        f"\r{what} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} {elapsed:5.1f}s",
        end="",
        file=sys.stderr,
        flush=True,
    )
