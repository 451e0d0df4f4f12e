"""Deployment config: parsed once, at the edge, into frozen dataclasses.

A deployment is N replicas (one GPU actor each, each with its own ring and engine) and one
frontend actor that serves HTTP for all of them. The file is TOML (or JSON); every key is
checked, unknown keys are errors. Example (all keys optional)::

    name = "blink"              # actor, placement-group and ring names derive from it
    namespace = "blink"         # Ray namespace of the detached actors
    model = ""                  # GGUF path; "" = the SmolLM2-135M reference model
    device = "auto"             # auto | cuda | emulated
    replicas = 1                # GPU actors; 0 = one per GPU in the cluster

    [ring]
    n_slots = 64
    prompt_arena_tokens = 262144
    output_capacity = 1024

    [http]
    host = "127.0.0.1"
    port = 8000

    [placement]
    dpu = "auto"                # auto | require | off: frontend on a node with the `dpu` resource
    gpu_actor_cpus = 1.0
    frontend_cpus = 1.0

    [lifecycle]
    start_timeout_s = 300.0
    max_restarts = -1           # Ray restarts of a killed actor; -1 = unbounded
    down_after_s = 2.0          # a ring whose heartbeat is older than this is a dead replica
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEVICES = ("auto", "cuda", "emulated")
DPU_MODES = ("auto", "require", "off")


@dataclass(frozen=True)
class RingConfig:
    n_slots: int = 64
    """Request slots per replica ring (the most requests one replica holds at once)."""
    prompt_arena_tokens: int = 1 << 18
    """int32 tokens in the prompt arena shared by all slots."""
    output_capacity: int = 1024
    """Tokens per slot in the output ring before the device pauses that slot."""

    def __post_init__(self) -> None:
        _check(1 <= self.n_slots <= 1 << 20, "ring.n_slots must be in [1, 2^20]")
        _check(self.prompt_arena_tokens >= 1, "ring.prompt_arena_tokens must be >= 1")
        _check(self.output_capacity >= 1, "ring.output_capacity must be >= 1")


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port (tests); `blink status` reports the bound one."""

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "http.port must be in [0, 65535]")


@dataclass(frozen=True)
class PlacementConfig:
    dpu: str = "auto"
    """auto: frontend on a `dpu` node when the cluster has one, else beside the GPU actors;
    require: fail when no node has `dpu`; off: never use `dpu` nodes."""
    gpu_actor_cpus: float = 1.0
    frontend_cpus: float = 1.0

    def __post_init__(self) -> None:
        _check(self.dpu in DPU_MODES, f"placement.dpu must be one of {DPU_MODES}")
        _check(self.gpu_actor_cpus >= 0 and self.frontend_cpus >= 0, "placement cpus must be >= 0")


@dataclass(frozen=True)
class LifecycleConfig:
    start_timeout_s: float = 300.0
    """Bound on each actor's start() (model load + engine start)."""
    max_restarts: int = -1
    down_after_s: float = 2.0
    """Heartbeat age after which the frontend treats a replica as dead."""

    def __post_init__(self) -> None:
        _check(self.start_timeout_s > 0, "lifecycle.start_timeout_s must be > 0")
        _check(self.max_restarts >= -1, "lifecycle.max_restarts must be >= -1")
        _check(self.down_after_s > 0, "lifecycle.down_after_s must be > 0")


@dataclass(frozen=True)
class DeployConfig:
    name: str = "blink"
    namespace: str = "blink"
    model: str = ""
    device: str = "auto"
    replicas: int = 1
    ring: RingConfig = field(default_factory=RingConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)

    def __post_init__(self) -> None:
        _check(self.name.replace("-", "").isalnum(), "name must be letters, digits and '-'")
        _check(bool(self.namespace), "namespace must not be empty")
        _check(self.device in DEVICES, f"device must be one of {DEVICES}")
        _check(self.replicas >= 0, "replicas must be >= 0 (0 = one per GPU)")

    # -- derived names: one place, so deploy / status / stop agree --------------------
    @property
    def frontend_name(self) -> str:
        return f"{self.name}-frontend"

    @property
    def placement_group_name(self) -> str:
        return f"{self.name}-pg"

    def gpu_actor_name(self, replica: int) -> str:
        return f"{self.name}-gpu-{replica}"

    def ring_name(self, replica: int) -> str:
        return f"{self.name}-ring-{replica}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    pass


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a table, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) in {where or 'config'}: {', '.join(unknown)}")
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        ftype = fields[k].type
        sub = _SECTIONS.get(ftype) if isinstance(ftype, str) else None
        if sub is not None:
            kwargs[k] = _build(sub, v, f"{where}.{k}" if where else k)
            continue
        want = {"int": int, "float": (int, float), "str": str}.get(str(ftype))
        if want is not None and (not isinstance(v, want) or isinstance(v, bool)):
            raise ConfigError(f"{where + '.' if where else ''}{k} must be {ftype}, got {v!r}")
        kwargs[k] = float(v) if ftype == "float" else v
    return cls(**kwargs)


_SECTIONS = {
    "RingConfig": RingConfig,
    "HttpConfig": HttpConfig,
    "PlacementConfig": PlacementConfig,
    "LifecycleConfig": LifecycleConfig,
}


def parse_deploy_config(data: dict[str, Any]) -> DeployConfig:
    """Build a DeployConfig from a plain dict (a parsed file); unknown keys raise ConfigError."""
    return _build(DeployConfig, data, "")


def load_deploy_config(path: str | Path | None, **overrides: Any) -> DeployConfig:
    """Read a TOML or JSON file (None: defaults) and apply top-level overrides (CLI flags)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        raw = p.read_bytes()
        data = json.loads(raw) if p.suffix == ".json" else tomllib.loads(raw.decode())
    cfg = parse_deploy_config(data)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
