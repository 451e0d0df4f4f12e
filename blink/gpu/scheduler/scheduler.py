"""The GPU-resident scheduler: control block layout, build, and the host-side launcher.

The kernel (`blink/gpu/scheduler/csrc/scheduler.cu`) is one block of 256 threads captured into a
device-launchable graph. The host launches it once; from then on the kernel scans the ring,
claims requests, builds each step in the engine's device buffers (`blink.gpu.engine.abi`), launches the
engine's graphs fire-and-forget, polls their completion word and publishes tokens to the ring.
It relaunches itself (tail launch) before the 120 fire-and-forget launches a graph execution may
issue, so it runs until `header.shutdown` is set. The host thread makes no CUDA call meanwhile.

`SCHED_CTL_DTYPE` is the one record the host and the kernel share: configuration written by the
host before the launch, state and diagnostics the kernel keeps across relaunches. The CUDA view
`blink/gpu/scheduler/csrc/scheduler_ctl.cuh` is generated from it (`python -m blink.gpu.scheduler.scheduler`).
Everything else the kernel keeps (rows, plan) lives in module globals no host code reads.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from blink.device.policy import StepLimits, step_limits
from blink.gpu.toolchain.build import Unit, build, default_cache_dir, nvrtc, target_for
from blink.gpu.toolchain.kernels import pack_args, signatures
from blink.protocol.cgen import header_main, header_text, struct_lines
from blink.protocol.layout import BLOCK_KEY_WORDS, SLOT_DTYPE
from blink.protocol.ring_geometry import RingView

CSRC = pathlib.Path(__file__).resolve().parent / "csrc"
ENGINE_INCLUDE = pathlib.Path(__file__).resolve().parents[1] / "engine" / "include"
ENGINE_SYS_MEMORY = ENGINE_INCLUDE.parent / "csrc" / "sys_memory.cuh"  # ring loads and stores, shared with sampling.cu
CTL_HEADER_PATH = CSRC / "scheduler_ctl.cuh"
SOURCES = (
    "scheduler.cu",
    "scheduler.cuh",
    "scheduler_kv.cuh",
    "scheduler_plan.cuh",
    "scheduler_ring.cuh",
    "scheduler_ctl.cuh",
    "scheduler_budget.cuh",
    "scheduler_policy.cuh",
)
KERNEL = "blink_sched"
INIT_KERNEL = "blink_sched_init"
THREADS = 256  # one block; the kernel's scan partition and row mapping assume exactly this
MAX_ROWS = 1024  # decode batch capacity compiled into the kernel (rows per step <= this)
LAUNCH_WINDOW = 120  # fire-and-forget launches one graph execution may issue
DEFAULT_CACHE = default_cache_dir()  # beside the engine's cubins

# ctl.flags bits
FLAG_ALWAYS_SCAN = 1  # scan every slot on every iteration (benchmarks the scan; no doorbell gating)

# fmt: off
SCHED_CTL_DTYPE = np.dtype([
    # configuration: written by the host before the first launch
    ("ring", "<u8"),                 # RingHeader*  (host-mapped: device pointer == host pointer)
    ("engine", "<u8"),               # const EngineABI*  (device memory, filled by the engine)
    ("claim", "<u8"),                # u32* [n_slots]  device-side claim word per slot (CAS 0 -> 1)
    ("waitq", "<u8"),                # u32* [n_slots]  FIFO of claimed slots not yet admitted
    ("kv_free", "<u8"),              # u32* [rows_cap * max_blocks_per_seq]  blocks freed by rows, drained by the plan
    ("row_blocks", "<u8"),           # i32* [rows_cap, max_blocks_per_seq]  block table of each row
    ("row_tokens", "<u8"),           # i32* [rows_cap, max_context]  prompt + generated of each row
    ("slot_copy", "<u8"),            # RingSlot* [n_slots]  request fields copied at claim time
    ("clock_offset_ns", "<i8"),      # unix ns = %globaltimer + clock_offset_ns
    ("graph_timeout_ns", "<u8"),     # a graph not done after this long -> FAILED
    ("rescan_ns", "<u8"),            # full slot scan (and cancel check) at least this often
    ("beat_ns", "<u8"),              # heartbeat period (<= 1 ms)
    ("rows_cap", "<u4"),             # rows (live sequences incl. preempted) the buffers hold, <= MAX_ROWS
    ("max_batch", "<u4"),            # running sequences (<= engine max_seqs, max_num_batched_tokens)
    ("max_num_batched_tokens", "<u4"),           # packed prompt tokens per prefill step (<= engine max_num_batched_tokens)
    ("max_context", "<u4"),          # prompt + generated per sequence (fits the KV pool)
    ("window", "<u4"),               # fire-and-forget launches per scheduler instance (<= 120)
    ("retry_max", "<u4"),            # retries of a launch that returns cudaErrorInvalidValue
    ("flags", "<u4"),                # FLAG_* bits
    ("long_prefill", "<u4"),         # most tokens of a running prefill per step while a request waits
    ("mixed_tokens", "<u4"),         # token budget of a step with decodes (step_budget); 0 = max_num_batched_tokens
    ("self_exec", "<u8"),            # the scheduler's own exec, if cudaGetCurrentGraphExec() gives 0
    # KV pool and prefix cache (csrc/scheduler_kv.cuh)
    ("kv_ref", "<u8"),               # u32* [num_kv_blocks]  rows holding each block
    ("kv_link", "<u8"),              # i32* [2, num_kv_blocks]  free queue: next, prev (-1: none)
    ("kv_key", "<u8"),               # u32* [num_kv_blocks, 5]  a block's key words, then 1 when keyed
    ("kv_hash", "<u8"),              # u32* [hash_mask + 1, 5]  key words, then block + 1 (0: empty)
    ("kv_takes", "<u8"),             # i32* [num_kv_blocks]  blocks taken by thread 0 for a parallel hand-out
    ("slot_keys", "<u8"),            # u32* [n_slots, max_blocks_per_seq, 4]  block keys copied at claim
    ("kv_cache_key", "<u8"),         # header.kv_cache_key (the model's identity; seeds the key chains)
    ("hash_mask", "<u4"),            # key table entries - 1 (a power of two >= 2 x num_kv_blocks)
    ("prefix_caching", "<u4"),       # 1: match and register block keys (DeviceFeatures.PREFIX_CACHING)
    # kernel state: zero before the first launch; kept across tail relaunches
    ("seq", "<u8"),                  # last step_seq written
    ("instances", "<u8"),            # scheduler graph executions so far
    ("here", "<u4"),                 # fire-and-forget launches by the current instance
    ("status", "<u4"),               # DeviceStatus as the kernel last wrote it
    ("fault", "<u4"),                # fault code when FAILED
    ("last_error", "<u4"),           # last cudaError_t of a failed launch
    ("max_retries", "<u4"),          # most retries one launch needed
    ("last_kind", "<u4"),            # 1 prefill (mixed included), 2 decode: the last step's graph family
    ("waitq_head", "<u4"),           # FIFO indices (monotonic, modulo n_slots)
    ("waitq_tail", "<u4"),
    ("kv_free_top", "<i4"),          # blocks in the free queue (cached ones included)
    ("kv_head", "<i4"),              # free queue: next block out (-1: empty)
    ("kv_tail", "<i4"),              # free queue: most recently released keyed block
    ("kv_pending", "<u4"),           # entries of kv_free not drained yet
    ("kv_cached", "<u4"),            # keys registered (blocks held or evictable)
    ("last_reset_seq", "<u8"),       # header.reset_cache_seq as last acted on
    ("prefix_cache_queries", "<u8"), # prompt tokens of first admissions
    ("prefix_cache_hits", "<u8"),    # of those, taken from the cache
    ("prefix_cache_resets", "<u8"),
    ("reset_pending", "<u4"),        # the reset doorbell moved: the next plan forgets every key
    ("_pad_kv", "<u4"),
    ("n_run", "<u4"),                # running rows (g_run, arrival order)
    ("n_wait", "<u4"),               # preempted rows waiting for recompute (g_wait, arrival order)
    ("n_free_rows", "<u4"),          # free row ids on the stack
    ("retries", "<u8"),              # launches retried (cudaErrorInvalidValue) in total
    ("last_submit_seq", "<u8"),      # doorbells as of the last scan
    ("last_cancel_seq", "<u8"),
    ("last_scan_ns", "<u8"),
    ("last_beat_ns", "<u8"),
    ("heartbeat", "<u8"),
    ("preemptions", "<u8"),
    # statistics, mirrored into the ring header
    ("steps", "<u8"),
    ("prefill_steps", "<u8"),
    ("tokens_generated", "<u8"),
    ("prompt_tokens", "<u8"),
    ("requests_admitted", "<u8"),
    ("requests_completed", "<u8"),
    ("launches", "<u8"),
    ("relaunches", "<u8"),
    ("launch_errors", "<u8"),
    ("sched_ns_total", "<u8"),
    ("step_ns_total", "<u8"),
    ("scan_ns_total", "<u8"),
    ("scans", "<u8"),
    ("mask_late_rows", "<u8"),       # constrained rows sampled before their mask was published (no token)
    # finer timing (not in the header): where the scheduler's own time goes
    ("plan_ns_total", "<u8"),        # iteration start -> launch call
    ("launch_ns_total", "<u8"),      # device cudaGraphLaunch calls, retries included
    ("wait_ns_total", "<u8"),        # launch return -> completion seen (graph time + poll latency)
    ("publish_ns_total", "<u8"),     # completion seen -> results accounted (ring writes overlap the next step)
    ("busy_iters", "<u8"),           # iterations that launched a step
], align=True)
# fmt: on


def render_ctl_header() -> str:
    body = [
        f"constexpr int SCHED_THREADS = {THREADS};",
        f"constexpr int SCHED_MAX_ROWS = {MAX_ROWS};",
        f"constexpr uint32_t SCHED_LAUNCH_WINDOW = {LAUNCH_WINDOW};",
        f"constexpr uint32_t SCHED_FLAG_ALWAYS_SCAN = {FLAG_ALWAYS_SCAN};",
        "",
        *struct_lines("SchedCtl", SCHED_CTL_DTYPE),
    ]
    about = ["The scheduler's control block: host-written configuration, kernel state kept across relaunches."]
    return header_text("blink.gpu.scheduler.scheduler", "blink/gpu/scheduler/scheduler.py", about, body)


# -- build -------------------------------------------------------------------------------------

# -ewp (extensible whole program): NVRTC declares the device runtime's cudaGraphLaunch and
# cudaGetCurrentGraphExec only for separately compiled code; -ewp declares them while keeping one
# whole-program cubin. The only external symbol left is cudaGraphLaunch, which the driver resolves
# at load time. A relocatable cubin (-rdc without a device link) would fail
# cuModuleGetFunction with CUDA_ERROR_INVALID_IMAGE: its unified function tables stay unresolved.
UNIT = Unit(
    CSRC / SOURCES[0],
    (*(CSRC / s for s in SOURCES[1:]), CSRC / "blink_ring.h", ENGINE_INCLUDE / "blink_engine.h", ENGINE_SYS_MEMORY),
    ("-ewp", "-lineinfo"),
)


def build_cubin(cache_dir: str | os.PathLike | None = None, arch: int = 90) -> pathlib.Path:
    """The scheduler module's cubin for compute capability `arch`, compiled (NVRTC) unless the
    cache holds this version. Raises blink.gpu.toolchain.build.BuildError when it cannot be built."""
    return build(UNIT, target_for(arch, nvrtc().archs), cache_dir or DEFAULT_CACHE)


# -- launcher ----------------------------------------------------------------------------------


def launch_args(kernel: str, **kwargs: object) -> list:
    """The ctypes arguments of a scheduler kernel, checked against its signature in
    csrc/kernel_params.json (as the engine's launches are)."""
    return pack_args(kernel, signatures("scheduler.cu")[kernel], kwargs)


def hash_entries(num_blocks: int) -> int:
    """Entries of the key table: the power of two at least twice the pool (load <= 1/2)."""
    return 1 << max(1, (2 * num_blocks - 1).bit_length())


def device_buffers(
    n_slots: int, num_blocks: int, max_blocks_per_seq: int, rows_cap: int, max_context: int
) -> dict[str, tuple[int, type]]:
    """The scheduler's device buffers (SchedCtl pointers): name -> (elements, numpy dtype).
    slot_copy holds one RingSlot per slot, so its size comes from the ring layout."""
    return {
        "claim": (n_slots, np.uint32),
        "waitq": (n_slots, np.uint32),
        # a block shared by several rows is freed once by each: the pending list holds every table entry
        "kv_free": (max(num_blocks, rows_cap * max_blocks_per_seq), np.uint32),
        "kv_ref": (num_blocks, np.uint32),
        "kv_link": (2 * num_blocks, np.int32),
        "kv_key": (5 * num_blocks, np.uint32),
        "kv_hash": (5 * hash_entries(num_blocks), np.uint32),
        "kv_takes": (num_blocks, np.int32),
        "slot_keys": (n_slots * max_blocks_per_seq * BLOCK_KEY_WORDS, np.uint32),
        "row_blocks": (rows_cap * max_blocks_per_seq, np.int32),
        "row_tokens": (rows_cap * max_context, np.int32),
        "slot_copy": (n_slots * SLOT_DTYPE.itemsize, np.uint8),
    }


_KV_BUFFERS = ("kv_ref", "kv_link", "kv_key", "kv_hash", "kv_takes", "slot_keys")


@dataclass(frozen=True)
class GpuSchedulerConfig:
    max_batch: int = 0
    """Running sequences; 0 = the engine's max_seqs (never more than it, its max_num_batched_tokens or MAX_ROWS)."""
    max_num_batched_tokens: int = 0
    """Tokens per step (decodes + prefill chunks); 0 = the engine's max_num_batched_tokens (never more)."""
    long_prefill_tokens: int = 0
    """Most tokens a running prefill takes per step while a request waits; 0 = a quarter of max_num_batched_tokens."""
    mixed_tokens: int = 0
    """Token budget of a step that carries decodes (blink.device.policy.step_budget); 0 = max_num_batched_tokens."""
    window: int = LAUNCH_WINDOW
    """Fire-and-forget launches per scheduler instance before the tail self-relaunch (1..120)."""
    retry_max: int = 1000
    """Retries of a launch answered cudaErrorInvalidValue (the exec still finishing)."""
    graph_timeout_s: float = 30.0
    """A step graph not complete after this long fails the device (status FAILED)."""
    rescan_s: float = 5e-3
    """Full slot scan and cancel check at least this often without a doorbell."""
    beat_s: float = 100e-6
    """Heartbeat period (the ring promises <= 1 ms)."""
    always_scan: bool = False
    """Scan every slot on every iteration (benchmarks the scan)."""
    prefix_caching: bool = True
    """Match the slots' block keys against cached KV blocks (blink/device/kv_blocks.py's policy)."""
    kv_cache_key: int = 0
    """header.kv_cache_key: the model's identity, which seeds the frontends' key chains."""

    def __post_init__(self) -> None:
        if min(self.max_batch, self.max_num_batched_tokens, self.long_prefill_tokens, self.mixed_tokens) < 0:
            raise ValueError("max_batch, max_num_batched_tokens, long_prefill_tokens and mixed_tokens must be >= 0")
        if not 1 <= self.window <= LAUNCH_WINDOW:
            raise ValueError(f"window must be in [1, {LAUNCH_WINDOW}], got {self.window}")
        if self.retry_max < 0 or self.graph_timeout_s <= 0 or self.rescan_s <= 0:
            raise ValueError("retry_max >= 0, graph_timeout_s > 0 and rescan_s > 0 required")
        if not 0 < self.beat_s <= 1e-3:
            raise ValueError("beat_s must be in (0, 1 ms]")


class GpuScheduler:
    """Starts the scheduler kernel on a ring for an engine whose graphs are captured.

    `start()` maps the ring, builds the control block, captures the kernel into a device-launchable
    graph and launches it once. From then until `join()` the calling thread makes no CUDA call:
    `status()` and `wait()` read the ring header in host memory only.
    """

    def __init__(self, engine: Any, view: RingView, config: GpuSchedulerConfig | None = None):
        from blink.gpu.toolchain.cuda_api import Driver

        self.engine = engine
        self.config = config or GpuSchedulerConfig()
        self.view = view
        self.drv: Driver = engine.driver
        self._ring_np = np.frombuffer(self.view.buf, np.uint8)
        self._registered = 0
        self._stream = None
        self._bufs: dict[str, object] = {}
        self.ctl = np.zeros((), SCHED_CTL_DTYPE)
        self.exec = 0
        self._graph = 0
        self.started = False

    def limits(self) -> StepLimits:
        """The limits the device schedules with and advertises (blink.device.policy.step_limits)."""
        d, cfg = self.engine.dims, self.config
        return step_limits(
            d.max_seqs,
            d.max_num_batched_tokens,
            d.max_context,
            d.num_blocks,
            d.block_size,
            max_batch=cfg.max_batch,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            long_prefill_tokens=cfg.long_prefill_tokens,
            mixed_tokens=cfg.mixed_tokens,
            batch_cap=MAX_ROWS,
        )

    def _clock_offset(self, fn_clock: int) -> int:
        """ns to add to %globaltimer to get time.time_ns(), never too small: the upper bound of
        the offset over several bracketed reads, so device stamps never precede host stamps."""
        import time

        import cupy as cp

        out = cp.zeros(1, cp.uint64)
        best = None
        for _ in range(20):
            t0 = time.time_ns()
            self.drv.launch(fn_clock, (1, 1, 1), (1, 1, 1), launch_args("blink_sched_clock", out=out), self._stream.ptr)
            self._stream.synchronize()
            t1 = time.time_ns()
            g = int(out.get()[0])
            if t1 - t0 < 5_000_000:
                best = t1 - g if best is None else min(best, t1 - g)
        if best is None:
            raise RuntimeError("could not calibrate the device clock")
        return best

    def start(self, cache_dir: str | None = None) -> None:

        import cupy as cp

        from blink.gpu.toolchain import cudart

        if self.started:
            raise RuntimeError("scheduler already started")
        eng, d, cfg = self.engine, self.engine.dims, self.config
        geo = self.view.geo
        lim = self.limits()
        max_batch, max_num_batched_tokens, max_context = lim.max_batch, lim.max_num_batched_tokens, lim.max_context
        rows_cap = min(MAX_ROWS, 2 * max_batch + 8)  # running + preempted rows
        kernels = eng.kernels
        cubin = build_cubin(cache_dir or kernels.cache_dir, kernels.arch)
        self.module = self.drv.module_load(str(cubin))
        fn = self.drv.get_function(self.module, KERNEL)
        fn_init = self.drv.get_function(self.module, INIT_KERNEL)
        fn_clock = self.drv.get_function(self.module, "blink_sched_clock")
        self._stream = cp.cuda.Stream(non_blocking=True)
        host_ptr = int(self._ring_np.ctypes.data)
        self._registered = cudart.host_register(self.drv, host_ptr, geo.total_bytes)
        b = self._bufs
        for name, (n, dtype) in device_buffers(
            geo.n_slots, d.num_blocks, d.max_blocks_per_seq, rows_cap, max_context
        ).items():
            b[name] = cp.zeros(n, dtype)
        c = self.ctl
        c["ring"] = self._registered
        c["engine"] = eng.abi_ptr
        for k in ("claim", "waitq", "kv_free", "row_blocks", "row_tokens", "slot_copy", *_KV_BUFFERS):
            c[k] = int(b[k].data.ptr)
        c["hash_mask"] = hash_entries(d.num_blocks) - 1
        c["prefix_caching"], c["kv_cache_key"] = int(cfg.prefix_caching), cfg.kv_cache_key
        c["clock_offset_ns"] = self._clock_offset(fn_clock)
        c["graph_timeout_ns"] = int(cfg.graph_timeout_s * 1e9)
        c["rescan_ns"] = int(cfg.rescan_s * 1e9)
        c["beat_ns"] = int(cfg.beat_s * 1e9)
        c["rows_cap"], c["max_batch"], c["max_num_batched_tokens"], c["max_context"] = (
            rows_cap,
            max_batch,
            max_num_batched_tokens,
            max_context,
        )
        c["window"], c["retry_max"] = cfg.window, cfg.retry_max
        c["long_prefill"], c["mixed_tokens"] = lim.long_prefill_tokens, lim.mixed_tokens
        c["flags"] = FLAG_ALWAYS_SCAN if cfg.always_scan else 0
        b["ctl"] = cp.asarray(np.frombuffer(c.tobytes(), np.uint8))
        s = self._stream.ptr
        cp.cuda.Device().synchronize()  # the buffers were filled on CuPy's stream; ours does not wait for it
        init_args = launch_args(INIT_KERNEL, c=b["ctl"], n_slots=geo.n_slots, num_kv_blocks=d.num_blocks)
        self.drv.launch(fn_init, (4, 1, 1), (256, 1, 1), init_args, s)
        self._stream.synchronize()
        # The kernel must run as a device graph: only then can it launch graphs fire-and-forget
        # and tail-launch itself (a plain launch of it fails with CUDA_ERROR_NOT_SUPPORTED).
        self.drv.begin_capture(s)
        try:
            self.drv.launch(fn, (1, 1, 1), (THREADS, 1, 1), launch_args(KERNEL, c=b["ctl"]), s, name=KERNEL)
        finally:
            self._graph = self.drv.end_capture(s)
        self.exec = self.drv.instantiate_device_launch(self._graph)
        self.drv.graph_upload(self.exec, s)
        c["self_exec"] = self.exec
        off = SCHED_CTL_DTYPE.fields["self_exec"][1]
        b["ctl"][off : off + 8] = cp.asarray(np.frombuffer(np.uint64(self.exec).tobytes(), np.uint8))
        cp.cuda.Device().synchronize()
        self.drv.graph_launch(self.exec, s)
        self.started = True

    # -- host side while serving: header reads only -----------------------------------------
    def status(self) -> int:
        return int(self.view.header["device_status"])

    def wait(self, timeout: float | None = None, stale_s: float = 30.0) -> int:
        """Block until the kernel reports STOPPED or FAILED (header reads and sleeps only).
        Returns the status; raises TimeoutError, or RuntimeError when the heartbeat stalls."""
        import time

        from blink.protocol.layout import DeviceStatus

        t_end = None if timeout is None else time.monotonic() + timeout
        last_beat, t_beat = -1, time.monotonic()
        while True:
            st = self.status()
            if st in (DeviceStatus.STOPPED, DeviceStatus.FAILED):
                return st
            hb = int(self.view.header["heartbeat"])
            now = time.monotonic()
            if hb != last_beat:
                last_beat, t_beat = hb, now
            elif now - t_beat > stale_s:
                raise RuntimeError(f"scheduler heartbeat stalled for {stale_s:.0f} s (status {st})")
            if t_end is not None and now > t_end:
                raise TimeoutError("scheduler did not stop")
            time.sleep(0.01)

    def stop(self, mode: int = 1, timeout: float = 60.0) -> int:
        """Ask the kernel to stop (1: drain, 2: cancel in-flight work), wait, join. Returns the status."""
        self.view.header["shutdown"] = mode
        st = self.wait(timeout)
        self.join()
        return st

    def join(self) -> np.ndarray:
        """After the kernel stopped: synchronize, release the ring mapping; returns the control block."""
        if self._stream is not None:
            self._stream.synchronize()
            self.ctl = np.frombuffer(self._bufs["ctl"].get().tobytes(), SCHED_CTL_DTYPE)[0]  # type: ignore[attr-defined]
        self.close()
        return self.ctl

    def close(self) -> None:
        from blink.gpu.toolchain import cudart

        if self._registered:
            cudart.host_unregister(self.drv, self._registered)
            self._registered = 0
        if self.exec:
            self.drv.graph_exec_destroy(self.exec)
            self.exec = 0
        if self._graph:
            self.drv.graph_destroy(self._graph)
            self._graph = 0
        self._bufs.clear()

    def diagnostics(self) -> dict[str, int]:
        """The control block's counters (after join())."""
        return {k: int(self.ctl[k]) for k in SCHED_CTL_DTYPE.names if not k.startswith("_")}


def main(argv: list[str] | None = None) -> int:
    return header_main(CTL_HEADER_PATH, render_ctl_header, "blink.gpu.scheduler.scheduler", argv)


if __name__ == "__main__":
    raise SystemExit(main())
