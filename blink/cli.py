"""The `blink` command: serve | generate | bench | pull (| deploy | status | stop, via blink.actors.cli).

Configuration is parsed here, once: defaults < --config FILE < flags, into blink.config.BlinkConfig.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from blink import config as C
from blink.models import hub

_RAY_COMMANDS = ("deploy", "status", "stop")
log = logging.getLogger("blink")


# vLLM's names for the same settings are accepted too (`vllm serve` command lines carry over); the
# help says where a meaning differs. Flags that ask for what Blink does not do are errors.
VLLM_NOOP_FLAGS = ("--trust-remote-code",)


def _add_stack_flags(p: argparse.ArgumentParser) -> None:
    """The flags of every command that builds a serving stack: model, device, vLLM's, ring."""
    _add_model_flags(p)
    _add_device_flags(p)
    _add_vllm_flags(p)
    _add_ring_flags(p)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML/JSON/YAML file with server/ring/device/model/deploy sections, or a vLLM-style YAML whose keys "
        "are this command's flag names (model: ..., max-model-len: ...); flags given here win",
    )
    p.add_argument(
        "--model",
        dest="model.spec",
        help="default | ORG/NAME (a Hugging Face model, as vllm serve takes it) | FILE.gguf | HF_DIR | random:<preset>",
    )
    p.add_argument("--served-model-name", dest="model.name", help="model name served by the API")
    p.add_argument(
        "--chat-template", dest="model.chat_template", help="a jinja chat template, or a file holding one (as vLLM's)"
    )
    parsers = ("auto", "hermes", "llama3_json", "phi4_mini_json")
    p.add_argument("--tool-call-parser", dest="server.tool_call_parser", choices=parsers, help="auto: by chat template")


def _add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", dest="device.kind", choices=("auto", "emulated", "cuda"))
    p.add_argument("--scheduler", dest="device.scheduler", choices=("gpu", "host"))
    p.add_argument("--max-batch", "--max-num-seqs", dest="device.max_batch", type=int, help="sequences per step")
    p.add_argument(
        "--max-num-batched-tokens",
        dest="device.max_num_batched_tokens",
        type=int,
        help="tokens per step (decodes + prefill chunks)",
    )
    p.add_argument(
        "--mixed-step-tokens",
        dest="device.mixed_tokens",
        type=int,
        help="token budget of a step that carries decodes (decodes + prefill chunk, doubled while it leaves the "
        "prompt under half of it or prompts queue behind it); 0 = --max-num-batched-tokens",
    )
    p.add_argument("--max-context", "--max-model-len", dest="device.max_context", type=int)
    p.add_argument("--kv-block-size", "--block-size", dest="device.kv_block_size", type=int)
    p.add_argument("--enable-prefix-caching", dest="device.enable_prefix_caching", action=argparse.BooleanOptionalAction,
                   help="reuse the KV of prompt prefixes computed before (default: on, as vLLM V1)")  # fmt: skip
    p.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="device.num_kv_blocks", type=int)
    p.add_argument(
        "--kv-cache-fraction",
        "--gpu-memory-utilization",
        dest="device.kv_cache_fraction",
        type=float,
        help="share of the GPU memory left free by the weights that the KV cache takes (vLLM's flag is a "
        "share of all GPU memory; both set how much memory goes to the KV cache)",
    )
    p.add_argument(
        "--max-device-restarts", dest="device.max_restarts", type=int, help="restarts of a dead device in a row"
    )
    p.add_argument("--kernel-cache-dir", dest="device.kernel_cache", metavar="DIR")
    p.add_argument(
        "--device-executor",
        dest="device.executor",
        metavar="MODULE:FUNCTION",
        help="emulated only: the executor factory of a stand-in model (benchmarks of the frontend)",
    )


def _add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags that Blink accepts with its one meaning, and the log level."""
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        dest="vllm_tp",
        type=int,
        default=1,
        metavar="N",
        help="1 only: a replica is one GPU (use --data-parallel-size with --ray for more GPUs)",
    )
    p.add_argument(
        "--dtype",
        dest="vllm_dtype",
        default="auto",
        metavar="DTYPE",
        help="auto | bfloat16, the only compute type",
    )
    for flag in VLLM_NOOP_FLAGS:
        p.add_argument(flag, action="store_true", dest=f"noop_{flag[2:].replace('-', '_')}", help=argparse.SUPPRESS)
    p.add_argument(
        "--quantization",
        "-q",
        dest="device.quantization",
        metavar="METHOD",
        help="fp8: linear layers' weights in FP8 e4m3 with per-channel scales, quantized at load (activations "
        "bf16); other methods are refused",
    )
    p.add_argument(
        "--kv-cache-dtype",
        dest="device.kv_cache_dtype",
        metavar="DTYPE",
        help="auto (the model dtype) | fp8: the KV cache in FP8 e4m3, scale 1 (twice the blocks); "
        "fp8_e5m2 and others are refused",
    )
    p.add_argument(
        "--log-level",
        dest="server.log_level",
        choices=("debug", "info", "warning", "error"),
        help="debug also prints the traceback of start-up errors",
    )


def _add_ring_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-slots", dest="ring.n_slots", type=int)
    p.add_argument("--mask-slots", dest="ring.mask_slots", type=int, help="structured-output requests at once")
    p.add_argument("--prompt-arena-tokens", dest="ring.prompt_arena_tokens", type=int)
    p.add_argument("--output-capacity", dest="ring.output_capacity", type=int)
    p.add_argument(
        "--transport",
        dest="ring.transport",
        choices=("auto", "shm", "tcp", "rdma"),
        help="how the frontend reaches the ring: shm (same host), tcp (ring agent on the GPU host; costs its CPU), "
        "rdma (pyverbs), auto (shm on the ring's host, else rdma where both ends have a device, else tcp)",
    )
    p.add_argument(
        "--ring-address",
        dest="ring.address",
        metavar="HOST:PORT",
        help="serve as a frontend only, of the ring behind the ring agent at HOST:PORT (a GPU host run with "
        "--ring-listen); no device starts here",
    )
    p.add_argument(
        "--ring-listen",
        dest="ring.listen",
        metavar="HOST:PORT",
        help="also serve this server's ring to frontends on other hosts through a ring agent (port 0: any)",
    )
    p.add_argument(
        "--ring-secret-file",
        dest="ring.secret_file",
        metavar="PATH",
        help="the ring agent's shared secret (mode 0600): made there by --ring-listen if missing, copied to "
        "each --ring-address frontend (default: ~/.blink/ring_agent.secret)",
    )
    p.add_argument(
        "--ring-frontends",
        dest="ring.remote_frontends",
        type=int,
        metavar="N",
        help="with --ring-listen: frontends on other hosts that may attach (each gets 1/(N+1) of the slots)",
    )
    p.add_argument("--rdma-device", dest="ring.rdma_device", help="RDMA device name (ibv_devices) (default: the first)")


def _origins_arg(v: str) -> str:
    """vLLM's JSON list ('["*"]') or a comma-separated list -> the comma-separated config value."""
    v = v.strip()
    if v.startswith("["):
        try:
            items = json.loads(v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from e
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return ",".join(items)
    return v


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless its default is unset or already stated."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        h = action.help or ""
        if "(default" in h or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return h
        return f"{h} (default: %(default)s)"


def _add_serve_flags(s: argparse.ArgumentParser) -> None:
    """`blink serve`'s flags: the stack's, the HTTP server's and the Ray path's."""
    s.add_argument("model_arg", nargs="?", metavar="MODEL", help="as --model (`vllm serve MODEL`)")
    _add_stack_flags(s)
    s.add_argument("--host", dest="server.host")
    s.add_argument("--port", dest="server.port", type=int)
    s.add_argument("--api-key", dest="server.api_key")
    s.add_argument("--max-body-bytes", dest="server.max_body_bytes", type=int)
    s.add_argument(
        "--public-metrics",
        dest="server.public_metrics",
        action="store_const",
        const=True,
        help="serve /metrics without the API key",
    )
    s.add_argument("--max-header-bytes", dest="server.max_header_bytes", type=int, metavar="N")
    s.add_argument("--body-read-timeout", dest="server.body_read_timeout_s", type=float, metavar="S")
    s.add_argument("--timeout-keep-alive", dest="server.keep_alive_timeout_s", type=float, metavar="S")
    s.add_argument("--max-connections", dest="server.max_connections", type=int, metavar="N")
    s.add_argument("--tokenizer-pool-size", dest="server.tokenizer_pool_size", type=int, metavar="N")
    s.add_argument("--max-stop-strings", dest="server.max_stop_strings", type=int, metavar="N")
    s.add_argument("--max-stop-string-chars", dest="server.max_stop_string_chars", type=int, metavar="N")
    s.add_argument("--shutdown-timeout", dest="server.shutdown_timeout_s", type=float, metavar="S")
    s.add_argument("--max-queue", dest="server.max_queue", type=int)
    s.add_argument("--max-n", dest="server.max_n", type=int, help="most choices (n) per request")
    s.add_argument(
        "--allowed-origins",
        dest="server.allowed_origins",
        type=_origins_arg,
        help='CORS origins: "*", a comma list, or a JSON list as vLLM takes it (\'["https://a.example"]\')',
    )
    s.add_argument(
        "--allowed-hosts",
        dest="server.allowed_hosts",
        type=_origins_arg,
        help="Host header values accepted besides loopback names when bound to loopback (DNS rebinding), "
        '"*" for any; a comma list or a JSON list',
    )
    s.add_argument(
        "--disable-log-requests",
        dest="server.log_requests",
        action="store_const",
        const=False,
        help="turn off the log line per request (on unless given)",
    )
    s.add_argument("--allow-reset-prefix-cache", dest="server.allow_reset_prefix_cache", action="store_const",
                   const=True, help="serve POST /reset_prefix_cache (refused with 403 otherwise)")  # fmt: skip
    s.add_argument(
        "--disable-log-stats",
        dest="server.log_stats",
        action="store_const",
        const=False,
        help="turn off the stats line every 10 s (on unless given)",
    )
    # --- Ray path (blink.actors): same actors as `blink deploy`, on an embedded local Ray ---
    s.add_argument("--ray", action="store_true", help="run the GPU and frontend actors on an embedded local Ray")
    s.add_argument(
        "--replicas",
        "--data-parallel-size",
        dest="deploy.replicas",
        type=int,
        help="with --ray: data-parallel replicas (0 = one per GPU)",
    )
    s.add_argument(
        "--frontends",
        "--api-server-count",
        dest="deploy.frontends",
        type=int,
        help="with --ray: frontend processes on the one port (like vLLM's --api-server-count; 0 = one per replica)",
    )


def build_parser() -> argparse.ArgumentParser:
    from blink import __version__

    ap = argparse.ArgumentParser(prog="blink", description="LLM serving with a GPU-resident scheduler")
    ap.add_argument("--version", action="version", version=f"blink {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API", formatter_class=HelpFormatter)
    _add_serve_flags(s)
    g = sub.add_parser("generate", help="print one completion (same stack, no HTTP)", formatter_class=HelpFormatter)
    _add_stack_flags(g)
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--max-tokens", type=int, default=128, metavar="N", help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, metavar="X", help="0 = greedy")
    g.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")

    b = sub.add_parser("bench", help="benchmark a running server (as `vllm bench serve`)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from blink import benchmark

    benchmark.add_arguments(
        bsub.add_parser(
            "serve",
            help="streamed completions against an OpenAI endpoint",
            formatter_class=HelpFormatter,
        )
    )

    p = sub.add_parser(
        "pull", help="download the default model (SmolLM2-135M-Instruct) if missing", formatter_class=HelpFormatter
    )
    p.add_argument("model", nargs="?", default="default", help="the model to fetch: default, or a Hugging Face name")
    p.add_argument("--cache-dir", metavar="DIR", help="where to put it (default: ~/.cache/blink/models)")

    for name in _RAY_COMMANDS:
        r = sub.add_parser(name, help=f"{name} on a Ray cluster (blink.actors.cli)", add_help=False)
        r.add_argument("rest", nargs=argparse.REMAINDER)
    for p in (s, g):
        describe_config_flags(p)
    return ap


_METAVARS = {int: "N", float: "X"}


def describe_config_flags(p: argparse.ArgumentParser) -> None:
    """Every flag that sets a config field (dest "section.field") gets the field's docstring as
    help when it has none, its default, and a metavar that reads as a value (N, X, HOST, ...)."""
    from blink.actors.config import DeploySection  # plain dataclasses: no Ray import

    sections = {**C.SECTIONS, "deploy": DeploySection}
    docs = C.field_docs(sections)
    for action in p._actions:
        if "." not in action.dest or not action.option_strings:
            continue
        section, name = action.dest.split(".", 1)
        default = getattr(sections[section](), name)
        if action.help is None:
            action.help = docs.get((section, name), "")
        if action.help is not argparse.SUPPRESS and "(default" not in action.help:
            if isinstance(action, argparse._StoreConstAction):  # a switch: the help says what giving it changes
                pass
            else:
                shown = "unset" if default is None or default == "" else default
                action.help = f"{action.help} (default: {shown})".lstrip()
        if action.metavar is None and not action.choices:
            action.metavar = _METAVARS.get(action.type, name.rsplit("_", 1)[-1].upper())  # type: ignore[arg-type]


def vllm_compat(args: argparse.Namespace) -> None:
    """The positional MODEL and vLLM's flags that have no setting here: checked, folded in."""
    model = getattr(args, "model_arg", None)
    if model is not None:
        if getattr(args, "model.spec", None) not in (None, model):
            raise C.ConfigError(f"two models given: {model!r} and --model {getattr(args, 'model.spec')!r}")
        setattr(args, "model.spec", model)
    if getattr(args, "vllm_tp", 1) != 1:
        raise C.ConfigError(
            "--tensor-parallel-size must be 1: a Blink replica is one GPU; for more GPUs, data-parallel "
            "replicas (--ray --data-parallel-size N)"
        )
    if getattr(args, "vllm_dtype", "auto") not in ("auto", "bfloat16", "bf16"):
        raise C.ConfigError(f"--dtype {args.vllm_dtype}: Blink computes in bfloat16 only (auto | bfloat16)")


def config_from_args(args: argparse.Namespace) -> C.BlinkConfig:
    """The serving config. A [deploy] section in the file is checked too (the same file serves
    `blink serve` and `blink deploy`) and applies with --ray only."""
    from blink.actors.config import build as build_with_deploy  # plain dataclasses: no Ray import

    vllm_compat(args)
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, field = key.split(".", 1)
            overrides.setdefault(section, {})[field] = value
    return build_with_deploy(args.config, overrides).serving


def flag_style_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """A vLLM-style config file (a flat mapping whose keys are flag names: `model: X`,
    `max-model-len: 4096`, `port: 8000`) becomes those flags, placed before the command line's own
    so that these win, as in vLLM. A sectioned file ([server], [device], ...) is left to C.build."""
    if len(argv) < 2 or argv[0] not in ("serve", "generate"):
        return argv
    for i, tok in enumerate(argv):
        if tok == "--config" and i + 1 < len(argv):
            path, span = argv[i + 1], 2
            break
        if tok.startswith("--config="):
            path, span = tok.split("=", 1)[1], 1
            break
    else:
        return argv
    data = C.load_file(path)
    sections = {*C.SECTIONS, "deploy"}
    if isinstance(data, dict) and all(k in sections and isinstance(v, dict) for k, v in data.items()):
        return argv
    if not isinstance(data, dict):
        raise C.ConfigError(f"{path}: expected a mapping of sections or of flag names")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    by_flag = {opt: a for a in sub._actions for opt in a.option_strings}
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = by_flag.get(flag)
        if action is None or flag in ("--config", "--help"):
            raise C.ConfigError(f"{path}: unknown key {key!r} (not a flag of `blink {argv[0]}`)")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise C.ConfigError(f"{path}: {key} must be true or false")
            flags += [flag] if value else []
        elif isinstance(value, (dict, bool)) or value is None:
            raise C.ConfigError(f"{path}: {key} = {value!r} is not a flag value")
        else:
            flags += [flag, json.dumps(value) if isinstance(value, list) else str(value)]
    return [argv[0], *flags, *argv[1:i], *argv[i + span :]]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _RAY_COMMANDS:
        return _ray_command(argv)
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
        return _ray_serve(args)
    for flag in ("replicas", "frontends"):
        if getattr(args, f"deploy.{flag}", None) is not None:
            print(f"blink serve: --{flag} needs --ray", file=sys.stderr)
            return 2
    try:
        if args.command == "pull":
            return _pull(args)
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
        return _fail(args.command, e)
    try:  # after the model's checks: a model the GPU cannot run is said first, whatever is installed
        cfg = check_device(cfg)
    except C.ConfigError as e:
        print(f"blink: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(cfg)
    return _generate(cfg, args)


def setup_logging(level: str) -> None:
    """The frontend's log lines (requests, stats, warnings) on stderr."""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%m-%d %H:%M:%S",
        stream=sys.stderr,
    )


def _fail(command: str, e: BaseException) -> int:
    """A start-up error as one line; its traceback only with --log-level debug."""
    log.debug("%s failed", command, exc_info=e)
    text = str(e) or type(e).__name__
    known = (RuntimeError, TimeoutError, OSError, ValueError, KeyError)
    print(f"blink {command}: {text if isinstance(e, known) else f'{type(e).__name__}: {text}'}", file=sys.stderr)
    return 1


RAY_HINT = "Ray is not installed: pip install 'blink-serve[ray]'"


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def _ray_command(argv: list[str]) -> int:
    if "-h" not in argv and "--help" not in argv and not ray_installed():
        print(f"blink {argv[0]}: {RAY_HINT}", file=sys.stderr)
        return 2
    from blink.actors import cli as actors_cli

    return int(actors_cli.main(argv) or 0)


def _ray_serve(args: argparse.Namespace) -> int:
    if not ray_installed():
        print(f"blink serve --ray: {RAY_HINT}", file=sys.stderr)
        return 2
    from blink.actors import cli as actors_cli

    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, field = key.split(".", 1)
            overrides.setdefault(section, {})[field] = value
    spec = overrides.get("model", {}).get("spec")
    if spec and hub.is_repo_id(spec):
        try:
            overrides["model"]["spec"] = str(hub.resolve(spec, hf_offline()))
        except hub.HubError as e:
            print(f"blink: {e}", file=sys.stderr)
            return 1
        overrides["model"].setdefault("name", spec)
    return actors_cli.serve_command(args.config, overrides)


def _pull(args: argparse.Namespace) -> int:
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


def hf_offline() -> bool:
    """HF_HUB_OFFLINE, read here at the edge (huggingface_hub's own truthy values)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model_name(cfg: C.BlinkConfig) -> C.BlinkConfig:
    """A Hugging Face name (`org/model`) -> its local snapshot directory, once, here; the API then
    serves the model under that name (as vLLM does) unless --served-model-name says otherwise."""
    spec = cfg.model.spec
    if not hub.is_repo_id(spec):
        return cfg
    path = hub.resolve(spec, hf_offline())
    return cfg.replace(model={"spec": str(path), "name": cfg.model.name or spec})


def check_device(cfg: C.BlinkConfig) -> C.BlinkConfig:
    """For --device cuda: CuPy and NVRTC must be installed (else a ConfigError naming the pip
    command). The kernel cache directory is settled here, where the environment is read
    ($XDG_CACHE_HOME); `auto` itself is resolved by the launch layer."""
    from blink.gpu.toolchain import build

    if cfg.device.kind == "cuda":
        have = (("CuPy", cupy_installed()), ("NVRTC", build.find_nvrtc() is not None))
        missing = [name for name, ok in have if not ok]
        if missing:
            raise C.ConfigError(f"--device cuda needs {' and '.join(missing)}: {build.INSTALL_HINT}")
    if cfg.device.kernel_cache:
        return cfg
    return cfg.replace(device={"kernel_cache": str(build.default_cache_dir(os.environ.get("XDG_CACHE_HOME")))})


def cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None


def _run(coro: Any) -> Any:
    import uvloop

    return uvloop.run(coro)


def _serve(cfg: C.BlinkConfig) -> int:
    from blink.stack import Stack, stderr_progress

    try:
        stack = Stack(cfg, stderr_progress)  # reads the ring agent's secret file, if any
    except C.ConfigError as e:
        return _fail("serve", e)
    try:
        stack.start_device()
        _run(_serve_async(stack))
    except Exception as e:  # a model that does not load, a port in use, a device that dies: one line
        return _fail("serve", e)
    finally:
        stack.shutdown()
    return 1 if stack.gave_up else 0


async def _serve_async(stack: Any) -> None:
    from blink.dpu.server import OpenAIServer, start_http

    cfg = stack.cfg
    stop = asyncio.Event()
    backend = await stack.start_frontend(on_give_up=stop.set)  # a device that cannot be restarted ends serve
    server = OpenAIServer(backend, stack.tokenizer, cfg.server)
    runner, port = await start_http(server, cfg.server.host, cfg.server.port)
    # The bound port on its own line: scripts that pass --port 0 read it from here.
    print(f"blink: serving {stack.tokenizer.name} on http://{cfg.server.host}:{port}/v1", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    now = asyncio.Event()  # a second signal: end the requests in flight at once

    def on_signal() -> None:
        (now if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await stop.wait()
        if stack.gave_up:
            print("blink: device lost", file=sys.stderr, flush=True)
        else:
            n, wait = len(server.completion.active), cfg.server.shutdown_timeout_s
            print(
                f"blink: shutting down: {n} request(s) in flight get up to {wait:g} s (a second signal ends them now)",
                file=sys.stderr,
                flush=True,
            )
            await server.drain(runner, wait, now)
    finally:
        await runner.cleanup()
        await stack.stop_frontend()


def _generate(cfg: C.BlinkConfig, args: argparse.Namespace) -> int:
    from blink.stack import Stack

    try:
        stack = Stack(cfg, progress=None)
    except C.ConfigError as e:
        return _fail("generate", e)
    try:
        stack.start_device()
        return _run(_generate_async(stack, args))
    except Exception as e:
        return _fail("generate", e)
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


if __name__ == "__main__":  # pragma: no cover
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
