"""A claimed slot's request as the device reads it at admission: whether it can be served
(`validate`: the SlotError it finishes with otherwise) and its sampling extensions (`seq_sampling`:
penalties, logit bias, logprob records), each read from the slot record and the prompt region it
names in the prompt arena (blink/protocol/layout.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from blink.protocol.layout import (
    LOGIT_BIAS_DTYPE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_IDS,
    DeviceFeatures,
    RingView,
    SlotError,
    SlotFlags,
    prompt_logprob_record,
    prompt_region_words,
)


@dataclass(frozen=True)
class SeqSampling:
    """A request's sampling extensions, read from its slot at admission (Seq.ext)."""

    presence: float
    frequency: float
    repetition: float
    min_p: float
    bias_ids: np.ndarray  # int32
    bias_vals: np.ndarray  # float32
    n_logprobs: int  # -1: no logprob records
    prompt_n: int  # -1: no prompt logprob records
    prompt_lp_offset: int  # int32 word of prompt record 0 in the prompt arena

    @property
    def penalized(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.bias_ids.size)


def validate(rec: np.void, view: RingView, max_context: int, vocab_size: int, features: DeviceFeatures) -> SlotError:
    """SlotError.NONE when the request is one this device can serve, else why not (the slot then
    finishes with that error)."""
    n, off = int(rec["prompt_len"]), int(rec["prompt_offset"])
    if n == 0 or off + n > view.geo.prompt_arena_tokens:
        return SlotError.BAD_PROMPT
    if n + 1 > max_context:
        return SlotError.PROMPT_TOO_LONG
    ids = view.prompt_arena[off : off + n]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        return SlotError.BAD_PROMPT
    t, p = float(rec["temperature"]), float(rec["top_p"])
    if not (math.isfinite(t) and t >= 0.0) or not (0.0 < p <= 1.0) or int(rec["n_stop"]) > MAX_STOP_IDS:
        return SlotError.BAD_PARAMS
    if int(rec["max_new_tokens"]) == 0:
        return SlotError.BAD_PARAMS
    return _validate_ext(rec, view, vocab_size, features)


def _validate_ext(rec: np.void, view: RingView, vocab_size: int, features: DeviceFeatures) -> SlotError:
    """The sampling extensions' fields (blink/protocol/layout.py): values, and every region they
    name inside the slot's prompt arena."""
    flags, feats = int(rec["flags"]), features
    if flags & SlotFlags.LOGPROBS and not feats & DeviceFeatures.LOGPROBS:
        return SlotError.BAD_PARAMS
    if flags & SlotFlags.PROMPT_LOGPROBS and not feats & DeviceFeatures.PROMPT_LOGPROBS:
        return SlotError.BAD_PARAMS
    pres, freq, rep, mp = (
        float(rec[f]) for f in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    )
    nb = int(rec["n_logit_bias"])
    penalized = pres != 0.0 or freq != 0.0 or rep not in (0.0, 1.0) or mp != 0.0 or nb
    if penalized and not feats & DeviceFeatures.PENALTIES:
        return SlotError.BAD_PARAMS
    if not all(math.isfinite(v) for v in (pres, freq, rep, mp)) or rep < 0.0 or not 0.0 <= mp <= 1.0:
        return SlotError.BAD_PARAMS
    if int(rec["n_logprobs"]) > MAX_LOGPROBS or nb > MAX_LOGIT_BIAS:
        return SlotError.BAD_PARAMS
    n, off = int(rec["prompt_len"]), int(rec["prompt_offset"])
    prompt_n = int(rec["n_logprobs"]) if flags & SlotFlags.PROMPT_LOGPROBS else None
    arena = view.geo.prompt_arena_tokens
    if off + prompt_region_words(n, nb, None) > arena:
        return SlotError.BAD_PARAMS
    if nb:
        bias = view.prompt_arena[off + n : off + n + 2 * nb].view(LOGIT_BIAS_DTYPE)
        if int(bias["token"].min()) < 0 or int(bias["token"].max()) >= vocab_size:
            return SlotError.BAD_PARAMS
        if not np.all(np.isfinite(bias["bias"])):
            return SlotError.BAD_PARAMS
    if prompt_n is not None:
        lo = int(rec["prompt_logprobs_offset"])
        if lo + n * prompt_logprob_record(prompt_n).itemsize // 4 > arena:
            return SlotError.BAD_PARAMS
    return SlotError.NONE


def seq_sampling(rec: np.void, view: RingView) -> SeqSampling | None:
    """The request's SeqSampling, or None when it uses none of the extensions."""
    flags, n, off, nb = (
        int(rec["flags"]),
        int(rec["prompt_len"]),
        int(rec["prompt_offset"]),
        int(rec["n_logit_bias"]),
    )
    rep = float(rec["repetition_penalty"]) or 1.0
    pres, freq, mp = float(rec["presence_penalty"]), float(rec["frequency_penalty"]), float(rec["min_p"])
    want = flags & (SlotFlags.LOGPROBS | SlotFlags.PROMPT_LOGPROBS)
    if not (want or nb or pres or freq or mp or rep != 1.0):
        return None
    bias = view.prompt_arena[off + n : off + n + 2 * nb].view(LOGIT_BIAS_DTYPE).copy()
    nl = int(rec["n_logprobs"])
    return SeqSampling(
        presence=pres,
        frequency=freq,
        repetition=rep,
        min_p=mp,
        bias_ids=bias["token"].astype(np.int32),
        bias_vals=bias["bias"].astype(np.float32),
        n_logprobs=nl if flags & SlotFlags.LOGPROBS else -1,
        prompt_n=nl if flags & SlotFlags.PROMPT_LOGPROBS else -1,
        prompt_lp_offset=int(rec["prompt_logprobs_offset"]),
    )
