"""Placement: which bundles a deployment needs, derived from its config and the cluster.

One placement group per deployment, found again by name (a second `blink deploy` or a restarted
driver reuses it instead of reserving the resources twice). Bundle 0 holds the frontend actors
(deploy.frontends of them, sharing one port); bundle 1 + i is the GPU actor of replica i.

Where the frontend goes: on a node with the custom `dpu` resource when the cluster has one
(the SmartNIC in the design), else beside the GPU actors. The rings are /dev/shm files on their
GPU actors' hosts; a frontend on another host reaches them over tcp or rdma through each GPU
actor's ring agent (ring.transport auto, tcp, rdma). So the bundles may spread (PACK): with a
`dpu` node the `dpu` bundle pins the frontend there and the GPU bundles go where the GPUs are.
Only ring.transport = shm keeps every bundle on one node (STRICT_PACK).

`plan_placement` is pure (testable without Ray); `ensure_placement_group` talks to Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .config import ConfigError, DeployConfig

DPU_RESOURCE = "dpu"


@dataclass(frozen=True)
class PlacementPlan:
    name: str
    bundles: tuple[dict[str, float], ...]  # (1 + replicas,) frontend first
    strategy: str  # STRICT_PACK | PACK
    replicas: int
    use_gpu: bool  # GPU actors hold a GPU each (else: emulated device on CPUs)
    use_dpu: bool  # frontend bundle asks for the `dpu` resource

    @property
    def frontend_bundle(self) -> int:
        return 0

    def gpu_bundle(self, replica: int) -> int:
        return 1 + replica


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def _add(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def plan_placement(cfg: DeployConfig, nodes: list[dict[str, float]]) -> PlacementPlan:
    """Bundles for `cfg` on a cluster whose alive nodes have the given total resources.

    Raises ConfigError when the cluster cannot hold the deployment (instead of letting the
    placement group wait forever)."""
    total_gpus = sum(n.get("GPU", 0.0) for n in nodes)
    dpu_nodes = [n for n in nodes if n.get(DPU_RESOURCE, 0.0) >= 1]
    if cfg.serving.device.kind == "cuda":
        use_gpu = True
    elif cfg.serving.device.kind == "emulated":
        use_gpu = False
    else:  # auto: GPUs when the cluster has enough for the replicas asked for
        use_gpu = total_gpus >= max(cfg.deploy.replicas, 1)
    replicas = cfg.deploy.replicas
    if replicas == 0:
        replicas = int(math.floor(total_gpus + 1e-9))
        if replicas == 0:
            raise ConfigError("replicas = 0 means one per GPU, but the cluster has no GPU")
    if use_gpu and total_gpus + 1e-9 < replicas:
        raise ConfigError(f"{replicas} replicas need {replicas} GPUs; the cluster has {total_gpus:g}")

    mode = cfg.deploy.dpu
    use_dpu = bool(dpu_nodes) and mode != "off"
    if mode == "require" and not dpu_nodes:
        raise ConfigError(f"deploy.dpu = require, but no node has the `{DPU_RESOURCE}` resource")

    frontend: dict[str, float] = {}  # every frontend actor in one bundle: they share a port
    if cfg.deploy.frontend_cpus > 0:
        frontend["CPU"] = cfg.deploy.frontend_cpus * cfg.frontend_count(replicas)
    if use_dpu:
        frontend[DPU_RESOURCE] = 1.0
    gpu: dict[str, float] = {}
    if cfg.deploy.gpu_actor_cpus > 0:
        gpu["CPU"] = cfg.deploy.gpu_actor_cpus
    if use_gpu:
        gpu["GPU"] = 1.0
    if not frontend or not gpu:
        raise ConfigError("every bundle needs a resource: set deploy.*_cpus > 0 (or use GPUs)")
    bundles = (frontend,) + tuple(dict(gpu) for _ in range(replicas))

    remote_ok = cfg.serving.ring.transport != "shm"  # a frontend may reach rings on other hosts
    if use_dpu or remote_ok:
        strategy = "PACK"
        if use_dpu and not any(_fits(frontend, n) for n in dpu_nodes):
            raise ConfigError(f"no `{DPU_RESOURCE}` node has room for the frontend bundle {frontend}")
        if not _fits(_add(list(bundles)), _add(nodes)):
            raise ConfigError(f"the cluster cannot hold {list(bundles)}")
    else:
        strategy = "STRICT_PACK"
        need = _add(list(bundles))
        if not any(_fits(need, n) for n in nodes):
            raise ConfigError(
                f"no node can hold the frontend and {replicas} GPU actor(s) together ({need}); "
                "ring.transport = shm needs one host for all of them (auto, tcp or rdma lift this)"
            )
    return PlacementPlan(cfg.placement_group_name, bundles, strategy, replicas, use_gpu, use_dpu)


def alive_node_resources() -> list[dict[str, float]]:
    """Total resources of each alive node of the connected Ray cluster."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def find_placement_group(name: str) -> Any | None:
    """The live placement group called `name` in the current namespace, or None."""
    from ray.util import get_placement_group, placement_group_table

    try:
        pg = get_placement_group(name)
    except ValueError:
        return None
    state = placement_group_table(pg).get("state")
    return None if state == "REMOVED" else pg


def ensure_placement_group(plan: PlacementPlan, detached: bool, timeout_s: float) -> Any:
    """Reuse the placement group named plan.name if it exists with the same bundles, else create it."""
    import ray
    from ray.util import placement_group, placement_group_table

    pg = find_placement_group(plan.name)
    if pg is not None:
        have = [dict(b) for b in pg.bundle_specs]
        if have != [dict(b) for b in plan.bundles]:
            raise ConfigError(
                f"placement group {plan.name!r} exists with bundles {have}, not {list(plan.bundles)}; "
                "run `blink stop` first"
            )
    else:
        pg = placement_group(
            list(plan.bundles), strategy=plan.strategy, name=plan.name, lifetime="detached" if detached else None
        )
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"placement group {plan.name!r} not ready after {timeout_s:g}s: {placement_group_table(pg)}"
        ) from None
    return pg


def remove_placement_group_by_name(name: str) -> bool:
    from ray.util import remove_placement_group

    pg = find_placement_group(name)
    if pg is None:
        return False
    remove_placement_group(pg)
    return True
