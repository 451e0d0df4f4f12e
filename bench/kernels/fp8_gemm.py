"""FP8-weight projections against bf16, kernel by kernel, at a model's linear shapes (no engine).

    python -m bench.kernels.fp8_gemm --out fp8_gemm-h200-<commit>.json   # Llama-3-8B and Qwen3-32B, ~2-3 min on an H200
    python -m bench.kernels.fp8_gemm --out x.json --presets llama3-8b --rows 1,8,256

For each projection (qkv, o, gate_up, down) and row count M: bf16 through cuBLAS and, for M <= 8, the
bf16 GEMV (model_kernels.cu); FP8 through its GEMV (fp8.cu, M <= 8, the engine's configuration), through dequantize + bf16 cuBLAS
(EngineConfig.fp8_gemm "dequant"), and W8A8 (blink/gpu/engine/fp8_gemm.py: the per-token activation
quantization kernel plus the cuBLASLt FP8 GEMM with outer-vector scales, "fp8_w8a8_outer", or with
fp32 sums and the scaling kernel, "fp8_w8a8_epilogue"; a mode cuBLASLt does not offer is left out).
Activations are random bf16. Each timing cycles over enough copies of the weight to exceed 4x the L2,
so every launch streams from HBM. Per M, the sum over a step's projections (x layers) of the best bf16
and the best FP8 path and of each path alone (`paths_ms`), and the M = 1 GEMVs' bandwidth against the
copy bandwidth (bytes: weights + scales + activations). Writes --out (default
bench/results/fp8_gemm-<gpu>-<commit>.json). Launches are eager, from Python: a kernel shorter than
Python's launch interval (the small projections' GEMVs and GEMMs, 20-40 us on the H200) is timed at that
interval (W8A8 is three launches: its ~100 us floor up to 1024 rows is the host's); bench.kernels.fp8_gemv
times the decode-step kernels and bench.kernels.fp8_gemm_graphs the W8A8 candidates in captured graphs.
"""

from __future__ import annotations

import argparse

from bench.common import (
    add_commit_arg,
    copy_bandwidth,
    gemm_roles,
    git_commit,
    metadata,
    result_path,
    short_device,
    time_ms,
    write_json,
)

ROLES = ("qkv", "o", "gate_up", "down")
L2_BYTES = 50 << 20


def _copies(nbytes: int) -> int:
    return max(1, -(-4 * L2_BYTES // nbytes))


def _setup():
    import cupy as cp

    from blink.gpu.toolchain.cuda_api import Cublas, Driver
    from blink.gpu.toolchain.kernels import DEFAULT_CACHE, Kernels

    cp.cuda.Device().use()
    cp.zeros(1)
    drv = Driver()
    stream = cp.cuda.Stream(non_blocking=True)
    ws = cp.empty(64 << 20, dtype=cp.uint8)
    return drv, Kernels(drv, DEFAULT_CACHE), Cublas(int(stream.ptr), int(ws.data.ptr), int(ws.nbytes)), stream, ws


def _w8a8(env) -> dict:
    """scaling mode -> Fp8Gemm on the benchmark's stream and workspace."""
    from blink.gpu.engine.fp8_gemm import SCALE_MODES, Fp8Gemm

    drv, _, _, stream, ws = env
    return {m: Fp8Gemm(drv, int(stream.ptr), int(ws.data.ptr), int(ws.nbytes), m) for m in SCALE_MODES}


def _time_role(env, n: int, k: int, rows: list[int]) -> dict[int, dict[str, float]]:
    """ms of each path at each M for one (n, k) projection."""
    import cupy as cp

    w16 = [cp.random.randint(0x3000, 0x3F80, (n, k), dtype=cp.uint16) for _ in range(_copies(2 * n * k))]
    w8 = [cp.random.randint(0, 126, (n, k), dtype=cp.uint8) for _ in range(_copies(n * k))]
    bufs = {
        "w16": w16,
        "w8": w8,
        "sc": cp.full(n, 1e-3, dtype=cp.float32),
        "x": cp.random.randint(0x3000, 0x3F80, (max(rows), k), dtype=cp.uint16)
        ^ (cp.random.randint(0, 2, (max(rows), k), dtype=cp.uint16) << 15),  # random signs
        "y": cp.zeros((max(rows), n), dtype=cp.uint16),
        "scratch": cp.empty((n, k), dtype=cp.uint16),
        "x8": cp.zeros((max(rows), k), dtype=cp.uint8),
        "xs": cp.zeros(max(rows), dtype=cp.float32),
        "d32": cp.zeros((max(rows), n), dtype=cp.float32),
    }
    out = {m: _time_m(env, bufs, m, n, k) for m in rows}
    bufs.clear()
    cp.get_default_memory_pool().free_all_blocks()
    return out


def _time_m(env, b: dict, m: int, n: int, k: int) -> dict[str, float]:
    """ms of each path at M = m, each launch on the next copy of the weight."""
    from blink.gpu.engine.fp8_weights import fp8_gemv_grid, fp8_gemv_name

    drv, kern, blas, stream = env[:4]
    s, xp, yp = int(stream.ptr), int(b["x"].data.ptr), int(b["y"].data.ptr)
    turn = [0]

    def nxt(ws: list) -> object:
        turn[0] += 1
        return ws[turn[0] % len(ws)]

    def launch(name: str, grid, **a) -> None:
        drv.launch(kern[name], grid, (256, 1, 1), kern.args(name, a), s, 0, name)

    def deq() -> None:
        launch(
            "fp8_dequant_rows", (-(-k // 4096), n, 1), codes=nxt(b["w8"]), scales=b["sc"], out=b["scratch"], N=n, K=k
        )
        blas.linear(xp, int(b["scratch"].data.ptr), yp, m, n, k)

    r = {"bf16_cublas": time_ms(lambda: blas.linear(xp, int(nxt(b["w16"]).data.ptr), yp, m, n, k), stream, 30)}
    if m <= 8:
        g = (-(-n // (8 * (1 if m == 1 else 4))), 1, 1)
        x, y = b["x"], b["y"]
        r["bf16_gemv"] = time_ms(lambda: launch(f"gemv_bf16_t{m}", g, W=nxt(b["w16"]), X=x, Y=y, N=n, K=k), stream, 30)
        name8, g8 = fp8_gemv_name(m), (fp8_gemv_grid(n, m), 1, 1)
        r["fp8_gemv"] = time_ms(
            lambda: launch(name8, g8, W=nxt(b["w8"]), scales=b["sc"], X=x, Y=y, N=n, K=k), stream, 30
        )
    r["fp8_dequant_cublas"] = time_ms(deq, stream, 30)
    for mode, g in env[5].items():  # also at M <= 8: where the GEMV should hand over
        if g.supported((m, n, k)):
            r[f"fp8_w8a8_{mode}"] = time_ms(
                lambda g=g, mode=mode: _w8a8_call(env, b, g, mode, m, n, k, nxt), stream, 30
            )
    return r


def _w8a8_call(env, b: dict, g, mode: str, m: int, n: int, k: int, nxt) -> None:
    """One W8A8 projection as Forward.fp8_linear runs it: quantize the rows, the FP8 GEMM, (scale)."""
    drv, kern, _, stream, _ = env[:5]
    s = int(stream.ptr)

    def launch(name: str, grid, **a) -> None:
        drv.launch(kern[name], grid, (256, 1, 1), kern.args(name, a), s, 0, name)

    x, x8, xs, y, d32 = b["x"][:m], b["x8"], b["xs"], b["y"], b["d32"]
    launch("fp8_quantize_rows", (m, 1, 1), W=x, codes=x8, scales=xs, N=m, K=k)
    d = y if mode == "outer" else d32
    p = lambda a: int(a.data.ptr)  # noqa: E731
    g.matmul(m, n, k, p(x8), p(nxt(b["w8"])), p(d), p(xs), p(b["sc"]))
    if mode == "epilogue":
        launch("fp8_scale_rows", (-(-n // 2048), m, 1), D=d32, xs=xs, ws=b["sc"], Y=y, T=m, N=n)


def bench_preset(env, name: str, rows: list[int], bw: dict) -> dict:
    from blink.models.config import preset

    cfg = preset(name)
    roles = gemm_roles(cfg)
    per_role = {role: _time_role(env, *roles[role], rows) for role in ROLES}
    steps = {}
    for m in rows:
        b16 = sum(min(v for p, v in per_role[r][m].items() if p.startswith("bf16")) for r in ROLES)
        f8 = sum(min(v for p, v in per_role[r][m].items() if p.startswith("fp8")) for r in ROLES)
        steps[m] = {"bf16_ms": b16 * cfg.num_layers, "fp8_ms": f8 * cfg.num_layers, "speedup": b16 / f8}
        print(f"{name} M={m:4d}: projections of a step bf16 {b16 * cfg.num_layers:7.3f} ms, "
              f"fp8 {f8 * cfg.num_layers:7.3f} ms ({b16 / f8:.2f}x)", flush=True)  # fmt: skip
    paths = sorted({p for r in ROLES for ms in per_role[r].values() for p in ms})
    paths_ms = {
        p: {
            m: cfg.num_layers * sum(per_role[r][m][p] for r in ROLES)
            for m in rows
            if all(p in per_role[r][m] for r in ROLES)
        }
        for p in paths
    }
    for p in paths:
        print(f"{name} {p:20s} " + " ".join(f"M={m}:{v:.3f}" for m, v in paths_ms[p].items()), flush=True)
    gemv1 = {}
    for r in ROLES:
        n, k = roles[r]
        ms = per_role[r][1]
        for path, nbytes in (("fp8_gemv", n * k + 4 * n + 2 * k + 2 * n), ("bf16_gemv", 2 * n * k + 2 * k + 2 * n)):
            if path in ms:
                gbps = nbytes / ms[path] / 1e6
                gemv1[f"{r}.{path}"] = {"GBps": gbps, "frac_of_read_bw": gbps / bw["read_GBps"]}
    return {
        "shapes": roles,
        "layers": cfg.num_layers,
        "ms": per_role,
        "step_projections": steps,
        "paths_ms": paths_ms,
        "gemv_m1": gemv1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="result JSON (default bench/results/fp8_gemm-<gpu>-<commit>.json)")
    ap.add_argument("--presets", default="llama3-8b,qwen3-32b")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    add_commit_arg(ap)
    a = ap.parse_args()
    env = _setup()
    env = (*env, _w8a8(env))
    bw = copy_bandwidth(1 << 30)
    rows = [int(r) for r in a.rows.split(",")]
    res = {"bench": "fp8_gemm", **metadata(a.commit or git_commit()), "copy_bandwidth": bw, "presets": {}}
    for name in a.presets.split(","):
        res["presets"][name] = bench_preset(env, name, rows, bw)
    write_json(a.out or str(result_path("fp8_gemm", short_device(res["gpu"]), res["commit"])), res)


if __name__ == "__main__":
    main()
