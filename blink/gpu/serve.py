"""The CUDA device process: load a model into the engine, capture its graphs, serve a ring.

    python -m blink.gpu.serve SPEC_JSON      (blink.protocol.wire.DeviceSpec; blink.launch starts it)

`spec.scheduler == "gpu"` starts the persistent scheduler kernel (blink.gpu.scheduler.scheduler) and the
process then only watches the ring header: no CUDA call until the kernel reports STOPPED.
`"host"` serves the ring with blink.device.ring_device over the same graphs launched from the
host (the ablation baseline). Exit code 0 after a clean stop, 1 after a fault.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from blink.device.process import device_main, kv_cache_key, kv_gib, phase, progress
from blink.models.fp8 import FP8_LM_HEAD
from blink.protocol.wire import DeviceSpec

SMALL_RANDOM_PARAMS = 1_000_000_000


def kv_cache_line(mcfg: Any, num_blocks: int, block_size: int, kv_cache_dtype: str) -> str:
    """The start-up line saying what the KV pool holds: blocks, GiB and element type."""
    fp8 = kv_cache_dtype == "fp8"
    gib = kv_gib(mcfg.num_layers, num_blocks, block_size, mcfg.num_kv_heads, mcfg.head_dim, 1 if fp8 else 2)
    return f"KV cache: {num_blocks} blocks of {block_size} tokens, {gib:.2f} GiB ({'fp8 e4m3' if fp8 else 'bf16'})"


def engine_config(spec: DeviceSpec, max_position: int, sampling_rows: int = 0) -> Any:
    """The engine's settings for a spec: the one place they are derived. A step packs at least one
    token per sequence, so the token budget is raised to max_batch; the context is the model's
    (max_position_embeddings, as vLLM's max_model_len) unless given, rounded down to whole KV blocks.
    The token buckets include every budget of a mixed step (mixed_budgets), so a mixed step that
    fills its budget runs a graph of exactly its size."""
    from blink.device.policy import mixed_budgets
    from blink.gpu.engine.engine import DEFAULT_TOKEN_BUCKETS, EngineConfig

    ctx = spec.max_context or max_position
    max_num_batched_tokens = max(spec.max_num_batched_tokens, spec.max_batch)
    buckets = set(DEFAULT_TOKEN_BUCKETS) | set(mixed_budgets(max_num_batched_tokens, spec.mixed_tokens))
    return EngineConfig(
        max_seqs=spec.max_batch,
        max_num_batched_tokens=max_num_batched_tokens,
        token_buckets=tuple(sorted(buckets)),
        block_size=spec.kv_block_size,
        max_context=ctx - ctx % spec.kv_block_size,
        kv_fraction=spec.kv_cache_fraction,
        num_kv_blocks=spec.num_kv_blocks,
        seed=spec.seed,
        sampling_rows=sampling_rows,
        quantization=spec.quantization,
        fp8_lm_head=FP8_LM_HEAD if spec.fp8_lm_head is None else spec.fp8_lm_head,
        kv_cache_dtype=spec.kv_cache_dtype,
        progress=True,  # warm-up and graph capture bars on stderr
    )


def weight_source(spec: DeviceSpec) -> tuple[Any, Any]:
    """(config, weights) of the spec's model as the engine takes them: blink.models.weights.Bf16Tensors
    read one tensor at a time (GGUF dequantised per tensor, HF safetensors mapped, small random
    presets made per tensor: the same bits as the emulated device's float32 rounded), or None for
    a large random preset, generated on the GPU."""
    from blink.models.config import preset

    mcfg = preset(spec.model.removeprefix("random:")) if spec.model.startswith("random:") else None
    if mcfg is not None and mcfg.num_params() > SMALL_RANDOM_PARAMS:
        phase(f"{spec.model}: {mcfg.num_params() / 1e9:.1f} B parameters generated on the GPU")
        return mcfg, None  # made on the host, billions of random numbers would take minutes
    from blink.models.registry import resolve_bf16

    phase(f"loading {spec.model}")
    return resolve_bf16(spec.model, allow_pull=False, seed=spec.seed, progress=progress("loading weights", "B"))


def build_engine(spec: DeviceSpec, sampling_rows: int = 0) -> Any:
    """Engine with the model's weights (random presets are generated on the GPU) and its graphs;
    sampling_rows: the sampling extensions' tables, one row per ring slot (0: off)."""
    import cupy as cp

    from blink.gpu.engine.engine import Engine
    from blink.gpu.toolchain.kernels import DEFAULT_CACHE

    dev = cp.cuda.Device()
    free, total = cp.cuda.runtime.memGetInfo()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    phase(f"CUDA device {dev.id}: {name}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    mcfg, tensors = weight_source(spec)  # read while they upload, inside Engine.create
    ecfg = engine_config(spec, mcfg.max_position, sampling_rows)
    if mcfg.quantization:  # an FP8 checkpoint: its weights are FP8 whatever the flag says
        ecfg = dataclasses.replace(ecfg, quantization=mcfg.quantization)
    engine = Engine.create(mcfg, ecfg, kernel_cache=spec.kernel_cache or DEFAULT_CACHE, bf16_tensors=tensors)
    d = engine.dims
    if ecfg.quantization:
        phase(
            f"weights: {ecfg.quantization}, {engine.weights.nbytes / 2**30:.2f} GiB on the device; FP8 GEMV up to "
            f"{ecfg.fp8_gemv_max_tokens} decode tokens, then {engine.fwd.fp8_path}"
        )
    phase(kv_cache_line(mcfg, d.num_blocks, d.block_size, ecfg.kv_cache_dtype) + "; capturing graphs")
    engine.capture()
    return engine


def run(spec: DeviceSpec) -> int:
    """Serve the ring in this process until told to stop. Returns the final DeviceStatus."""
    from blink.gpu.toolchain.build import BuildError
    from blink.protocol.gc_freeze import freeze_startup_heap
    from blink.protocol.layout import DeviceStatus
    from blink.protocol.transport import ShmTransport

    transport = ShmTransport.open(spec.ring)
    view = transport.view()
    try:
        # the sampling extensions' tables: a row per ring slot (both schedulers fill the extension fields)
        engine = build_engine(spec, view.geo.n_slots)
    except BuildError as e:  # no NVRTC, a GPU too old, a compile error: one message, no traceback
        print(f"blink: {e}", file=sys.stderr, flush=True)
        view.header["device_status"] = DeviceStatus.FAILED
        return DeviceStatus.FAILED
    try:
        if spec.scheduler == "gpu":
            from blink.gpu.scheduler.scheduler import GpuScheduler, GpuSchedulerConfig

            sched = GpuScheduler(
                engine,
                view,
                GpuSchedulerConfig(
                    max_batch=spec.max_batch,
                    mixed_tokens=spec.mixed_tokens,
                    prefix_caching=spec.prefix_caching,
                    kv_cache_key=kv_cache_key(spec),
                ),
            )
            frozen = freeze_startup_heap().objects  # before the kernel starts: its one collection pause too
            sched.start()
            phase(f"persistent scheduler kernel launched ({frozen} start-up objects frozen)")
            try:
                status = sched.wait()  # header reads and sleeps only: the host is off the token path
            finally:
                sched.join()
            return status
        from blink.device.ring_device import RingDevice, RingDeviceConfig
        from blink.gpu.engine.host_executor import HostExecutor

        frozen = freeze_startup_heap().objects
        phase(f"serving the ring (scheduler: the host loop; {frozen} start-up objects frozen)")
        rcfg = RingDeviceConfig(
            max_batch=spec.max_batch,
            mixed_tokens=spec.mixed_tokens,
            prefix_caching=spec.prefix_caching,
            kv_cache_key=kv_cache_key(spec),
        )
        return RingDevice(view, HostExecutor(engine), rcfg).run()
    except BaseException:
        view.header["device_status"] = DeviceStatus.FAILED
        raise
    finally:
        engine.close()


if __name__ == "__main__":
    raise SystemExit(device_main(run))
