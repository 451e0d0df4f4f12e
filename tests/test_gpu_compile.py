"""Every CUDA source of the engine and the scheduler compiles with NVRTC (no toolkit, no GPU) for
every target architecture; the engine's kernel names are in the cubins."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest

from blink.gpu.engine.abi import bucket_of
from blink.gpu.engine.attention_launch import FLASH_COMBINE_OF, FLASH_VARIANTS
from blink.gpu.engine.engine import EngineConfig, _buckets
from blink.gpu.engine.weights import bf16_bits_to_f32, f32_to_bf16_bits
from blink.gpu.scheduler import scheduler as S
from blink.gpu.toolchain import build as B
from blink.gpu.toolchain import kernels

CU_FILES = sorted([*kernels.CSRC.glob("*.cu"), *S.CSRC.glob("*.cu")])
needs_nvrtc = pytest.mark.skipif(B.find_nvrtc() is None, reason="NVRTC not installed (pip install 'blink-serve[cu13]')")


def test_engine_sources_exist():
    assert {*kernels.SOURCES, S.UNIT.source.name} == {p.name for p in CU_FILES}


def _unit(name: str) -> B.Unit:
    return S.UNIT if name == S.UNIT.source.name else kernels.UNITS[name]


@needs_nvrtc
@pytest.mark.parametrize("arch", B.TARGET_ARCHS)
@pytest.mark.parametrize("src", CU_FILES, ids=lambda p: p.name)
def test_compiles_for_every_target(src: pathlib.Path, arch: int, tmp_path: pathlib.Path):
    """The scheduler on sm_90 (the H200): the production build, with ptxas's report of its one-block
    budget (full optimisation: what the report is about). Every other source and target: the same
    source, options and headers with --Ofast-compile=max (front end and code generation, ptxas
    included, for that architecture at a fifth of the compile time: flash_decode.cu takes 100 s of
    CPU at full optimisation, 17 s so; CI has 2 cores). Flash decode's spills are read from the
    production cubin on the GPU (tests/gpu/test_kernel_resources.py), which gpu_check.sh's build part
    makes before its tests; B.build and its cache: test_cache_key_tracks_source_arch_and_options."""
    unit = _unit(src.name)
    rtc = B.nvrtc()
    if arch != 90 or src.name != S.UNIT.source.name:
        out = tmp_path / f"{src.stem}.sm_{arch}.cubin"
        opts = (*unit.options, "--Ofast-compile=max")
        out.write_bytes(rtc.compile(src, f"sm_{arch}", opts, unit.include_dirs()))
    else:  # the production build, with ptxas's report
        image = rtc.compile(src, "sm_90", (*unit.options, "--ptxas-options=-v"), unit.include_dirs())
        _assert_scheduler_fits_one_block(rtc.last_log)
        out = tmp_path / (src.stem + ".cubin")
        out.write_bytes(image)
    data = out.read_bytes()
    assert data[:4] == b"\x7fELF"
    names = data.decode("latin-1")
    if src.name == "prefill_attention.cu":
        for hd in (16, 32, 64, 128):
            assert f"attn_prefill_fa2_hd{hd}" in names
    if src.name == "model_kernels.cu":
        for k in ("embed_tokens", "add_rmsnorm", "rope_kv_write", "swiglu", "signal_done", "gemv_bf16_t8"):
            assert k in names
    if src.name == "moe.cu":  # each expert kernel and its FP8-weight variant
        for k in ("moe_pair_gate_up", "moe_pair_down", "moe_gate_up_m16", "moe_down_mma_m64"):
            assert k in names and f"{k}_fp8" in names, k
    if src.name == "fp8.cu":
        for k in (
            "fp8_quantize_rows",
            "fp8_dequant_rows",
            "fp8_scale_rows",
            "gemv_fp8_t1_r1u8",
            "gemv_fp8_resid_t8_r2u2",
        ):
            assert k in names
    if src.name == "sampling.cu":
        for k in ("sample_tokens", "penalty_mark", "logits_ext", "sample_post"):
            assert k in names
    if src.name == "flash_decode.cu":
        for hd in (16, 32, 64, 128):
            for v in FLASH_VARIANTS:
                assert f"attn_{v}_hd{hd}_g4" in names and f"attn_{FLASH_COMBINE_OF[v]}_combine_hd{hd}" in names
    if src.name == S.UNIT.source:
        for sym in (S.KERNEL, S.INIT_KERNEL, "blink_sched_clock"):
            assert sym in names, sym
        # the device runtime's launch is left for the driver to resolve at load time, and nothing
        # else: a relocatable cubin with unresolved unified-function tables fails to load
        assert "cudaGraphLaunch" in names and "__UFT" not in names
        assert data[16] == 2  # ELF e_type ET_EXEC: a whole-program image, not relocatable code


def _assert_scheduler_fits_one_block(ptxas_log: str) -> None:
    lines = ptxas_log.splitlines()
    start = next(i for i, ln in enumerate(lines) if f"entry function '{S.KERNEL}'" in ln)
    line = next(ln for ln in lines[start:] if "Used" in ln and "registers" in ln)
    regs = int(line.split("Used")[1].split("registers")[0])
    smem = int(line.split("bytes smem")[0].split(",")[-1].strip()) if "bytes smem" in line else 0
    assert smem <= 48 * 1024  # static shared memory of one block
    assert regs * S.THREADS <= 65536


@needs_nvrtc
def test_bench_kernels_compile():
    """The variants kept in bench/kernels/ (out of the serving path) still build on the engine's
    sources (NVRTC, --Ofast-compile=max: a compile check, not a build to run)."""
    src = kernels.CSRC.parents[3] / "bench" / "kernels" / "flash_decode_variants.cu"
    names = B.nvrtc().compile(src, "sm_90", (f"-I{kernels.CSRC}", "--Ofast-compile=max")).decode("latin-1")
    for v in ("flash8", "flashq8"):
        assert f"attn_{v}_hd128_g4" in names and f"attn_{v}_combine_hd128" in names
    assert "attn_flashmma_hd128_g4" in names
    # the first fp8-KV attention kernels (bench.kernels.fp8kv_attention), and only those
    src = src.with_name("fp8kv_variants.cu")
    names = B.nvrtc().compile(src, "sm_90", (f"-I{kernels.CSRC}", "--Ofast-compile=max")).decode("latin-1")
    for k in ("attn_flashq_hd128_g4_fp8tile", "attn_flashmma_hd128_g4_fp8tile", "attn_prefill_fa2_hd128_fp8tile"):
        assert k in names, k
    assert "attn_flashq_hd128_g4_fp8kv" not in names and "attn_flashq_combine_hd128" not in names


def test_kernel_signatures_file_is_fresh():
    """kernel_params.json (what launches are checked against; serving needs no nvcc) matches the
    sources: each entry's key, and, where nvcc exists, its preprocessor's view of every kernel."""
    for s in kernels.PARAM_SOURCES:
        assert kernels.signatures(s), s  # raises when the source changed since the file was made
    if shutil.which("nvcc") or pathlib.Path("/usr/local/cuda/bin/nvcc").exists():
        assert kernels.PARAMS_FILE.read_text() == kernels.render_params(), (
            "run python -m blink.gpu.build_kernels --params"
        )


@needs_nvrtc
def test_cache_key_tracks_source_arch_and_options(tmp_path: pathlib.Path):
    a = kernels.build("sampling.cu", tmp_path, 90)
    assert kernels.build("sampling.cu", tmp_path, 90) == a  # cached
    assert a.name.startswith("sampling-sm_90-")
    v = B.nvrtc().version
    u = kernels.UNITS["sampling.cu"]
    assert u.key("sm_90", v) != kernels.UNITS["moe.cu"].key("sm_90", v)
    assert u.key("sm_90", v) != u.key("sm_80", v) != B.Unit(u.source, u.deps, ("-lineinfo",)).key("sm_80", v)
    assert (
        u.key("sm_90", (13, 0)) == u.key("sm_90", (13, 5)) != u.key("sm_90", (12, 9))
    )  # a cache carries across minors


@needs_nvrtc
def test_gpu_newer_than_nvrtc_gets_ptx_older_ones_a_message(tmp_path: pathlib.Path):
    archs = B.nvrtc().archs
    assert B.target_for(90, archs) == "sm_90" and B.target_for(86, archs) == "sm_86"
    assert B.target_for(999, archs) == f"compute_{max(archs)}"
    ptx = B.build(kernels.UNITS["sampling.cu"], "compute_80", tmp_path)
    assert ptx.suffix == ".ptx" and b".entry sample_tokens" in ptx.read_bytes()
    with pytest.raises(B.BuildError, match="compute capability 7.5; Blink needs 8.0"):
        B.target_for(75, archs)


def test_missing_nvrtc_names_the_install_command(monkeypatch):
    monkeypatch.setattr(B, "find_nvrtc", lambda: None)
    with pytest.raises(B.BuildError, match=r"pip install 'blink-serve\[cu13\]'"):
        kernels.build("sampling.cu", "/nonexistent", 90)


def test_default_cache_is_the_checkout_or_the_user_cache(monkeypatch, tmp_path: pathlib.Path):
    assert B.default_cache_dir() == B.GPU_DIR.parents[1] / "build" / "kernels"  # a source checkout
    monkeypatch.setattr(B, "GPU_DIR", tmp_path / "site-packages" / "blink" / "gpu")  # an installed wheel
    assert B.default_cache_dir("/xdg") == pathlib.Path("/xdg/blink/kernels")
    assert B.default_cache_dir(None) == pathlib.Path.home() / ".cache" / "blink" / "kernels"


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38, 1e-40], np.float32)
    # 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0)
    got = bf16_bits_to_f32(f32_to_bf16_bits(x))
    assert got[0] == 1.0 and got[1] == 1.0 and got[2] == 1.015625 and got[3] == -2.5
    rng = np.random.default_rng(0)
    y = rng.standard_normal(10000).astype(np.float32)
    r = bf16_bits_to_f32(f32_to_bf16_bits(y))
    assert np.all(np.abs(r - y) <= np.abs(y) * 2.0**-8)


def test_bucket_lookup_tables():
    bb = _buckets((1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 512), 200)
    assert bb == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 200)  # capped, cap added
    tab = bucket_of(bb, 200)
    for n in range(1, 201):
        assert bb[tab[n]] >= n and (tab[n] == 0 or bb[tab[n] - 1] < n)
    with pytest.raises(ValueError):
        bucket_of((1, 4, 2), 4)


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError):
        EngineConfig(execs_per_shape=1)
    with pytest.raises(ValueError):
        EngineConfig(max_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError):
        EngineConfig(max_context=1000, block_size=16)


# ---------------------------------------------------------------- flash decode index math (CPU)
# A lane-level numpy model of flash_decode.cu (grid split choice, run-time chunks, warp tiles,
# the reduce-scatter of the scores, the per-warp probability array, the warp and split merges):
# run against plain softmax attention, so an index slip fails here before the GPU run.


def _flash_chunk(L: int, ns: int, grid_splits: int, nkv: int, target: int, quantum: int) -> int:
    per = max(1, ns * nkv)
    units = max(1, -(-L // quantum))
    best_q, best_cost = units, -(-per // target) * (units + 1)
    for n in range(2, min(grid_splits, units) + 1):
        q = -(-units // n)
        used = -(-units // q)
        cost = -(-(per * used) // target) * (q + 1)
        if cost < best_cost:
            best_q, best_cost = q, cost
    return best_q * quantum


def _flash_cta(q, kc, vc, bt, kvh, start, end, HD, G, N):
    """One CTA: returns (o [G, HD] normalised, lse [G]) over keys start..end-1 of one KV head."""
    from blink.gpu.engine.attention_launch import FLASH_WARPS

    LPT, lane = HD // 8, np.arange(32)
    KPI = 32 // LPT
    KT, NW, bs = N * KPI, FLASH_WARPS, kc.shape[1]
    LOG_LPT, LOG_N = LPT.bit_length() - 1, N.bit_length() - 1
    STEPS = min(LOG_N, LOG_LPT)
    R, DUP = N >> STEPS, LOG_LPT - STEPS
    c, h = lane % LPT, lane // LPT
    qr = np.stack([q[g][c[:, None] * 8 + np.arange(8)] for g in range(G)])  # [G, 32, 8]
    wm, wl, wo = np.full((NW, G), -np.inf), np.zeros((NW, G)), np.zeros((NW, G, HD))
    ib, owner = (c >> DUP) * R, (c & ((1 << DUP) - 1)) == 0
    for warp in range(NW):
        m, lsum, acc = np.full(G, -np.inf), np.zeros(G), np.zeros((G, 32, 8))
        for t0 in range(start + warp * KT, end, NW * KT):
            kr, vr = np.zeros((N, 32, 8)), np.zeros((N, 32, 8))
            for i in range(N):
                t = t0 + KPI * i + h
                for ln in range(32):
                    if t[ln] < end:
                        blk, row = bt[t[ln] // bs], t[ln] % bs
                        kr[i, ln] = kc[blk, row, kvh, c[ln] * 8 : c[ln] * 8 + 8]
                        vr[i, ln] = vc[blk, row, kvh, c[ln] * 8 : c[ln] * 8 + 8]
            sc = [[(qr[g] * kr[i]).sum(axis=1) for i in range(N)] for g in range(G)]  # [g][i] -> (32,)
            for st in range(STEPS):
                w, mask = N >> (st + 1), (LPT >> 1) >> st
                up = (lane & mask) != 0
                for g in range(G):
                    for j in range(w):
                        send = np.where(up, sc[g][j], sc[g][j + w])
                        keep = np.where(up, sc[g][j + w], sc[g][j])
                        sc[g][j] = keep + send[lane ^ mask]
            mask = (LPT >> 1) >> STEPS
            while mask > 0:
                for g in range(G):
                    for j in range(R):
                        sc[g][j] = sc[g][j] + sc[g][j][lane ^ mask]
                mask >>= 1
            ps = np.full((KT, G), np.nan)
            for g in range(G):
                for j in range(R):
                    sc[g][j] = np.where(t0 + KPI * (ib + j) + h >= end, -np.inf, sc[g][j])
                m_new = max(m[g], max(sc[g][j].max() for j in range(R)))
                alpha = np.exp2(m[g] - m_new)
                total = 0.0
                for j in range(R):
                    p = np.exp2(sc[g][j] - m_new)
                    total += p[owner].sum()
                    keys = KPI * (ib + j) + h
                    assert np.isnan(ps[keys[owner], g]).all()  # each key stored by exactly one lane
                    ps[keys[owner], g] = p[owner]
                lsum[g] = lsum[g] * alpha + total
                m[g] = m_new
                acc[g] *= alpha
            assert not np.isnan(ps).any()
            for i in range(N):
                acc += ps[KPI * i + h].T[:, :, None] * vr[i][None]
        summed = np.zeros((G, HD))
        for ln in range(32):
            summed[:, c[ln] * 8 : c[ln] * 8 + 8] += acc[:, ln]
        wm[warp], wl[warp], wo[warp] = m, lsum, summed
    M = wm.max(axis=0)
    f = np.where(wl > 0, np.exp2(wm - M), 0.0)
    den = (f * wl).sum(axis=0)
    return (f[:, :, None] * wo).sum(axis=0) / den[:, None], M + np.log2(den)


# N = 4: flashq (its cp.async ring only changes where the loads go); N = 8: bench/kernels' flash8/flashq8
@pytest.mark.parametrize("N,occ", [(4, 3), (8, 2)], ids=["flashq", "flash8"])
@pytest.mark.parametrize("hd,G", [(16, 2), (32, 3), (64, 1), (128, 4)])
def test_flash_decode_index_math(N: int, occ: int, hd: int, G: int):
    from blink.gpu.engine.attention_launch import flash_grid_splits, flash_quantum

    rng = np.random.default_rng(hd + G)
    nkv, bs, max_context, sms = 2, 8, 512, 6
    target = sms * occ
    lens = [1, 37, 300] if hd == 128 else [5, 150]
    S = len(lens)
    mbps = max_context // bs
    nblocks = S * mbps
    kc = rng.standard_normal((nblocks, bs, nkv, hd))
    vc = rng.standard_normal((nblocks, bs, nkv, hd))
    bts = rng.permutation(nblocks).reshape(S, mbps)  # shuffled paged tables
    q = rng.standard_normal((S, nkv * G, hd)) * (1.0 / hd**0.5) * 1.4426950408889634
    ns_grid = flash_grid_splits(S, nkv, hd, max_context, target, N, 32)
    quantum = flash_quantum(hd, N)
    multi = False
    for s, L in enumerate(lens):
        chunk = _flash_chunk(L, S, ns_grid, nkv, target, quantum)
        nused = -(-L // chunk)
        assert nused <= ns_grid and chunk % quantum == 0
        multi |= nused > 1
        for kvh in range(nkv):
            parts = []
            for split in range(ns_grid):
                start = split * chunk
                if start >= L:
                    continue  # the CTA exits
                parts.append(
                    _flash_cta(q[s, kvh * G : kvh * G + G], kc, vc, bts[s], kvh, start, min(L, start + chunk), hd, G, N)
                )
            assert len(parts) == nused
            lse = np.stack([p[1] for p in parts])  # combine: 2^(lse_i - M) weights
            w = np.exp2(lse - lse.max(axis=0))
            got = (w[:, :, None] * np.stack([p[0] for p in parts])).sum(axis=0) / w.sum(axis=0)[:, None]
            rows = bts[s][np.arange(L) // bs], np.arange(L) % bs
            K, V = kc[rows[0], rows[1], kvh], vc[rows[0], rows[1], kvh]  # [L, hd]
            sc = q[s, kvh * G : kvh * G + G] @ K.T
            p = np.exp2(sc - sc.max(axis=1, keepdims=True))
            want = (p / p.sum(axis=1, keepdims=True)) @ V
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    assert multi  # the split + combine path was exercised


def test_flash_launches_per_bucket():
    """Forward's flash launches (no GPU: a recording _launch): one wave of CTAs at batch 1 with a
    combine, one split and no combine at batch 256 (test_gpu_fusion_plan checks every launch's
    arguments against the kernels' signatures)."""
    from types import SimpleNamespace

    from blink.gpu.engine.attention_launch import FLASHMMA_MIN_BATCH, flash_smem_bytes
    from blink.gpu.engine.forward import Dims, Forward
    from blink.models.config import preset

    fake = SimpleNamespace(data=SimpleNamespace(ptr=4096))
    f = object.__new__(Forward)
    f.c, f.num_sms, f.max_splits, f.kv_suffix = preset("llama3-8b"), 132, 32, ""
    f.d = Dims(256, 256, 66, 16, 20000, 1056)
    f.arena = SimpleNamespace(ptr=dict.fromkeys(("cu_q_lens", "seq_lens", "block_tables", "num_seqs"), 8192))
    f.q = f.part_o = f.part_ml = f.attn = fake
    f.decode_kernels = {v: f"attn_{v}_hd128_g4" for v in FLASH_VARIANTS}
    f.flash_combine = {v: f"attn_{FLASH_COMBINE_OF[v]}_combine_hd128" for v in FLASH_VARIANTS}
    f.flash_smem = {v: flash_smem_bytes(v, 128) for v in FLASH_VARIANTS}
    calls: list = []
    f._launch = lambda name, grid, block, stream, smem=0, **args: calls.append((name, grid, len(args), smem))
    f._record_flash(0, 1, "flashq", 1 << 20, 2 << 20, 0.1)
    assert calls == [("attn_flashq_hd128_g4", (32, 8, 1), 15, 65536), ("attn_flashq_combine_hd128", (8, 1, 1), 10, 0)]
    calls.clear()
    f._record_flash(0, 256, "flashq", 1 << 20, 2 << 20, 0.1)
    assert calls == [("attn_flashq_hd128_g4", (1, 8, 256), 15, 65536)]
    calls.clear()
    f._record_flash(0, 1, "flashmma", 1 << 20, 2 << 20, 0.1)  # flashq's splits and combine, its own smem
    assert calls == [("attn_flashmma_hd128_g4", (32, 8, 1), 15, 73984), ("attn_flashq_combine_hd128", (8, 1, 1), 10, 0)]
    f._decode_override = None  # the serving choice: flashq below FLASHMMA_MIN_BATCH, flashmma from there
    assert FLASHMMA_MIN_BATCH == 128
    assert [f.decode_variant(b) for b in (1, 127, 128, 256)] == ["flashq", "flashq", "flashmma", "flashmma"]


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("ntiles", [0, 1, 2, 5, 11])
def test_flash_cp_async_ring_order(stages: int, ntiles: int):
    """The cp.async ring of flashq/flashq8 as flash_decode.cu drives it: copies land only when a
    wait_group retires their group; each tile is read from the slot it was copied to, after its
    group retired, and no slot is refilled before its tile was read."""
    slots: list = [None] * stages
    pending: list[list[tuple[int, int]]] = []  # committed groups of (slot, tile), oldest first

    def issue(tile: int, slot: int) -> None:
        pending.append([(slot, tile)])  # one commit per issue, as in the kernel

    def wait(allowed: int) -> None:
        while len(pending) > allowed:
            for slot, tile in pending.pop(0):
                slots[slot] = tile

    unread: set[int] = set()
    for st in range(stages - 1):
        issue(st, st)
        unread.add(st)
    stage = 0
    for j in range(ntiles):
        refill = stages - 1 if stage == 0 else stage - 1
        assert refill not in unread  # the slot's previous tile (j - 1) was read already
        issue(j + stages - 1, refill)
        unread.add(refill)
        wait(stages - 1)
        assert slots[stage] == j
        unread.discard(stage)
        stage = stage + 1 if stage + 1 < stages else 0
    wait(0)


def test_decode_groups_are_the_instantiated_ones():
    """The engine accepts exactly the GQA groups whose decode kernels exist (flashq and flashmma)."""
    import re

    from blink.gpu.engine.attention_launch import DECODE_GROUPS

    src = (kernels.CSRC / "flash_decode.cu").read_text()
    flash = {int(g) for g in re.findall(r"^\s*FLASH\(flashq, HD, (\d+),", src, re.M)}
    mma = {int(g) for g in re.findall(r"^\s*FLASHMMA\(HD, (\d+)\)", src, re.M)}
    assert flash == mma == set(DECODE_GROUPS)


def test_offset_asserts_are_skipped_only_without_offsetof():
    """NVRTC 13.0 (the H200's CUDA 13.0) has no __builtin_offsetof: scheduler.cu failed to build there
    ("identifier __builtin_offsetof is undefined"). Its <stddef.h> then lacks offsetof, and every
    generated offset assert sits under `#ifdef offsetof`; sizes are always asserted."""
    import re

    from blink.gpu.toolchain import build

    assert "offsetof" not in build.rtc_headers((13, 0))["stddef.h"]
    assert "__builtin_offsetof" in build.rtc_headers((13, 5))["stddef.h"]
    for path in [*kernels.INCLUDE.glob("*.h"), *kernels.CSRC.glob("*.cu*"), *S.CSRC.glob("*.[ch]*")]:
        depth = 0
        for line in path.read_text().splitlines():
            if line.startswith("#ifdef offsetof"):
                depth += 1
            elif line.startswith("#endif") and depth:
                depth -= 1
            elif re.search(r"static_assert\(offsetof", line):
                assert depth, f"{path.name}: an offsetof assert outside #ifdef offsetof: {line}"
