"""Decode attention variants retired from the engine, against the engine's own (flashq).

llm.c dev/cuda style: each variant stays runnable with its own small benchmark, out of the serving
path. bench/kernels/flash_decode_variants.cu holds "flash8" and "flashq8" (flash_decode.cu's
template with 8 K + 8 V vectors per lane per tile) and "flashmma" (the G query heads of a KV head as
the rows of mma.sync tiles: tensor cores instead of fp32 FMAs; its splits are merged by flashq's
combine kernel). This script builds them, runs each with the
engine's launch geometry (grid splits from blink.gpu.engine.attention_launch) on random bf16 data in a
paged KV cache with shuffled blocks, checks its output against flashq's (and flashq against a
float64 numpy reference at batch 1), and times every kernel with its combine.

    python bench/kernels/decode_attention.py [--batches 1,8,64,256] [--context 1024] [--out F.json]

Needs an NVIDIA GPU, CuPy and NVRTC. Shape: Llama-3-8B (32 query heads, 8 KV heads, head dim 128).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib

import numpy as np

from bench.common import add_commit_arg, metadata
from blink.gpu.engine.attention_launch import flash_grid_splits
from blink.gpu.toolchain import kernels
from blink.gpu.toolchain.cuda_api import Driver

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "flash_decode_variants.cu"
# variant -> (K/V vectors per lane per tile, CTAs per SM it is compiled for at G = 4, cp.async stages)
VARIANTS = {"flashq": (4, 3, 4), "flash8": (8, 2, 0), "flashq8": (8, 2, 3), "flashmma": (4, 3, 0)}
MMA_SMEM = (16 + 4 * 64) * (128 + 8) * 2  # flashmma_smem(HD) in flash_decode_variants.cu
NQ, NKV, HD, BS = 32, 8, 128, 16


def build() -> pathlib.Path:
    """The variants' cubin for this GPU (NVRTC, as the engine's), cached beside the engine's."""
    from blink.gpu.toolchain import build as B

    rtc = B.nvrtc()
    target = B.target_for(kernels.device_arch(), rtc.archs)
    key = hashlib.sha256(kernels.source_key("flash_decode.cu").encode() + SOURCE.read_bytes()).hexdigest()[:16]
    out = kernels.DEFAULT_CACHE / f"flash_decode_variants-{target}-{key}.cubin"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(rtc.compile(SOURCE, target, (f"-I{kernels.CSRC}",)))
    return out


def randn_bf16(cp: object, shape: tuple[int, ...]) -> object:
    """N(0, 1) as bf16 bit patterns (uint16), made on the GPU."""
    x = cp.random.standard_normal(shape, dtype=cp.float32)  # type: ignore[attr-defined]
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)  # type: ignore[attr-defined]


def f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="")
    add_commit_arg(ap)
    a = ap.parse_args()
    import cupy as cp

    cp.zeros(1)
    drv = Driver()
    eng_k = kernels.Kernels(drv)
    mod = drv.module_load(str(build()))
    sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    params = eng_k.params[f"attn_flashq_hd{HD}_g{NQ // NKV}"]
    comb_params = eng_k.params[f"attn_flashq_combine_hd{HD}"]
    fn = {"flashq": (eng_k[f"attn_flashq_hd{HD}_g4"], eng_k[f"attn_flashq_combine_hd{HD}"])}
    for v in ("flash8", "flashq8"):
        fn[v] = (drv.get_function(mod, f"attn_{v}_hd{HD}_g4"), drv.get_function(mod, f"attn_{v}_combine_hd{HD}"))
    fn["flashmma"] = (drv.get_function(mod, f"attn_flashmma_hd{HD}_g4"), fn["flashq"][1])
    smem = {v: 4 * st * 2 * n * 32 * 16 for v, (n, _, st) in VARIANTS.items()}
    smem["flashmma"] = MMA_SMEM
    for v, (f, _) in fn.items():
        if smem[v]:
            drv.set_max_dynamic_smem(f, smem[v])
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    L, mbps = a.context, a.context // BS
    rows = []
    bad = 0  # variants whose output differs from flashq's (each is still timed and reported)
    for S in (int(b) for b in a.batches.split(",")):
        nblocks = S * mbps
        q, kc, vc = (randn_bf16(cp, shape) for shape in ((S, NQ * HD), (nblocks, BS, NKV, HD), (nblocks, BS, NKV, HD)))
        bt = cp.asarray(rng.permutation(nblocks).astype(np.int32).reshape(S, mbps))
        sl = cp.full(S, L, cp.int32)
        cu = cp.arange(S + 1, dtype=cp.int32)
        ns = cp.asarray(np.array([S], np.uint32))
        po = cp.zeros(S * 32 * NQ * HD, cp.float32)
        plse = cp.zeros(S * 32 * NQ, cp.float32)
        sc = (1.0 / HD**0.5) * 1.4426950408889634
        cp.cuda.Device().synchronize()  # the data came from CuPy's stream; the kernels run on `stream`
        outs, times = {}, {}
        for v, (n, minb, _) in VARIANTS.items():
            target = sms * minb
            nsplit = flash_grid_splits(S, NKV, HD, L, target, n, 32)
            out = cp.zeros((S, NQ * HD), cp.uint16)
            common = dict(po=po, plse=plse, out=out, cu=cu, sl=sl, ns=ns, nkv=NKV, target=target)
            args = kernels.pack_args(v, params, dict(q=q, kc=kc, vc=vc, bt=bt, bs=BS, mbps=mbps, sc=sc, **common))
            cargs = kernels.pack_args(v, comb_params, dict(nq=NQ, grid_splits=nsplit, **common))

            def run(v=v, args=args, cargs=cargs, nsplit=nsplit, S=S) -> None:
                drv.launch(fn[v][0], (nsplit, NKV, S), (128, 1, 1), args, stream.ptr, smem[v], v)
                if nsplit > 1:
                    drv.launch(fn[v][1], (-(-NQ // 4), S, 1), (128, 1, 1), cargs, stream.ptr, 0, v)

            run()
            stream.synchronize()
            outs[v] = f32(out.get())
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            for _ in range(a.iters):
                run()
            e1.record(stream)
            e1.synchronize()
            times[v] = cp.cuda.get_elapsed_time(e0, e1) / a.iters
        if S == 1:  # flashq against float64 attention over the gathered context
            k = f32(kc.get())[bt.get()[0]].reshape(L, NKV, HD).astype(np.float64)
            vv = f32(vc.get())[bt.get()[0]].reshape(L, NKV, HD).astype(np.float64)
            qq = f32(q.get())[0].reshape(NQ, HD).astype(np.float64)
            g = np.repeat(np.arange(NKV), NQ // NKV)
            s = np.einsum("hd,lhd->hl", qq, k[:, g]) / HD**0.5
            p = np.exp(s - s.max(1, keepdims=True))
            want = np.einsum("hl,lhd->hd", p / p.sum(1, keepdims=True), vv[:, g]).reshape(-1)
            err = float(np.abs(outs["flashq"][0] - want).max())
            assert err < 2e-2, f"flashq vs float64: {err}"
        for v in VARIANTS:
            err = float(np.abs(outs[v] - outs["flashq"]).max())
            rows.append({"batch": S, "variant": v, "ms": times[v], "max_abs_diff_vs_flashq": err})
            ok = bool(err < 2e-2)
            rows[-1]["matches_flashq"] = ok
            bad += not ok
            print(
                f"batch {S:4d}  {v:8s} {times[v]:8.4f} ms/layer  |diff vs flashq| {err:.2e}{'' if ok else '  MISMATCH'}"
            )
    if a.out:
        res = metadata(a.commit)
        res |= {"context": L, "shape": {"nq": NQ, "nkv": NKV, "head_dim": HD}, "rows": rows}
        pathlib.Path(a.out).write_text(json.dumps(res, indent=1))
    if bad:
        raise SystemExit(f"{bad} variant runs differ from flashq")


if __name__ == "__main__":
    main()
