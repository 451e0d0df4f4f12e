"""Large-batch FP8 projections as the engine runs them: each candidate in a captured graph, checked
against the numpy definition.

    python -m bench.kernels.fp8_gemm_graphs --out DIR/fp8_gemm_graphs-h200-<commit>.json   # Llama-3-8B, every candidate: ~1 min
    python -m bench.kernels.fp8_gemm_graphs --presets llama3-8b,qwen3-32b --variants bf16_cublas,epilogue,outer --out x.json

bench.kernels.fp8_gemm launches eagerly from Python: a W8A8 projection there is three launches
(quantize, cuBLASLt, scale) of 20-40 us of host time each, so its small-M numbers (a ~100 us floor a
projection) are the host's, not the GPU's. Here each (projection, M, candidate) is one graph of one
call per weight copy (enough copies to exceed 4x the L2, so every call streams its weight from HBM,
as each layer does in a step), replayed; the time is a call's share. Candidates (VARIANTS):

  bf16_cublas            the bf16 GEMM (cuBLAS) on bf16 weights: the baseline
  epilogue               W8A8 (blink/gpu/engine/fp8_gemm.py): fp8_quantize_rows, cuBLASLt FP8 with fp32
                         sums (the heuristic's first algorithm, as the engine), fp8_scale_rows
  outer                  the same with cuBLASLt's outer-vector scales and bf16 output: no scaling kernel
  outer_nullptrs         outer, heuristic queried with null scale pointers (the first Fp8Gemm: offered
                         nothing on the H200, so the engine ran "epilogue" at every M)
  *_tuned                the fastest of the heuristic's algorithms, timed once (tune): a timed pick at build
  *_fast                 with cuBLASLt's FAST_ACCUM (EngineConfig.fp8_fast_accum)
  quantize               fp8_quantize_rows alone (its share of every W8A8 candidate)
  mma                    weight-only fp8_mma (fp8.cu, bf16 activations) in 32-row pieces (M <= 128)

Each candidate's output at M rows is checked against the definition (blink.models.fp8.w8a8_linear;
mma: the weight-only product) on CHECK_ROWS of its rows, with the GPU test's bound
(tests/gpu/test_fp8_gemm.py): `ok`, and max |err| / rms. Per M, `step_ms`: each candidate's sum
over a step's four projections times the layers, and "engine": each projection on the engine's mode
(blink.gpu.engine.fp8_gemm.fp8_gemm_mode; FAST_ACCUM as --fast-accum says). Writes --out (JSON with date, gpu, commit, command).
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.common import add_commit_arg, gemm_roles, git_commit, metadata, result_path, short_device, write_json

ROLES = ("qkv", "o", "gate_up", "down")
VARIANTS = (
    "bf16_cublas", "epilogue", "epilogue_tuned", "epilogue_fast", "outer_nullptrs", "outer", "outer_tuned",
    "outer_fast", "quantize", "mma",
)  # fmt: skip
L2_BYTES = 50 << 20
CHECK_ROWS = 4
REPS = 5
MMA_PIECE = 32


def _gemms(drv, stream: int, ws, sm_target: int) -> dict:
    """variant -> Fp8Gemm (None where it offers nothing at a probe shape)."""
    from blink.gpu.engine.fp8_gemm import Fp8Gemm

    spec = {  # mode, FAST_ACCUM, scale pointers at the query
        "epilogue": ("epilogue", False, True), "epilogue_tuned": ("epilogue", False, True),
        "epilogue_fast": ("epilogue", True, True), "outer_nullptrs": ("outer", False, False),
        "outer": ("outer", False, True), "outer_tuned": ("outer", False, True), "outer_fast": ("outer", True, True),
    }  # fmt: skip
    out = {}
    for name, (mode, fast, query) in spec.items():
        out[name] = Fp8Gemm(drv, stream, int(ws.data.ptr), int(ws.nbytes), mode, sm_target, fast, query)
    return out


class Role:
    """One projection's buffers: weight copies (codes + scales, bf16 copies), activations, outputs."""

    def __init__(self, n: int, k: int, rows: int, seed: int) -> None:
        import cupy as cp

        cp.random.seed(seed)
        self.n, self.k = n, k
        copies = max(1, -(-4 * L2_BYTES // (n * k)))
        codes = cp.random.randint(0, 0x7F, (n, k), dtype=cp.uint8) | (
            cp.random.randint(0, 2, (n, k), dtype=cp.uint8) << 7
        )
        self.w8 = [codes] + [cp.roll(codes, i, axis=1) for i in range(1, copies)]
        self.ws = [cp.random.uniform(1e-3, 2e-3, n, dtype=cp.float32) for _ in range(copies)]
        self.w16 = [cp.random.randint(0x3000, 0x3F80, (n, k), dtype=cp.uint16) for _ in range(max(1, copies // 2))]
        xf = cp.random.standard_normal((rows, k), dtype=cp.float32) * cp.exp2(cp.random.randint(-4, 4, (rows, 1)))
        self.x = (xf.astype(cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)  # bf16 (truncated) bits
        self.x8 = cp.zeros((rows, k), dtype=cp.uint8)
        self.xs = cp.zeros(rows, dtype=cp.float32)
        self.y = cp.zeros((rows, n), dtype=cp.uint16)
        self.d32 = cp.zeros((rows, n), dtype=cp.float32)
        self._ref_w = None

    def calls(self) -> int:
        return max(len(self.w8), 4)

    def ref(self, m: int, weight_only: bool) -> tuple[np.ndarray, np.ndarray]:
        """(rows checked, numpy definition of y there) for copy 0 at M = m."""
        import cupy as cp

        from blink.models import fp8
        from blink.models.bf16 import bf16_bits_to_f32

        if self._ref_w is None:
            self._ref_w = fp8.Fp8Weight(cp.asnumpy(self.w8[0]), cp.asnumpy(self.ws[0]))
        rows = np.unique(np.linspace(0, m - 1, CHECK_ROWS).astype(int))
        x = bf16_bits_to_f32(cp.asnumpy(self.x[rows]))
        if weight_only:
            return rows, x @ self._ref_w.dequantize().T
        return rows, fp8.w8a8_linear(x, self._ref_w)


def _enqueue(env, role: Role, variant: str, m: int, i: int) -> None:
    """Call i of a graph: the candidate on weight copy i % copies."""
    drv, kern, blas, gemms, s = env
    r = role
    c = i % len(r.w8)
    p = lambda a: int(a.data.ptr)  # noqa: E731

    def launch(name: str, grid, **a) -> None:
        drv.launch(kern[name], grid, (256, 1, 1), kern.args(name, a), s, 0, name)

    if variant == "bf16_cublas":
        blas.linear(p(r.x), p(r.w16[c % len(r.w16)]), p(r.y), m, r.n, r.k)
        return
    if variant == "mma":
        from blink.gpu.engine.fp8_weights import fp8_mma_grid, fp8_mma_name

        for r0 in range(0, m, MMA_PIECE):
            t = min(MMA_PIECE, m - r0)
            launch(fp8_mma_name(t), (fp8_mma_grid(r.n), 1, 1), W=r.w8[c], scales=r.ws[c], X=p(r.x) + 2 * r0 * r.k,
                   Y=p(r.y) + 2 * r0 * r.n, N=r.n, K=r.k, T=t)  # fmt: skip
        return
    launch("fp8_quantize_rows", (m, 1, 1), W=r.x, codes=r.x8, scales=r.xs, N=m, K=r.k)
    if variant == "quantize":
        return
    g = gemms[variant]
    d = r.y if g.scales == "outer" else r.d32
    g.matmul(m, r.n, r.k, p(r.x8), p(r.w8[c]), p(d), p(r.xs), p(r.ws[c]))
    if g.scales == "epilogue":
        launch("fp8_scale_rows", (-(-r.n // 2048), m, 1), D=r.d32, xs=r.xs, ws=r.ws[c], Y=r.y, T=m, N=r.n)


def _time(env, role: Role, variant: str, m: int) -> float:
    """us of one call: a graph of role.calls() calls, replayed REPS times."""
    ms = _graph_ms(env[0], env[4], lambda: [_enqueue(env, role, variant, m, i) for i in range(role.calls())], REPS)
    return 1e3 * ms / role.calls()


def tune(
    g, key: tuple[int, int, int], operand_sets: list[tuple[int, int, int, int, int]], reps: int = 3
) -> list[float]:
    """Make key's plan of Fp8Gemm g the fastest of the heuristic's algorithms that a device graph
    accepts, each timed once as a captured graph of one call per operand set (each call reads its
    weight copy from memory), replayed `reps` times: the "timed pick at build" candidate (the engine
    takes the heuristic's first: docs/decisions.md). Returns the ms a call of each algorithm in the
    heuristic's order (inf: not device-launchable)."""
    from blink.gpu.engine.fp8_gemm import Plan

    desc, a, b, d = g._descriptors(key)
    offered = g._heuristics(desc, a, b, d)
    ms = [float("inf")] * len(offered)
    for i, hr in enumerate(offered):
        p = Plan(desc, a, b, d, hr, i, len(offered))
        if g._device_launchable(p, operand_sets[0]):
            ms[i] = _graph_ms(g.drv, g.stream, lambda p=p: [g._run(p, ops) for ops in operand_sets], reps)
            ms[i] /= len(operand_sets)
    if not offered or min(ms) == float("inf"):
        g._destroy(desc, a, b, d)
        raise RuntimeError(f"no device-launchable FP8 algorithm for {key}")
    old = g.plans.pop(key, None)
    if old is not None:
        g._destroy(old.desc, old.a, old.b, old.d)
    best = ms.index(min(ms))
    g.plans[key] = Plan(desc, a, b, d, offered[best], best, len(offered))
    return ms


def _graph_ms(drv, s: int, enqueue, reps: int) -> float:
    """ms of one replay of a host-launched graph of what enqueue() puts on stream s (one warm-up replay)."""
    import cupy as cp

    drv.begin_capture(s)
    try:
        enqueue()
    finally:
        graph = drv.end_capture(s)
    ex = drv.instantiate(graph)
    stream = cp.cuda.ExternalStream(s)  # a raw handle (Stream.from_external wants the __cuda_stream__ protocol)
    try:
        drv.graph_launch(ex, s)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        for _ in range(reps):
            drv.graph_launch(ex, s)
        e1.record(stream)
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) / reps
    finally:
        drv.graph_exec_destroy(ex)
        drv.graph_destroy(graph)


def _check(env, role: Role, variant: str, m: int) -> dict:
    """The candidate's y at M = m on copy 0 against the definition (the GPU test's bound)."""
    import cupy as cp

    from blink.models.bf16 import bf16_bits_to_f32

    role.y[...] = 0
    cp.cuda.Device().synchronize()  # the zeros (legacy stream) before the call (the bench's stream)
    _enqueue(env, role, variant, m, 0)
    cp.cuda.Device().synchronize()
    rows, ref = role.ref(m, variant == "mma")
    got = bf16_bits_to_f32(cp.asnumpy(role.y[rows])).astype(np.float64)
    ref = ref.astype(np.float64)
    rms = float(np.sqrt(np.mean(ref**2)))
    err = np.abs(got - ref)
    ok = bool((err <= 2.0**-7 * np.abs(ref) + 2e-3 * rms).all())
    return {"ok": ok, "max_err_over_rms": float(err.max() / rms)}


def _one(env, role: Role, variant: str, m: int, key_info: dict) -> dict | None:
    """{us, ok, max_err_over_rms, algo} of one candidate, None where it does not apply."""
    gemms = env[3]
    if variant == "mma" and m > 4 * MMA_PIECE:
        return None
    g = gemms.get(variant)
    key = (m, role.n, role.k)
    if g is not None:
        offered = g.offered(key)
        key_info[variant] = offered
        if not offered:
            return None
        if variant.endswith("_tuned"):
            c = range(len(role.w8))
            sets = [(int(role.x8.data.ptr), int(role.w8[i].data.ptr), int((role.y if g.scales == "outer" else role.d32).data.ptr),
                     int(role.xs.data.ptr), int(role.ws[i].data.ptr)) for i in c]  # fmt: skip
            tune(g, key, sets)
    res = {"us": _time(env, role, variant, m)}
    if variant not in ("bf16_cublas", "quantize"):
        res.update(_check(env, role, variant, m))
    if g is not None:
        p = g.plans[key]
        res["algo"] = {"index": p.index, "offered": p.offered}
    return res


def bench_preset(env, name: str, rows: list[int], variants: list[str], fast: bool = False) -> dict:
    from blink.gpu.engine.fp8_gemm import fp8_gemm_mode
    from blink.models.config import preset

    cfg = preset(name)
    roles = gemm_roles(cfg)
    per_role: dict = {}
    offered: dict = {}
    for ri, role_name in enumerate(ROLES):
        n, k = roles[role_name]
        role = Role(n, k, max(rows), ri)
        per_role[role_name] = {}
        for m in rows:
            info: dict = {}
            per_role[role_name][m] = {v: r for v in variants if (r := _one(env, role, v, m, info)) is not None}
            offered[f"{role_name}.{m}"] = info
            line = " ".join(
                f"{v}={r['us']:.1f}{'' if r.get('ok', True) else '!'}" for v, r in per_role[role_name][m].items()
            )
            print(f"{name} {role_name:7s} M={m:5d} us: {line}", flush=True)
        del role
        import cupy as cp

        cp.get_default_memory_pool().free_all_blocks()
    step_ms = {
        m: {
            v: cfg.num_layers * sum(per_role[r][m][v]["us"] for r in ROLES) / 1e3
            for v in variants
            if all(v in per_role[r][m] for r in ROLES)
        }
        for m in rows
    }
    suffix = "_fast" if fast else ""
    for m, d in step_ms.items():
        picks = [(r, fp8_gemm_mode({"outer", "epilogue"}, m, roles[r][0]) + suffix) for r in ROLES]
        if all(v in per_role[r][m] for r, v in picks):  # the engine's pick for each projection
            d["engine"] = cfg.num_layers * sum(per_role[r][m][v]["us"] for r, v in picks) / 1e3
        print(f"{name} M={m:5d} step ms: " + " ".join(f"{v}={x:.3f}" for v, x in d.items()), flush=True)
    return {"shapes": roles, "layers": cfg.num_layers, "us": per_role, "step_ms": step_ms, "offered": offered}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="result JSON (default bench/results/fp8_gemm_graphs-<gpu>-<commit>.json)")
    ap.add_argument("--presets", default="llama3-8b")
    ap.add_argument("--rows", default="64,128,256,1024,4096")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sm-reserve", type=int, default=1, help="SMs the GEMMs leave free (EngineConfig.gemm_sm_reserve)")
    ap.add_argument("--fast-accum", action="store_true", help="the engine's step_ms with FAST_ACCUM")
    add_commit_arg(ap)
    a = ap.parse_args()
    import cupy as cp

    from blink.gpu.toolchain.cuda_api import Cublas, Driver
    from blink.gpu.toolchain.kernels import DEFAULT_CACHE, Kernels

    cp.cuda.Device().use()
    drv = Driver()
    stream = cp.cuda.Stream(non_blocking=True)
    ws = cp.empty(64 << 20, dtype=cp.uint8)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    blas = Cublas(int(stream.ptr), int(ws.data.ptr), int(ws.nbytes))
    blas.set_sm_count_target(sms - a.sm_reserve if a.sm_reserve else 0)
    gemms = _gemms(drv, int(stream.ptr), ws, sms - a.sm_reserve if a.sm_reserve else 0)
    env = (drv, Kernels(drv, DEFAULT_CACHE), blas, gemms, int(stream.ptr))
    rows = [int(r) for r in a.rows.split(",")]
    variants = [v for v in a.variants.split(",") if v]
    res = {"bench": "fp8_gemm_graphs", **metadata(a.commit or git_commit()), "sm_reserve": a.sm_reserve, "presets": {}}
    for name in a.presets.split(","):
        res["presets"][name] = bench_preset(env, name, rows, variants, a.fast_accum)
    write_json(a.out or str(result_path("fp8_gemm_graphs", short_device(res["gpu"]), res["commit"])), res)


if __name__ == "__main__":
    main()
