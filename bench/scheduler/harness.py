"""Shared by the scheduler benchmarks: build an engine once, serve one workload on a fresh ring.

The device (GPU-resident scheduler or the host-driven loop, over the same engine and graphs) runs
in this process; the load (bench/scheduler/ring_load.py: blink's frontend roles on the ring, no HTTP) runs in
a child process, so the two never share an interpreter lock. The child stores header.shutdown when
its workload is done.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator

from blink.protocol.ring_geometry import RingGeometry, RingView
from blink.protocol.transport import ShmTransport

ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def make_engine(
    preset_name: str,
    max_seqs: int,
    max_num_batched_tokens: int,
    max_context: int,
    kv_blocks: int = 0,
    gemm_sm_reserve: int = -1,
    layers: int = 0,
    quantization: str = "",
    fp8_gemm: str = "",
    kv_cache_dtype: str = "auto",
    fp8_fast_accum: bool = False,
):
    """An engine over random weights of `preset_name` (`layers`: that many of its layers; 0: all), captured;
    `quantization` "fp8": its dense projections in FP8 (EngineConfig.quantization; `fp8_gemm`: its
    EngineConfig.fp8_gemm, "" = the default; `fp8_fast_accum`: EngineConfig.fp8_fast_accum); `kv_cache_dtype` "fp8": an FP8 KV cache (EngineConfig.kv_cache_dtype)."""
    from blink.gpu.engine.engine import Engine, EngineConfig
    from blink.models.config import preset

    batch = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_seqs)
    tokens = tuple(t for t in (64, 256, 1024, 4096, 8192) if t <= max_num_batched_tokens)
    ecfg = EngineConfig(
        max_seqs=max_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_context=max_context,
        num_kv_blocks=kv_blocks,
        batch_buckets=batch,
        token_buckets=tokens,
        progress=False,
        quantization=quantization,
        **({"fp8_gemm": fp8_gemm} if fp8_gemm else {}),
        kv_cache_dtype=kv_cache_dtype,
        fp8_fast_accum=fp8_fast_accum,
        **({"gemm_sm_reserve": gemm_sm_reserve} if gemm_sm_reserve >= 0 else {}),
    )
    t0 = time.perf_counter()
    cfg = preset(preset_name)
    eng = Engine.create(cfg.replace(num_layers=layers) if layers else cfg, ecfg)
    rep = eng.capture()
    print(
        f"engine {preset_name}: {rep.graphs} graphs / {rep.execs} execs, {eng.dims.num_blocks} KV blocks, "
        f"built in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return eng


@contextlib.contextmanager
def fresh_ring(geometry: RingGeometry) -> Iterator[tuple[str, ShmTransport, RingView]]:
    """A new shared-memory ring under a name no other run uses (pid and clock): (name, transport,
    its local view); closed and unlinked on the way out."""
    name = f"blink-bench-{os.getpid()}-{time.monotonic_ns()}"
    t = ShmTransport.create(name, geometry)
    view = t.view()
    try:
        yield name, t, view
    finally:
        del view  # before close: the map closes now unless the caller still holds a view of it
        t.close()
        t.unlink()


def serve_workload(
    eng,
    scheduler: str,
    load_args: list[str],
    n_slots: int,
    prompt_per_slot: int,
    output_capacity: int,
    max_batch: int = 0,
    timeout_s: float = 300.0,
    executor=None,
) -> dict:
    """Serve one workload; returns the load generator's JSON plus the device's counters."""
    from blink.protocol.layout import DeviceStatus

    with fresh_ring(RingGeometry(n_slots, n_slots * prompt_per_slot, output_capacity)) as (name, _, view):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "bench.scheduler.ring_load", "--ring", name, "--shutdown", "1", *load_args]
        proc = None
        diag: dict = {}
        try:
            if scheduler == "gpu":
                from blink.gpu.scheduler.scheduler import GpuScheduler, GpuSchedulerConfig

                s = GpuScheduler(eng, view, GpuSchedulerConfig(max_batch=max_batch))
                s.start()
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
                try:
                    status = s.wait(timeout_s)
                except (TimeoutError, RuntimeError):
                    view.header["shutdown"] = 2  # never leave the kernel running on a shared engine
                    s.wait(30)
                    raise
                finally:
                    s.join()
                diag = s.diagnostics()
            else:
                from blink.device.ring_device import RingDevice, RingDeviceConfig
                from blink.gpu.engine.host_executor import HostExecutor

                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
                ex = executor if executor is not None else HostExecutor(eng)
                status = RingDevice(view, ex, RingDeviceConfig(max_batch=max_batch)).run()
            out, _ = proc.communicate(timeout=60)
            if proc.returncode != 0 or status != DeviceStatus.STOPPED:
                raise RuntimeError(f"workload failed: loadgen rc {proc.returncode}, device status {status}")
            res = json.loads(out.strip().splitlines()[-1])
            h = view.header
            res["device"] = {
                k: int(h[k]) for k in ("steps", "prefill_steps", "launches", "relaunches", "launch_errors")
            }
            res["device"]["sched_us_per_launch"] = int(h["sched_ns_total"]) / max(int(h["launches"]), 1) / 1e3
            if diag:
                res["device"]["retries"] = diag["retries"]
                res["device"]["max_retries"] = diag["max_retries"]
                # where the device's time went (ms): launch -> completion seen, summed over steps, and
                # the scheduler's own phases (SchedCtl counters)
                for k in ("step_ns_total", "wait_ns_total", "plan_ns_total", "launch_ns_total", "publish_ns_total"):
                    if k in diag:
                        res["device"][k.replace("_ns_total", "_ms_total")] = diag[k] / 1e6
                for k in ("busy_iters", "instances"):
                    if k in diag:
                        res["device"][k] = diag[k]
            return res
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
