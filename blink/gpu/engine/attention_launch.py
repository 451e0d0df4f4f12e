"""Attention in a model step: which kernel serves each bucket, and its launches.

Forward (blink/gpu/engine/forward.py) records the rest of the step; this mixin owns the attention role:
the prefill kernel (attn_prefill_fa2: prefill_attention.cu), the decode kernel (flash_decode.cu:
"flashq" on CUDA cores below FLASHMMA_MIN_BATCH sequences, "flashmma" on tensor cores from there)
and the split counts they are recorded with. It reads Forward's buffers (q, attn, part_o,
part_ml), its step arena and its `_launch`. docs/decisions.md says why these kernels serve; the
variants that lost are in bench/kernels/ or recorded there.
"""

from __future__ import annotations

from blink.gpu.toolchain.cuda_api import Driver
from blink.gpu.toolchain.kernels import Kernels

DECODE_HEAD_DIMS = (16, 32, 64, 128)
DECODE_GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)
PREFILL_TILE = 64
# Decode attention kernels (flash_decode.cu). flashq: keys per split chosen at run time, separate
# combine; flashmma: flashq's splits on tensor cores (the G query heads of a KV head as mma rows),
# merged by flashq's combine. FLASH_VARIANTS: (K/V vectors per lane per tile, the split quantum's
# N; CTAs per SM at the compiled register count for G <= 4; cp.async ring stages).
FLASHMMA_MIN_BATCH = 128  # buckets of this many sequences and more decode on flashmma
# The same over an fp8 KV cache (its _fp8kv kernels: flashq decodes codes in registers, doing twice the
# fp32 work per byte read; flashmma decodes them into f16 tiles): bench.kernels.fp8kv_attention times both.
FLASHMMA_MIN_BATCH_FP8KV = FLASHMMA_MIN_BATCH
FLASH_VARIANTS = {"flashq": (4, 3, 4), "flashmma": (4, 3, 0)}
FLASH_COMBINE_OF = {"flashq": "flashq", "flashmma": "flashq"}
FLASH_WARPS = 4


def flash_smem_bytes(variant: str, head_dim: int) -> int:
    """Dynamic shared memory of a flash decode kernel: flashq's cp.async ring; flashmma's Q tile and
    two stages of 64-key K and V tiles (flashmma_smem in flash_decode.cu)."""
    if variant == "flashmma":
        return (16 + 4 * 64) * (head_dim + 8) * 2
    n, _, stages = FLASH_VARIANTS[variant]
    return FLASH_WARPS * stages * 2 * n * 32 * 16


def flash_quantum(head_dim: int, n: int) -> int:
    """Keys per split are a multiple of this (flash_quantum in flash_decode.cu)."""
    return max(32, n * (256 // head_dim))


def flash_grid_splits(s: int, nkv: int, head_dim: int, max_context: int, target: int, n: int, max_splits: int) -> int:
    """Grid splits of a flash kernel for a bucket of s sequences: room for about 2 waves of
    `target` CTAs when the bucket is full; flash_chunk (flash_decode.cu) picks how many are used
    (CTAs past that exit at once, but each still costs a launch slot)."""
    want = -(-2 * target // (s * nkv))
    cap = max(1, -(-max_context // flash_quantum(head_dim, n)))
    return max(1, min(max_splits, want, cap))


class AttentionLaunches:
    """Mixin of Forward: attention kernel handles, variant choice and launch recording."""

    def _init_attention(self, kernels: Kernels, driver: Driver) -> None:
        """Kernel handles and shared-memory limits of the attention kernels (at construction)."""
        c = self.c
        hd, group = c.head_dim, c.num_heads // c.num_kv_heads
        # scores, probabilities and O in registers (mma.sync), K/V double buffered by cp.async:
        # Q + 2 x (K, V) tiles of 64 x (hd + 8) bf16
        # An fp8 KV cache: the "_fp8kv" instantiations of every attention kernel (kv_suffix, kv_cache.cuh).
        sfx = self.kv_suffix
        self.fn_prefill, self.prefill_smem = f"attn_prefill_fa2_hd{hd}{sfx}", 5 * 64 * (hd + 8) * 2
        driver.set_max_dynamic_smem(kernels[self.fn_prefill], self.prefill_smem)
        self.decode_kernels: dict[str, str] = {}
        self.flash_combine: dict[str, str] = {}
        self.flash_smem: dict[str, int] = {}
        for v in FLASH_VARIANTS:
            self.decode_kernels[v] = f"attn_{v}_hd{hd}_g{group}{sfx}"
            self.flash_combine[v] = f"attn_{FLASH_COMBINE_OF[v]}_combine_hd{hd}"
            self.flash_smem[v] = flash_smem_bytes(v, hd)
            if self.flash_smem[v]:
                driver.set_max_dynamic_smem(kernels[self.decode_kernels[v]], self.flash_smem[v])
        self._decode_override: str | None = None

    def set_decode_attention(self, variant: str | None) -> None:
        """Record every decode bucket with `variant` from now on (tests and benchmarks compare the two
        kernels on one KV cache); None: back to the serving choice (decode_variant)."""
        if variant is not None and variant not in self.decode_kernels:
            raise ValueError(f"decode_attention {variant!r} not in {sorted(self.decode_kernels)}")
        self._decode_override = variant

    def decode_variant(self, S: int) -> str:
        """The decode attention recorded for a bucket of S sequences."""
        least = FLASHMMA_MIN_BATCH_FP8KV if self.kv_suffix else FLASHMMA_MIN_BATCH
        return self._decode_override or ("flashmma" if S >= least else "flashq")

    def flash_target(self, variant: str) -> int:
        """CTAs the flash kernels aim for: one full wave at their occupancy."""
        return self.num_sms * FLASH_VARIANTS[variant][1]

    def flash_splits(self, s: int, variant: str) -> int:
        c, n = self.c, FLASH_VARIANTS[variant][0]
        target = self.flash_target(variant)
        return flash_grid_splits(s, c.num_kv_heads, c.head_dim, self.d.max_context, target, n, self.max_splits)

    def _record_attention(self, stream: int, S: int, T: int, decode: bool, kc: int, vc: int, scale_log2: float) -> None:
        """One layer's attention: q and the paged KV (kc, vc) -> attn."""
        # Every sequence's last token through the decode kernel, in decode and prefill graphs alike: a
        # prefill graph may carry one-token decode rows (mixed steps, blink/device/scheduler.py), which
        # the prefill kernel skips so that their numerics match a pure decode step. The prefill kernel
        # then rewrites every row of the multi-token rows (their last token included).
        self._record_decode_attention(stream, S, kc, vc, scale_log2)
        if not decode:
            grid = (T // PREFILL_TILE + S, self.c.num_heads, 1)
            args = self._attn_args(kc, vc, scale_log2)
            self._launch(self.fn_prefill, grid, (128, 1, 1), stream, self.prefill_smem, **args)

    def _record_decode_attention(self, stream: int, S: int, kc: int, vc: int, scale_log2: float) -> None:
        """The decode kernel for a bucket of S sequences: one query (the last row) per sequence."""
        self._record_flash(stream, S, self.decode_variant(S), kc, vc, scale_log2)

    def _attn_args(self, kc: int, vc: int, scale_log2: float) -> dict[str, object]:
        """The arguments every attention kernel takes: q, the paged KV, the output, the batch's
        sequences and the KV geometry with the softmax scale."""
        c, d, a = self.c, self.d, self.arena.ptr
        return dict(
            q=self.q, kc=kc, vc=vc, out=self.attn, cu=a["cu_q_lens"], sl=a["seq_lens"], bt=a["block_tables"],
            ns=a["num_seqs"], nkv=c.num_kv_heads, bs=d.block_size, mbps=d.max_blocks_per_seq, sc=scale_log2,
        )  # fmt: skip

    def _record_flash(self, stream: int, S: int, variant: str, kc: int, vc: int, scale_log2: float) -> None:
        c, a = self.c, self.arena.ptr
        nsplit, target = self.flash_splits(S, variant), self.flash_target(variant)
        self._launch(
            self.decode_kernels[variant], (nsplit, c.num_kv_heads, S), (32 * FLASH_WARPS, 1, 1), stream,
            self.flash_smem[variant], po=self.part_o, plse=self.part_ml, target=target,
            **self._attn_args(kc, vc, scale_log2),
        )  # fmt: skip
        # one split per sequence: the attention kernel wrote the output
        if nsplit > 1:
            self._launch(
                self.flash_combine[variant], (-(-c.num_heads // FLASH_WARPS), S, 1), (32 * FLASH_WARPS, 1, 1),
                stream, po=self.part_o, plse=self.part_ml, out=self.attn, cu=a["cu_q_lens"], sl=a["seq_lens"],
                ns=a["num_seqs"], nkv=c.num_kv_heads, nq=c.num_heads, grid_splits=nsplit, target=target,
            )  # fmt: skip
