"""Shared pieces of the benchmarks (bench/*/): result metadata (metadata, git_commit, the GPU's name
from CUDA or nvidia-smi) and where results go (result_path), CUDA-event timing, the device-to-device
copy bandwidth of this GPU, synthetic steps, the decode benchmarks' engine and rows
(bench/engine/decode.py, bench/engine/moe_decode.py), and per-kernel-category timing of a step."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from blink.device.executor import StepBatch

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def result_path(bench: str, device: str, commit: str) -> pathlib.Path:
    """bench/results/<bench>-<device>-<commit>.json: the one naming scheme of result files (device: a
    short name such as "h200" or "emulated"; see short_device)."""
    return RESULTS / f"{bench}-{device}-{commit}.json"


def short_device(name: str) -> str:
    """ "NVIDIA H200" -> "h200", "cpu" -> "cpu": the device part of a result file's name."""
    return name.split()[-1].lower() if name.strip() else "unknown"


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (Linux /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gpu_name() -> str:
    """The CUDA device's name ("NVIDIA H200"); "cpu" where there is no cupy or no GPU."""
    try:
        import cupy as cp

        name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    except (ImportError, RuntimeError):  # no cupy, no driver, no device: the result says so
        return "cpu"
    return name.decode() if isinstance(name, bytes) else str(name)


def smi_gpu_names() -> list[str]:
    """The GPUs' names as nvidia-smi lists them ([] without nvidia-smi): for the processes that drive
    servers and must not open a CUDA context of their own (bench/paper/evaluate.py, scaleout.py, soak.py,
    ttft_breakdown.py)."""
    if not shutil.which("nvidia-smi"):
        return []
    r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return [line.strip() for line in r.stdout.splitlines() if line.strip()] if r.returncode == 0 else []


def smi_gpu_name() -> str:
    """The first GPU's name as nvidia-smi lists it; "cpu" where it lists none (as gpu_name())."""
    names = smi_gpu_names()
    return names[0] if names else "cpu"


def git_commit() -> str:
    """The commit to record where the command line names none (--commit): this checkout's short HEAD,
    "-dirty" when blink/ or bench/ has uncommitted changes, else "unknown" (a tree without .git)."""
    root = ROOT

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)

    try:
        head = git("rev-parse", "--short", "HEAD")
    except OSError:  # no git
        return "unknown"
    if head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    dirty = git("status", "--porcelain", "--", "blink", "bench").stdout.strip()
    return head.stdout.strip() + ("-dirty" if dirty else "")


def add_commit_arg(ap: Any) -> None:
    """--commit: the commit a result records (and its file name carries); default: git_commit()."""
    ap.add_argument(
        "--commit", default=None, type=str, help="commit recorded in the result (default: this checkout's HEAD)"
    )


def command_line(argv: Sequence[str]) -> str:
    """argv as a command: a script of this clone (and the interpreter before it) as `python -m` its
    module, so that it reproduces from any clone and names no path of this machine."""
    args = list(argv)
    for i, a in enumerate(args[:2]):
        path = pathlib.Path(a)
        if path.suffix == ".py" and path.resolve().is_relative_to(ROOT):
            module = ".".join(path.resolve().relative_to(ROOT).with_suffix("").parts)
            args[: i + 1] = ["python", "-m", module]
            break
    return " ".join(args)


def metadata(
    commit: str, argv: list[str] | None = None, *, gpu_key: str = "gpu", gpu: str | None = None
) -> dict[str, Any]:
    """What every result JSON records: when, where, which sources (the commit given with --commit,
    else git_commit()) and the command line.

    gpu_key: the key of the GPU's name: "gpu", or "device" in the results that have always called it
    so (the scheduler benchmarks, whose rows are keyed by scheduler, "gpu" and "host"). gpu: the name
    where the caller has it without CUDA (smi_gpu_names: a process whose servers own the GPU); then
    no "sms" either. Otherwise gpu_name() and the device's SM count ("sms") from CUDA."""
    out: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        gpu_key: gpu if gpu is not None else gpu_name(),
        "commit": commit if commit and commit != "unknown" else git_commit(),
        "command": command_line(argv if argv is not None else sys.argv),
    }
    if gpu is None and out[gpu_key] != "cpu":
        import cupy as cp

        out["sms"] = int(cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"])
    return out


def time_ms(fn: Callable[[], None], stream: Any, iters: int = 20, warmup: int = 3) -> float:
    """Mean milliseconds of fn() (which enqueues work on `stream`) over `iters` back-to-back calls."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    stream.synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(stream)
    for _ in range(iters):
        fn()
    b.record(stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / iters


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> dict[str, float]:
    """Device-to-device copy: bytes read + written per second (the usual 'copy bandwidth')."""
    import cupy as cp

    src = cp.ones(nbytes // 2, dtype=cp.uint16)
    dst = cp.empty_like(src)
    s = cp.cuda.Stream(non_blocking=True)

    def run() -> None:
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3, s.ptr)

    ms = time_ms(run, s, iters=iters)
    return {"bytes": nbytes, "ms": ms, "read_plus_write_GBps": 2 * nbytes / ms / 1e6, "read_GBps": nbytes / ms / 1e6}


def decode_bytes(config: Any, batch: int, context: int, elem_bytes: int = 2) -> dict[str, int]:
    """Bytes one decode step of `batch` sequences at `context` tokens reads from device memory (bf16):
    every weight once, except that the embedding table contributes only its `batch` gathered rows
    (all of it when it doubles as the LM head), and a MoE layer only its router and the experts the
    step routes to: exactly num_experts_per_tok at batch 1, at most min(num_experts, batch * top-k)
    above (an upper bound); plus the K and V of every sequence's context. For a dense model "weights"
    equals the CUDA engine's GpuWeights.bytes_per_step plus the gathered rows (checked on the GPU)."""
    c = config
    h = c.hidden_size
    attn = h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 2 * h  # qkv, o, the two norms
    attn += 2 * c.head_dim if c.qk_norm else 0
    attn += c.q_size + 2 * c.kv_size if c.attn_bias else 0
    experts_read = min(c.num_experts, batch * c.num_experts_per_tok)
    moe = c.num_experts * h + experts_read * 3 * h * c.moe_intermediate_size
    mlp = sum(moe if c.layer_is_moe(i) else 3 * h * c.intermediate_size for i in range(c.num_layers))
    head = c.vocab_size * h + h  # LM head (or the tied table) and the final norm
    rows = 0 if c.tie_word_embeddings else batch * h
    weights = elem_bytes * (c.num_layers * attn + mlp + head + rows)
    kv = elem_bytes * batch * context * c.num_layers * 2 * c.kv_size
    return {"weights": weights, "kv": kv, "total": weights + kv, "experts_read_per_layer": experts_read}


def write_json(path: str, result: dict[str, Any]) -> None:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {p}", file=sys.stderr)


def synthetic_step(
    num_seqs: int, new_tokens: int, context: int, block_size: int, vocab: int, rng: np.random.Generator
) -> StepBatch:
    """A step of `num_seqs` sequences, each computing its last `new_tokens` tokens (1: decode) of a
    `context`-token sequence, greedy; sequence i owns the KV blocks [i * n, (i + 1) * n), n =
    ceil(context / block_size). Random token ids (the benchmarks time shapes, not text)."""
    S, T, n = num_seqs, num_seqs * new_tokens, -(-context // block_size)
    if not 1 <= new_tokens <= context:
        raise ValueError("need 1 <= new_tokens <= context")
    return StepBatch(
        input_ids=rng.integers(0, vocab, T).astype(np.int32),
        positions=np.tile(np.arange(context - new_tokens, context, dtype=np.int32), S),
        cu_q_lens=(np.arange(S + 1) * new_tokens).astype(np.int32),
        seq_lens=np.full(S, context, np.int32),
        block_tables=np.arange(S * n, dtype=np.int32).reshape(S, n),
        temperature=np.zeros(S, np.float32),
        top_p=np.ones(S, np.float32),
        top_k=np.zeros(S, np.int32),
        seed=np.arange(S, dtype=np.uint64),
        sample_pos=np.zeros(S, np.uint32),
    )


def load_synthetic(eng: Any, num_seqs: int, new_tokens: int, context: int, rng: np.random.Generator) -> bool:
    """synthetic_step into the engine's step arena (Engine.load_step, then the H2D copy); returns
    whether it is a decode step. The caller launches the graph it wants."""
    b = synthetic_step(num_seqs, new_tokens, context, eng.dims.block_size, eng.config.vocab_size, rng)
    decode = eng.load_step(b)
    eng.arena.upload(eng.s, num_seqs)
    return decode


def preset_config(name: str, layers: int = 0) -> Any:
    """The preset's ModelConfig, cut to its first `layers` layers where layers > 0 (the benchmarks'
    --model and --layers)."""
    from blink.models.config import preset

    cfg = preset(name)
    return cfg.replace(num_layers=layers) if layers else cfg


def decode_engine_config(batches: Sequence[int], context: int, **fields: Any) -> Any:
    """EngineConfig of a decode benchmark (bench/engine/decode.py, bench/engine/moe_decode.py): one batch bucket
    per batch timed, one token bucket (the largest batch), block size 16, and a KV pool of exactly
    ceil(context / 16) + 1 blocks per sequence of the largest batch. `fields`: the other
    EngineConfig fields a benchmark sets from its flags."""
    from blink.gpu.engine.engine import EngineConfig

    bmax, bs = max(batches), 16
    return EngineConfig(
        max_seqs=bmax,
        max_num_batched_tokens=bmax,
        max_context=context + bs * 2,
        block_size=bs,
        num_kv_blocks=bmax * (-(-context // bs) + 1),
        batch_buckets=tuple(batches),
        token_buckets=(bmax,),
        **fields,
    )


def decode_engine(cfg: Any, ecfg: Any) -> tuple[Any, Any, dict[str, float]]:
    """The CUDA engine with its decode graphs captured (no prefill graphs), and this GPU's copy
    bandwidth measured after the capture (with the engine's memory in place): (engine, capture
    report, copy_bandwidth())."""
    from blink.gpu.engine.engine import Engine

    eng = Engine.create(cfg, ecfg)
    rep = eng.capture(decode=True, prefill=False)
    return eng, rep, copy_bandwidth()


def step_launch(eng: Any, batch: int) -> Callable[[], None]:
    """Launches the engine's own captured decode step of `batch` one-token sequences."""
    return lambda: eng.driver.graph_launch(eng.pick_exec(batch, batch, True), eng.s)


def alternate(eng: Any, execs: Sequence[int]) -> Callable[[], None]:
    """Launches the execs of one captured variant (Engine.capture_variant) in turn, as the engine
    launches its own: an exec cannot be relaunched right after it completes."""
    it = itertools.count()
    return lambda: eng.driver.graph_launch(execs[next(it) % len(execs)], eng.s)


def copy_fraction(nbytes: float, ms: float, bw: dict[str, float]) -> float:
    """`nbytes` moved in `ms` milliseconds, as a fraction of the copy bandwidth (copy_bandwidth())."""
    return nbytes / ms / 1e6 / bw["read_plus_write_GBps"]


def step_rates(batch: int, ms: float, nbytes: float, bw: dict[str, float]) -> dict[str, float]:
    """A decode step's row fields: its time, tokens per second (one token per sequence), the bytes it
    reads, their rate and its fraction of the copy bandwidth."""
    return {
        "ms_per_step": ms,
        "tokens_per_s": batch / ms * 1e3,
        "bytes_per_step": nbytes,
        "GBps": nbytes / ms / 1e6,
        "frac_of_copy_bw": copy_fraction(nbytes, ms, bw),
    }


def print_breakdown(what: str, breakdown: dict[str, dict[str, float]]) -> None:
    """One line per step of category_times() results: each category's milliseconds and their sum."""
    for label, parts in breakdown.items():
        print(
            f"{what} {label} by kernel category (ms): "
            + ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
            + f"; sum {sum(parts.values()):.3f}"
        )


CATEGORIES = ("embed", "norm", "gemm", "rope", "attn", "swiglu", "moe", "head", "sample", "done")


def kernel_category(name: str) -> str:
    """Benchmark category of a kernel launch."""
    for prefix, cat in (
        ("embed", "embed"),
        ("add_rmsnorm", "norm"),
        ("add_bias", "gemm"),  # the qkv projection's bias (qwen2): counted with its GEMM
        ("gemv", "gemm"),
        ("fp8_", "gemm"),  # FP8 weights: W8A8 activation quantization and scaling, the head's dequantization
        ("rope", "rope"),
        ("attn", "attn"),
        ("swiglu", "swiglu"),
        ("moe_", "moe"),  # route, align, expert GEMVs, combine; the router: moe_router_t<T> (steps of <= 4
        # tokens) here, the GEMM of larger steps in "gemm"
        ("final_norm", "head"),
        ("sample", "sample"),
        ("penalty_mark", "sample"),  # the sampling extensions (ext_on gated)
        ("logits_ext", "sample"),
        ("token_mask", "sample"),  # structured output (mask_on gated)
        ("signal", "done"),
    ):
        if name.startswith(prefix):
            return cat
    raise KeyError(name)


def gemm_roles(cfg: Any) -> dict[str, tuple[int, int]]:
    """(n_out, k) of each cuBLAS GEMM of a dense model's step, by role (the lm head once per step)."""
    H = cfg.hidden_size
    return {
        "qkv": (cfg.q_size + 2 * cfg.kv_size, H),
        "o": (H, cfg.q_size),
        "gate_up": (2 * cfg.intermediate_size, H),
        "down": (H, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, H),
    }


def decode_traffic(
    cfg: Any, batch: int, context: int, fp8: bool = False, fp8_head: bool = False
) -> dict[str, dict[str, float]]:
    """Bytes moved and FLOPs of each kernel category of a decode step (bf16 weights, activations and
    KV; f32 logits): batch sequences, each attending over `context` cached tokens. GEMMs by role
    (gemm_<role>: weights once + inputs + outputs); attention reads each sequence's K and V; the
    pointwise kernels read and write their activations once (the floor of what they must move).
    `fp8`: the projections' weights are FP8 (a byte a weight + an fp32 scale a row); `fp8_head`: the
    LM head's too."""
    B, L, H, q, kv, inter, V = (
        batch, cfg.num_layers, cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size,
    )  # fmt: skip
    out: dict[str, dict[str, float]] = {}
    for role, (n, k) in gemm_roles(cfg).items():
        times = 1 if role == "lm_head" else L
        ob = 4 if role == "lm_head" else 2
        w = n * k + 4 * n if (fp8_head if role == "lm_head" else fp8) else 2 * n * k
        out[f"gemm_{role}"] = {"bytes": times * (w + 2 * B * k + ob * B * n), "flops": times * 2.0 * B * n * k}
    out["attn"] = {"bytes": L * (B * context * 2 * kv * 2 + 2 * B * q * 2), "flops": L * 4.0 * B * context * q}
    out["norm"] = {"bytes": L * 2 * 4 * B * H * 2, "flops": L * 2 * 5.0 * B * H}
    out["rope"] = {"bytes": L * B * (2 * q + 4 * kv) * 2, "flops": L * 6.0 * B * (q + kv)}
    out["swiglu"] = {"bytes": L * B * 3 * inter * 2, "flops": L * 5.0 * B * inter}
    out["embed"] = {"bytes": 2 * B * H * 2, "flops": 0.0}
    out["head"] = {"bytes": 3 * B * H * 2, "flops": 5.0 * B * H}
    out["sample"] = {"bytes": B * V * 4, "flops": 2.0 * B * V}
    return out


@contextlib.contextmanager
def only_launches(fwd: Any, categories: set[str], roles: set[tuple[int, int]] | None = None) -> Iterator[None]:
    """While a step is recorded, issue only the kernel launches (and cuBLAS / cuBLASLt GEMMs: "gemm") of
    these categories, in the step's order: the engine's Forward with its driver, cuBLAS and FP8 GEMM
    wrapped. `roles`: with "gemm", only the projections (GEMMs, GEMVs, fused GEMVs with what they fold
    in, FP8 kernels) whose weight has one of these (n_out, k) shapes (gemm_roles)."""
    drv, blas, fp8_gemms = fwd.drv, fwd.blas, getattr(fwd, "fp8_gemms", None)

    def launch(
        fn: int,
        grid: Any,
        block: Any,
        args: Any,
        stream: int,
        smem: int = 0,
        name: str = "",
        programmatic: bool = False,
    ) -> None:
        if kernel_category(name) in categories:
            drv.launch(fn, grid, block, args, stream, smem, name, programmatic=programmatic)

    def of_role(method: str, w_at: int) -> Callable[..., None]:
        real = getattr(fwd, method)

        def call(*args: Any, **kw: Any) -> None:
            if tuple(args[w_at].shape)[-2:] in roles:  # type: ignore[operator]
                real(*args, **kw)

        return call

    fwd.drv = SimpleNamespace(launch=launch)
    if "gemm" not in categories:
        fwd.blas = SimpleNamespace(linear=lambda *a, **k: None)
        if fp8_gemms is not None:
            fwd.fp8_gemms = {m: SimpleNamespace(matmul=lambda *a, **k: None) for m in fp8_gemms}
    own = {m: vars(fwd)[m] for m in ("linear", "fused_linear") if m in vars(fwd)}  # instance attributes
    if "gemm" in categories and roles is not None:  # Forward.linear(x, w, ...), .fused_linear(kind, x, w, ...)
        fwd.linear, fwd.fused_linear = of_role("linear", 1), of_role("fused_linear", 2)
    try:
        yield
    finally:
        fwd.drv, fwd.blas = drv, blas
        if fp8_gemms is not None:
            fwd.fp8_gemms = fp8_gemms
        if "gemm" in categories and roles is not None:
            for m in ("linear", "fused_linear"):
                if m in own:
                    setattr(fwd, m, own[m])
                else:
                    vars(fwd).pop(m, None)  # the class's method again


def category_times(
    eng: Any, S: int, T: int, decode: bool, categories: Sequence[str], iters: int, warmup: int = 3
) -> dict[str, float]:
    """Milliseconds of each kernel category of the (S, T) step, each captured as a graph of its own
    (the same launches and order as in the step: only_launches)."""
    out = {}
    for cat in categories:
        if cat == "moe" and not eng.config.is_moe:  # no launch: an empty graph cannot be instantiated
            continue  # for device launch (CUDA_ERROR_INVALID_VALUE on the H200)
        with only_launches(eng.fwd, {cat}):
            execs = eng.capture_variant(S, T, decode)
        out[cat] = time_ms(alternate(eng, execs), eng.stream, iters=iters, warmup=warmup)
    return out
