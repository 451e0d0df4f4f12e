"""`blink generate`, `blink pull` and the Ray commands (`serve --ray`, deploy | status | stop:
blink.actors.cli, behind a check that Ray is installed)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

from blink import config as C
from blink.models import hub

from .config_args import hf_offline, overrides_from_args
from .serve import fail, run_loop

RAY_HINT = "Ray is not installed: pip install 'blink-serve[ray]'"


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def ray_command(argv: list[str]) -> int:
    if "-h" not in argv and "--help" not in argv and not ray_installed():
        print(f"blink {argv[0]}: {RAY_HINT}", file=sys.stderr)
        return 2
    from blink.actors import cli as actors_cli

    return int(actors_cli.main(argv) or 0)


def ray_serve(args: argparse.Namespace) -> int:
    if not ray_installed():
        print(f"blink serve --ray: {RAY_HINT}", file=sys.stderr)
        return 2
    from blink.actors import cli as actors_cli

    overrides = overrides_from_args(args)
    spec = overrides.get("model", {}).get("spec")
    if spec and hub.is_repo_id(spec):
        try:
            overrides["model"]["spec"] = str(hub.resolve(spec, hf_offline()))
        except hub.HubError as e:
            print(f"blink: {e}", file=sys.stderr)
            return 1
        overrides["model"].setdefault("name", spec)
    return actors_cli.serve_command(args.config, overrides)


def pull(args: argparse.Namespace) -> int:
    from blink.models import registry

    if hub.is_repo_id(args.model):
        try:
            print(hub.resolve(args.model, hf_offline(), args.cache_dir))
        except hub.HubError as e:
            print(f"blink pull: {e}", file=sys.stderr)
            return 1
        return 0
    if args.model not in ("default", registry.DEFAULT_NAME):
        print(
            f"blink pull: expected the default model ({registry.DEFAULT_NAME}) or a Hugging Face name (org/model)",
            file=sys.stderr,
        )
        return 2
    path = registry.pull(args.cache_dir, progress=True)
    print(path)
    return 0


def generate(cfg: C.BlinkConfig, args: argparse.Namespace) -> int:
    from blink.stack import Stack

    try:
        stack = Stack(cfg, progress=None)
    except C.ConfigError as e:
        return fail("generate", e)
    try:
        stack.start_device()
        return run_loop(_generate_async(stack, args))
    except Exception as e:
        return fail("generate", e)
    finally:
        stack.shutdown()


async def _generate_async(stack: Any, args: argparse.Namespace) -> int:
    from blink.dpu.generation import stream_text
    from blink.protocol.sampling_params import SamplingParams
    from blink.protocol.wire import SubmitRequest

    tok = stack.tokenizer
    tracker = await stack.start_frontend()
    try:
        if args.chat:
            ids = tok.chat_prompt([{"role": "user", "content": args.prompt}])
        else:
            ids = tok.completion_prompt(args.prompt)
        req = SubmitRequest(
            tracker.new_request_id(),
            ids,
            args.max_tokens,
            stop_ids=tok.stop_ids([], ignore_eos=False),
            sampling=SamplingParams(temperature=args.temperature, seed=args.seed),
        )
        async for ev in stream_text(tracker, tok, req, []):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        await stack.stop_frontend()
    return 0
