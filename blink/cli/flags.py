"""`blink`'s argument parser: every command's flags, their help and defaults (the config fields'
docstrings), and vLLM's names for the same settings."""

from __future__ import annotations

import argparse
import json

from blink import config as C

RAY_COMMANDS = ("deploy", "status", "stop")  # handed to blink.actors.cli


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
        "--fp8-lm-head",
        dest="device.fp8_lm_head",
        action=argparse.BooleanOptionalAction,
        help="with FP8 weights, the LM head in FP8 too (half its bytes; costs accuracy: off by default)",
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

    for name in RAY_COMMANDS:
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
