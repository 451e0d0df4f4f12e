"""The FP8-weight GEMV of decode steps, every compiled configuration, against the bf16 GEMV, bf16 cuBLAS
and the W8A8 cuBLASLt GEMM, at Llama-3-8B's and Qwen3-32B's projection shapes (no engine).

    python -m bench.kernels.fp8_gemv --out DIR [--commit SHA]          # ~1-2 min on an H200
    python -m bench.kernels.fp8_gemv --out x.json --presets llama3-8b --tokens 1,8

For each projection (qkv, o, gate_up, down) and token count T (default 1, 2, 4, 8, 16, 32):
  fp8_gemv_r<R>u<U>   the plain FP8 GEMV (fp8.cu) in each configuration compiled for bucket T
  fp8_gemv_r<R>p<S>   (and _r<R>p<S>: the pipelined weight loop, a cp.async ring of S stretches a row)
                      (FP8_GEMV_CONFIGS; T <= 8). "engine" names the one the engine launches
                      (FP8_GEMV_CONFIG), "previous" the configuration of the GEMV before the
                      configurations existed (R = 1, U = 4 for one token, R = 4, U = 2 above: the same
                      loads and arithmetic; that kernel had no minimum-blocks register bound).
  fp8_fused_r<R>u<U>  the same configuration with the fusion the engine uses for the role (qkv: norm
                      (the engine's norm_rope for Llama adds the RoPE epilogue), gate_up: norm_swiglu, o
                      and down: resid), prologue and epilogue included: what decode steps below
                      FP8_MMA_MIN_TOKENS run ("engine_fused" in step_ms).
  fp8_gemv_pieces     T = 16, 32: the t8 GEMV launched T / 8 times (the weights read T / 8 times).
  fp8_mma_m<MT>       the weight-only tensor-core kernel (every T up to 32, each compiled MT; the engine's
                      from FP8_MMA_MIN_TOKENS tokens: "engine_weight_only" in step_ms).
  bf16_gemv           the bf16 GEMV (model_kernels.cu, T <= 8; the LM head's fp32 one); bf16_cublas; fp8_w8a8_<scales> (the
                      per-token activation quantization, the cuBLASLt FP8 GEMM, for "epilogue" the
                      scaling kernel; a scaling mode cuBLASLt lacks is left out).
Each time is a captured graph of REPS launches, each on the next copy of the weight (the copies
exceed 4x the L2, so every launch streams from HBM), replayed after a warm-up: launch gaps as in the
engine's graphs, not Python's launch rate. Per path: ms, GB/s and the fraction of the copy bandwidth
(read + write, as the engine's decode benchmark: bytes = weights + scales + activations in and out).
Per preset and T: the four projections' sum over the layers per path ("step_ms"), and the LM head (its
shape is timed too: "lm_head_fp8_best" against "lm_head_bf16_gemv" is what an FP8 LM head would save,
"lm_head_fp8_engine" the engine's FP8 head with its fp32 logits, "fp8_head_f32" per role). Every
configuration of a bucket sums in the same order: `bitwise_equal` records that their outputs agree.
Writes DIR/fp8_gemv-<gpu>-<commit>.json (or the file --out names).
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable

from bench.common import add_commit_arg, copy_bandwidth, gemm_roles, git_commit, metadata, short_device, write_json

ROLES = ("qkv", "o", "gate_up", "down")  # a layer's projections (step_ms sums them over the layers)
FUSED_KIND = {"qkv": "norm", "o": "resid", "gate_up": "norm_swiglu", "down": "resid"}
L2_BYTES = 50 << 20
REPS = 20
PREVIOUS = {1: (1, 4), 2: (4, 2), 4: (4, 2), 8: (4, 2)}


def _copies(nbytes: int) -> int:
    return max(1, -(-4 * L2_BYTES // nbytes))


class Rig:
    """Driver, kernels, cuBLAS and cuBLASLt on one stream; graph timing."""

    def __init__(self) -> None:
        import cupy as cp

        from blink.gpu.engine.fp8_gemm import SCALE_MODES, Fp8Gemm
        from blink.gpu.toolchain.cuda_api import Cublas, Driver
        from blink.gpu.toolchain.kernels import DEFAULT_CACHE, Kernels

        cp.cuda.Device().use()
        cp.zeros(1)
        self.drv = Driver()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.s = int(self.stream.ptr)
        self.ws = cp.empty(64 << 20, dtype=cp.uint8)
        self.k = Kernels(self.drv, DEFAULT_CACHE)
        self.blas = Cublas(self.s, int(self.ws.data.ptr), int(self.ws.nbytes))
        self.w8a8 = {m: Fp8Gemm(self.drv, self.s, int(self.ws.data.ptr), int(self.ws.nbytes), m) for m in SCALE_MODES}

    def launch(self, name: str, grid: int, smem: int = 0, **args: object) -> None:
        self.drv.launch(self.k[name], (grid, 1, 1), (256, 1, 1), self.k.args(name, args), self.s, smem, name)

    def graph_ms(self, body: Callable[[int], None], iters: int = 5) -> float:
        """Milliseconds per body(i) call: REPS calls captured as one graph, replayed `iters` times after one warm-up."""
        import cupy as cp

        body(0)  # outside the capture: plans (cuBLASLt) and lazy loads happen here
        self.stream.synchronize()
        self.drv.begin_capture(self.s)
        try:
            for i in range(REPS):
                body(i)
        finally:
            graph = self.drv.end_capture(self.s)
        ex = self.drv.instantiate(graph)
        try:
            self.drv.graph_launch(ex, self.s)
            self.stream.synchronize()
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(self.stream)
            for _ in range(iters):
                self.drv.graph_launch(ex, self.s)
            b.record(self.stream)
            b.synchronize()
            return cp.cuda.get_elapsed_time(a, b) / (iters * REPS)
        finally:
            self.drv.graph_exec_destroy(ex)
            self.drv.graph_destroy(graph)


def _buffers(n: int, k: int, tmax: int) -> dict:
    import cupy as cp

    def bf16(shape: tuple[int, ...]) -> object:  # N(0, 1) as bf16 bits
        x = cp.random.standard_normal(shape, dtype=cp.float32)
        return (x.view(cp.uint32) >> 16).astype(cp.uint16)

    def codes() -> object:  # finite e4m3 codes of both signs
        return cp.random.randint(0, 126, (n, k), dtype=cp.uint8) | (
            cp.random.randint(0, 2, (n, k), dtype=cp.uint8) << 7
        )

    return {
        "w16": [bf16((n, k)) for _ in range(_copies(2 * n * k))],
        "w8": [codes() for _ in range(_copies(n * k))],
        "sc": cp.random.uniform(1e-3, 2e-3, n, dtype=cp.float32),
        "x": bf16((tmax, k)),
        "nw": bf16((k,)),
        "y": cp.zeros((tmax, 2 * n), dtype=cp.uint16),  # room for fp32 logits (the LM head)
        "x8": cp.zeros((tmax, k), dtype=cp.uint8),
        "xs": cp.zeros(tmax, dtype=cp.float32),
        "d32": cp.zeros((tmax, n), dtype=cp.float32),
    }


def time_role(rig: Rig, role: str, n: int, k: int, tokens: list[int]) -> dict[int, dict]:
    """{T: {"ms": {path: ms}, "bitwise_equal": bool}} of one (n, k) projection."""
    import cupy as cp

    b = _buffers(n, k, max(tokens))
    out = {T: _time_tokens(rig, b, role, n, k, T) for T in tokens}
    b.clear()
    cp.get_default_memory_pool().free_all_blocks()
    return out


def _time_tokens(rig: Rig, b: dict, role: str, n: int, k: int, T: int) -> dict:
    """The paths' milliseconds at T tokens, and whether the FP8 GEMV's configurations agree bit for bit."""
    import cupy as cp

    from blink.gpu.engine.fp8_weights import (
        FP8_GEMV_CONFIG,
        FP8_GEMV_CONFIGS,
        FP8_MMA_COMPILED,
        FP8_MMA_MAX_TOKENS,
        FP8_MMA_MIN_TOKENS,
        fp8_config_label,
        fp8_gemv_grid,
        fp8_gemv_name,
        fp8_mma_grid,
        fp8_mma_name,
    )

    w8, w16, sc, x, y = b["w8"], b["w16"], b["sc"], b["x"], b["y"]
    ms: dict[str, float] = {}
    outs = []

    def fp8(name: str, grid: int, smem: int = 0, **extra: object) -> Callable[[int], None]:
        return lambda i: rig.launch(name, grid, smem, W=w8[i % len(w8)], scales=sc, X=x, Y=y, N=n, K=k, **extra)

    kind = FUSED_KIND.get(role, "")
    for cfg in FP8_GEMV_CONFIGS.get(T, ()):
        run = fp8(fp8_gemv_name(T, "", cfg), fp8_gemv_grid(n, T, "", cfg))
        ms[f"fp8_gemv_{fp8_config_label(cfg)}"] = rig.graph_ms(run)
        y[:] = 0
        run(0)
        outs.append(cp.asnumpy(y[:T]))
        if kind:  # the fusion the engine runs for the role, in this configuration
            name = fp8_gemv_name(T, kind, cfg)
            smem = T * k * 2 if kind.startswith("norm") else 0
            if smem:  # the pipelined kernels' static ring counts against the default 48 KB: always raise it
                rig.drv.set_max_dynamic_smem(rig.k[name], smem)
            fused = fp8(name, fp8_gemv_grid(n, T, kind, cfg), smem, nw=b["nw"], eps=1e-5)
            ms[f"fp8_fused_{fp8_config_label(cfg)}"] = rig.graph_ms(fused)
    if T in FP8_GEMV_CONFIG:
        grid16 = -(-n // (8 * (1 if T == 1 else 4)))
        bf16_name = f"gemv_{'f32' if role == 'lm_head' else 'bf16'}_t{T}"  # the engine's LM head writes fp32
        ms["bf16_gemv"] = rig.graph_ms(lambda i: rig.launch(bf16_name, grid16, W=w16[i % len(w16)], X=x, Y=y, N=n, K=k))
    else:
        name8, grid8 = fp8_gemv_name(8), fp8_gemv_grid(n, 8)

        def pieces(i: int) -> None:
            for r0 in range(0, T, 8):
                rig.launch(name8, grid8, W=w8[i % len(w8)], scales=sc, X=x[r0:], Y=y[r0:], N=n, K=k)

        ms["fp8_gemv_pieces"] = rig.graph_ms(pieces)
    nt8 = next(t for t in sorted(FP8_MMA_COMPILED) if 8 * t >= T)
    for mt in FP8_MMA_COMPILED[nt8]:
        name, grid = fp8_mma_name(T, mt), fp8_mma_grid(n, mt)
        ms[f"fp8_mma_m{mt}"] = rig.graph_ms(
            lambda i, name=name, grid=grid: rig.launch(
                name, grid, W=w8[i % len(w8)], scales=sc, X=x, Y=y, N=n, K=k, T=T
            )
        )
    if role == "lm_head" and T <= FP8_MMA_MAX_TOKENS:  # the engine's FP8 LM head (fp32 logits: Fp8Launches.fp8_head)
        if T in FP8_GEMV_CONFIG and T < FP8_MMA_MIN_TOKENS:
            head = fp8(fp8_gemv_name(T, "f32"), fp8_gemv_grid(n, T))
        else:
            head = fp8(fp8_mma_name(T, f32=True), fp8_mma_grid(n), T=T)
        ms["fp8_head_f32"] = rig.graph_ms(head)
    xp, yp = int(x.data.ptr), int(y.data.ptr)
    ms["bf16_cublas"] = rig.graph_ms(lambda i: rig.blas.linear(xp, int(w16[i % len(w16)].data.ptr), yp, T, n, k))
    for mode, g in rig.w8a8.items():
        if g.supported((T, n, k)):
            ms[f"fp8_w8a8_{mode}"] = rig.graph_ms(lambda i, g=g, mode=mode: _w8a8(rig, b, g, mode, i, T, n, k))
    print(f"{role} {n}x{k} T={T}: " + " ".join(f"{p} {v * 1e3:.1f}us" for p, v in ms.items()), flush=True)
    return {"ms": ms, "bitwise_equal": all((o == outs[0]).all() for o in outs)}


def _w8a8(rig: Rig, b: dict, g: object, mode: str, i: int, T: int, n: int, k: int) -> None:
    """One W8A8 projection as Forward.fp8_linear runs it: quantize the rows, the FP8 GEMM, (scale)."""
    x8, xs, y, d32, sc = b["x8"], b["xs"], b["y"], b["d32"], b["sc"]
    rig.launch("fp8_quantize_rows", T, W=b["x"], codes=x8, scales=xs, N=T, K=k)
    d = y if mode == "outer" else d32
    p = lambda a: int(a.data.ptr)  # noqa: E731
    g.matmul(T, n, k, p(x8), p(b["w8"][i % len(b["w8"])]), p(d), p(xs), p(sc))  # type: ignore[attr-defined]
    if mode == "epilogue":
        rig.launch("fp8_scale_rows", -(-n // 2048), D=d32, xs=xs, ws=sc, Y=y, T=T, N=n)


def path_bytes(path: str, n: int, k: int, T: int) -> int:
    """Bytes a path must move: the weight once (per launch for the pieces), its scales, x in and y out."""
    act = 2 * T * (k + n)
    if path.startswith("bf16"):
        return 2 * n * k + act
    reads = -(-T // 8) if path == "fp8_gemv_pieces" else 1
    return reads * (n * k + 4 * n) + act


def bench_preset(rig: Rig, name: str, tokens: list[int], bw: dict) -> dict:
    from blink.gpu.engine.fp8_weights import FP8_GEMV_CONFIG, FP8_MMA_MIN_TOKENS, FP8_MMA_ROWS, fp8_config_label
    from blink.models.config import preset

    cfg = preset(name)
    roles = {r: gemm_roles(cfg)[r] for r in (*ROLES, "lm_head")}
    per_role = {r: time_role(rig, r, *roles[r], tokens) for r in roles}
    for r, (n, k) in roles.items():
        for T, row in per_role[r].items():
            row["GBps"] = {p: path_bytes(p, n, k, T) / ms / 1e6 for p, ms in row["ms"].items()}
            row["frac_of_copy_bw"] = {p: v / bw["read_plus_write_GBps"] for p, v in row["GBps"].items()}
    step: dict[int, dict[str, float]] = {}
    for T in tokens:
        paths = set.intersection(*(set(per_role[r][T]["ms"]) for r in ROLES))
        step[T] = {p: cfg.num_layers * sum(per_role[r][T]["ms"][p] for r in ROLES) for p in sorted(paths)}
        if T >= FP8_MMA_MIN_TOKENS:  # the engine's kernel where decode steps of T tokens are weight-only
            step[T]["engine_weight_only"] = step[T][f"fp8_mma_m{FP8_MMA_ROWS}"]
        if T in FP8_GEMV_CONFIG:
            eng, prev = FP8_GEMV_CONFIG[T], PREVIOUS[T]
            step[T].setdefault("engine_weight_only", step[T][f"fp8_gemv_{fp8_config_label(eng)}"])
            step[T]["gemv_engine_config"] = step[T][f"fp8_gemv_{fp8_config_label(eng)}"]
            step[T]["previous"] = step[T][f"fp8_gemv_{fp8_config_label(prev)}"]
            best = {r: min(v for p, v in per_role[r][T]["ms"].items() if p.startswith("fp8_gemv_r")) for r in ROLES}
            step[T]["best_config_per_role"] = cfg.num_layers * sum(best.values())
            step[T]["engine_fused"] = step[T][
                f"fp8_fused_{fp8_config_label(eng)}"
            ]  # the engine's launches below 8 tokens
        head = per_role["lm_head"][T]["ms"]
        step[T]["lm_head_bf16_gemv"] = head.get("bf16_gemv", head["bf16_cublas"])
        # what an FP8 LM head would take (bf16 out here; the engine's writes fp32 logits)
        step[T]["lm_head_fp8_best"] = min(v for p, v in head.items() if p.startswith(("fp8_gemv_r", "fp8_mma")))
        if "fp8_head_f32" in head:  # the engine's FP8 LM head (EngineConfig.fp8_lm_head), fp32 logits
            step[T]["lm_head_fp8_engine"] = head["fp8_head_f32"]
        print(
            f"{name} T={T} step projections (ms): " + ", ".join(f"{p} {v:.3f}" for p, v in step[T].items()), flush=True
        )
    return {
        "shapes": roles,
        "layers": cfg.num_layers,
        "engine_config": {str(t): list(c) for t, c in FP8_GEMV_CONFIG.items()},
        "engine_mma": {"rows": FP8_MMA_ROWS, "min_tokens": FP8_MMA_MIN_TOKENS},
        "previous_config": {str(t): list(c) for t, c in PREVIOUS.items()},
        "roles": per_role,
        "step_ms": step,
    }


def out_path(arg: str, res: dict) -> str:
    """--out: a directory (existing, or ending in /) gets fp8_gemv-<gpu>-<commit>.json; else the file itself."""
    name = f"fp8_gemv-{short_device(res['gpu'])}-{res['commit']}.json"
    if not arg:
        return str(pathlib.Path(__file__).resolve().parents[1] / "results" / name)
    p = pathlib.Path(arg)
    return str(p / name) if p.is_dir() or arg.endswith("/") else arg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="result directory or JSON file (default bench/results/)")
    ap.add_argument("--presets", default="llama3-8b,qwen3-32b")
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    add_commit_arg(ap)
    a = ap.parse_args()
    rig = Rig()
    bw = copy_bandwidth(1 << 30)
    tokens = [int(t) for t in a.tokens.split(",")]
    res = {"bench": "fp8_gemv", **metadata(a.commit or git_commit()), "copy_bandwidth": bw, "reps": REPS, "presets": {}}
    for name in a.presets.split(","):
        res["presets"][name] = bench_preset(rig, name, tokens, bw)
    path = out_path(a.out, res)
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json(path, res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
