"""Sampling in a model step: the sampler's buffers and launches over the step's logits.

Forward (blink/gpu/engine/forward.py) records the rest of the step; this mixin owns the sampling role:
the sampling extensions' buffers and tables (one row per ring slot, sampling_rows of them), the
extension kernels and sample_tokens over Forward's logits (sampling.cu), and the prompt logprob
records of prefill steps. It reads Forward's config (c), weights (w), step arena, residual stream
(resid), num_sms and its `_launch`.
"""

from __future__ import annotations

from typing import Any

from blink.gpu.engine.fp8_weights import Fp8Linear
from blink.protocol.layout import MAX_LOGIT_BIAS, MAX_LOGPROBS


class SamplingLaunches:
    def _init_sampling_buffers(self, z: Any, Sm: int, Tm: int) -> None:
        """The sampling extensions' buffers (`z` allocates zeros on the GPU)."""
        import cupy as cp

        sampling_rows, H = self.sampling_rows, self.c.hidden_size
        # Sampling extensions (sampling.cu): outputs of the step, and the per-row tables (one row per
        # ring slot; one dummy row when they are off, so the graphs' pointers stay valid).
        rows, V = max(1, sampling_rows), self.c.vocab_size
        self.proc = z(Sm if sampling_rows else 1, V, dt=cp.float32)
        self.chosen_lp = z(Sm, dt=cp.float32)
        self.top_ids = z(Sm, MAX_LOGPROBS, dt=cp.int32)
        self.top_lps = z(Sm, MAX_LOGPROBS, dt=cp.float32)
        self.lp_stats = z(2 * Sm, dt=cp.float32)
        self.pen_state = z(rows, V if sampling_rows else 1, dt=cp.uint32)
        self.logit_bias_n = z(rows, dt=cp.int32)
        self.logit_bias_ids = z(rows, MAX_LOGIT_BIAS, dt=cp.int32)
        self.logit_bias_vals = z(rows, MAX_LOGIT_BIAS, dt=cp.float32)
        self.mask_words = (V + 31) // 32  # token masks (token_mask reads them from the ring)
        self.mask_open = z(Sm, dt=cp.int32)  # the gate token_mask read for each row
        # Prompt logprobs (plp_* in sampling.cu): the final-normed hidden state, the fp32 logits and
        # the record of every scored row; up to max_num_batched_tokens rows (that many times vocab * 4
        # bytes of logits), allocated with the extension tables.
        P = Tm if sampling_rows else 1
        self.plp_hid = z(P, H)
        self.plp_logits = z(P, V if sampling_rows else 1, dt=cp.float32)
        self.plp_lp = z(P, dt=cp.float32)
        self.plp_ids = z(P, MAX_LOGPROBS, dt=cp.int32)
        self.plp_lps = z(P, MAX_LOGPROBS, dt=cp.float32)

    def record_sampling(self, stream: int, S: int) -> None:
        """Sampling over self.logits: the extension kernels (each returns at once unless the step's
        ext_on is set, and then works only on the rows that use an extension; token_mask also needs
        mask_on, and reads each masked row's gate and bits from the ring), sample_tokens."""
        V, a, ns = self.c.vocab_size, self.arena.ptr, self.arena.ptr["num_seqs"]
        on = a["ext_on"] if self.sampling_rows else None
        if on is not None:
            self._launch(
                "penalty_mark", (S, 1, 1), (256, 1, 1), stream, state=self.pen_state, V=V, pen_row=a["pen_row"],
                fresh=a["fresh"], input_ids=a["input_ids"], cu_q_lens=a["cu_q_lens"], num_seqs=ns, ext_on=on,
            )  # fmt: skip
            self._launch(
                "logits_ext", (S, 1, 1), (1024, 1, 1), stream, logits=self.logits, proc=self.proc, V=V,
                state=self.pen_state, pen_row=a["pen_row"], presence_penalty=a["presence_penalty"],
                frequency_penalty=a["frequency_penalty"], repetition_penalty=a["repetition_penalty"],
                logit_bias_n=self.logit_bias_n, logit_bias_ids=self.logit_bias_ids,
                logit_bias_vals=self.logit_bias_vals, max_logit_bias=MAX_LOGIT_BIAS, logprobs=a["logprobs"],
                max_lp=MAX_LOGPROBS, top_ids=self.top_ids, top_lps=self.top_lps, stats=self.lp_stats, num_seqs=ns,
                ext_on=on,
            )  # fmt: skip
            self._launch(
                "token_mask", (S, 1, 1), (1024, 1, 1), stream, logits=self.logits, proc=self.proc, V=V,
                pen_row=a["pen_row"], mask_gate=a["mask_gate"], mask_bits=a["mask_bits"],
                ring_mask_words=a["ring_mask_words"], sample_pos=a["sample_pos"], mask_open=self.mask_open,
                num_seqs=ns, ext_on=on, mask_on=a["mask_on"],
            )  # fmt: skip
        self._launch(
            "sample_tokens", (S, 1, 1), (1024, 1, 1), stream, logits=self.logits, V=V,
            temperature=a["temperature"], top_p=a["top_p"], top_k=a["top_k"], seed=a["seed"],
            sample_pos=a["sample_pos"], out_tokens=self.out_tokens, num_seqs=ns, proc=self.proc,
            pen_row=a["pen_row"], min_p=a["min_p"], ext_on=on, mask_on=a["mask_on"], mask_open=self.mask_open,
        )  # fmt: skip
        if on is not None:
            self._launch(
                "sample_post", (S, 1, 1), (32, 1, 1), stream, logits=self.logits, V=V, out_tokens=self.out_tokens,
                emit=a["emit"], logprobs=a["logprobs"], stats=self.lp_stats, chosen_lp=self.chosen_lp,
                state=self.pen_state, pen_row=a["pen_row"], num_seqs=ns, ext_on=on,
            )  # fmt: skip

    def record_prompt_logprobs(self, stream: int, T: int, delta: object) -> None:
        """Prompt logprob records of the step's scored rows (prefill graphs only: a step that scores
        prompt tokens is launched on one): final norm, LM head and records over rows j < plp_count,
        each kernel returning at once unless ext_on and plp_count are set."""
        c, a = self.c, self.arena.ptr
        V, H, on, cnt = c.vocab_size, c.hidden_size, a["ext_on"], a["plp_count"]
        g = min(T, self.num_sms)
        self._launch(
            "plp_norm", (g, 1, 1), (256, 1, 1), stream, residual=self.resid, delta=delta, w=self.w.final_norm,
            hid=self.plp_hid, plp_tok=a["plp_tok"], plp_count=cnt, ext_on=on, H=H, eps=c.rms_eps,
        )  # fmt: skip
        head = self.w.lm_head
        fp8 = isinstance(head, Fp8Linear)  # the FP8 LM head: codes and scales
        w = {"W": head.codes, "scales": head.scales} if fp8 else {"W": head}
        self._launch(
            "plp_lm_head_fp8" if fp8 else "plp_lm_head", (-(-V // 64), 1, 1), (256, 1, 1), stream,
            hid=self.plp_hid, logits=self.plp_logits, V=V, K=H, plp_count=cnt, ext_on=on, **w,
        )  # fmt: skip
        self._launch(
            "plp_records", (g, 1, 1), (1024, 1, 1), stream, logits=self.plp_logits, V=V, plp_target=a["plp_target"],
            plp_prompt_logprobs=a["plp_prompt_logprobs"], max_lp=MAX_LOGPROBS, plp_lp=self.plp_lp, plp_ids=self.plp_ids,
            plp_lps=self.plp_lps, plp_count=cnt, ext_on=on,
        )  # fmt: skip
