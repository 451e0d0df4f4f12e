"""The MoE layer's launches and buffers (kernels: blink/gpu/engine/csrc/moe.cu, whose header describes the algorithm).

Everything a step's routing decides (expert counts, offsets, which tile belongs to which expert)
is computed on the device; the host only sizes buffers and grids for the worst case of a token
bucket, so one captured graph serves every routing:

    pairs    T*k                                   (token, slot) pairs of a step of T tokens
    tiles    min(T*k, (T*k + E*(tm-1)) // tm)       upper bound of sum_e ceil(cnt_e / tm):
             each expert's segment is padded to tm rows, and a used expert holds >= 1 pair
    rows     tiles * tm                             rows of the permuted activations

Graphs of at most PAIR_MAX_TOKENS tokens (decode) skip the permutation: a block row per (token, slot)
pair routes its token itself and reads its expert once (moe_pair_gate_up, moe_pair_down).
Otherwise the tile height tm is TILE_M (16) for small graphs (tile GEMV on CUDA cores up to MMA_MIN_TOKENS
tokens, tensor cores above) and BIG_TILE_M (64) from BIG_TILE_MIN_TOKENS on (tensor cores: each
weight fragment then feeds 4 row fragments). All of it is fixed per graph at capture.

FP8 experts (`--quantization fp8`: experts_gate_up / experts_down as Fp8Linear, codes and per-row scales)
take each expert kernel's `_fp8` variant, which reads the codes and their scales (argument S) and the
activations in bf16 (W8A16); the router and the permutation are the same.

`align_reference` is the permutation in numpy (the kernel's contract, for CPU tests).
"""

from __future__ import annotations

import numpy as np

from blink.gpu.engine.fp8_weights import Fp8Linear
from blink.gpu.toolchain.cuda_api import Driver
from blink.gpu.toolchain.kernels import Kernels
from blink.models.config import ModelConfig

TILE_M = 16  # rows per expert tile; the kernels are compiled per height: moe_*_m16 (moe.cu's macros)
BIG_TILE_M = 64  # the tensor-core kernels' tile in large graphs (moe_align_m64, moe_*_mma_m64)
BIG_TILE_MIN_TOKENS = 256  # graphs of at least this many tokens use BIG_TILE_M
MMA_KC = 256  # moe.cu MMA_KC: inputs staged per step of the tensor-core kernels
WARPS, COLS = 8, 4  # moe.cu MOE_WARPS, MOE_COLS: output columns per block = WARPS * COLS (tile GEMV)
PAIR_WARPS, PAIR_COLS = 4, 4  # moe.cu PAIR_WARPS, PAIR_COLS: the pair path's blocks (PAIR_WARPS * PAIR_COLS columns)
MMA_BN = WARPS * 16  # moe.cu MMA_BN: output columns per block of the tensor-core variant
MMA_LDB = 24  # moe.cu MMA_LDB: row stride of an FP8 expert kernel's decoded weight fragments
MMA_MIN_TOKENS = 64  # graphs of at least this many tokens run the expert GEMMs on tensor cores
FUSED_ROUTE_MAX_TOKENS = 64  # graphs of at most this many tokens route and align in one block (one launch)
PAIR_MAX_TOKENS = 8  # graphs of at most this many tokens take the pair path: no permutation (moe_pair_*)
# (the pair path's outputs equal the tile GEMV's bit for bit: tests/gpu/test_moe.py; why 8: docs/decisions.md)
ROUTER_MAX_TOKENS = 4  # graphs of at most this many tokens compute the router logits with moe_router_t<T>
ROUTER_WARPS = 2  # moe.cu ROUTER_WARPS: router rows per moe_router block (a warp each)
ROUTE_WARPS = 4  # tokens per moe_route block (a warp each)
NORM_VPT = 4  # moe.cu MOE_NORM_VPT: moe_combine_norm (256 threads) holds 8 * NORM_VPT columns per thread
MAX_EXPERTS = 256  # moe_route: 32 lanes x ROUTE_MAX_PER_LANE; moe_align needs <= 1024 (registry.CUDA_MOE_MAX_*)
MAX_TOPK = 32  # moe_route: slot j is kept by lane j


def max_tiles(tokens: int, k: int, experts: int, tile_m: int = TILE_M) -> int:
    """Upper bound of the expert tiles of a step of `tokens` tokens (the expert kernels' grid.y)."""
    p = tokens * k
    return min(p, (p + experts * (tile_m - 1)) // tile_m)


def check_moe(c: ModelConfig) -> None:
    """The compiled kernels' limits (raised at engine construction)."""
    if c.num_experts > MAX_EXPERTS or c.num_experts_per_tok > MAX_TOPK:
        raise ValueError(
            f"MoE kernels take <= {MAX_EXPERTS} experts and top-k <= {MAX_TOPK} "
            f"(got {c.num_experts}, {c.num_experts_per_tok})"
        )
    if c.moe_intermediate_size % 8 or c.hidden_size % 8:
        raise ValueError("moe_intermediate_size and hidden_size must be multiples of 8 (16-byte vectors)")
    if c.hidden_size > 8 * 256 * NORM_VPT:
        raise ValueError(f"hidden_size {c.hidden_size} > {8 * 256 * NORM_VPT} (moe_combine_norm's registers)")


def align_reference(topk_ids: np.ndarray, experts: int, tile_m: int = TILE_M) -> dict[str, np.ndarray]:
    """moe_align in numpy: topk_ids (T, k) -> cnt (E,), off (E+1,) padded, sorted_pair (off[E],)
    with -1 in padding rows, pair_pos (T*k,) (pairs in ascending order within an expert; the
    kernel's order within an expert is arbitrary)."""
    flat = np.asarray(topk_ids, dtype=np.int64).ravel()
    cnt = np.bincount(flat, minlength=experts)
    padded = -(-cnt // tile_m) * tile_m
    off = np.concatenate([[0], np.cumsum(padded)])
    sorted_pair = np.full(int(off[-1]), -1, np.int64)
    pair_pos = np.empty(flat.size, np.int64)
    order = np.argsort(flat, kind="stable")
    first = np.searchsorted(flat[order], np.arange(experts))
    for rank, p in enumerate(order):
        e = flat[p]
        row = off[e] + rank - first[e]
        sorted_pair[row] = p
        pair_pos[p] = row
    return {"cnt": cnt, "off": off, "sorted_pair": sorted_pair, "pair_pos": pair_pos}


class MoeLaunches:
    """Buffers for `max_num_batched_tokens` and the launches of one MoE layer (Forward.record calls `record`)."""

    def __init__(self, c: ModelConfig, max_num_batched_tokens: int, driver: Driver, kernels: Kernels) -> None:
        import cupy as cp

        check_moe(c)
        self.c = c
        E, k, H, inter = c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
        rows = self.rows(c, max_num_batched_tokens)
        z = lambda *shape, dt=cp.uint16: cp.zeros(shape, dtype=dt)  # noqa: E731
        self.logits = z(max_num_batched_tokens, E, dt=cp.float32)  # router output
        self.topk_ids = z(max_num_batched_tokens * k, dt=cp.int32)
        self.topk_w = z(max_num_batched_tokens * k, dt=cp.float32)
        self.expert_off = z(E + 1, dt=cp.int32)
        self.expert_cnt = z(E, dt=cp.int32)
        self.sorted_pair = z(rows, dt=cp.int32)
        self.pair_pos = z(max_num_batched_tokens * k, dt=cp.int32)
        self.act = z(rows, inter)  # swiglu of the permuted rows
        self.y = z(rows, H)  # expert outputs, permuted rows
        for kind, K in (("gate_up", H), ("down", inter)):
            for sfx in ("", "_fp8"):
                driver.set_max_dynamic_smem(kernels[f"moe_{kind}_m{TILE_M}{sfx}"], self.smem(False, K, TILE_M))
                for tm in (TILE_M, BIG_TILE_M):
                    f8 = bool(sfx)
                    driver.set_max_dynamic_smem(kernels[f"moe_{kind}_mma_m{tm}{sfx}"], self.smem(True, K, tm, f8))
        self.big_tile_min_tokens = BIG_TILE_MIN_TOKENS
        """Graphs of at least this many tokens (on tensor cores) take 64-row tiles."""
        self.mma_min_tokens = MMA_MIN_TOKENS
        """Graphs of at least this many tokens take the tensor-core expert kernels (the benchmarks
        move it to time one variant against the other); within a graph a row's result depends
        only on its own input, whatever shares its tile."""
        self.pair_max_tokens = PAIR_MAX_TOKENS
        """Graphs of at most this many tokens take the pair path (no permutation)."""
        self.fused_route_max_tokens = FUSED_ROUTE_MAX_TOKENS
        """Graphs of at most this many tokens route and align in one launch (moe_route_align)."""

    @staticmethod
    def smem(mma: bool, K: int, tm: int, fp8: bool = False) -> int:
        """Dynamic shared memory of an expert kernel over K inputs with tm-row tiles (moe.cu's layouts;
        fp8: the tensor-core variant's decoded weight fragments behind)."""
        if not mma:
            return tm * K * 2
        return (
            -(-(tm * (MMA_KC + 8) * 2) // 128) * 128
            + WARPS * 2 * 256 * 4
            + (WARPS * 2 * 16 * MMA_LDB * 2 if fp8 else 0)
        )

    @staticmethod
    def rows(c: ModelConfig, tokens: int) -> int:
        """Rows of the permuted buffers for a step of `tokens` tokens, whichever tile it takes."""
        E, k = c.num_experts, c.num_experts_per_tok
        return max(max_tiles(tokens, k, E, tm) * tm for tm in (TILE_M, BIG_TILE_M))

    def tile_m(self, T: int) -> int:
        """The tile height of a graph of T tokens."""
        return BIG_TILE_M if self.uses_mma(T) and T >= self.big_tile_min_tokens else TILE_M

    def uses_mma(self, T: int) -> bool:
        c = self.c
        aligned = c.hidden_size % 16 == 0 and c.moe_intermediate_size % 16 == 0
        return aligned and T >= self.mma_min_tokens

    @staticmethod
    def device_bytes(c: ModelConfig, max_num_batched_tokens: int) -> int:
        """What the buffers take (the engine's KV pool sizing leaves room for it)."""
        E, k = c.num_experts, c.num_experts_per_tok
        rows = MoeLaunches.rows(c, max_num_batched_tokens)
        return (
            max_num_batched_tokens * (4 * E + 12 * k)
            + 4 * (2 * E + 1 + rows)
            + 2 * rows * (c.moe_intermediate_size + c.hidden_size)
        )

    def record(self, fwd, stream: int, T: int, hid: object, router: object, gate_up: object, down: object,
               out: object, num_tokens: int, then_norm: dict | None = None) -> None:  # fmt: skip
        """One MoE layer over hid [T, H] (normed) into out [T, H], launched through the Forward `fwd`
        (its _launch and linear: the router GEMM of steps above ROUTER_MAX_TOKENS tokens goes where every
        other projection goes, cuBLAS or the GEMV; below, moe_router_t<T>; the benchmarks' launch
        filters see every MoE launch). With `then_norm`
        ({residual, w, out}): no `out`; the combine does the next layer's add_rmsnorm instead
        (residual += the layer's output, out = rmsnorm(residual) * w: moe_combine_norm)."""
        c = self.c
        E, k, H, inter = c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
        if T <= ROUTER_MAX_TOKENS:  # every weight load of a lane in flight at once; gemv_f32_t1's sums
            fwd._launch(
                f"moe_router_t{T}", (-(-E // ROUTER_WARPS), 1, 1), (32 * ROUTER_WARPS, 1, 1), stream, W=router,
                X=hid, Y=self.logits, N=E, K=H,
            )  # fmt: skip
        else:
            fwd.linear(hid, router, self.logits, T, stream, out_f32=True)
        route = dict(logits=self.logits, topk_ids=self.topk_ids, topk_w=self.topk_w, num_tokens=num_tokens, E=E, k=k,
                     norm_topk=int(c.norm_topk_prob))  # fmt: skip
        align = dict(expert_off=self.expert_off, expert_cnt=self.expert_cnt, sorted_pair=self.sorted_pair,
                     pair_pos=self.pair_pos)  # fmt: skip
        comb = dict(y=self.y, topk_w=self.topk_w, num_tokens=num_tokens, k=k, H=H)
        # FP8 experts: the _fp8 kernels, codes W and row scales S
        f8, wgu, wdn = self._weights(gate_up, down)
        if T <= self.pair_max_tokens:
            bn, threads = PAIR_WARPS * PAIR_COLS, 32 * PAIR_WARPS
            fwd._launch(
                f"moe_pair_gate_up{f8}", (-(-inter // bn), T * k, 1), (threads, 1, 1), stream, H * 2,
                logits=self.logits, X=hid, Y=self.act, topk_ids=self.topk_ids, topk_w=self.topk_w,
                num_tokens=num_tokens, E=E, k=k, norm_topk=int(c.norm_topk_prob), N=inter, K=H, **wgu,
            )  # fmt: skip
            fwd._launch(
                f"moe_pair_down{f8}", (-(-H // bn), T * k, 1), (threads, 1, 1), stream, inter * 2, X=self.act,
                Y=self.y, topk_ids=self.topk_ids, num_tokens=num_tokens, k=k, N=H, K=inter, **wdn,
            )  # fmt: skip
            self._combine(fwd, stream, T, out, then_norm, None, comb)
            return
        tm, mma = self.tile_m(T), self.uses_mma(T)
        if T <= self.fused_route_max_tokens and tm == TILE_M:
            fwd._launch(f"moe_route_align_m{tm}", (1, 1, 1), (1024, 1, 1), stream, **route, **align)
        else:
            fwd._launch("moe_route", (-(-T // ROUTE_WARPS), 1, 1), (32 * ROUTE_WARPS, 1, 1), stream, **route)
            fwd._launch(
                f"moe_align_m{tm}", (1, 1, 1), (1024, 1, 1), stream, topk_ids=self.topk_ids, num_tokens=num_tokens,
                k=k, E=E, **align,
            )  # fmt: skip
        tiles = max_tiles(T, k, E, tm)
        bn, v = (MMA_BN, "_mma") if mma else (WARPS * COLS, "")
        fwd._launch(
            f"moe_gate_up{v}_m{tm}{f8}", (-(-inter // bn), tiles, 1), (32 * WARPS, 1, 1), stream,
            self.smem(mma, H, tm, bool(f8)), X=hid, sorted_pair=self.sorted_pair, Y=self.act,
            expert_off=self.expert_off, expert_cnt=self.expert_cnt, E=E, k=k, N=inter, K=H, **wgu,
        )  # fmt: skip
        fwd._launch(
            f"moe_down{v}_m{tm}{f8}", (-(-H // bn), tiles, 1), (32 * WARPS, 1, 1), stream,
            self.smem(mma, inter, tm, bool(f8)), X=self.act, Y=self.y, expert_off=self.expert_off,
            expert_cnt=self.expert_cnt, E=E, N=H, K=inter, **wdn,
        )  # fmt: skip
        self._combine(fwd, stream, T, out, then_norm, self.pair_pos, comb)

    @staticmethod
    def _weights(gate_up: object, down: object) -> tuple[str, dict, dict]:
        """The expert kernels' name suffix and weight arguments: bf16 arrays (W), or FP8 experts
        (Fp8Linear: codes W, scales S) for the _fp8 kernels."""
        if isinstance(gate_up, Fp8Linear) and isinstance(down, Fp8Linear):
            return "_fp8", {"W": gate_up.codes, "S": gate_up.scales}, {"W": down.codes, "S": down.scales}
        if isinstance(gate_up, Fp8Linear) or isinstance(down, Fp8Linear):
            raise TypeError("MoE experts: gate_up and down must both be FP8 or both bf16")
        return "", {"W": gate_up}, {"W": down}

    def _combine(self, fwd, stream: int, T: int, out, then_norm, pair_pos, comb: dict) -> None:
        if then_norm is None:
            fwd._launch("moe_combine", (T, 1, 1), (128, 1, 1), stream, out=out, pair_pos=pair_pos, **comb)
        else:
            fwd._launch(
                "moe_combine_norm", (T, 1, 1), (256, 1, 1), stream, eps=self.c.rms_eps, pair_pos=pair_pos,
                **then_norm, **comb,
            )  # fmt: skip
