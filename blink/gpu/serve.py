"""The CUDA device process: load a model into the engine, capture its graphs, serve a ring.

    python -m blink.gpu.serve --ring NAME --model random:tiny-llama [--scheduler gpu|host] ...

`--scheduler gpu` (default) starts the persistent scheduler kernel (blink.gpu.scheduler) and the
process then only watches the ring header: no CUDA call until the kernel reports STOPPED.
`--scheduler host` serves the ring with blink.device.ring_device over the same graphs launched
from the host (the ablation baseline). Exit code 0 after a clean stop, 1 after a fault.

`start()` is what `blink serve --device cuda` calls (via blink.dpu.launch); `conformance_factory`
plugs this device into tests/conformance (BLINK_DEVICE_FACTORY=blink.gpu.serve:conformance_factory).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

SMALL_RANDOM_PARAMS = 1_000_000_000


@dataclass(frozen=True)
class GpuServeConfig:
    ring: str
    """Shared-memory ring name (/dev/shm/<ring>), created by the frontend."""
    model: str = "default"
    """Model spec (blink.models.registry): default, a .gguf, an HF dir, random:<preset>."""
    scheduler: str = "gpu"
    """gpu: the persistent scheduler kernel; host: the host-driven loop over the same graphs."""
    kv_blocks: int = 0
    """KV blocks in the pool; 0 sizes it from kv_fraction."""
    kv_fraction: float = 0.85
    """Share of free GPU memory for the KV pool when kv_blocks is 0."""
    block_size: int = 16
    max_batch: int = 32
    """Sequences per step (the engine's largest batch bucket)."""
    max_tokens: int = 2048
    """Packed tokens per prefill step (the engine's largest token bucket)."""
    max_context: int = 0
    """Tokens per sequence; 0 = the model's limit (capped at 8192)."""
    seed: int = 0
    """Seed of random weights."""
    decode_attention: str = ""
    """Decode attention table (blink.gpu.engine.parse_decode_attention: "basic", "1:flash,64:basic");
    "" = the engine's default."""

    def __post_init__(self) -> None:
        if self.scheduler not in ("gpu", "host"):
            raise ValueError(f"scheduler must be gpu or host, got {self.scheduler!r}")
        for f in ("block_size", "max_batch", "max_tokens"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1")
        if self.kv_blocks < 0 or self.max_context < 0:
            raise ValueError("kv_blocks and max_context must be >= 0")

    def argv(self) -> list[str]:
        out: list[str] = []
        for f in dataclasses.fields(self):
            out += [f"--{f.name.replace('_', '-')}", str(getattr(self, f.name))]
        return out


def parse_args(argv: list[str] | None = None) -> GpuServeConfig:
    ap = argparse.ArgumentParser(prog="python -m blink.gpu.serve", description=__doc__.splitlines()[0])
    types = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(GpuServeConfig):
        flag = f"--{f.name.replace('_', '-')}"
        typ = types[f.type if isinstance(f.type, str) else f.type.__name__]
        if f.default is dataclasses.MISSING:
            ap.add_argument(flag, dest=f.name, type=typ, required=True)
        else:
            ap.add_argument(flag, dest=f.name, type=typ, default=f.default)
    return GpuServeConfig(**vars(ap.parse_args(argv)))


def build_engine(cfg: GpuServeConfig) -> Any:
    """Engine with the model's weights (random presets are generated on the GPU) and its graphs."""
    from blink.gpu.engine import Engine, EngineConfig, parse_decode_attention
    from blink.models.config import preset

    mcfg = preset(cfg.model.removeprefix("random:")) if cfg.model.startswith("random:") else None
    if mcfg is not None and mcfg.num_params() > SMALL_RANDOM_PARAMS:
        weights = None  # generated on the GPU: a host copy of billions of float32 would take minutes
    else:
        # the registry's weights: a small random preset is then the very model the emulated device runs
        from blink.models.registry import resolve_model

        bundle = resolve_model(cfg.model, allow_pull=False, seed=cfg.seed)
        mcfg, weights = bundle.config, bundle.weights
    ctx = cfg.max_context or min(mcfg.max_position, 8192)
    ctx -= ctx % cfg.block_size
    max_seqs = min(cfg.max_batch, cfg.max_tokens)
    ecfg = EngineConfig(
        max_seqs=max_seqs,
        max_tokens=cfg.max_tokens,
        block_size=cfg.block_size,
        max_context=ctx,
        kv_fraction=cfg.kv_fraction,
        num_kv_blocks=cfg.kv_blocks,
        seed=cfg.seed,
        progress=False,
    )
    if cfg.decode_attention:
        ecfg = dataclasses.replace(ecfg, decode_attention_table=parse_decode_attention(cfg.decode_attention))
    engine = Engine.create(mcfg, ecfg, weights)
    engine.capture()
    return engine


def run(cfg: GpuServeConfig) -> int:
    """Serve the ring in this process until told to stop. Returns the final DeviceStatus."""
    from blink.protocol.layout import DeviceStatus
    from blink.protocol.transport import ShmTransport

    transport = ShmTransport.open(cfg.ring)
    view = transport.view()
    engine = build_engine(cfg)
    try:
        if cfg.scheduler == "gpu":
            from blink.gpu.scheduler import GpuScheduler, GpuSchedulerConfig

            sched = GpuScheduler(engine, view, GpuSchedulerConfig(max_batch=cfg.max_batch))
            sched.start()
            try:
                status = sched.wait()  # header reads and sleeps only: the host is off the token path
            finally:
                sched.join()
            return status
        from blink.device.ring_device import RingDevice, RingDeviceConfig
        from blink.gpu.host_executor import HostExecutor

        return RingDevice(view, HostExecutor(engine), RingDeviceConfig(max_batch=cfg.max_batch)).run()
    except BaseException:
        view.header["device_status"] = DeviceStatus.FAILED
        raise
    finally:
        engine.close()


def _popen(cfg: GpuServeConfig, **popen_kwargs: Any) -> subprocess.Popen:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(popen_kwargs.pop("env", None) or os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen([sys.executable, "-m", "blink.gpu.serve", *cfg.argv()], env=env, **popen_kwargs)


def config_for_blink(ring_name: str, config: Any) -> GpuServeConfig:
    """The device process's configuration for a BlinkConfig (blink.config) serving `ring_name`."""
    d = config.device
    return GpuServeConfig(
        ring=ring_name,
        model=config.model.spec,
        scheduler=d.scheduler,
        kv_blocks=d.num_kv_blocks or 0,
        kv_fraction=min(d.kv_cache_fraction, 0.95),
        block_size=d.kv_block_size,
        max_batch=d.max_batch,
        max_tokens=max(d.max_tokens, d.max_batch),
        max_context=d.max_context or 0,
    )


def start(ring_name: str, config: Any, **popen_kwargs: Any) -> subprocess.Popen:
    """`blink serve --device cuda`: the device process for a BlinkConfig (blink.config)."""
    return _popen(config_for_blink(ring_name, config), **popen_kwargs)


def config_for_conformance(
    ring: str,
    *,
    model: str,
    kv_blocks: int,
    block_size: int,
    max_batch: int,
    max_tokens: int,
    max_context: int,
    scheduler: str = "gpu",
) -> GpuServeConfig:
    return GpuServeConfig(
        ring=ring,
        model=model,
        scheduler=scheduler,
        kv_blocks=kv_blocks,
        block_size=block_size,
        max_batch=max_batch,
        max_tokens=max(max_tokens, max_batch),  # the engine packs at least one token per sequence
        max_context=max_context,
    )


def conformance_factory(ring: str, **spec: Any) -> subprocess.Popen:
    """The "cuda" device of tests/conformance: this scheduler on the engine, in a child process."""
    return _popen(config_for_conformance(ring, **spec))


def conformance_factory_basic(ring: str, **spec: Any) -> subprocess.Popen:
    """conformance_factory with the "basic" decode attention (bench/run_gpu.sh's fallback when the
    default decode attention fails the engine tests)."""
    return _popen(dataclasses.replace(config_for_conformance(ring, **spec), decode_attention="basic"))


def host_conformance_factory(ring: str, **spec: Any) -> subprocess.Popen:
    """The host-driven loop over the same engine (the ablation baseline) as a conformance device."""
    return _popen(config_for_conformance(ring, scheduler="host", **spec))


def main(argv: list[str] | None = None) -> int:
    from blink.protocol.layout import DeviceStatus

    status = run(parse_args(argv))
    return 0 if status == DeviceStatus.STOPPED else 1


if __name__ == "__main__":
    raise SystemExit(main())
