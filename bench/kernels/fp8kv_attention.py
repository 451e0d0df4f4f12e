"""Attention over an fp8 KV cache: the engine's _fp8kv kernels against the first fp8 kernels and the bf16 cache.

Three ways to read the same K/V values (random e4m3 codes; the bf16 cache holds their exact values):
  bf16      the engine's bf16 kernels (attn_flashq/flashmma/prefill_fa2_hd128_g4) on the bf16 cache;
  fp8_tile  the first fp8 kernels (bench/kernels/fp8kv_variants.cu, kv_cache.cuh KvFp8Tile): synchronous
            8-code loads decoded into the bf16 tiles;
  fp8       the engine's _fp8kv kernels (KvFp8): the codes by 16-byte cp.async, decoded once.
Decode attention (flashq and flashmma, each with its combine, the engine's launch geometry: grid splits
from blink.gpu.engine.attention_launch) at batch 1, 32, 128, 256 and context 1024, 4096; prefill
attention (fa2) over one prompt of 1024 and 4096 tokens. Each row: milliseconds, the K/V bytes the
kernel reads from the cache and their fraction of the copy bandwidth, and the largest difference of
its output from the bf16 kernel's and from float64 attention (batch 1 and prefill rows). Exits non-zero
when an fp8 kernel's output is off (|diff| >= 2e-2 against float64 or the bf16 kernel).

    python -m bench.kernels.fp8kv_attention --out DIR [--commit SHA] [--batches 1,32,128,256]
        [--contexts 1024,4096] [--prompts 1024,4096] [--iters 20]

writes DIR/fp8kv_attention-<gpu>-<commit>.json. Needs an NVIDIA GPU, CuPy and NVRTC. Shape: Llama-3-8B
(32 query heads, 8 KV heads, head dim 128), block size 16, blocks shuffled.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.common import add_commit_arg, copy_bandwidth, metadata, short_device, time_ms, write_json
from blink.gpu.engine.attention_launch import (
    FLASH_VARIANTS,
    FLASH_WARPS,
    PREFILL_TILE,
    flash_grid_splits,
    flash_smem_bytes,
)
from blink.gpu.toolchain import kernels
from blink.models import fp8
from blink.models.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "fp8kv_variants.cu"
NQ, NKV, HD, BS = 32, 8, 128, 16
G = NQ // NKV
KVS = ("bf16", "fp8_tile", "fp8")
TOL = 2e-2
PREFILL_SMEM = 5 * 64 * (HD + 8) * 2  # attention_launch: Q + 2 stages of K and V tiles


def build() -> pathlib.Path:
    """The fp8_tile kernels' cubin for this GPU (NVRTC, as the engine's), cached beside the engine's."""
    from blink.gpu.toolchain import build as B

    rtc = B.nvrtc()
    target = B.target_for(kernels.device_arch(), rtc.archs)
    key = hashlib.sha256(
        (kernels.source_key("flash_decode.cu") + kernels.source_key("prefill_attention.cu")).encode()
        + SOURCE.read_bytes()
    ).hexdigest()[:16]
    out = kernels.DEFAULT_CACHE / f"fp8kv_variants-{target}-{key}.cubin"
    if not out.exists():
        unit = kernels.UNITS["flash_decode.cu"]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(rtc.compile(SOURCE, target, (*unit.options, f"-I{kernels.CSRC}"), unit.include_dirs()))
    return out


def random_cache(cp: Any, nblocks: int, seed: int) -> dict[str, Any]:
    """K and V of `nblocks` blocks as e4m3 codes with |value| <= 3.75 (exponent field <= 8, either sign),
    and the same values as bf16 bits."""
    rs = cp.random.RandomState(seed)
    n = nblocks * BS * NKV * HD
    table = cp.asarray(f32_to_bf16_bits(fp8.E4M3_VALUES[:256].copy()).astype(np.uint16))
    out = {}
    for name in ("k", "v"):
        b = rs.randint(0, 2**31 - 1, size=n // 4, dtype=cp.int32).view(cp.uint8)
        codes = ((b & 0x80) | ((b & 0x7F) % 72)).astype(cp.uint8)
        out[name + "8"] = codes.reshape(nblocks, BS, NKV, HD)
        out[name + "16"] = table[codes].reshape(nblocks, BS, NKV, HD)
    return out


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal_from: int | None) -> np.ndarray:
    """float64 attention of queries q (T, NQ, HD) over keys/values (L, NKV, HD) of one sequence; the
    query t sees keys 0..causal_from + t (causal_from None: every key)."""
    g = np.repeat(np.arange(NKV), G)
    s = np.einsum("thd,lhd->thl", q, k[:, g]) / HD**0.5
    if causal_from is not None:
        t, L = np.arange(q.shape[0])[:, None], np.arange(k.shape[0])[None, :]
        s = np.where((L <= causal_from + t)[:, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("thl,lhd->thd", p / p.sum(-1, keepdims=True), v[:, g])


class Rig:
    """The engine's kernels and the fp8_tile variants, launched by name on CuPy arrays."""

    def __init__(self) -> None:
        import cupy as cp

        from blink.gpu.toolchain.cuda_api import Driver

        cp.zeros(1)
        self.cp = cp
        self.drv = Driver()
        self.eng = kernels.Kernels(self.drv)
        self.mod = self.drv.module_load(str(build()))
        self.sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.fns: dict[str, int] = {}

    def fn(self, name: str, smem: int) -> int:
        if name not in self.fns:
            f = self.drv.get_function(self.mod, name) if name.endswith("_fp8tile") else self.eng[name]
            if smem:
                self.drv.set_max_dynamic_smem(f, smem)
            self.fns[name] = f
        return self.fns[name]

    def launcher(self, name: str, sig: str, grid: tuple, smem: int, **args: Any) -> Callable[[], None]:
        """A closure launching kernel `name` (whose parameters are engine kernel `sig`'s) on the stream."""
        f = self.fn(name, smem)
        packed = kernels.pack_args(name, self.eng.params[sig], args)
        return lambda: self.drv.launch(f, grid, (32 * FLASH_WARPS, 1, 1), packed, self.stream.ptr, smem, name)


def kernel_name(kind: str, kv: str) -> tuple[str, str]:
    """(kernel, engine kernel with its signature) of a decode variant ("flashq", "flashmma") or "prefill"."""
    base = f"attn_prefill_fa2_hd{HD}" if kind == "prefill" else f"attn_{kind}_hd{HD}_g{G}"
    sfx = {"bf16": "", "fp8_tile": "_fp8tile", "fp8": "_fp8kv"}[kv]
    return base + sfx, base + ("_fp8kv" if kv != "bf16" else "")


def decode_rows(rig: Rig, cache: dict, S: int, L: int, iters: int, bw: dict, rng: np.random.Generator) -> list[dict]:
    cp = rig.cp
    mbps = L // BS
    nblocks = cache["k8"].shape[0]
    bt_np = rng.permutation(nblocks)[: S * mbps].astype(np.int32).reshape(S, mbps)
    q = cp.asarray(f32_to_bf16_bits(rng.standard_normal((S, NQ * HD)).astype(np.float32)))
    d = dict(
        q=q, bt=cp.asarray(bt_np), sl=cp.full(S, L, cp.int32), cu=cp.arange(S + 1, dtype=cp.int32),
        ns=cp.asarray(np.array([S], np.uint32)), po=cp.zeros(S * 32 * NQ * HD, cp.float32),
        plse=cp.zeros(S * 32 * NQ, cp.float32),
    )  # fmt: skip
    want = None
    if S == 1:
        k = bf16_bits_to_f32(cp.asnumpy(cache["k16"][cp.asarray(bt_np[0])])).reshape(L, NKV, HD).astype(np.float64)
        v = bf16_bits_to_f32(cp.asnumpy(cache["v16"][cp.asarray(bt_np[0])])).reshape(L, NKV, HD).astype(np.float64)
        qq = bf16_bits_to_f32(cp.asnumpy(q)).reshape(1, NQ, HD).astype(np.float64)
        want = reference(qq, k, v, None).reshape(1, -1)
    sc = (1.0 / HD**0.5) * 1.4426950408889634
    rows, outs = [], {}
    kv_elems = S * L * NKV * HD * 2
    for variant in ("flashq", "flashmma"):
        n, minb, _ = FLASH_VARIANTS[variant]
        target = rig.sms * minb
        nsplit = flash_grid_splits(S, NKV, HD, L, target, n, 32)
        smem = flash_smem_bytes(variant, HD)
        for kv in KVS:
            name, sig = kernel_name(variant, kv)
            kc, vc = (cache["k16"], cache["v16"]) if kv == "bf16" else (cache["k8"], cache["v8"])
            out = cp.zeros((S, NQ * HD), cp.uint16)
            common = dict(
                po=d["po"], plse=d["plse"], out=out, cu=d["cu"], sl=d["sl"], ns=d["ns"], nkv=NKV, target=target
            )
            attn = rig.launcher(
                name, sig, (nsplit, NKV, S), smem, q=d["q"], kc=kc, vc=vc, bt=d["bt"], bs=BS, mbps=mbps, sc=sc, **common
            )
            comb_name = f"attn_flashq_combine_hd{HD}"
            comb = rig.launcher(comb_name, comb_name, (-(-NQ // 4), S, 1), 0, nq=NQ, grid_splits=nsplit, **common)

            def run(attn: Callable[[], None] = attn, comb: Callable[[], None] = comb, nsplit: int = nsplit) -> None:
                attn()
                if nsplit > 1:
                    comb()

            cp.cuda.Device().synchronize()
            run()
            rig.stream.synchronize()
            outs[kv] = bf16_bits_to_f32(cp.asnumpy(out))
            ms = time_ms(run, rig.stream, iters=iters)
            nbytes = kv_elems * (2 if kv == "bf16" else 1)
            row = {
                "batch": S, "context": L, "kernel": variant, "kv": kv, "splits": nsplit, "ms": ms, "kv_bytes": nbytes,
                "GBps": nbytes / ms / 1e6, "frac_of_copy_bw": nbytes / ms / 1e6 / bw["read_plus_write_GBps"],
            }  # fmt: skip
            if kv != "bf16":
                row["max_abs_diff_vs_bf16"] = float(np.abs(outs[kv] - outs["bf16"]).max())
            if want is not None:
                row["max_abs_diff_vs_float64"] = float(np.abs(outs[kv] - want).max())
            rows.append(row)
    return rows


def prefill_rows(rig: Rig, cache: dict, T: int, iters: int, bw: dict, rng: np.random.Generator) -> list[dict]:
    """One sequence of T new tokens (no cached prefix): fa2 over the tokens' own K/V."""
    cp = rig.cp
    mbps = T // BS
    bt_np = rng.permutation(cache["k8"].shape[0])[:mbps].astype(np.int32).reshape(1, mbps)
    q = cp.asarray(f32_to_bf16_bits(rng.standard_normal((T, NQ * HD)).astype(np.float32)))
    d = dict(bt=cp.asarray(bt_np), sl=cp.full(1, T, cp.int32), cu=cp.asarray(np.array([0, T], np.int32)))
    k = bf16_bits_to_f32(cp.asnumpy(cache["k16"][cp.asarray(bt_np[0])])).reshape(T, NKV, HD).astype(np.float64)
    v = bf16_bits_to_f32(cp.asnumpy(cache["v16"][cp.asarray(bt_np[0])])).reshape(T, NKV, HD).astype(np.float64)
    rows_checked = np.unique(np.linspace(0, T - 1, 64).astype(int))  # float64 reference on these queries
    qq = bf16_bits_to_f32(cp.asnumpy(q)).reshape(T, NQ, HD).astype(np.float64)
    want = np.stack([reference(qq[t : t + 1], k[: t + 1], v[: t + 1], None)[0] for t in rows_checked])
    sc = (1.0 / HD**0.5) * 1.4426950408889634
    rows, outs = [], {}
    flops = 4 * NQ * HD * T * (T + 1) / 2  # QK^T and PV over the causal half
    for kv in KVS:
        name, sig = kernel_name("prefill", kv)
        kc, vc = (cache["k16"], cache["v16"]) if kv == "bf16" else (cache["k8"], cache["v8"])
        out = cp.zeros((T, NQ * HD), cp.uint16)
        run = rig.launcher(
            name, sig, (T // PREFILL_TILE + 1, NQ, 1), PREFILL_SMEM, q=q, kc=kc, vc=vc, out=out, cu=d["cu"], sl=d["sl"],
            bt=d["bt"], ns=cp.asarray(np.array([1], np.uint32)), nkv=NKV, bs=BS, mbps=mbps, sc=sc,
        )  # fmt: skip
        cp.cuda.Device().synchronize()
        run()
        rig.stream.synchronize()
        outs[kv] = bf16_bits_to_f32(cp.asnumpy(out)).reshape(T, NQ, HD)
        ms = time_ms(run, rig.stream, iters=iters)
        nbytes = T * NKV * HD * 2 * (2 if kv == "bf16" else 1)
        row = {
            "tokens": T, "kernel": "fa2", "kv": kv, "ms": ms, "TFLOPs": flops / ms / 1e9, "kv_bytes": nbytes,
            "frac_of_copy_bw": nbytes / ms / 1e6 / bw["read_plus_write_GBps"],
            "max_abs_diff_vs_float64": float(np.abs(outs[kv][rows_checked] - want).max()),
        }  # fmt: skip
        if kv != "bf16":
            row["max_abs_diff_vs_bf16"] = float(np.abs(outs[kv] - outs["bf16"]).max())
        rows.append(row)
    return rows


def bad_rows(rows: list[dict]) -> list[dict]:
    """The rows whose output is off: any kernel against float64, an fp8 kernel against the bf16 one."""
    keys = ("max_abs_diff_vs_float64", "max_abs_diff_vs_bf16")
    return [r for r in rows if any(not r.get(k, 0.0) < TOL for k in keys)]


def summary(rows: list[dict], key: tuple[str, ...]) -> list[dict]:
    """Per shape: the fp8 kernels' speedup over the bf16 one and the new fp8 over fp8_tile."""
    by: dict[tuple, dict[str, float]] = {}
    for r in rows:
        by.setdefault(tuple(r[k] for k in key), {})[r["kv"]] = r["ms"]
    return [
        {**dict(zip(key, k, strict=True)), "bf16_ms": t["bf16"], "fp8_tile_ms": t["fp8_tile"], "fp8_ms": t["fp8"],
         "fp8_vs_bf16": t["bf16"] / t["fp8"], "fp8_vs_fp8_tile": t["fp8_tile"] / t["fp8"]}
        for k, t in by.items()
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="results folder")
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--prompts", default="1024,4096")
    ap.add_argument("--iters", type=int, default=20)
    add_commit_arg(ap)
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    prompts = [int(x) for x in a.prompts.split(",") if x]
    rig = Rig()
    bw = copy_bandwidth()
    need = max([max(batches) * max(contexts), *prompts]) // BS
    cache = random_cache(rig.cp, need, seed=0)
    rng = np.random.default_rng(0)
    decode: list[dict] = []
    for L in contexts:
        for S in batches:
            decode += decode_rows(rig, cache, S, L, a.iters, bw, rng)
            for r in decode[-6:]:
                print(
                    f"decode batch {S:4d} ctx {L:5d} {r['kernel']:8s} {r['kv']:8s} {r['ms']:8.4f} ms "
                    f"{r['frac_of_copy_bw']:6.1%} of copy bw  diff vs bf16 {r.get('max_abs_diff_vs_bf16', 0):.1e}"
                )
    prefill: list[dict] = []
    for T in prompts:
        prefill += prefill_rows(rig, cache, T, a.iters, bw, rng)
        for r in prefill[-3:]:
            print(f"prefill {T:5d} {r['kv']:8s} {r['ms']:8.4f} ms {r['TFLOPs']:6.1f} TFLOP/s")
    res = metadata(a.commit)
    res |= {
        "shape": {"nq": NQ, "nkv": NKV, "head_dim": HD, "block_size": BS}, "copy_bandwidth": bw,
        "decode": decode, "prefill": prefill,
        "decode_summary": summary(decode, ("batch", "context", "kernel")),
        "prefill_summary": summary(prefill, ("tokens",)),
    }  # fmt: skip
    for s in res["decode_summary"] + res["prefill_summary"]:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()})
    write_json(str(pathlib.Path(a.out) / f"fp8kv_attention-{short_device(res['gpu'])}-{res['commit']}.json"), res)
    bad = bad_rows(decode + prefill)
    if bad:
        raise SystemExit(f"{len(bad)} runs off (|diff| >= {TOL}): {bad[:4]}")


if __name__ == "__main__":
    main()
