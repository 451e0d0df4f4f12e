"""The `blink` command: serve | generate | bench | pull (| deploy | status | stop, via blink.actors.cli).

Configuration is parsed here, once: defaults < --config FILE < flags, into blink.config.BlinkConfig.
One module per role: flags (the parser), config_args (command line -> config), serve (the HTTP
server's stack), commands (generate, pull, the Ray commands); `main` dispatches.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from blink import config as C
from blink.models import hub

from .commands import generate, pull, ray_command, ray_serve
from .config_args import check_device, config_from_args, flag_style_config, resolve_model_name, vllm_compat
from .flags import RAY_COMMANDS, build_parser
from .serve import fail, serve, setup_logging

__all__ = ["RAY_COMMANDS", "build_parser", "check_device", "config_from_args", "flag_style_config", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in RAY_COMMANDS:
        return ray_command(argv)
    parser = build_parser()
    try:
        argv = flag_style_config(argv, parser)
    except C.ConfigError as e:
        print(f"blink: config error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command == "bench":
        from blink import benchmark

        return benchmark.main(args)
    if args.command in ("serve", "generate"):
        try:
            vllm_compat(args)
        except C.ConfigError as e:
            print(f"blink: config error: {e}", file=sys.stderr)
            return 2
    if args.command == "serve" and args.ray:  # the config may carry a [deploy] section: parsed there
        return ray_serve(args)
    for flag in ("replicas", "frontends"):
        if getattr(args, f"deploy.{flag}", None) is not None:
            print(f"blink serve: --{flag} needs --ray", file=sys.stderr)
            return 2
    try:
        if args.command == "pull":
            return pull(args)
        cfg = resolve_model_name(config_from_args(args))
    except C.ConfigError as e:
        print(f"blink: config error: {e}", file=sys.stderr)
        return 2
    except hub.HubError as e:
        print(f"blink: {e}", file=sys.stderr)
        return 1
    setup_logging(cfg.server.log_level)
    try:
        from blink.launch import resolve_kind
        from blink.models import registry

        registry.check_model(cfg.model.spec)
        registry.check_device(cfg.model.spec, resolve_kind(cfg.device.kind))
    except (FileNotFoundError, registry.UnsupportedModelError) as e:
        return fail(args.command, e)
    try:  # after the model's checks: a model the GPU cannot run is said first, whatever is installed
        cfg = check_device(cfg)
    except C.ConfigError as e:
        print(f"blink: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(cfg)
    return generate(cfg, args)
