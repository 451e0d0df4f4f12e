"""The CUDA model engine: weights, paged KV pool, step buffers and a device-launchable graph cache.

Usage (the GPU scheduler reads the ABI record; the host path calls `step`):

    from blink.gpu.engine.engine import Engine, EngineConfig
    from blink.models.config import preset
    eng = Engine.create(preset("llama3-8b"), EngineConfig(max_seqs=256, max_num_batched_tokens=4096))  # random weights
    # or Engine.create(cfg, EngineConfig(...), host_weights=hf_named_float32_dict)
    # or Engine.create(cfg, EngineConfig(...), bf16_tensors=registry.resolve_bf16(spec)[1])
    eng.capture()                       # decode + prefill graphs, 2 execs per shape, DeviceLaunch + uploaded
    eng.abi_ptr                         # device address of the ENGINE_DTYPE record (blink/gpu/engine/abi.py)
    eng.arena.ptr["input_ids"], ...     # device addresses of the step buffers (also in the record)
    tokens = eng.step(batch)            # host launch of the matching graph (blink.protocol.step.StepBatch)

Graph choice: decode graphs (every sequence has one query token) per batch bucket; prefill graphs
(any mix of chunk lengths, cached context allowed) per (batch bucket, token bucket) with
token bucket >= batch bucket. Shapes not captured are 0 in the table; a driver falls back to the
largest shape. One step may be in flight at a time: all graphs share the activation buffers and
the cuBLAS workspace.

Decode attention is chosen per batch bucket at capture time (attention_launch.decode_variant); a
graph never bakes in lengths, the flash kernels size their splits from the live num_seqs and
seq_lens (blink/gpu/engine/csrc/flash_decode.cu).

Why two execs per shape: relaunching an exec right after its completion token is seen fails with
cudaErrorInvalidValue about half the time on the H200 (the exec still counts as running), so the
scheduler alternates between them (blink_sched's launch() also retries that error).

Writing a step into the step arena (load_step, map_ring) is the StepLoader mixin
(blink/gpu/engine/step_loader.py); filling the ABI record after capture the AbiWriter mixin
(blink/gpu/engine/abi.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from blink.gpu.engine.abi import AbiWriter
from blink.gpu.engine.engine_config import (  # noqa: F401 (the engine's public names, re-exported)
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_TOKEN_BUCKETS,
    EngineConfig,
)
from blink.gpu.engine.forward import PDL_MIN_ARCH, Dims, Forward, kv_element_bytes
from blink.gpu.engine.fp8_gemm import SCALE_MODES, Fp8Gemm
from blink.gpu.engine.fp8_weights import (
    Fp8Loader,
    fp8_activation_bytes,
    fp8_head_scratch_elems,
    fp8_scratch_elems,
    quantize_head,
    quantize_layers,
)
from blink.gpu.engine.moe_launch import MoeLaunches
from blink.gpu.engine.step_loader import StepLoader
from blink.gpu.engine.weights import GpuWeights
from blink.gpu.toolchain.cuda_api import Cublas, CudaError, Driver
from blink.gpu.toolchain.kernels import DEFAULT_CACHE, Kernels, device_arch
from blink.models.config import ModelConfig
from blink.protocol.layout import MAX_LOGIT_BIAS, MAX_LOGPROBS
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.step import StepBatch


def _buckets(values: tuple[int, ...], cap: int) -> tuple[int, ...]:
    """The configured bucket sizes up to `cap`, plus `cap` itself (the largest shape)."""
    out = sorted({v for v in values if v <= cap} | {cap})
    return tuple(out)


@dataclass
class CaptureReport:
    graphs: int = 0
    execs: int = 0
    seconds: float = 0.0
    device_bytes: int = 0
    nodes_decode_max: int = 0
    shapes: list[tuple[str, int, int]] = field(default_factory=list)
    pdl_refused: str = ""  # why the graphs were captured without programmatic dependent launch


class Engine(StepLoader, AbiWriter):
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
        self.token_buckets = _buckets(ecfg.token_buckets, ecfg.max_num_batched_tokens)
        num_blocks = ecfg.num_kv_blocks or self._pool_blocks(ecfg, config, max_context)
        self.dims = Dims(ecfg.max_seqs, ecfg.max_num_batched_tokens, mbps, ecfg.block_size, num_blocks, max_context)
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.num_sms = int(sms)
        self.fwd = Forward(
            config,
            weights,
            self.dims,
            driver,
            kernels,
            self.cublas,
            sms,
            sampling_rows=ecfg.sampling_rows,
            kv_cache_dtype=ecfg.kv_cache_dtype,
        )
        self.fwd.gemv_max_tokens = ecfg.gemv_max_tokens
        self.fwd.fp8_gemv_max_tokens = ecfg.fp8_gemv_max_tokens
        self.fwd.fp8_mma_min_tokens = ecfg.fp8_mma_min_tokens
        self.fwd.set_fp8_gemv_config(dict(ecfg.fp8_gemv_config))
        self.fwd.pdl = ecfg.pdl and device_arch() >= PDL_MIN_ARCH
        if self.fwd.fp8:
            self._set_fp8_path()
        self.arena = self.fwd.arena
        nb, nt, E = len(self.batch_buckets), len(self.token_buckets), ecfg.execs_per_shape
        self.decode_execs = np.zeros((nb, E), np.uint64)
        self.prefill_execs = np.zeros((nb, nt, E), np.uint64)
        self._graphs: list[int] = []
        self._next_exec: dict[tuple, int] = {}
        self.report = CaptureReport()
        self._abi_dev = None
        self._tables: dict[str, object] = {}
        self._ring: tuple[int, RingGeometry] | None = None  # map_ring: the ring's device address, geometry
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
        bf16_tensors: Iterable[tuple[str, np.ndarray]] | None = None,
    ) -> Engine:
        """Engine over `bf16_tensors` (blink.models.weights.Bf16Tensors, uploaded one at a time: the
        device process's path), `host_weights` (HF names, float arrays, rounded to bf16), or random
        weights made on the GPU when neither is given."""
        if host_weights is not None and bf16_tensors is not None:
            raise ValueError("Engine.create: host_weights or bf16_tensors, not both")
        import cupy as cp

        cp.cuda.Device().use()
        cp.zeros(1)  # creates the primary context the driver API calls run in
        driver = Driver()
        kernels = Kernels(driver, kernel_cache)  # type: ignore[arg-type]
        stream = cp.cuda.Stream(non_blocking=True)
        fp8 = ecfg.quantization == "fp8"
        if fp8 and host_weights is not None:
            raise ValueError("Engine.create: fp8 weights come from bf16_tensors or random weights")
        if bf16_tensors is not None:
            loader = Fp8Loader(driver, kernels, fp8_scratch_elems(config)) if fp8 else None
            weights = GpuWeights.from_bf16(config, bf16_tensors, loader, fp8_head=fp8 and ecfg.fp8_lm_head)
            del loader  # its staging buffer: freed once the last quantization ran (legacy stream order)
        elif host_weights is not None:
            weights = GpuWeights.from_host(config, host_weights)
        else:
            weights = GpuWeights.random(config, driver, kernels, int(stream.ptr), seed=ecfg.seed)
            if fp8:
                stream.synchronize()
                quantize_layers(weights.layers, driver, kernels)
                if ecfg.fp8_lm_head:
                    quantize_head(weights, driver, kernels)
        stream.synchronize()
        cp.cuda.Device().synchronize()
        return cls(config, ecfg, weights, driver, kernels, stream)

    @staticmethod
    def _pool_blocks(ecfg: EngineConfig, c: ModelConfig, max_context: int) -> int:
        import cupy as cp

        # Activation buffers are allocated after this; estimate them to leave room.
        Tm, Sm = ecfg.max_num_batched_tokens, ecfg.max_seqs
        act = 2 * Tm * (3 * c.hidden_size + (c.q_size + 2 * c.kv_size) + 2 * c.q_size + 3 * c.intermediate_size)
        act += 4 * Sm * c.vocab_size + 8 * Sm * 32 * c.q_size * 4
        if c.is_moe:
            act += MoeLaunches.device_bytes(c, Tm)
        if ecfg.quantization:  # the largest of the paths' buffers (the path is chosen after this)
            act += max(fp8_activation_bytes(c, Tm, p) for p in ("epilogue", "dequant"))
            act += 2 * fp8_head_scratch_elems(c, Sm) if ecfg.fp8_lm_head else 0
        if ecfg.sampling_rows:  # processed logits, penalty state, logit_bias tables, prompt logprob rows
            act += 4 * Sm * c.vocab_size + ecfg.sampling_rows * (4 * c.vocab_size + 8 * MAX_LOGIT_BIAS)
            act += Tm * (4 * c.vocab_size + 2 * c.hidden_size + 4 + 8 * MAX_LOGPROBS)
        # What CuPy's pool keeps cached from frees (FP8 random weights made in bf16, a loader's staging
        # buffer) is free memory too: hand it back first, or the driver does not count it.
        cp.get_default_memory_pool().free_all_blocks()
        free = cp.cuda.runtime.memGetInfo()[0] - act - (ecfg.graph_reserve_mib << 20)
        per_block = c.num_layers * 2 * ecfg.block_size * c.kv_size * kv_element_bytes(ecfg.kv_cache_dtype)
        n = int(free * ecfg.kv_fraction) // per_block
        if n < max_context // ecfg.block_size:
            raise MemoryError(f"KV pool of {n} blocks cannot hold one {max_context}-token sequence")
        return n

    def _set_fp8_path(self) -> None:
        """Choose the FP8 projections' paths past the GEMV (EngineConfig.fp8_gemm): "auto" the W8A8
        scaling modes that cuBLASLt supports for every projection shape (each GEMM then takes one by
        its shape: fp8_gemm.fp8_gemm_mode), else dequantize + bf16 GEMM; a mode named alone."""
        want, r = self.ecfg.fp8_gemm, self.ecfg.gemm_sm_reserve
        lw = self.weights.layers[0]
        shapes = [tuple(w.shape) for w in (lw.qkv, lw.o, lw.gate_up, lw.down) if w is not None]
        rows = sorted({*self.token_buckets, *(b for b in self.batch_buckets if b > self.ecfg.fp8_gemv_max_tokens)})
        gemms: dict[str, Fp8Gemm] = {}
        for scales in SCALE_MODES if want == "auto" else (want,) if want in SCALE_MODES else ():
            g = Fp8Gemm(self.driver, self.s, int(self.workspace.data.ptr), int(self.workspace.nbytes), scales,
                        self.num_sms - r if r else 0, self.ecfg.fp8_fast_accum)  # fmt: skip
            if all(g.supported((t, n, k)) for t in rows[:1] + rows[-1:] for n, k in shapes):
                gemms[scales] = g
                continue
            g.close()
            if want != "auto":
                raise ValueError(f"fp8_gemm {want!r}: cuBLASLt offers no such FP8 GEMM on this GPU")
        self.fwd.set_fp8_gemm(gemms)

    # ------------------------------------------------------------------ graph cache

    def _capture_one(self, S: int, T: int, decode: bool, execs: int) -> list[int]:
        d = self.driver
        self._gemm_sm_target()
        d.begin_capture(self.s)
        try:
            self.fwd.record(self.s, S, T, decode)
        finally:
            graph = d.end_capture(self.s)
        self._graphs.append(graph)
        if decode:
            self.report.nodes_decode_max = max(self.report.nodes_decode_max, d.graph_node_count(graph))
        out = []
        for _ in range(execs):
            try:
                ex = d.instantiate_device_launch(graph)
            except CudaError as e:
                if not self.fwd.pdl or out:
                    raise
                self._refuse_pdl(graph, str(e))
                return self._capture_one(S, T, decode, execs)
            d.graph_upload(ex, self.s)
            out.append(ex)
        self.report.graphs += 1
        self.report.execs += execs
        return out

    def _refuse_pdl(self, graph: int, why: str) -> None:
        """A graph with programmatic dependent launch that cannot be instantiated for device launch: it is
        captured again without it, and so is every graph after it."""
        self._graphs.remove(graph)
        self.driver.graph_destroy(graph)
        self.fwd.pdl = False
        self.report.pdl_refused = why
        print(f"blink engine: graphs captured without programmatic dependent launch ({why})", file=sys.stderr)

    def _gemm_sm_target(self) -> None:
        r = self.ecfg.gemm_sm_reserve
        self.cublas.set_sm_count_target(self.num_sms - r if r else 0)

    def gemm_jobs(self, rows: list[int]) -> list[tuple[object, object, object, int, bool]]:
        """Every cuBLAS-or-GEMV projection of a step at each row count, as (x, w, y, rows, fp32
        output) on layer 0's weights and the activation buffers: what warm-up runs and tuning times."""
        f, lw = self.fwd, self.weights.layers[0]
        dense = next((x for x in self.weights.layers if x.router is None), None)
        sparse = next((x for x in self.weights.layers if x.router is not None), None)
        jobs: list[tuple[object, object, object, int, bool]] = []
        for r in rows:
            jobs += [(f.hid, lw.qkv, f.qkv, r, False), (f.attn, lw.o, f.delta, r, False)]
            if dense is not None:
                jobs += [(f.hid, dense.gate_up, f.gu, r, False), (f.act, dense.down, f.delta, r, False)]
            if sparse is not None:
                jobs.append((f.hid, sparse.router, f.moe.logits, r, True))  # type: ignore[union-attr]
            if r <= self.dims.max_seqs:
                jobs.append((f.last, self.weights.lm_head, f.logits, r, True))
        return jobs

    def _warmup(self) -> None:
        """Run each distinct GEMM row count once outside capture (cuBLAS loads its kernels and
        picks algorithms), with live counts 0 so the other kernels return at once."""
        self._gemm_sm_target()
        self.arena.host_bytes[:] = 0
        self.arena.upload(self.s, 0)
        rows = sorted(set(self.batch_buckets) | set(self.token_buckets))
        for x, w, y, r, f32 in self.gemm_jobs(rows):
            self.fwd.linear(x, w, y, r, self.s, out_f32=f32)
        self.fwd.record(self.s, self.batch_buckets[0], self.batch_buckets[0], True)
        self.fwd.record(self.s, 1, self.token_buckets[0], False)
        self.stream.synchronize()  # type: ignore[attr-defined]

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

    def capture_variant(self, S: int, T: int, decode: bool) -> list[int]:
        """Extra execs of one shape outside the table, recorded with the engine's current kernel
        choices: tests and benchmarks compare variants (attention, fusions, GEMM back ends) on one
        KV cache."""
        return self._capture_one(S, T, decode, self.ecfg.execs_per_shape)

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

    @staticmethod
    def bind_thread() -> None:
        """Make the device's primary context current in the calling thread. Driver API calls (the ring's
        registration) from a thread that has made no CUDA runtime call yet would find no context
        (CUDA_ERROR_INVALID_CONTEXT); cudaSetDevice makes the primary context current, cudaFree(0)
        makes sure it exists."""
        import cupy as cp

        rt = cp.cuda.runtime
        rt.setDevice(rt.getDevice())
        rt.free(0)

    def step(self, b: StepBatch) -> np.ndarray:
        """Run one step through its graph from the host; returns (S,) int32 sampled tokens. With
        b.ext, the logprob records of its rows with logprobs >= 0 are written into b.ext.logprobs,
        and those of its scored prompt tokens (targets >= 0) into b.ext.prompt_logprobs."""
        decode = self.load_step(b)
        P = int(self.arena.host["plp_count"][0]) if b.ext is not None else 0
        decode = decode and not P  # prompt logprobs are computed by the prefill graphs only
        keep = self._upload_bias(b)
        self.arena.upload(self.s, b.num_seqs)
        self.driver.graph_launch(self.pick_exec(b.num_seqs, b.num_tokens, decode), self.s)
        S, f, x = b.num_seqs, self.fwd, b.ext
        out = f.out_tokens[:S].get(stream=self.stream)
        n_alt = None if x is None else x.column("logprobs")
        want = None if x is None else np.flatnonzero((n_alt >= 0) & x.emit)
        if want is not None and want.size:
            chosen = f.chosen_lp[:S].get(stream=self.stream)
            top_ids = f.top_ids[:S].get(stream=self.stream)
            top_lps = f.top_lps[:S].get(stream=self.stream)
        if P:
            p_lp = f.plp_lp[:P].get(stream=self.stream)
            p_ids = f.plp_ids[:P].get(stream=self.stream)
            p_lps = f.plp_lps[:P].get(stream=self.stream)
        self.stream.synchronize()  # type: ignore[attr-defined]
        del keep
        if want is not None and want.size:
            for s in want:
                n = int(min(n_alt[s], MAX_LOGPROBS))
                rec = x.logprobs[s]
                rec["logprob"] = chosen[s]
                rec["top_ids"][:n] = top_ids[s, :n]
                rec["top_logprobs"][:n] = top_lps[s, :n]
        if P:  # the kernels wrote the first plp_prompt_logprobs[j] alternatives of each; the rest are not read
            rec = x.prompt_logprobs[self.arena.host["plp_tok"][:P]]
            rec["logprob"], rec["top_ids"], rec["top_logprobs"] = p_lp, p_ids, p_lps
            x.prompt_logprobs[self.arena.host["plp_tok"][:P]] = rec
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
        for g in self.fwd.fp8_gemms.values():
            g.close()
        self.fwd.fp8_gemms = {}


def _bar(done: int, total: int, elapsed: float, what: str = "capturing graphs") -> None:
    width = 30
    fill = width * done // total
    print(
        f"\r{what} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} {elapsed:5.1f}s",
        end="",
        file=sys.stderr,
        flush=True,
    )
