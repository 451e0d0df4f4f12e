"""Configuration, parsed once at the edge into frozen dataclasses.

Sources, later ones win: defaults < config file (JSON, TOML; YAML when pyyaml is installed)
< command-line flags. A file is a mapping of sections (`server`, `ring`, `device`, `model`) to
mappings of fields. Unknown sections or keys, wrong types and out-of-range values are errors
that name the offending key. Nothing below the edge reads environment variables.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The cuda default of DeviceConfig.mixed_tokens: a step stays memory-bound to ~200 tokens, so a mixed
# step of this budget costs little more than a decode step; why 192: docs/decisions.md.
DEFAULT_MIXED_TOKENS = 192


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it."""


def _bounds(section: str, name: str, value: float | int, lo: float | None = None, hi: float | None = None) -> None:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise ConfigError(f"{section}.{name} = {value!r} is outside {rng}")


def _choice(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name} = {value!r}; expected one of {', '.join(choices)}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address the HTTP server binds (loopback by default; 0.0.0.0 exposes it)."""
    port: int = 8000
    """TCP port of the HTTP server; 0 picks a free one."""
    api_key: str | None = None
    """When set, every request but /health (and /metrics with public_metrics) needs
    `Authorization: Bearer <api_key>`; the key is compared in constant time."""
    public_metrics: bool = False
    """Serve /metrics without the API key (as vLLM does), for a Prometheus that holds no key."""
    max_body_bytes: int = 4 << 20
    """Largest accepted request body; larger ones get 413."""
    max_header_bytes: int = 8190
    """Longest request line and longest header field; longer ones get 400 and the connection closes."""
    body_read_timeout_s: float = 30.0
    """A request body must arrive whole within this many seconds of its handler asking for it;
    a slower one (a trickled or never-ending chunked body) gets 408 and the connection closes."""
    keep_alive_timeout_s: float = 5.0
    """A connection with no complete request head this many seconds after it opened or after its
    previous response is closed: idle keep-alive connections and slowly trickled headers alike
    (uvicorn's --timeout-keep-alive, which vLLM serves with, defaults to 5 s)."""
    max_connections: int = 4096
    """Open HTTP connections; one more gets `503` and is closed at once, so a flood of idle sockets
    cannot use up the process's file descriptors (the soft fd limit is raised to fit, when allowed)."""
    tokenizer_pool_size: int = 1
    """Processes that tokenize prompts of more than 16 KiB (the tokenizer holds the GIL, so a long
    prompt encoded in this process would pause every stream and health check); 0 = a thread here."""
    max_stop_strings: int = 16
    """Stop strings per request; more is a 400."""
    max_stop_string_chars: int = 1024
    """Characters per stop string; a longer one is a 400 (stop matching costs up to the sum of their
    lengths once per request, then a constant per generated character)."""
    shutdown_timeout_s: float = 5.0
    """On SIGINT/SIGTERM: how long requests in flight may take to finish before each is ended with an
    error event (a second signal ends them at once)."""
    max_queue: int = 1024
    """Requests that may wait for a free ring slot; beyond that new requests get 429."""
    max_n: int = 128
    """Most choices (`n`) one request may ask for; beyond it a 400. OpenAI's own limit: each choice
    is a ring request of its own (docs/decisions.md, "Serving and frontend")."""
    heartbeat_timeout_s: float = 30.0
    """Device heartbeat silence (seconds) that counts as a device failure."""
    allowed_origins: str | None = None
    """CORS: comma-separated origins whose browser pages may call the API ("*": any); None: no
    CORS headers (browsers then refuse cross-origin calls, as without vLLM's --allowed-origins)."""
    allowed_hosts: str | None = None
    """Host header values accepted besides loopback names, comma-separated ("*": any). A server bound
    to loopback answers only requests whose Host names loopback unless this says otherwise, which
    keeps web pages out through DNS rebinding; on other addresses it restricts Host only when set."""
    log_requests: bool = True
    """A log line per request (id, tokens, TTFT, total time, finish reason); vLLM's
    --disable-log-requests turns it off."""
    log_stats: bool = True
    """A log line every 10 s (running, waiting, KV usage, tokens/s); --disable-log-stats turns it off."""
    log_level: str = "info"
    """debug | info | warning | error; debug also prints the traceback of start-up errors."""
    tool_call_parser: str = "auto"
    """How tool calls are found in the model's text (vLLM's --tool-call-parser): hermes (Hermes, Qwen2.5,
    Qwen3) | llama3_json | phi4_mini_json | auto (by the chat template's tool format)."""
    allow_reset_prefix_cache: bool = False
    """Serve POST /reset_prefix_cache (vLLM serves it in its development mode only): anyone who can
    reach the server could otherwise empty the cache every other request relies on."""

    def __post_init__(self) -> None:
        _choice("server", "log_level", self.log_level, ("debug", "info", "warning", "error"))
        _choice(
            "server", "tool_call_parser", self.tool_call_parser, ("auto", "hermes", "llama3_json", "phi4_mini_json")
        )
        _bounds("server", "port", self.port, 0, 65535)
        _bounds("server", "max_body_bytes", self.max_body_bytes, 1024, 1 << 30)
        _bounds("server", "max_header_bytes", self.max_header_bytes, 256, 1 << 20)
        _bounds("server", "body_read_timeout_s", self.body_read_timeout_s, 0.01, 3600)
        _bounds("server", "keep_alive_timeout_s", self.keep_alive_timeout_s, 0.01, 3600)
        _bounds("server", "max_connections", self.max_connections, 1, 1 << 20)
        _bounds("server", "tokenizer_pool_size", self.tokenizer_pool_size, 0, 64)
        _bounds("server", "max_stop_strings", self.max_stop_strings, 0, 1024)
        _bounds("server", "max_stop_string_chars", self.max_stop_string_chars, 1, 1 << 20)
        _bounds("server", "shutdown_timeout_s", self.shutdown_timeout_s, 0, 3600)
        _bounds("server", "max_queue", self.max_queue, 0, 1 << 20)
        _bounds("server", "max_n", self.max_n, 1, 256)
        _bounds("server", "heartbeat_timeout_s", self.heartbeat_timeout_s, 0.1, 3600)
        if self.api_key is not None and not self.api_key:
            raise ConfigError("server.api_key must not be empty (leave it unset to disable auth)")
        if self.allowed_origins is not None and not self.origins:
            raise ConfigError("server.allowed_origins names no origin")
        if self.allowed_hosts is not None and not self.hosts:
            raise ConfigError("server.allowed_hosts names no host")

    @property
    def origins(self) -> frozenset[str]:
        return frozenset(o.strip() for o in (self.allowed_origins or "").split(",") if o.strip())

    @property
    def hosts(self) -> frozenset[str]:
        """allowed_hosts as lower-case names without ports."""
        return frozenset(h.strip().lower() for h in (self.allowed_hosts or "").split(",") if h.strip())


@dataclass(frozen=True)
class RingConfig:
    n_slots: int = 256
    """Request slots in the ring: the most requests in flight on the device at once."""
    prompt_arena_tokens: int = 256 * 8192
    """Prompt arena size in tokens; each slot owns prompt_arena_tokens // n_slots of it."""
    output_capacity: int = 1024
    """Output ring tokens per slot; the device pauses a slot whose reader falls this far behind."""
    transport: str = "auto"
    """How the frontend reaches the ring: shm (a /dev/shm mapping: same host) | tcp (through a ring
    agent on the GPU host, which costs that host's CPU per round trip) | rdma (one-sided READ/WRITE,
    pyverbs) | auto (shm when the frontend shares the ring's host, rdma when both ends have an RDMA
    device and pyverbs, tcp otherwise)."""
    address: str | None = None
    """host:port of a ring agent: set, this server is a frontend only (no device here); it serves the
    ring that agent serves (a GPU host running with ring.listen)."""
    listen: str | None = None
    """host:port: also serve this server's ring to frontends on other hosts through a ring agent
    (port 0 picks one; the chosen address is printed)."""
    rdma_device: str = ""
    """RDMA device to use (ibv_devices name); "" = the first one."""
    mask_slots: int = 64
    """Allowed-token bitmasks in the ring: the most structured-output (or tool-call-enforced) requests
    in flight at once; more wait for one. 0: structured output is refused."""
    mask_vocab: int = 152_064
    """Tokens a bitmask covers (the model's vocabulary must fit; 19,008 B a mask by default)."""
    secret_file: str | None = None
    """The ring agent's shared secret (64 hex digits, mode 0600). With ring.listen it is created if
    missing; a frontend with ring.address must hold a copy. None = ~/.blink/ring_agent.secret (an
    agent only this server's frontend reaches, ring.transport tcp/rdma without ring.listen, gets a
    fresh secret in memory instead)."""
    remote_frontends: int = 1
    """With ring.listen: how many frontends on other hosts may attach. The slots are split into
    remote_frontends + 1 partitions (slot s to frontend s % (remote_frontends + 1); this server's own
    frontend has partition 0), so that each slot has one frontend."""

    def __post_init__(self) -> None:
        _bounds("ring", "n_slots", self.n_slots, 1, 1 << 16)
        _bounds("ring", "output_capacity", self.output_capacity, 1, 1 << 20)
        _bounds("ring", "prompt_arena_tokens", self.prompt_arena_tokens, self.n_slots, 1 << 28)
        _bounds("ring", "mask_slots", self.mask_slots, 0, 1 << 16)
        _bounds("ring", "mask_vocab", self.mask_vocab, 32, 1 << 22)
        _choice("ring", "transport", self.transport, ("auto", "shm", "tcp", "rdma"))
        _bounds("ring", "remote_frontends", self.remote_frontends, 1, 64)
        if self.listen is not None and self.remote_frontends + 1 > self.n_slots:
            raise ConfigError(f"ring.remote_frontends = {self.remote_frontends} leaves no slot to some frontend")
        for f in ("address", "listen"):
            v = getattr(self, f)
            if v is not None:
                host, sep, port = v.rpartition(":")
                if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                    raise ConfigError(f"ring.{f} = {v!r}; expected host:port")
        if self.address is not None and self.address.rpartition(":")[2] == "0":
            raise ConfigError("ring.address needs the agent's port, not 0")
        if self.address is not None and self.listen is not None:
            raise ConfigError(
                "ring.address (a frontend of a remote ring) and ring.listen (serve the local ring) exclude each other"
            )

    @property
    def prompt_tokens_per_slot(self) -> int:
        return self.prompt_arena_tokens // self.n_slots


@dataclass(frozen=True)
class DeviceConfig:
    kind: str = "auto"
    """auto (cuda when a GPU is usable, else emulated) | emulated (numpy on the CPU) | cuda."""
    scheduler: str = "gpu"
    """gpu: the persistent scheduler kernel; host: the host-driven loop (baseline). cuda only."""
    max_batch: int = 32
    """Sequences per decode step."""
    max_num_batched_tokens: int | None = None
    """Tokens per step: every decode plus prefill chunks (vLLM's max_num_batched_tokens). None =
    2048 on cuda, 256 on the emulated device: a CPU step of 2048 prompt tokens at a long context runs
    for tens of seconds, and the heartbeat waits for the step. See step_tokens."""
    mixed_tokens: int | None = None
    """Token budget of a step that carries decodes, the running decodes included (Sarathi-Serve's
    token budget), doubled while it leaves a prompt less than half of itself or while prompts queue
    behind the one admitted (never above max_num_batched_tokens; blink/device/policy.py step_budget); 0 = max_num_batched_tokens. None = DEFAULT_MIXED_TOKENS
    on cuda, 0 on the emulated device (no graphs there, so no bucket to fill). See mixed_step_tokens."""
    kv_block_size: int = 16
    """Tokens per KV cache block."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool; None sizes the pool from kv_cache_fraction (cuda) or max_batch x max_context."""
    kv_cache_fraction: float = 0.9
    """Fraction of free GPU memory given to the KV cache when num_kv_blocks is None."""
    max_context: int | None = None
    """Prompt + generated tokens per request; None = the model's own limit."""
    ready_timeout_s: float = 900.0
    """How long start-up (model load, warm-up) may take before the server gives up."""
    max_restarts: int = 3
    """`blink serve` restarts a device process that dies, with backoff, up to this many times in a
    row (a device that then serves for a minute starts the count over); past that it exits non-zero.
    0: exit at the first death."""
    executor: str = ""
    """emulated: a stand-in model's executor factory, "module:function", imported by the device process
    (benchmarks of the frontend use one whose steps take a modeled time); "" = the numpy model."""
    quantization: str | None = None
    """fp8: the linear layers' weights quantized at load to FP8 e4m3 with per-output-channel scales,
    activations in bf16 (vLLM's --quantization fp8); None = the weights as the checkpoint holds them.
    Dense models on the CUDA device (MoE models: the emulated device only)."""
    fp8_lm_head: bool | None = None
    """With FP8 weights, the LM head in FP8 too (per vocabulary row, weight-only; a tied head gets an FP8 copy
    of the embedding): half its bytes a step, at an accuracy cost (docs/decisions.md); None = the default
    (blink.models.fp8.FP8_LM_HEAD: off)."""
    kv_cache_dtype: str = "auto"
    """The KV cache's element type (vLLM's --kv-cache-dtype): "auto" = the model dtype (bf16 on cuda,
    float32 on the emulated device); "fp8" = float8 e4m3 with a per-tensor scale of 1 (values stored
    directly, saturating to +-448): half the bytes of a bf16 cache, twice the blocks (cuda). Both devices
    round K and V the same way (blink.models.fp8.kv_round)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full prompt blocks that an earlier request computed (vLLM's automatic prefix
    caching, on by default as in vLLM V1); --no-enable-prefix-caching turns it off."""
    kernel_cache: str | None = None
    """Directory of the compiled CUDA kernels (cuda only); None = build/kernels in a source checkout,
    else $XDG_CACHE_HOME/blink/kernels (~/.cache/blink/kernels)."""

    def __post_init__(self) -> None:
        _choice("device", "kind", self.kind, ("auto", "emulated", "cuda"))
        _choice("device", "scheduler", self.scheduler, ("gpu", "host"))
        _bounds("device", "max_batch", self.max_batch, 1, 4096)
        if self.max_num_batched_tokens is not None:
            _bounds("device", "max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        if self.mixed_tokens is not None:
            _bounds("device", "mixed_tokens", self.mixed_tokens, 0, 1 << 20)
        _bounds("device", "kv_block_size", self.kv_block_size, 1, 1024)
        if self.num_kv_blocks is not None:
            _bounds("device", "num_kv_blocks", self.num_kv_blocks, 1, 1 << 24)
        _bounds("device", "kv_cache_fraction", self.kv_cache_fraction, 0.01, 0.95)
        if self.max_context is not None:
            _bounds("device", "max_context", self.max_context, 2, 1 << 24)
        _bounds("device", "ready_timeout_s", self.ready_timeout_s, 1, 24 * 3600)
        _bounds("device", "max_restarts", self.max_restarts, 0, 1000)
        if self.executor and ":" not in self.executor:
            raise ConfigError(f"device.executor = {self.executor!r}; expected module:function")
        if self.quantization is not None:
            _choice("device", "quantization", self.quantization, ("fp8",))
        _choice("device", "kv_cache_dtype", self.kv_cache_dtype, ("auto", "fp8"))

    def step_tokens(self, kind: str) -> int:
        """Tokens per step on a device of `kind` ("cuda" | "emulated"): max_num_batched_tokens or its default,
        never below max_batch (a step carries one token of every decoding sequence)."""
        default = 2048 if kind == "cuda" else 256
        return max(self.max_num_batched_tokens if self.max_num_batched_tokens is not None else default, self.max_batch)

    def mixed_step_tokens(self, kind: str) -> int:
        """Token budget of a step with decodes on a device of `kind`: mixed_tokens or its default,
        0 (off: max_num_batched_tokens) when it is 0 or not below step_tokens."""
        m = self.mixed_tokens if self.mixed_tokens is not None else (DEFAULT_MIXED_TOKENS if kind == "cuda" else 0)
        return m if m < self.step_tokens(kind) else 0


@dataclass(frozen=True)
class ModelConfig:
    spec: str = "default"
    """default (SmolLM2-135M-Instruct) | a .gguf file | an HF directory | random:<preset> (tests)."""
    name: str | None = None
    """Model name served by the API (`model` field, /v1/models); None derives it from the spec."""
    chat_template: str | None = None
    """A jinja chat template replacing the model's (vLLM's --chat-template): the template itself, or
    a file holding it, read here, once, so that the text travels with the config."""

    def __post_init__(self) -> None:
        if not self.spec:
            raise ConfigError("model.spec must not be empty")
        if self.name is not None and not self.name:
            raise ConfigError("model.name must not be empty")
        t = self.chat_template
        if t is not None and "{{" not in t and "{%" not in t:  # a file name, not a template
            try:
                text = pathlib.Path(t).expanduser().read_text()
            except OSError as e:
                raise ConfigError(f"model.chat_template: cannot read {t}: {e.strerror}") from e
            object.__setattr__(self, "chat_template", text)


@dataclass(frozen=True)
class BlinkConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    ring: RingConfig = field(default_factory=RingConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    model: ModelConfig = field(default_factory=ModelConfig)

    def replace(self, **sections: Mapping[str, Any]) -> BlinkConfig:
        """A copy with some fields of some sections changed, checked like a file would be."""
        return from_mapping(sections, base=self)


SECTIONS: dict[str, type] = {"server": ServerConfig, "ring": RingConfig, "device": DeviceConfig, "model": ModelConfig}


def field_docs(sections: Mapping[str, type] = SECTIONS) -> dict[tuple[str, str], str]:
    """{(section, field): the docstring under the field in this file}, for --help: the one place a
    setting is described is its dataclass."""
    import ast
    import inspect

    out = {}
    for section, cls in sections.items():
        body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    out[(section, node.target.id)] = " ".join(nxt.value.value.split())
    return out


def coerce(where: str, value: Any, annotation: Any) -> Any:
    """Check a parsed value against a field's type (no silent str->int conversion)."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{where} must not be null")
    for t in options:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{where} must be finite")
            return float(value)
        if t is str and isinstance(value, str):
            return value
    names = " | ".join("null" if t is type(None) else t.__name__ for t in options)
    raise ConfigError(f"{where} = {value!r} has the wrong type; expected {names}")


def _section(cls: type, name: str, values: Mapping[str, Any], base: Any) -> Any:
    if not isinstance(values, Mapping):
        raise ConfigError(f"section {name!r} must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ConfigError(f"unknown key {name}.{key} (known: {', '.join(sorted(known))})")
    changes = {k: coerce(f"{name}.{k}", v, hints[k]) for k, v in values.items()}
    try:
        return dataclasses.replace(base, **changes)
    except TypeError as e:  # pragma: no cover - keys are checked above
        raise ConfigError(str(e)) from e


def from_mapping(data: Mapping[str, Any], base: BlinkConfig | None = None) -> BlinkConfig:
    """Build a config from nested mappings {section: {field: value}}, over `base` (defaults)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    base = base or BlinkConfig()
    out = {}
    for name in data:
        if name not in SECTIONS:
            raise ConfigError(f"unknown config section {name!r} (known: {', '.join(SECTIONS)})")
    for name, cls in SECTIONS.items():
        cur = getattr(base, name)
        out[name] = _section(cls, name, data[name], cur) if name in data else cur
    return BlinkConfig(**out)


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a JSON, TOML or YAML config file into plain mappings (not yet validated)."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    try:
        if ext == ".json":
            return json.loads(raw)
        if ext == ".toml":
            return tomllib.loads(raw.decode())
        if ext in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError as e:
                raise ConfigError(f"{path}: YAML needs pyyaml (pip install pyyaml), or use JSON/TOML") from e
            return yaml.safe_load(raw) or {}
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from e
    raise ConfigError(f"{path}: unknown config format {ext!r} (use .json, .toml, .yaml)")


def build(config_file: str | None = None, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> BlinkConfig:
    """The one entry point: defaults, then the file, then explicit overrides (CLI flags that were given)."""
    cfg = from_mapping(load_file(config_file)) if config_file else BlinkConfig()
    if overrides:
        cfg = from_mapping({k: v for k, v in overrides.items() if v}, base=cfg)
    return cfg
