"""The on-device sampling kernels on their own: rows of fp32 logits in, one token per row out.

The engine's graphs run the same kernel (sample_tokens) on the LM head's output; this test helper
checks the kernels against blink.device.sampling on fixed logits:
`sample` (temperature, top-k, top-p) and `sample_ext` (the extensions: logprobs, logit_bias,
penalties with their per-row state, min_p), each kernel launched as the graphs would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blink.gpu.toolchain.cuda_api import Driver
from blink.gpu.toolchain.kernels import Kernels
from blink.protocol.layout import MAX_LOGPROBS

SEEN = np.uint32(0x80000000)  # bit 31 of a penalty-state word (sampling.cu)


@dataclass
class ExtResult:
    tokens: np.ndarray  # (S,) int32
    chosen_logprob: np.ndarray  # (S,) float32, rows with logprobs >= 0 and emit
    top_ids: np.ndarray  # (S, MAX_LOGPROBS) int32, the first logprobs[s] of each row
    top_logprobs: np.ndarray  # (S, MAX_LOGPROBS) float32
    processed: np.ndarray  # (S, V) float32, rows with pen_row >= 0
    state: np.ndarray  # (rows, V) uint32, after the step


class GpuSampler:
    def __init__(self, driver: Driver, kernels: Kernels, stream: object) -> None:
        self.driver, self.k, self.stream = driver, kernels, stream
        self.fn = kernels["sample_tokens"]

    def _launch(self, name: str, grid: int, block: int, **args: object) -> None:
        """Launch by parameter name (checked against the kernel's signature: Kernels.args)."""
        s = int(self.stream.ptr)  # type: ignore[attr-defined]
        self.driver.launch(self.k[name], (grid, 1, 1), (block, 1, 1), self.k.args(name, args), s, name=name)

    def sample(
        self,
        logits: np.ndarray,
        temperature: np.ndarray,
        top_p: np.ndarray,
        top_k: np.ndarray,
        seed: np.ndarray,
        ks: np.ndarray,
    ) -> np.ndarray:
        import cupy as cp

        rows, vocab = logits.shape
        dev = [
            cp.asarray(np.ascontiguousarray(a, dtype=dt))
            for a, dt in (
                (logits, np.float32),
                (temperature, np.float32),
                (top_p, np.float32),
                (top_k, np.int32),
                (seed, np.uint64),
                (ks, np.uint32),
            )
        ]
        out = cp.full(rows, -1, dtype=cp.int32)
        n = cp.asarray(np.array([rows], np.uint32))
        cp.cuda.Device().synchronize()  # the uploads ran on CuPy's stream, the launch uses ours
        lg, t, p, k, sd, ks_ = dev
        self._launch(
            "sample_tokens", rows, 1024, logits=lg, V=vocab, temperature=t, top_p=p, top_k=k, seed=sd,
            sample_pos=ks_, out_tokens=out, num_seqs=n, proc=None, pen_row=None, min_p=None, ext_on=None,
            mask_on=None, mask_open=None,
        )  # fmt: skip
        self.stream.synchronize()  # type: ignore[attr-defined]
        return out.get()

    def sample_ext(
        self,
        logits: np.ndarray,
        temperature: np.ndarray,
        top_p: np.ndarray,
        top_k: np.ndarray,
        seed: np.ndarray,
        ks: np.ndarray,
        *,
        min_p: np.ndarray,
        state: np.ndarray,
        pen_row: np.ndarray,
        fresh: np.ndarray,
        input_ids: np.ndarray,
        cu_q_lens: np.ndarray,
        presence_penalty: np.ndarray,
        frequency_penalty: np.ndarray,
        repetition_penalty: np.ndarray,
        logit_bias_cu: np.ndarray,
        logit_bias_ids: np.ndarray,
        logit_bias_vals: np.ndarray,
        logprobs: np.ndarray,
        emit: np.ndarray,
    ) -> ExtResult:
        """One step's sampling with the extensions: penalty_mark, logits_ext, sample_tokens,
        sample_post, in the graphs' order. state: (rows, V) uint32 (SEEN | count per id)."""
        import cupy as cp

        S, V = logits.shape

        def up(a: np.ndarray, dt: type) -> object:
            a = np.ascontiguousarray(a, dtype=dt)
            return cp.asarray(a if a.size else np.zeros(1, dt))

        lg = up(logits, np.float32)
        st = up(state, np.uint32)
        proc = cp.zeros((S, V), cp.float32)
        top_ids = cp.full((S, MAX_LOGPROBS), -1, cp.int32)
        top_lps = cp.zeros((S, MAX_LOGPROBS), cp.float32)
        stats = cp.zeros(2 * S, cp.float32)
        chosen = cp.zeros(S, cp.float32)
        out = cp.full(S, -1, cp.int32)
        n = cp.asarray(np.array([S], np.uint32))
        on = cp.asarray(np.array([1], np.uint32))
        # logit_bias: the CSR rows of the step into the state rows' tables (the engine copies a
        # request's entries there when it is admitted)
        rows = state.shape[0]
        nb = np.diff(np.asarray(logit_bias_cu, np.int64))
        max_logit_bias = max(1, int(nb.max(initial=0)))
        b_n = np.zeros(max(rows, 1), np.int32)
        b_ids = np.zeros((max(rows, 1), max_logit_bias), np.int32)
        b_vals = np.zeros((max(rows, 1), max_logit_bias), np.float32)
        for s in range(S):
            if nb[s]:
                r, lo = int(pen_row[s]), int(logit_bias_cu[s])
                assert r >= 0, "logit_bias needs a state row"
                b_n[r] = nb[s]
                b_ids[r, : nb[s]] = logit_bias_ids[lo : lo + nb[s]]
                b_vals[r, : nb[s]] = logit_bias_vals[lo : lo + nb[s]]
        a = {
            k: up(v, dt)
            for k, v, dt in (
                ("temperature", temperature, np.float32),
                ("top_p", top_p, np.float32),
                ("top_k", top_k, np.int32),
                ("seed", seed, np.uint64),
                ("ks", ks, np.uint32),
                ("min_p", min_p, np.float32),
                ("pen_row", pen_row, np.int32),
                ("fresh", fresh, np.int32),
                ("input_ids", input_ids, np.int32),
                ("cu", cu_q_lens, np.int32),
                ("presence_penalty", presence_penalty, np.float32),
                ("frequency_penalty", frequency_penalty, np.float32),
                ("repetition_penalty", repetition_penalty, np.float32),
                ("logit_bias_n", b_n, np.int32),
                ("logit_bias_ids", b_ids, np.int32),
                ("logit_bias_vals", b_vals, np.float32),
                ("logprobs", logprobs, np.int32),
                ("emit", emit, np.int32),
            )
        }
        cp.cuda.Device().synchronize()
        pr, nl = a["pen_row"], a["logprobs"]
        self._launch(
            "penalty_mark", S, 256, state=st, V=V, pen_row=pr, fresh=a["fresh"], input_ids=a["input_ids"],
            cu_q_lens=a["cu"], num_seqs=n, ext_on=on,
        )  # fmt: skip
        self._launch(
            "logits_ext", S, 1024, logits=lg, proc=proc, V=V, state=st, pen_row=pr,
            presence_penalty=a["presence_penalty"], frequency_penalty=a["frequency_penalty"],
            repetition_penalty=a["repetition_penalty"], logit_bias_n=a["logit_bias_n"],
            logit_bias_ids=a["logit_bias_ids"], logit_bias_vals=a["logit_bias_vals"], max_logit_bias=max_logit_bias,
            logprobs=nl, max_lp=MAX_LOGPROBS, top_ids=top_ids, top_lps=top_lps, stats=stats, num_seqs=n, ext_on=on,
        )  # fmt: skip
        self._launch(
            "sample_tokens", S, 1024, logits=lg, V=V, temperature=a["temperature"], top_p=a["top_p"],
            top_k=a["top_k"], seed=a["seed"], sample_pos=a["ks"], out_tokens=out, num_seqs=n, proc=proc,
            pen_row=pr, min_p=a["min_p"], ext_on=on, mask_on=cp.zeros(1, cp.uint32), mask_open=cp.zeros(S, cp.int32),
        )  # fmt: skip
        self._launch(
            "sample_post", S, 32, logits=lg, V=V, out_tokens=out, emit=a["emit"], logprobs=nl, stats=stats,
            chosen_lp=chosen, state=st, pen_row=pr, num_seqs=n, ext_on=on,
        )  # fmt: skip
        self.stream.synchronize()  # type: ignore[attr-defined]
        return ExtResult(
            out.get(), chosen.get(), top_ids.get(), top_lps.get(), proc.get(), st.get().reshape(state.shape)
        )
