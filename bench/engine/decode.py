"""Decode step time of the CUDA engine at context 1024 (Llama-3-8B shape, all 32 layers, random
bf16 weights) for batch 1..256, against this GPU's device-to-device copy bandwidth.

Bytes per step (common.decode_bytes) = every weight once (of the embedding table only the gathered
rows) + the K/V of every sequence's context. Graphs are launched
from the host back to back and timed with CUDA events (so host launch overhead overlaps).
Both decode attention kernels (--variants: flashq, flashmma) are timed at every batch, as a whole
step and as a graph of their attention launches alone; the fastest per batch is printed (the engine
switches from flashq to flashmma at attention_launch.FLASHMMA_MIN_BATCH).

    python -m bench.engine.decode --out DIR/decode.json [--variants flashq,flashmma]

GEMV fusions (the engine serves every one): --compare-fusion times other sets as extra rows
("fusion_<spec>") in the same process, --gemv-max-tokens moves batches 2-8 onto the GEMV path (the
only steps that fuse).

`--role-breakdown` (where the batch-128/256 decode step's time goes) times only,
for each batch of --batches and each context of --contexts: the whole captured decode step, and each
kernel category captured as a graph of its own launches (the step's order and shapes; CUDA events
around graph launches, outside the graphs): the cuBLAS GEMMs by layer role (qkv, o, gate_up, down,
lm_head), attention, norms, RoPE + KV write, SwiGLU, embedding, final norm, sampling; then each of
--attention-variants (default flashmma) alone on the same q and KV, with its largest difference
from the engine's attention output (relative to its largest value; "MISMATCH" past 2e-2). Each category
gets its bytes and FLOPs (common.decode_traffic), achieved GB/s and TFLOP/s, and an ideal time
max(bytes / copy bandwidth, FLOPs / --peak-tflops); the step gets the issue's bandwidth fraction
(weights + every sequence's K/V, over the measured copy bandwidth) and the time no category covers
(the gaps between kernels in the graph).

    python -m bench.engine.decode --role-breakdown --batches 128,256 --contexts 320,1024 \
        --out bench/results/decode_breakdown-h200-<commit>.json --commit <commit>

FP8 weights (--quantization fp8, random bf16 weights quantized on the GPU as the engine loads them): the
step's bytes count what the engine holds (a byte a projection weight + an fp32 scale a row; the LM head
in FP8 too with --fp8-lm-head), and the GEMMs are split by role at every batch (the FP8 GEMV, the
tensor-core kernel, the W8A8 GEMM; a fused GEMV counts with what it folds in: the qkv role's norm and
RoPE, o's and down's residual add, gate_up's norm and SwiGLU). --compare-fp8-mma (batches, default 1):
the whole step also with the other FP8 decode kernel (the fused GEMV <-> the tensor-core kernel,
EngineConfig.fp8_mma_min_tokens), captured and timed in the same process on the same KV cache
("fp8_mma" / "fp8_gemv" rows, or step_ms_<variant> in --role-breakdown rows). --fp8-gemv-config sets the
FP8 GEMV's configuration per bucket (EngineConfig.fp8_gemv_config, e.g. "1=r2p4": the pipelined weight loop);
--compare-fp8-gemv-config "1=r2p4;1=r1p8" times the whole step in each as well ("fp8_gemv_<spec>").

    python -m bench.engine.decode --role-breakdown --quantization fp8 --batches 1,256 --contexts 320,1024 \
        --out bench/results/decode_breakdown_fp8-h200-<commit>.json --commit <commit>
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.common import (
    CATEGORIES,
    add_commit_arg,
    alternate,
    category_times,
    copy_fraction,
    decode_bytes,
    decode_engine,
    decode_engine_config,
    decode_traffic,
    gemm_roles,
    load_synthetic,
    metadata,
    only_launches,
    preset_config,
    print_breakdown,
    step_launch,
    step_rates,
    time_ms,
    write_json,
)
from blink.gpu.engine.attention_launch import FLASH_VARIANTS
from blink.gpu.engine.forward import GEMV_FUSIONS
from blink.gpu.engine.fp8_weights import FP8_MMA_MAX_TOKENS


def parse_gemv_fusion(spec: str) -> frozenset[str]:
    """ "none" -> no fusion; "all" -> every fusion (what serves); else a comma list of GEMV_FUSIONS."""
    spec = spec.strip()
    if spec == "all":
        return frozenset(GEMV_FUSIONS)
    out = frozenset(p.strip() for p in spec.split(",") if p.strip() not in ("", "none"))
    if out - set(GEMV_FUSIONS):
        raise SystemExit(f"gemv fusion {sorted(out - set(GEMV_FUSIONS))} not in {GEMV_FUSIONS} (or none, all)")
    return out


def parse_fp8_gemv_config(spec: str) -> dict[int, tuple]:
    """ "1=r2p4,2=r2u4" -> {bucket: configuration} (fp8_weights.FP8_GEMV_CONFIGS, by fp8_config_label)."""
    from blink.gpu.engine.fp8_weights import FP8_GEMV_CONFIGS, fp8_config_label

    out = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        nt_s, _, label = part.partition("=")
        nt = int(nt_s)
        by_label = {fp8_config_label(c): c for c in FP8_GEMV_CONFIGS.get(nt, ())}
        if label not in by_label:
            raise SystemExit(f"fp8 GEMV configuration {part!r}: bucket {nt} has {sorted(by_label)}")
        out[nt] = by_label[label]
    return out


def engine_fields(a: argparse.Namespace) -> dict:
    """The EngineConfig fields the flags set (the others: decode_engine_config's)."""
    out: dict = {"gemv_max_tokens": a.gemv_max_tokens} if a.gemv_max_tokens else {}
    if a.no_pdl:
        out["pdl"] = False
    if a.quantization:
        out["quantization"] = a.quantization
        out["fp8_lm_head"] = a.fp8_lm_head
        if a.fp8_mma_min_tokens:
            out["fp8_mma_min_tokens"] = a.fp8_mma_min_tokens
        if a.fp8_gemv_config:
            out["fp8_gemv_config"] = tuple(parse_fp8_gemv_config(a.fp8_gemv_config).items())
    return out


def fp8_config_variants(eng, b: int, specs: str) -> dict[str, list[int]]:
    """The decode step of batch b with other FP8 GEMV configurations (";"-separated parse_fp8_gemv_config
    specs), each captured now: {"fp8_gemv_<spec>": execs}."""
    fwd, out = eng.fwd, {}
    for spec in (x.strip() for x in specs.split(";") if x.strip()):
        keep = dict(fwd.fp8_gemv_config)
        fwd.set_fp8_gemv_config(parse_fp8_gemv_config(spec))
        try:
            out[f"fp8_gemv_{spec}"] = eng.capture_variant(b, b, True)
        finally:
            fwd.fp8_gemv_config = keep
    return out


def step_bytes(eng, cfg, b: int, ctx: int) -> float:
    """Bytes one decode step reads: common.decode_bytes for bf16; with FP8 weights what the engine holds
    (GpuWeights.bytes_per_step: codes, scales, the bf16 norms and an LM head either way) plus the gathered
    embedding rows (all of the table is counted where it is the head) and the K/V of every sequence."""
    if not eng.fwd.fp8:
        return decode_bytes(cfg, b, ctx)["total"]
    w = eng.weights
    rows = 0 if w.lm_head is w.embed else b * cfg.hidden_size * 2
    kv_elem = 1 if eng.fwd.kv_suffix else 2
    return w.bytes_per_step + rows + kv_elem * b * ctx * cfg.num_layers * 2 * cfg.kv_size


def fp8_kernel_variant(eng, b: int) -> tuple[str, list[int]]:
    """The decode step of batch b with the other FP8 decode kernel than the engine's (the fused GEMV <->
    the tensor-core kernel), captured now: (its name, its execs)."""
    fwd, keep = eng.fwd, eng.fwd.fp8_mma_min_tokens
    on_mma = b >= keep
    fwd.fp8_mma_min_tokens = FP8_MMA_MAX_TOKENS + 1 if on_mma else 1
    try:
        execs = eng.capture_variant(b, b, True)
    finally:
        fwd.fp8_mma_min_tokens = keep
    return ("fp8_gemv" if on_mma else "fp8_mma"), execs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=0, help="0 = the preset's")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--compare-cublas", default="1,8", help="batches also timed with cuBLAS instead of the GEMV")
    ap.add_argument("--variants", default=",".join(FLASH_VARIANTS), help="decode attention kernels timed")
    ap.add_argument("--breakdown", default="1,256", help="batches whose kernel categories are timed one by one")
    ap.add_argument("--compare-fusion", default="", help='other gemv fusions timed as rows, ";"-separated ("none;all")')
    ap.add_argument("--gemv-max-tokens", type=int, default=0, help="EngineConfig.gemv_max_tokens (0: its default)")
    ap.add_argument("--role-breakdown", action="store_true", help="only the per-role breakdown (docstring)")
    ap.add_argument("--contexts", default="320,1024", help="contexts of --role-breakdown")
    ap.add_argument(
        "--attention-variants",
        default="flashmma",
        help="--role-breakdown: other decode attention kernels timed alone on the same q and KV, checked against the engine's",
    )
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak for ideal times (H200: ~790)")
    ap.add_argument("--quantization", choices=("", "fp8"), default="", help="EngineConfig.quantization")
    ap.add_argument("--fp8-lm-head", action="store_true", help="EngineConfig.fp8_lm_head (with --quantization fp8)")
    ap.add_argument("--fp8-mma-min-tokens", type=int, default=0, help="EngineConfig.fp8_mma_min_tokens (0: default)")
    ap.add_argument("--compare-fp8-mma", default="1", help="fp8: batches also timed with the other FP8 kernel")
    ap.add_argument("--fp8-gemv-config", default="", help='EngineConfig.fp8_gemv_config, e.g. "1=r2p4,2=r2p4"')
    ap.add_argument(
        "--compare-fp8-gemv-config", default="",
        help='fp8: whole steps also with these GEMV configurations, ";"-separated ("1=r2p4;1=r1p8")',
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1, help="time the variants in turn this many times (median)")
    ap.add_argument("--no-pdl", action="store_true", help="EngineConfig.pdl off (programmatic dependent launch)")
    ap.add_argument(
        "--compare-pdl", default="1", help='batches also timed with EngineConfig.pdl on and off ("pdl_on", "pdl_off")'
    )
    add_commit_arg(ap)
    ap.add_argument("--out", default="bench/results/decode.json")
    a = ap.parse_args(argv)
    cfg = preset_config(a.model, a.layers)
    if a.role_breakdown:
        return role_breakdown(a, cfg, argv)
    batches = [int(x) for x in a.batches.split(",")]
    bmax, ctx = max(batches), a.context
    ecfg = decode_engine_config(batches, ctx, **engine_fields(a))
    compare_fusion = [f.strip() for f in a.compare_fusion.split(";") if f.strip()]
    for f in compare_fusion:
        parse_gemv_fusion(f)
    timed_variants = [v for v in a.variants.split(",") if v]
    for v in timed_variants:
        if v not in FLASH_VARIANTS:
            raise SystemExit(f"unknown decode attention kernel {v!r} (known: {tuple(FLASH_VARIANTS)})")
    eng, rep, bw = decode_engine(cfg, ecfg)
    weight_bytes = eng.weights.bytes_per_step
    rows = []
    breakdown: dict[str, dict[str, float]] = {}
    attn_only: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(0)
    h = eng.arena.host
    for b in batches:
        load_synthetic(eng, b, 1, ctx, rng)  # b sequences, context ctx, greedy
        variants = {"engine": step_launch(eng, b)}
        if eng.fwd.fp8 and str(b) in a.compare_fp8_mma.split(",") and b <= eng.fwd.fp8_gemv_max_tokens:
            name, execs = fp8_kernel_variant(eng, b)
            variants[name] = alternate(eng, execs)
        if eng.fwd.fp8 and eng.fwd.uses_fp8_gemv_bucket(b):  # other GEMV configurations
            for name, execs in fp8_config_variants(eng, b, a.compare_fp8_gemv_config).items():
                variants[name] = alternate(eng, execs)
        if str(b) in a.compare_pdl.split(","):  # programmatic dependent launch on and off, both captured now
            engine_pdl = eng.fwd.pdl
            for on in (True, False):
                eng.fwd.pdl = on
                try:
                    variants["pdl_on" if on else "pdl_off"] = alternate(eng, eng.capture_variant(b, b, True))
                finally:
                    eng.fwd.pdl = engine_pdl
        if str(b) in a.compare_cublas.split(",") and not eng.fwd.fp8:  # the other GEMM back end at this batch
            eng.fwd.gemv_max_tokens = 8 if b > ecfg.gemv_max_tokens else 0  # the GEMV, or cuBLAS only
            execs = eng.capture_variant(b, b, True)
            eng.fwd.gemv_max_tokens = ecfg.gemv_max_tokens
            variants["gemv" if b > ecfg.gemv_max_tokens else "cublas_only"] = alternate(eng, execs)
        engine_fusion = eng.fwd.gemv_fusion
        for f in compare_fusion:  # the same step with other GEMV fusions
            eng.fwd.set_gemv_fusion(parse_gemv_fusion(f))
            execs = eng.capture_variant(b, b, True)
            eng.fwd.set_gemv_fusion(engine_fusion)
            variants[f"fusion_{f}"] = alternate(eng, execs)
        default_variant = eng.fwd.decode_variant(b)
        variant_of = {"engine": default_variant}
        for v in timed_variants:  # the other decode attention kernels
            if v == default_variant:
                continue
            eng.fwd.set_decode_attention(v)
            execs = eng.capture_variant(b, b, True)
            eng.fwd.set_decode_attention(None)
            variants[f"attn_{v}"] = alternate(eng, execs)
            variant_of[f"attn_{v}"] = v
        for v in dict.fromkeys([default_variant, *timed_variants]):  # attention launches alone
            eng.fwd.set_decode_attention(v)
            with only_launches(eng.fwd, {"attn"}):
                execs = eng.capture_variant(b, b, True)
            eng.fwd.set_decode_attention(None)
            attn_only.setdefault(str(b), {})[v] = time_ms(alternate(eng, execs), eng.stream, iters=a.iters)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(a.rounds):  # the variants in turn, round after round: drift falls on all of them
            for name, fn in variants.items():
                times[name].append(time_ms(fn, eng.stream, iters=a.iters))
        for name in variants:
            ms = float(np.median(times[name]))
            moved = step_bytes(eng, cfg, b, ctx)
            attention = variant_of.get(name, default_variant)
            rows.append({"batch": b, "variant": name, "decode_attention": attention, **step_rates(b, ms, moved, bw)})
        if str(b) in a.breakdown.split(","):
            # "norm" / "swiglu" folded into the GEMVs have no launches of their own (an empty graph)
            cats = [c for c in CATEGORIES if c not in eng.fwd.fusions_for(b)]
            breakdown[str(b)] = category_times(eng, b, b, True, cats, a.iters)
    # sampling cost at the largest batch: temperature 1, top-p 0.9, top-k 50
    b = bmax
    h["temperature"][:b], h["top_p"][:b], h["top_k"][:b] = 1.0, 0.9, 50
    h["seed"][:b] = np.arange(b)
    eng.arena.upload(eng.s, b)
    ms = time_ms(step_launch(eng, b), eng.stream, iters=a.iters)
    rows.append({"batch": b, "variant": "engine_sampled_t1_p0.9_k50", "ms_per_step": ms, "tokens_per_s": b / ms * 1e3})
    res = {
        **metadata(a.commit, argv),
        "model": cfg.name,
        "layers": cfg.num_layers,
        "context": ctx,
        "gemv_fusion": ",".join(sorted(eng.fwd.gemv_fusion)) or "none",
        "gemv_max_tokens": ecfg.gemv_max_tokens,
        **fp8_fields(ecfg),
        "weight_bytes": weight_bytes,
        "copy_bandwidth": bw,
        "capture": {
            "graphs": rep.graphs,
            "execs": rep.execs,
            "seconds": rep.seconds,
            "device_bytes": rep.device_bytes,
            "decode_graph_nodes_max": rep.nodes_decode_max,
            "pdl": eng.fwd.pdl,
            "pdl_refused": rep.pdl_refused,
        },
        "rows": rows,
        "breakdown_ms": breakdown,
        "attention_only_ms": attn_only,
    }
    # the fastest decode attention per batch (whole step, GEMM back end as the engine's)
    best: dict[int, tuple[str, float]] = {}
    for r in rows:
        if r["variant"] == "engine" or r["variant"].startswith("attn_"):
            b, ms = r["batch"], r["ms_per_step"]
            if b not in best or ms < best[b][1]:
                best[b] = (r["decode_attention"], ms)
    res["best_decode_attention"] = {str(b): {"variant": v, "ms_per_step": ms} for b, (v, ms) in best.items()}
    write_json(a.out, res)
    print(f"\ncopy bandwidth (read+write) {bw['read_plus_write_GBps']:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB")
    print(f"engine gemv fusion: {res['gemv_fusion']}, gemv_max_tokens {ecfg.gemv_max_tokens}, pdl {eng.fwd.pdl}")
    if rep.pdl_refused:
        print(f"programmatic dependent launch refused: {rep.pdl_refused}")
    print(f"{'batch':>5} {'variant':>28} {'ms/step':>8} {'tok/s':>9} {'GB/s':>7} {'of copy':>7}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['variant']:>28} {r['ms_per_step']:8.3f} {r['tokens_per_s']:9.0f} "
            f"{r.get('GBps', 0):7.0f} {r.get('frac_of_copy_bw', 0):7.1%}"
        )
    print_breakdown("batch", breakdown)
    for b, parts in attn_only.items():
        print(
            f"batch {b} attention launches alone (ms, {cfg.num_layers} layers): "
            + ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
        )
    for b, (v, ms) in sorted(best.items()):
        print(f"best at batch {b}: {v} {ms:.3f} ms/step ({b / ms * 1e3:.0f} tok/s)")
    eng.close()
    return 0


def fp8_fields(ecfg) -> dict:
    """The result's FP8 settings (empty for bf16 weights)."""
    if not ecfg.quantization:
        return {}
    keys = ("quantization", "fp8_lm_head", "fp8_mma_min_tokens", "fp8_gemv_max_tokens", "kv_cache_dtype")
    out = {k: getattr(ecfg, k) for k in keys}
    from blink.gpu.engine.fp8_weights import FP8_GEMV_CONFIG

    out["fp8_gemv_config"] = {str(nt): list(c) for nt, c in {**FP8_GEMV_CONFIG, **dict(ecfg.fp8_gemv_config)}.items()}
    return out


def capture_for_host(eng, b: int) -> tuple[int, int]:
    """The decode step of bucket b as the forward records it now (only_launches filters it), as a
    graph instantiated for host launches (a category with no launch, e.g. "moe" of a dense model,
    makes an empty graph, which cannot be instantiated for device launch: CUDA_ERROR_INVALID_VALUE
    on the H200). Returns (graph, exec), exec 0 for an empty graph."""
    d = eng.driver
    eng._gemm_sm_target()  # the GEMMs sized as in the engine's graphs
    d.begin_capture(eng.s)
    try:
        eng.fwd.record(eng.s, b, b, True)
    finally:
        graph = d.end_capture(eng.s)
    if d.graph_node_count(graph) == 0:
        return graph, 0
    ex = d.instantiate(graph)
    d.graph_upload(ex, eng.s)
    return graph, ex


def against_ideal(t: dict[str, float], ms: float, bw_Bps: float, peak: float) -> dict[str, float]:
    """--role-breakdown's row of one category timed at `ms`: its bytes and FLOPs (`t`, from
    decode_traffic), their achieved rates, and the ideal time max(bytes / copy bandwidth, FLOPs /
    peak) in ms (bw_Bps in bytes/s, peak in FLOP/s)."""
    ideal = max(t["bytes"] / bw_Bps, t["flops"] / peak) * 1e3
    return {
        "ms": ms,
        "bytes": t["bytes"],
        "flops": t["flops"],
        "GBps": t["bytes"] / ms / 1e6,
        "TFLOPs": t["flops"] / ms / 1e9,
        "ideal_ms": ideal,
        "ideal_over_ms": ideal / ms if ms else 0.0,
    }


def role_breakdown(a: argparse.Namespace, cfg, argv: list[str] | None) -> int:
    """--role-breakdown: whole decode step and each kernel category, by batch and context."""
    batches = [int(x) for x in a.batches.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    ecfg = decode_engine_config(batches, max(contexts), **engine_fields(a))
    eng, rep, bw = decode_engine(cfg, ecfg)
    fp8, fp8_head = eng.fwd.fp8, eng.fwd.fp8 and ecfg.fp8_lm_head
    bw_Bps = bw["read_plus_write_GBps"] * 1e9
    peak = a.peak_tflops * 1e12
    weight_bytes = eng.weights.bytes_per_step
    kv_per_token = cfg.num_layers * 2 * cfg.kv_size * 2
    roles = gemm_roles(cfg)
    extra_attn = [v for v in a.attention_variants.split(",") if v]
    rng = np.random.default_rng(0)
    rows = []
    for ctx in contexts:
        for b in batches:
            load_synthetic(eng, b, 1, ctx, rng)
            step_ms = time_ms(step_launch(eng, b), eng.stream, a.iters)
            other: dict[str, float] = {}
            if fp8 and str(b) in a.compare_fp8_mma.split(",") and b <= eng.fwd.fp8_gemv_max_tokens:
                name, execs = fp8_kernel_variant(eng, b)
                other[f"step_ms_{name}"] = time_ms(alternate(eng, execs), eng.stream, a.iters)
            if fp8 and eng.fwd.uses_fp8_gemv_bucket(b):  # the whole step in other GEMV configurations
                for name, execs in fp8_config_variants(eng, b, a.compare_fp8_gemv_config).items():
                    other[f"step_ms_{name}"] = time_ms(alternate(eng, execs), eng.stream, a.iters)
            traffic = decode_traffic(cfg, b, ctx, fp8=fp8, fp8_head=fp8_head)
            cats: dict[str, dict[str, float]] = {}
            # bf16 GEMVs are launches of category "gemm", not split by role here; FP8 projections are, at
            # every batch (only_launches selects them by weight shape)
            gemv = eng.fwd.uses_gemv(b) and not fp8
            fused = eng.fwd.fusions_for(b)
            names = (["gemm"] if gemv else [f"gemm_{r}" for r in roles]) + [
                c for c in CATEGORIES if c != "gemm" and c not in fused and (c != "moe" or cfg.is_moe)
            ]
            for name in names:
                if name.startswith("gemm_"):
                    with only_launches(eng.fwd, {"gemm"}, {roles[name.removeprefix("gemm_")]}):
                        graph, ex = capture_for_host(eng, b)
                else:
                    with only_launches(eng.fwd, {name}):
                        graph, ex = capture_for_host(eng, b)
                ms = time_ms(lambda ex=ex: eng.driver.graph_launch(ex, eng.s), eng.stream, a.iters) if ex else 0.0
                if ex:
                    eng.driver.graph_exec_destroy(ex)
                eng.driver.graph_destroy(graph)
                if name == "gemm":  # every GEMM together (the GEMV path)
                    g = [v for k, v in traffic.items() if k.startswith("gemm_")]
                    t = {"bytes": sum(v["bytes"] for v in g), "flops": sum(v["flops"] for v in g)}
                else:
                    t = traffic.get(name, {"bytes": 0.0, "flops": 0.0})
                cats[name] = against_ideal(t, ms, bw_Bps, peak)
            for v in extra_attn:  # other decode attention kernels on the same q and KV: time and agreement
                outs, ms_v = {}, 0.0
                for var in (eng.fwd.decode_variant(b), v):
                    eng.fwd.set_decode_attention(var)
                    with only_launches(eng.fwd, {"attn"}):
                        graph, ex = capture_for_host(eng, b)
                    eng.fwd.set_decode_attention(None)
                    eng.driver.graph_launch(ex, eng.s)
                    eng.stream.synchronize()
                    outs[var] = (eng.fwd.attn[:b].get().astype(np.uint32) << 16).view(np.float32)
                    if var == v:
                        ms_v = time_ms(lambda ex=ex: eng.driver.graph_launch(ex, eng.s), eng.stream, a.iters)
                    eng.driver.graph_exec_destroy(ex)
                    eng.driver.graph_destroy(graph)
                ref = outs[eng.fwd.decode_variant(b)]
                rel = float(np.abs(outs[v] - ref).max() / max(float(np.abs(ref).max()), 1e-30))
                cats[f"attn_{v}"] = {
                    **against_ideal(traffic["attn"], ms_v, bw_Bps, peak),
                    "max_rel_diff_vs_engine": rel,
                    "matches_engine": rel < 2e-2,
                }
            moved = step_bytes(eng, cfg, b, ctx)  # the (and the table's) bytes per step
            own = {k: c for k, c in cats.items() if not k.startswith("attn_")}  # the step's own kernels
            total_cat = sum(c["ms"] for c in own.values())
            ideal_total = sum(c["ideal_ms"] for c in own.values())
            rows.append(
                {
                    "batch": b,
                    "context": ctx,
                    "step_ms": step_ms,
                    **other,
                    "tokens_per_s": b / step_ms * 1e3,
                    "bytes_per_step": moved,
                    "frac_of_copy_bw": copy_fraction(moved, step_ms, bw),
                    "categories_sum_ms": total_cat,
                    "uncovered_ms": step_ms - total_cat,
                    "ideal_sum_ms": ideal_total,
                    "categories": cats,
                }
            )
            print(
                f"\nbatch {b} context {ctx}: step {step_ms:.3f} ms, {moved / 1e9:.2f} GB = "
                f"{rows[-1]['frac_of_copy_bw']:.1%} of copy bandwidth; categories {total_cat:.3f} ms "
                f"(ideal {ideal_total:.3f}), not covered {step_ms - total_cat:.3f} ms"
                + "".join(f"; {k} {v:.3f}" for k, v in other.items()),
                flush=True,
            )
            print(f"  {'category':<14}{'ms':>8}{'ideal':>8}{'ideal/ms':>9}{'GB/s':>8}{'TFLOP/s':>9}")
            for name, c in cats.items():
                agree = "" if "matches_engine" not in c else f"  rel diff vs engine {c['max_rel_diff_vs_engine']:.1e}"
                agree += "" if c.get("matches_engine", True) else "  MISMATCH"
                print(
                    f"  {name:<14}{c['ms']:8.3f}{c['ideal_ms']:8.3f}{c['ideal_over_ms']:9.1%}"
                    f"{c['GBps']:8.0f}{c['TFLOPs']:9.1f}{agree}"
                )
    res = {
        **metadata(a.commit, argv),
        "model": cfg.name,
        "layers": cfg.num_layers,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "copy_bandwidth": bw,
        "peak_tflops": a.peak_tflops,
        "decode_attention": {str(b): eng.fwd.decode_variant(b) for b in batches},
        "gemv_max_tokens": ecfg.gemv_max_tokens,
        **fp8_fields(ecfg),
        "fp8_fusions": {str(b): ",".join(sorted(eng.fwd.fusions_for(b))) for b in batches} if fp8 else {},
        "capture": {"graphs": rep.graphs, "seconds": rep.seconds},
        "rows": rows,
    }
    write_json(a.out, res)
    print(f"copy bandwidth (read+write) {bw['read_plus_write_GBps']:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB")
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
