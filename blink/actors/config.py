"""Deployment config: the serving config (blink/config.py) plus a `deploy` section, parsed once.

`blink serve --ray`, `blink deploy`, `blink status` and `blink stop` read the same file as
`blink serve` (sections server / ring / device / model, see blink/config.py) with one more
section, `deploy`, defined here. Every key is checked; unknown keys are errors::

    [deploy]
    name = "blink"           # actor, placement-group and ring names derive from it
    namespace = "blink"      # Ray namespace of the (detached) named actors
    replicas = 1             # GPU actors, each with its own ring and engine; 0 = one per GPU
    dpu = "auto"             # frontend on a node with the `dpu` resource: auto | require | off
    gpu_actor_cpus = 1.0
    frontend_cpus = 1.0      # per frontend process
    frontends = 1            # frontend processes sharing one port (SO_REUSEPORT); 0 = one per replica
    start_timeout_s = 900.0  # bound on each actor's start() (model load + engine start)
    max_restarts = -1        # Ray restarts of a killed actor; -1 = unbounded

Replica liveness uses `server.heartbeat_timeout_s` (the device heartbeat in the ring header).

Actors receive the config as JSON text (`to_json` / `from_json`), not as a pickled object.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from blink import config as serving

ConfigError = serving.ConfigError
DPU_MODES = ("auto", "require", "off")


@dataclass(frozen=True)
class DeploySection:
    name: str = "blink"
    """Deployment name; actor, placement-group and ring names derive from it."""
    namespace: str = "blink"
    """Ray namespace of the named actors and the placement group."""
    replicas: int = 1
    """GPU actors (data-parallel replicas); 0 = one per GPU of the cluster."""
    dpu: str = "auto"
    """auto: frontend on a `dpu` node when the cluster has one, else beside the GPU actors;
    require: fail without a `dpu` node; off: never use one."""
    gpu_actor_cpus: float = 1.0
    """CPUs reserved per GPU actor (the emulated device computes on them)."""
    frontend_cpus: float = 1.0
    """CPUs reserved per frontend actor (HTTP, tokenizer, slot tracker, token reader)."""
    frontends: int = 1
    """Frontend actors serving one port (the kernel spreads connections over them, SO_REUSEPORT),
    each owning a share of every ring's slots: more cores for HTTP and detokenization, like vLLM's
    api-server-count. 0 = one per replica."""
    start_timeout_s: float = 900.0
    """Bound on each actor's start(): model load, engine start, HTTP bind."""
    max_restarts: int = -1
    """How often Ray restarts a killed actor; -1 = unbounded."""
    ray_auth: str = "token"
    """token: `blink deploy` refuses a Ray cluster it reached without Ray's token authentication
    (RAY_AUTH_MODE=token, the token shared by every node: cluster.yaml does that), since anyone who
    reaches such a cluster's ports can run code on its GPU hosts; off: deploy anyway (a cluster on a
    network only its operators reach)."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").isalnum():
            raise ConfigError(f"deploy.name = {self.name!r}: use letters, digits and '-'")
        if not self.namespace or not self.namespace.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"deploy.namespace = {self.namespace!r}: use letters, digits, '-' and '_'")
        if self.replicas < 0:
            raise ConfigError("deploy.replicas must be >= 0 (0 = one per GPU)")
        if not 0 <= self.frontends <= 64:
            raise ConfigError("deploy.frontends must be in [0, 64] (0 = one per replica)")
        if self.dpu not in DPU_MODES:
            raise ConfigError(f"deploy.dpu = {self.dpu!r}; expected one of {', '.join(DPU_MODES)}")
        if self.gpu_actor_cpus < 0 or self.frontend_cpus < 0:
            raise ConfigError("deploy.*_cpus must be >= 0")
        if self.start_timeout_s <= 0:
            raise ConfigError("deploy.start_timeout_s must be > 0")
        if self.max_restarts < -1:
            raise ConfigError("deploy.max_restarts must be >= -1")
        if self.ray_auth not in ("token", "off"):
            raise ConfigError(f"deploy.ray_auth = {self.ray_auth!r}; expected token or off")


@dataclass(frozen=True)
class DeployConfig:
    deploy: DeploySection = field(default_factory=DeploySection)
    serving: serving.BlinkConfig = field(default_factory=serving.BlinkConfig)

    # -- shorthands and derived names: one place, so deploy / status / stop agree -----
    @property
    def name(self) -> str:
        return self.deploy.name

    @property
    def namespace(self) -> str:
        return self.deploy.namespace

    def frontend_actor_name(self, index: int) -> str:
        return f"{self.deploy.name}-frontend" + (f"-{index}" if index else "")

    def frontend_count(self, replicas: int) -> int:
        """Frontend processes for a deployment of `replicas` GPU actors."""
        return self.deploy.frontends or max(replicas, 1)

    @property
    def placement_group_name(self) -> str:
        return f"{self.deploy.name}-pg"

    def gpu_actor_name(self, replica: int) -> str:
        return f"{self.deploy.name}-gpu-{replica}"

    def ring_name(self, replica: int) -> str:
        # The namespace is part of the name: /dev/shm is per host, not per Ray namespace, and a
        # GPU actor replaces whatever ring sits under its name.
        return f"{self.deploy.namespace}-{self.deploy.name}-ring-{replica}"

    def to_json(self) -> str:
        return json.dumps({"deploy": dataclasses.asdict(self.deploy), **dataclasses.asdict(self.serving)})

    @classmethod
    def from_json(cls, text: str) -> DeployConfig:
        return from_mapping(json.loads(text))


def _deploy_section(values: Any, base: DeploySection) -> DeploySection:
    if not isinstance(values, Mapping):
        raise ConfigError(f"section 'deploy' must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(DeploySection)
    known = {f.name for f in dataclasses.fields(DeploySection)}
    changes = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown key deploy.{key} (known: {', '.join(sorted(known))})")
        changes[key] = serving.coerce(f"deploy.{key}", value, hints[key])
    return dataclasses.replace(base, **changes)


def from_mapping(data: Mapping[str, Any], base: DeployConfig | None = None) -> DeployConfig:
    """{deploy: {...}, server: {...}, ring: {...}, ...} -> DeployConfig over `base` (defaults)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    base = base or DeployConfig()
    rest = {k: v for k, v in data.items() if k != "deploy"}
    dep = _deploy_section(data["deploy"], base.deploy) if "deploy" in data else base.deploy
    return DeployConfig(dep, serving.from_mapping(rest, base=base.serving))


def build(config_file: str | None = None, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> DeployConfig:
    """Defaults, then the file, then explicit overrides ({section: {key: value}}, CLI flags given)."""
    cfg = from_mapping(serving.load_file(config_file)) if config_file else DeployConfig()
    if overrides:
        cfg = from_mapping({k: v for k, v in overrides.items() if v}, base=cfg)
    return cfg
