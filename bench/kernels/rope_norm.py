"""The engine's two RoPE/KV-write kernels and two add-RMSNorm kernels (blink/gpu/engine/csrc/model_kernels.cu), per model
shape and token count: "old" = rope_kv_write_warp / add_rmsnorm_rows (the earlier kernels, which
the engine keeps for few-token RoPE steps and many-token norm steps: forward.rope_kernel / norm_kernel), "new" =
rope_kv_write / add_rmsnorm.

For each shape and T (--tokens): T tokens packed from min(T, 256) sequences (T / S new tokens each
after a cached prefix of --context, shuffled block tables), random bf16 data. First both versions run
once on identical inputs and their outputs are compared bit for bit (q_out, K and V caches; residual
and normed output): "bitwise" in the table. Then each is captured as a graph of --calls launches (the
decode step's count: 32 RoPE launches into 4 rotating KV caches, 64 norms), timed over --iters graph
launches with CUDA events: microseconds per call and GB/s over the bytes a call must move (RoPE: the
qkv row in, q/k/v out, its cos/sin rows; norm: residual and delta in, residual and output out),
against this GPU's device-to-device copy bandwidth. The inputs of these graphs stay in L2 from one
call to the next below ~T = 1024 (so does the qkv a GEMM has just written in the real step): above
100 % of the copy bandwidth is possible there.

    python -m bench.kernels.rope_norm [--tokens 1,64,256,1024,4096] [--models llama3-8b,qwen3-8b,smollm2-135m,phi-4]
                              [--commit X] [--out F.json]
Needs an NVIDIA GPU, CuPy and NVRTC.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from bench.common import add_commit_arg, copy_bandwidth, git_commit, metadata, time_ms, write_json
from blink.gpu.engine.forward import rope_launch
from blink.gpu.toolchain import kernels
from blink.gpu.toolchain.cuda_api import Driver
from blink.models.config import preset

KV_LAYERS = 4  # distinct KV caches the graph's RoPE launches rotate through
BS = 16


def randn_bits(cp, shape, scale: float = 1.0):
    x = cp.random.standard_normal(shape, dtype=cp.float32) * np.float32(scale)
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)  # truncated to bf16: any bf16 values do


class Bench:
    def __init__(self, calls_rope: int, calls_norm: int, iters: int) -> None:
        import cupy as cp

        self.cp = cp
        cp.zeros(1)
        self.drv = Driver()
        self.k = kernels.Kernels(self.drv)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
        self.calls = {"rope": calls_rope, "norm": calls_norm}
        self.iters = iters

    def fn(self, name: str) -> int:
        return self.k[name]

    def launch(self, name: str, grid, block, args: dict) -> None:
        """Launch on self.stream (the caller has synchronised the device after CuPy's own work)."""
        params = self.k.params[name]
        self.drv.launch(
            self.fn(name), grid, block, kernels.pack_args(name, params, args), int(self.stream.ptr), 0, name
        )

    def graph_us(self, launches) -> float:
        """Microseconds per launch of `launches` (a list of (name, grid, block, args)) as one graph."""
        s = int(self.stream.ptr)
        self.cp.cuda.Device().synchronize()
        self.drv.begin_capture(s)
        for ln in launches:
            self.launch(*ln)
        graph = self.drv.end_capture(s)
        ex = self.drv.instantiate(graph)
        self.drv.graph_destroy(graph)
        ms = time_ms(lambda: self.drv.graph_launch(ex, s), self.stream, iters=self.iters)
        self.drv.graph_exec_destroy(ex)
        return ms * 1e3 / len(launches)

    def rope(self, cfg, T: int, context: int) -> dict:
        cp = self.cp
        nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nh, half = nq + 2 * nkv, hd // 2
        S = min(T, 256)
        lens = np.full(S, T // S)
        lens[: T % S] += 1
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        pos = np.concatenate([context + np.arange(n) for n in lens]).astype(np.int32)
        mbps = -(-(context + int(lens.max())) // BS)
        rng = np.random.default_rng(T)
        bt = rng.permutation(S * mbps).astype(np.int32).reshape(S, mbps)
        max_pos = int(pos.max()) + 1
        ang = np.arange(max_pos, dtype=np.float32)[:, None] * (1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd))[None]
        d = {
            "qkv": randn_bits(cp, (T, nh * hd), 2.0),
            "cos_tab": cp.asarray(np.cos(ang).astype(np.float32)),
            "sin_tab": cp.asarray(np.sin(ang).astype(np.float32)),
            "positions": cp.asarray(pos),
            "cu_q_lens": cp.asarray(cu),
            "block_tables": cp.asarray(bt),
            "num_tokens": cp.asarray(np.array([T], np.uint32)),
            "num_seqs": cp.asarray(np.array([S], np.uint32)),
            "q_norm_w": randn_bits(cp, (hd,)) if cfg.qk_norm else None,
            "k_norm_w": randn_bits(cp, (hd,)) if cfg.qk_norm else None,
        }
        const = dict(nq=nq, nkv=nkv, hd=hd, bs=BS, mbps=mbps, eps=cfg.rms_eps)
        kv = [cp.zeros((S * mbps, BS, nkv, hd), cp.uint16) for _ in range(2 * KV_LAYERS)]
        q_out = cp.zeros((T, nq * hd), cp.uint16)
        geo = {
            "rope_kv_write": rope_launch(nh, hd, T, self.sms),
            "rope_kv_write_warp": ((T, -(-nh // 8), 1), (256, 1, 1)),
        }

        def args(layer: int) -> dict:
            return {**d, **const, "q_out": q_out, "k_cache": kv[2 * layer], "v_cache": kv[2 * layer + 1]}

        outs = {}
        for name in geo:  # one launch each on zeroed outputs: bitwise comparison
            q_out.fill(0)
            kv[0].fill(0)
            kv[1].fill(0)
            cp.cuda.Device().synchronize()  # CuPy works on its own stream
            self.launch(name, *geo[name], args(0))
            self.stream.synchronize()
            outs[name] = [cp.asnumpy(a) for a in (q_out, kv[0], kv[1])]
        same = all(np.array_equal(a, b) for a, b in zip(*outs.values(), strict=True))
        n = self.calls["rope"]
        us = {name: self.graph_us([(name, *geo[name], args(i % KV_LAYERS)) for i in range(n)]) for name in geo}
        nbytes = 2 * T * nh * hd * 2 + T * 2 * half * 4
        return {"kernel": "rope_kv_write", "bitwise": same, "bytes": nbytes, "old_us": us["rope_kv_write_warp"],
                "new_us": us["rope_kv_write"], "grid": list(geo["rope_kv_write"][0]),
                "block": list(geo["rope_kv_write"][1])}  # fmt: skip

    def norm(self, cfg, T: int) -> dict:
        cp = self.cp
        H = cfg.hidden_size
        r0, delta = randn_bits(cp, (T, H), 3.0), randn_bits(cp, (T, H))
        w = randn_bits(cp, (H,), 0.2)
        resid, out = r0.copy(), cp.zeros((T, H), cp.uint16)
        a = {"residual": resid, "delta": delta, "w": w, "out": out, "num_tokens": cp.asarray(np.array([T], np.uint32)),
             "H": H, "eps": cfg.rms_eps}  # fmt: skip
        outs = {}
        names = ("add_rmsnorm_rows", "add_rmsnorm")
        for name in names:
            resid[...] = r0
            cp.cuda.Device().synchronize()
            self.launch(name, (T, 1, 1), (256, 1, 1), a)
            self.stream.synchronize()
            outs[name] = (cp.asnumpy(resid), cp.asnumpy(out))
        same = all(np.array_equal(x, y) for x, y in zip(*outs.values(), strict=True))
        n = self.calls["norm"]
        us = {name: self.graph_us([(name, (T, 1, 1), (256, 1, 1), a)] * n) for name in names}
        return {"kernel": "add_rmsnorm", "bitwise": same, "bytes": 4 * T * H * 2, "old_us": us["add_rmsnorm_rows"],
                "new_us": us["add_rmsnorm"], "grid": [T, 1, 1], "block": [256, 1, 1]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,64,256,1024,4096")
    ap.add_argument("--models", default="llama3-8b,qwen3-8b,smollm2-135m,phi-4")
    ap.add_argument("--context", type=int, default=320, help="cached tokens before each sequence's new ones")
    ap.add_argument("--rope-calls", type=int, default=32, help="RoPE launches per timed graph")
    ap.add_argument("--norm-calls", type=int, default=64, help="norm launches per timed graph")
    ap.add_argument("--iters", type=int, default=20)
    add_commit_arg(ap)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    b = Bench(a.rope_calls, a.norm_calls, a.iters)
    bw = copy_bandwidth(1 << 30)
    gbps_copy = bw["read_plus_write_GBps"]
    rows = []
    print(f"copy bandwidth {gbps_copy:.0f} GB/s (read + write)")
    print(
        f"{'model':14} {'kernel':14} {'T':>5} {'old us':>8} {'new us':>8} {'x':>5} {'new GB/s':>9} {'of copy':>8}  bitwise"
    )
    for m in a.models.split(","):
        cfg = preset(m)
        for T in (int(x) for x in a.tokens.split(",")):
            for row in (b.rope(cfg, T, a.context), b.norm(cfg, T)):
                row.update(model=m, T=T, new_GBps=row["bytes"] / row["new_us"] / 1e3,
                           old_GBps=row["bytes"] / row["old_us"] / 1e3)  # fmt: skip
                row["new_frac_of_copy"] = row["new_GBps"] / gbps_copy
                rows.append(row)
                print(
                    f"{m:14} {row['kernel']:14} {T:>5} {row['old_us']:8.2f} {row['new_us']:8.2f} "
                    f"{row['old_us'] / row['new_us']:5.2f} {row['new_GBps']:9.0f} {row['new_frac_of_copy']:8.1%}  "
                    f"{'ok' if row['bitwise'] else 'MISMATCH'}"
                )
    if a.out:
        meta = metadata(a.commit or git_commit(), argv if argv is not None else sys.argv)
        write_json(a.out, {**meta, "copy_bandwidth": bw, "rows": rows})
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
