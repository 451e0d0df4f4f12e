"""`blink deploy | status | stop` (a running Ray cluster) and `blink serve --ray` (embedded local Ray).

    blink deploy [--config FILE] [--address auto] [--replicas N] [--frontends F] [--name NAME]
    blink status [--config FILE] [--address auto] [--json]
    blink stop   [--config FILE] [--address auto]

`deploy` places detached, named actors in the deployment's namespace and returns once the
HTTP endpoint answers; `status` and `stop` find them again by name. The config file is the one
`blink serve` reads, plus an optional [deploy] section (blink/actors/config.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

from .config import ConfigError, DeployConfig, build


def _overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    dep: dict[str, Any] = {}
    if getattr(args, "replicas", None) is not None:
        dep["replicas"] = args.replicas
    if getattr(args, "frontends", None) is not None:
        dep["frontends"] = args.frontends
    if getattr(args, "name", None) is not None:
        dep["name"] = args.name
    if getattr(args, "namespace", None) is not None:
        dep["namespace"] = args.namespace
    return {"deploy": dep}


def _connect(address: str, namespace: str) -> None:
    import ray

    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="WARNING")


def ray_token_auth() -> bool:
    """Whether this driver reached the cluster with Ray's token authentication (a cluster that
    requires tokens admits no driver without one, so a driver without is on a cluster without)."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    return get_authentication_mode() == AuthenticationMode.TOKEN


NO_RAY_AUTH = (
    "the Ray cluster at {address} was reached without Ray's token authentication: anyone who reaches "
    "its ports can run code on its GPU hosts. Start every node with RAY_AUTH_MODE=token and one shared "
    "token (cluster.yaml does: ~/.ray/auth_token, made by `ray get-auth-token --generate`), or set "
    'deploy.ray_auth = "off" for a cluster on a network only you reach'
)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="blink", description="Blink on a Ray cluster")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("deploy", "place and start a deployment on a running Ray cluster"),
        ("status", "show a deployment's actors and replicas"),
        ("stop", "stop a deployment and release its resources"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", help="config file (JSON/TOML/YAML) with an optional [deploy] section")
        p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
        p.add_argument("--name", help="deployment name (overrides deploy.name)")
        p.add_argument("--namespace", help="Ray namespace (overrides deploy.namespace)")
        if name == "deploy":
            p.add_argument("--replicas", type=int, help="GPU actors; 0 = one per GPU (overrides deploy.replicas)")
            p.add_argument(
                "--frontends",
                type=int,
                help="frontend processes on the one port (like vLLM's --api-server-count); 0 = one per replica",
            )
        if name == "status":
            p.add_argument("--json", action="store_true", help="print JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = build(args.config, _overrides(args))
    except ConfigError as e:
        print(f"blink {args.cmd}: {e}", file=sys.stderr)
        return 2
    from ray.exceptions import AuthenticationError

    try:
        _connect(args.address, cfg.namespace)
    except ConnectionError as e:
        print(
            f"blink {args.cmd}: no Ray cluster at {args.address!r}: {e} (a cluster with token authentication "
            "refuses a driver without its token: RAY_AUTH_MODE=token and ~/.ray/auth_token, as cluster.yaml sets up)",
            file=sys.stderr,
        )
        return 1
    except AuthenticationError as e:
        print(
            f"blink {args.cmd}: the Ray cluster at {args.address!r} refused this driver: {e.message}", file=sys.stderr
        )
        return 1
    from . import deploy

    if args.cmd == "deploy":
        if cfg.deploy.ray_auth == "token" and not ray_token_auth():
            print(f"blink deploy: {NO_RAY_AUTH.format(address=args.address)}", file=sys.stderr)
            return 1
        try:
            d = deploy.deploy(cfg, detached=True)
        except (ConfigError, TimeoutError, deploy.StartError) as e:
            print(f"blink deploy: {e}", file=sys.stderr)
            return 1
        from .frontend_actor import wait_http

        wait_http(d.url, cfg.deploy.start_timeout_s)
        print(f"deployed {cfg.name!r} ({d.plan.replicas} replica(s), namespace {cfg.namespace!r}): {d.url}")
        return 0
    if args.cmd == "status":
        st = deploy.status(cfg)
        if args.json:
            print(json.dumps(st, indent=2, default=str))
        else:
            print(format_status(st))
        return 0 if st["frontends"] or st["replicas"] else 3
    st = deploy.stop(cfg)
    print(f"stopped {cfg.name!r}: frontends={st['frontends']} replicas={st['replicas']} pg={st['placement_group']}")
    return 0


def format_status(st: dict[str, Any]) -> str:
    lines = [f"deployment {st['name']!r} (namespace {st['namespace']!r})"]
    fes = st["frontends"]
    if not fes:
        lines.append("  frontend: not running")
    for k, fe in enumerate(fes):
        name = "frontend" if len(fes) == 1 else f"frontend {k}"
        lines.append(
            f"  {name}: {fe.get('state')} {fe.get('url', '')} pid {fe.get('pid')} {fe.get('error', '')}".rstrip()
        )
        for r in fe.get("replicas", []):
            state = "up" if r["up"] else f"DOWN ({r['down_reason']})"
            lines.append(f"    route {r['replica']}: {state} requests={r['requests']} free={r.get('free_slots', '-')}")
    if not st["replicas"]:
        lines.append("  replicas: none")
    for r in st["replicas"]:
        lines.append(
            f"  replica {r.get('replica')}: {r.get('state')} device={r.get('device', '?')} pid={r.get('pid', '?')} "
            f"tokens={r.get('tokens_generated', '-')} running={r.get('running', '-')} {r.get('error', '')}".rstrip()
        )
    return "\n".join(lines)


def local_ray_resources(cfg: DeployConfig) -> dict[str, Any]:
    """ray.init arguments for an embedded single-node cluster that can hold `cfg`."""
    replicas = max(cfg.deploy.replicas, 1)
    need = cfg.deploy.frontend_cpus * cfg.frontend_count(replicas) + replicas * cfg.deploy.gpu_actor_cpus
    # Logical CPUs: the emulated device and the frontend share cores happily; Ray only counts.
    return {"num_cpus": max(os.cpu_count() or 1, int(need + 0.999))}


def serve_command(config_file: str | None, overrides: dict[str, dict[str, Any]]) -> int:
    """`blink serve --ray [flags]`: parse the config (with its optional [deploy] section) and serve."""
    try:
        cfg = build(config_file, overrides)
    except ConfigError as e:
        print(f"blink serve: config error: {e}", file=sys.stderr)
        return 2
    return serve_ray(cfg)


def serve_ray(cfg: DeployConfig) -> int:
    """`blink serve --ray`: the deployment's actors on an embedded local Ray, until Ctrl-C."""
    import ray

    ray.init(
        address="local",  # always a new embedded cluster, never one found via a temp-dir file
        namespace=cfg.namespace,
        include_dashboard=False,
        log_to_driver=True,
        logging_level="WARNING",
        **local_ray_resources(cfg),
    )
    from . import deploy
    from .frontend_actor import wait_http

    try:
        d = deploy.deploy(cfg, detached=False)
        wait_http(d.url, cfg.deploy.start_timeout_s)
        print(
            f"blink: serving {cfg.serving.model.spec} on {d.url}/v1 ({d.plan.replicas} replica(s) on Ray)",
            file=sys.stderr,
            flush=True,
        )
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        done.wait()
        deploy.stop(cfg)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
