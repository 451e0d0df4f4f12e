"""The emulated device: a CPU process that serves a shared-memory ring with the numpy executor.

    python -m blink.device.emulated SPEC_JSON      (blink.protocol.wire.DeviceSpec; blink.launch starts it)

It opens the ring /dev/shm/<spec.ring>, builds the executor and runs `RingDevice` until
header.shutdown asks it to stop. The process exits 0 after a clean stop (status STOPPED) and 1
after a device fault (status FAILED).

`spec.executor = "module:function"` swaps the executor factory (tests use a hash-based stand-in
model; anything with the `Executor` interface works). The factory is called as
`factory(model, num_blocks=, block_size=, max_batch=, max_num_batched_tokens=, max_blocks_per_seq=)`.
"""

from __future__ import annotations

import importlib

from blink.models.fp8 import FP8_LM_HEAD
from blink.protocol.gc_freeze import freeze_startup_heap
from blink.protocol.layout import DeviceStatus
from blink.protocol.transport import ShmTransport
from blink.protocol.wire import DeviceSpec

from .executor import Executor
from .process import device_main, kv_cache_key, kv_gib, phase, progress
from .ring_device import RingDevice, RingDeviceConfig

DEFAULT_CONTEXT = 2048  # sizes the KV pool when neither num_kv_blocks nor max_context is given


def kv_blocks(spec: DeviceSpec) -> int:
    """The KV pool when not configured: enough for max_batch sequences of max_context (2048 when
    unset). np.zeros pages are only touched as the cache fills."""
    ctx = spec.max_context or DEFAULT_CONTEXT
    return spec.num_kv_blocks or spec.max_batch * -(-ctx // spec.kv_block_size)


def build_executor(spec: DeviceSpec) -> Executor:
    width = -(-spec.max_context // spec.kv_block_size) if spec.max_context else None
    kw = dict(
        num_blocks=kv_blocks(spec),
        block_size=spec.kv_block_size,
        max_batch=spec.max_batch,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_blocks_per_seq=width,
    )
    if spec.executor:
        mod, _, fn = spec.executor.partition(":")
        return getattr(importlib.import_module(mod), fn)(spec.model, **kw)
    from .numpy_executor import NumpyExecutor

    phase(f"loading {spec.model}" + (f" ({spec.quantization} weights)" if spec.quantization else ""))
    quant = spec.quantization or None
    ex = NumpyExecutor.from_model(
        spec.model, progress=progress("loading weights", "B"), quantization=quant, kv_cache_dtype=spec.kv_cache_dtype,
        fp8_lm_head=FP8_LM_HEAD if spec.fp8_lm_head is None else spec.fp8_lm_head, **kw,
    )  # fmt: skip
    c = ex.config
    gib = kv_gib(c.num_layers, ex.num_blocks, spec.kv_block_size, c.num_kv_heads, c.head_dim, 4)
    held = "float32 holding fp8 e4m3 values" if spec.kv_cache_dtype == "fp8" else "float32"
    phase(f"KV cache: {ex.num_blocks} blocks of {spec.kv_block_size} tokens, {gib:.2f} GiB ({held}, paged in as used)")
    return ex


def run(spec: DeviceSpec) -> DeviceStatus:
    """Serve the ring in this process until it is told to stop."""
    transport = ShmTransport.open(spec.ring)
    executor = build_executor(spec)
    view = transport.view()
    try:
        frozen = freeze_startup_heap().objects
        phase(f"serving the ring (scheduler: the emulated device's loop; {frozen} start-up objects frozen)")
        rcfg = RingDeviceConfig(
            mixed_tokens=spec.mixed_tokens, prefix_caching=spec.prefix_caching, kv_cache_key=kv_cache_key(spec)
        )
        return RingDevice(view, executor, rcfg).run()
    finally:
        executor.close()
        del view
        transport.close()


if __name__ == "__main__":
    raise SystemExit(device_main(run))
