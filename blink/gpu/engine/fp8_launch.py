"""FP8 projections in a model step: the path past the GEMV and the launches of an FP8 linear.

Forward (blink/gpu/engine/forward.py) records the rest of the step; this mixin owns the FP8 weights'
projections: which path steps past the FP8 GEMV take (set_fp8_gemm: the W8A8 GEMM of
blink/gpu/engine/fp8_gemm.py, or dequantize + bf16 GEMM) with its buffers, and fp8_linear's
launches (fp8.cu), and the FP8 LM head's (fp8_head). It reads Forward's config (c), dims (d), cuBLAS
handle (blas), the step kind (fp8_decode, fp8_gemv_max_tokens, fp8_mma_min_tokens), the GEMV's
configuration (fp8_gemv_config), the head's scratch (fp8_head_scratch) and its `_launch`.
"""

from __future__ import annotations

from blink.gpu.engine.fp8_gemm import Fp8Gemm, describe_fp8_modes, fp8_epilogue_elems, fp8_gemm_mode
from blink.gpu.engine.fp8_weights import (
    FP8_GEMV_BUCKETS,
    FP8_GEMV_CONFIGS,
    FP8_HEAD_CHUNK_ROWS,
    FP8_MMA_MAX_TOKENS,
    Fp8Linear,
    fp8_gemv_grid,
    fp8_gemv_name,
    fp8_gemv_pieces,
    fp8_max_outputs,
    fp8_mma_grid,
    fp8_mma_name,
    fp8_scratch_elems,
)


def _ptr(a: object) -> int:
    return int(a.data.ptr)  # type: ignore[attr-defined]


class Fp8Launches:
    def set_fp8_gemm(self, gemms: dict[str, Fp8Gemm]) -> None:
        """The paths of FP8 projections past the GEMV with their buffers: `gemms` the W8A8 GEMM of each
        scaling mode set up ("outer", "epilogue"; blink/gpu/engine/fp8_gemm.py, which picks one per
        GEMM shape: fp8_gemm_mode), with the per-token codes and scales of a step's activations and,
        for "epilogue", its fp32 sums; no gemms: "dequant", the bf16 GEMM over fp8_scratch (the
        largest projection)."""
        import cupy as cp

        c, Tm = self.c, self.d.max_num_batched_tokens
        self.fp8_gemms = dict(gemms)
        self.fp8_path = describe_fp8_modes(set(gemms))
        if not gemms:
            self.fp8_scratch = cp.zeros(fp8_scratch_elems(c), dtype=cp.uint16)
            return
        self.fp8_x8 = cp.zeros((Tm, max(c.hidden_size, c.q_size, c.intermediate_size)), dtype=cp.uint8)
        self.fp8_xs = cp.zeros(Tm, dtype=cp.float32)
        elems = fp8_epilogue_elems(set(gemms), Tm, fp8_max_outputs(c))
        if elems:
            self.fp8_d32 = cp.zeros(elems, dtype=cp.float32)

    def set_fp8_gemv_config(self, configs: dict[int, tuple]) -> None:
        """The FP8 GEMV's configuration per bucket for the steps recorded from now on (EngineConfig.fp8_gemv_config;
        buckets not named keep theirs), one of FP8_GEMV_CONFIGS each. Speed only: all sum in the same order."""
        for nt, cfg in configs.items():
            if nt not in FP8_GEMV_CONFIGS or tuple(cfg) not in FP8_GEMV_CONFIGS[nt]:
                raise ValueError(f"fp8 GEMV configuration {cfg} of bucket {nt}: not compiled ({FP8_GEMV_CONFIGS})")
        self.fp8_gemv_config = {**self.fp8_gemv_config, **{nt: tuple(c) for nt, c in configs.items()}}

    def uses_fp8_gemv_bucket(self, T: int) -> bool:
        """Whether a step of T tokens runs the FP8 weights on one FP8 GEMV bucket (a decode step below
        fp8_mma_min_tokens: from there the tensor-core kernel, unfused)."""
        fp8_decode = self.fp8 and self.fp8_decode and T <= self.fp8_gemv_max_tokens
        return fp8_decode and T in FP8_GEMV_BUCKETS and T < self.fp8_mma_min_tokens

    def _fp8_gemv_pieces(self, kind: str, x: object, w: Fp8Linear, y: object, rows: int, y_bytes: int, stream: int):
        """The FP8 GEMV of `kind` ("": bf16 out, "f32": fp32 out of y_bytes an element) over `rows` rows in
        bucket pieces (fp8_gemv_pieces), each bucket in its configuration."""
        n_out, k = w.shape
        for r0, nt in fp8_gemv_pieces(rows):
            cfg = self.fp8_gemv_config[nt]
            self._launch(
                fp8_gemv_name(nt, kind, cfg), (fp8_gemv_grid(n_out, nt, kind, cfg), 1, 1), (256, 1, 1), stream,
                W=w.codes, scales=w.scales, X=_ptr(x) + 2 * r0 * k, Y=_ptr(y) + y_bytes * r0 * n_out, N=n_out, K=k,
            )  # fmt: skip

    def fp8_linear(self, x: object, w: Fp8Linear, y: object, rows: int, stream: int) -> None:
        """y (bf16) = x w^T for FP8 w: in decode steps of up to fp8_gemv_max_tokens rows weight-only (bf16
        activations): the FP8 GEMV in bucket pieces below fp8_mma_min_tokens rows, the tensor-core kernel
        from there; in every other step x quantized per token and the W8A8 GEMM
        (blink/gpu/engine/fp8_gemm.py), or on the "dequant" path w dequantized to bf16 and the bf16
        GEMM. The numpy definition draws the same line (blink.models.fp8.uses_w8a8)."""
        n_out, k = w.shape
        if self.fp8_decode and rows <= self.fp8_gemv_max_tokens:
            if rows >= self.fp8_mma_min_tokens:  # the tensor-core kernel, every row at once
                self._launch(
                    fp8_mma_name(rows), (fp8_mma_grid(n_out), 1, 1), (256, 1, 1), stream, W=w.codes,
                    scales=w.scales, X=x, Y=y, N=n_out, K=k, T=rows,
                )  # fmt: skip
                return
            self._fp8_gemv_pieces("", x, w, y, rows, 2, stream)  # between buckets in pieces: 6 = 4 + 2
            return
        mode = fp8_gemm_mode(set(self.fp8_gemms), rows, n_out)
        if mode == "dequant":
            self._launch(
                "fp8_dequant_rows", (-(-k // 4096), n_out, 1), (256, 1, 1), stream, codes=w.codes, scales=w.scales,
                out=self.fp8_scratch, N=n_out, K=k,
            )  # fmt: skip
            self.blas.linear(_ptr(x), _ptr(self.fp8_scratch), _ptr(y), rows, n_out, k, False)
            return
        gemm = self.fp8_gemms.get(mode)
        if gemm is None:
            raise RuntimeError(f"fp8 weights: no {mode!r} GEMM (set_fp8_gemm)")
        x8, xs = self.fp8_x8, self.fp8_xs
        self._launch("fp8_quantize_rows", (rows, 1, 1), (256, 1, 1), stream, W=x, codes=x8, scales=xs, N=rows, K=k)
        outer = mode == "outer"
        d = y if outer else self.fp8_d32
        gemm.matmul(rows, n_out, k, _ptr(x8), _ptr(w.codes), _ptr(d), _ptr(xs), _ptr(w.scales))
        if not outer:
            self._launch(
                "fp8_scale_rows", (-(-n_out // 2048), rows, 1), (256, 1, 1), stream, D=d, xs=xs, ws=w.scales, Y=y,
                T=rows, N=n_out,
            )  # fmt: skip

    def fp8_head(self, x: object, w: Fp8Linear, y: object, rows: int, stream: int) -> None:
        """y (fp32 logits [rows, vocab]) = x w^T for the FP8 LM head, weight-only in every step (the
        definition: blink.models.fp8, FP8_LM_HEAD): the FP8 GEMV's f32 kernels in bucket pieces below
        fp8_mma_min_tokens rows, the tensor-core kernel's f32 twin up to FP8_MMA_MAX_TOKENS, past that
        FP8_HEAD_CHUNK_ROWS vocabulary rows at a time dequantized into fp8_head_scratch and the bf16 GEMM
        writing their columns of y."""
        n_out, k = w.shape
        if rows < self.fp8_mma_min_tokens:
            self._fp8_gemv_pieces("f32", x, w, y, rows, 4, stream)
            return
        if rows <= FP8_MMA_MAX_TOKENS:
            self._launch(
                fp8_mma_name(rows, f32=True), (fp8_mma_grid(n_out), 1, 1), (256, 1, 1), stream, W=w.codes,
                scales=w.scales, X=x, Y=y, N=n_out, K=k, T=rows,
            )  # fmt: skip
            return
        for n0 in range(0, n_out, FP8_HEAD_CHUNK_ROWS):
            nc = min(FP8_HEAD_CHUNK_ROWS, n_out - n0)
            self._launch(
                "fp8_dequant_rows", (-(-k // 4096), nc, 1), (256, 1, 1), stream, codes=_ptr(w.codes) + n0 * k,
                scales=_ptr(w.scales) + 4 * n0, out=self.fp8_head_scratch, N=nc, K=k,
            )  # fmt: skip
            self.blas.linear(_ptr(x), _ptr(self.fp8_head_scratch), _ptr(y) + 4 * n0, rows, nc, k, True, n_out)
