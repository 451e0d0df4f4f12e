"""Place and start a deployment on a connected Ray cluster; find it again; stop it.

Used by `blink serve --ray` (embedded local Ray, actors owned by the driver), `blink deploy`
(running cluster, detached named actors in a namespace), `blink status`, `blink stop` and
the scale-out benchmark. Every Ray call here is start-up or control plane; after `deploy()` returns,
requests and tokens flow HTTP -> frontend -> ring -> engine without Ray.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from blink.protocol.transport import SHM_DIR

from .config import DeployConfig
from .placement import PlacementPlan, alive_node_resources, ensure_placement_group, plan_placement

log = logging.getLogger(__name__)


@dataclass
class Deployment:
    cfg: DeployConfig
    plan: PlacementPlan
    gpu_actors: list[Any]  # ray ActorHandle per replica
    frontend: Any  # ray ActorHandle of frontend 0
    rings: list[dict[str, Any]]  # GpuActor.ring_info() per replica
    frontend_info: dict[str, Any]  # FrontendActor.start() result of frontend 0 (url, ...)
    frontends: list[Any] = field(default_factory=list)  # every frontend actor, frontend 0 first
    frontends_info: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.frontend_info["url"]


def _actor_options(cfg: DeployConfig, name: str, pg: Any, bundle: int, detached: bool) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts: dict[str, Any] = dict(
        name=name,
        namespace=cfg.namespace,
        get_if_exists=True,  # a second deploy finds the running actor instead of failing
        max_restarts=cfg.deploy.max_restarts,
        max_task_retries=0,
        # start() runs for seconds; status() must answer meanwhile.
        max_concurrency=4,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=False
        ),
    )
    if detached:
        opts["lifetime"] = "detached"
    return opts


def deploy(cfg: DeployConfig, detached: bool) -> Deployment:
    """Reserve the placement group, start every GPU actor, then the frontend; all under timeouts.

    detached=False: the actors belong to this driver and live only while the returned
    Deployment (its actor handles) is referenced; Ray reclaims them once the handles are gone.
    Deploying a name that is already running reuses its placement group and actors as they are
    (a different replica count is refused); to change the config, `blink stop` first."""
    import ray

    from blink.protocol.agent_auth import new_secret

    from .frontend_actor import FrontendActor
    from .gpu_actor import GpuActor

    plan = plan_placement(cfg, alive_node_resources())
    timeout = cfg.deploy.start_timeout_s
    pg = ensure_placement_group(plan, detached, timeout)
    gpu_cls = ray.remote(GpuActor)
    fe_cls = ray.remote(FrontendActor)
    gpu_bundle = plan.bundles[plan.gpu_bundle(0)]
    n_fe = cfg.frontend_count(plan.replicas)
    # The ring agents' secret: every GPU actor serves its ring to the clients that prove it, and only
    # the frontend actors get it (as an argument: Ray's own token authentication guards the cluster).
    secret = new_secret()
    gpus = []
    for i in range(plan.replicas):
        opts = _actor_options(cfg, cfg.gpu_actor_name(i), pg, plan.gpu_bundle(i), detached)
        opts.update(num_cpus=gpu_bundle.get("CPU", 0.0), num_gpus=gpu_bundle.get("GPU", 0.0))
        gpus.append(gpu_cls.options(**opts).remote(cfg.to_json(), i, secret, n_fe))
    try:
        rings = _get_all([a.start.remote() for a in gpus], timeout, "GPU actor start()", gpus)
    except (StartError, TimeoutError):
        # Actors killed mid-start cannot remove their rings themselves. ray.kill is asynchronous:
        # wait for them to be gone first, or one still in start() could create its ring after this.
        _wait_dead(gpus, 10.0)
        unlink_local_rings(cfg)
        raise
    fe_bundle = plan.bundles[plan.frontend_bundle]
    frontends: list[Any] = []
    infos: list[dict[str, Any]] = []
    for k in range(n_fe):
        # Frontend 0 binds the configured port; the others share the port it bound (SO_REUSEPORT).
        opts = _actor_options(cfg, cfg.frontend_actor_name(k), pg, plan.frontend_bundle, detached)
        opts.update(num_cpus=fe_bundle.get("CPU", 0.0) / n_fe)
        if "dpu" in fe_bundle:
            opts["resources"] = {"dpu": fe_bundle["dpu"] / n_fe}
        port = None if k == 0 else infos[0]["port"]
        frontends.append(fe_cls.options(**opts).remote(cfg.to_json(), plan.replicas, k, n_fe, port, secret))
        (info,) = _get_all([frontends[k].start.remote()], timeout, f"frontend {k} start()", frontends)
        infos.append(info)
    for fe in frontends:
        _wait_routes(fe, plan.replicas, timeout)
    frontend, fe_info = frontends[0], infos[0]
    return Deployment(cfg, plan, gpus, frontend, rings, fe_info, frontends, infos)


def _wait_routes(frontend: Any, replicas: int, timeout: float) -> None:
    """Until the frontend has attached every replica's ring. A frontend that cannot see a ring
    (placed on another host than its GPU actor: the shared-memory ring is per host) fails here,
    at deploy time, with the reason, instead of serving a fraction of the replicas."""
    import ray

    t_end = time.monotonic() + timeout
    while True:
        routes = ray.get(frontend.status.remote(), timeout=timeout).get("replicas", [])
        if len(routes) == replicas and all(r["up"] for r in routes):
            return
        if time.monotonic() > t_end:
            down = "; ".join(f"replica {r['replica']}: {r['down_reason']}" for r in routes if not r["up"])
            raise StartError(f"the frontend did not attach every ring within {timeout:g}s ({down})")
        time.sleep(0.05)


def _get_all(refs: list[Any], timeout: float, what: str, actors: list[Any]) -> list[Any]:
    import ray

    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise TimeoutError(f"{what} did not finish in {timeout:g}s; actors killed") from None
    except ray.exceptions.RayTaskError as e:
        # A start that failed (bad model, engine crash) would fail again on every restart.
        for a in actors:
            ray.kill(a, no_restart=True)
        raise StartError(f"{what} failed: {e.cause if e.cause is not None else e}; actors killed") from None


class StartError(RuntimeError):
    """An actor's start() raised; the message carries the actor's own error."""


def find_all(cfg: DeployConfig) -> tuple[list[Any], list[Any]]:
    """Handles of a running deployment's named actors (in cfg.namespace): (GPU actors by replica,
    frontend actors by index)."""
    import ray
    from ray.util import list_named_actors

    named = {a["name"] for a in list_named_actors(all_namespaces=True) if a["namespace"] == cfg.namespace}

    def numbered(prefix: str) -> list[int]:
        return sorted(int(n[len(prefix) :]) for n in named if n.startswith(prefix) and n[len(prefix) :].isdigit())

    gpus = [ray.get_actor(cfg.gpu_actor_name(i), namespace=cfg.namespace) for i in numbered(cfg.gpu_actor_name(0)[:-1])]
    fe_ids = ([0] if cfg.frontend_actor_name(0) in named else []) + numbered(cfg.frontend_actor_name(0) + "-")
    frontends = [ray.get_actor(cfg.frontend_actor_name(k), namespace=cfg.namespace) for k in fe_ids]
    return gpus, frontends


def status(cfg: DeployConfig, timeout_s: float = 10.0) -> dict[str, Any]:
    """Status of every actor of the deployment; an actor that does not answer is reported as such.
    "frontend" is frontend 0's; "frontends" lists every frontend's."""
    import ray

    gpus, frontends = find_all(cfg)
    out: dict[str, Any] = {"name": cfg.name, "namespace": cfg.namespace, "replicas": [], "frontend": None}
    for i, a in enumerate(gpus):
        try:
            out["replicas"].append(ray.get(a.status.remote(), timeout=timeout_s))
        except (ray.exceptions.RayError, TimeoutError) as e:
            out["replicas"].append({"replica": i, "state": "UNREACHABLE", "error": f"{type(e).__name__}: {e}"})
    out["frontends"] = []
    for fe in frontends:
        try:
            out["frontends"].append(ray.get(fe.status.remote(), timeout=timeout_s))
        except (ray.exceptions.RayError, TimeoutError) as e:
            out["frontends"].append({"state": "UNREACHABLE", "error": f"{type(e).__name__}: {e}"})
    out["frontend"] = out["frontends"][0] if out["frontends"] else None
    return out


def stop(cfg: DeployConfig, timeout_s: float = 30.0) -> dict[str, Any]:
    """Stop the frontend, drain and stop each engine, kill the actors, release the placement group."""
    import ray

    from .placement import remove_placement_group_by_name

    gpus, frontends = find_all(cfg)
    stopped: dict[str, Any] = {"frontends": 0, "replicas": 0, "placement_group": False}
    for fe in frontends:
        try:
            ray.get(fe.stop.remote(), timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("frontend stop: %s", e)
        ray.kill(fe, no_restart=True)
        stopped["frontends"] += 1
    for a in gpus:
        try:
            ray.get(a.stop.remote(drain=True, timeout_s=timeout_s), timeout=timeout_s + 5)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("gpu actor stop: %s", e)
        ray.kill(a, no_restart=True)
        stopped["replicas"] += 1
    stopped["placement_group"] = remove_placement_group_by_name(cfg.placement_group_name)
    stopped["rings_removed"] = unlink_local_rings(cfg)
    return stopped


def _wait_dead(actors: list[Any], timeout_s: float) -> None:
    """Until every (killed) actor answers calls with RayActorError, or the timeout."""
    import ray

    t_end = time.monotonic() + timeout_s
    for a in actors:
        while time.monotonic() < t_end:
            try:
                ray.get(a.pid.remote(), timeout=max(0.1, t_end - time.monotonic()))
            except ray.exceptions.RayActorError:
                break  # dead
            except ray.exceptions.GetTimeoutError:
                break  # out of time: the caller goes on without the guarantee
            time.sleep(0.05)  # still answering: the kill has not landed yet


def unlink_local_rings(cfg: DeployConfig) -> int:
    """Remove this deployment's ring files left on this host by killed GPU actors (a live actor
    unlinks its own ring when it stops). Ring names carry the namespace and deployment name, so
    only this deployment's files match. Returns how many were removed."""
    prefix = cfg.ring_name(0)[: -len("0")]
    n = 0
    for f in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "[0-9]*")):
        if f[len(SHM_DIR) + 1 + len(prefix) :].isdigit():
            with contextlib.suppress(FileNotFoundError):  # raced with its actor's own unlink
                os.unlink(f)
                n += 1
    return n
