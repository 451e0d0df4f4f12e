"""A claimed slot's request as the device reads it at admission: whether it can be served
(`validate`: the SlotError it finishes with otherwise) and its sampling parameters (`sampling_of`:
the request's blink.protocol.sampling_params.SamplingParams; its token mask), each read from the slot record and
the prompt region it names in the prompt arena (blink/protocol/layout.py).
"""

from __future__ import annotations

import numpy as np

from blink.protocol.layout import (
    BLOCK_KEY_WORDS,
    LOGIT_BIAS_DTYPE,
    MAX_LOGIT_BIAS,
    MAX_STOP_IDS,
    DeviceFeatures,
    SlotError,
    prompt_logprob_record,
    prompt_region_words,
)
from blink.protocol.ring_geometry import RingView
from blink.protocol.sampling_params import SamplingParams


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
    if int(rec["n_stop"]) > MAX_STOP_IDS or int(rec["max_new_tokens"]) == 0:
        return SlotError.BAD_PARAMS
    return _validate_sampling(rec, view, vocab_size, features)


def _validate_sampling(rec: np.void, view: RingView, vocab_size: int, features: DeviceFeatures) -> SlotError:
    """The sampling parameters (SamplingParams.problem, the one definition of their ranges), every
    region they name inside the slot's prompt arena, and the device features they need."""
    nb, n, off = int(rec["n_logit_bias"]), int(rec["prompt_len"]), int(rec["prompt_offset"])
    arena = view.geo.prompt_arena_tokens
    if nb > MAX_LOGIT_BIAS or off + prompt_region_words(n, nb, None) > arena:
        return SlotError.BAD_PARAMS
    sp = sampling_of(rec, view)
    if sp.problem(vocab_size) is not None:
        return SlotError.BAD_PARAMS
    if sp.prompt_logprobs >= 0:
        lo = int(rec["prompt_logprobs_offset"])
        if lo + n * prompt_logprob_record(sp.prompt_logprobs).itemsize // 4 > arena:
            return SlotError.BAD_PARAMS
    need = DeviceFeatures.NONE
    if sp.logprobs >= 0:
        need |= DeviceFeatures.LOGPROBS
    if sp.prompt_logprobs >= 0:
        need |= DeviceFeatures.PROMPT_LOGPROBS
    if sp.penalized or sp.min_p != 0.0:
        need |= DeviceFeatures.PENALTIES
    mask = int(rec["mask_slot"])  # 0: none; m + 1: bitmask m of the mask arena
    if mask:
        need |= DeviceFeatures.TOKEN_MASK
        if mask > view.geo.n_masks:
            return SlotError.BAD_PARAMS
    return SlotError.NONE if need & features == need else SlotError.BAD_PARAMS


def sampling_of(rec: np.void, view: RingView) -> SamplingParams:
    """The request's SamplingParams (its logit_bias from the prompt region; validate checked that
    the region lies inside the arena)."""
    n, off, nb = int(rec["prompt_len"]), int(rec["prompt_offset"]), int(rec["n_logit_bias"])
    bias = view.prompt_arena[off + n : off + n + 2 * nb].view(LOGIT_BIAS_DTYPE)
    return SamplingParams.from_slot(rec, bias)


def validate_keys(rec: np.void, view: RingView, block_size: int) -> SlotError:
    """The block keys (prefix caching): at most one per full prompt block, inside the arena."""
    nk = int(rec["n_block_keys"])
    if nk == 0:
        return SlotError.NONE
    if nk > int(rec["prompt_len"]) // block_size:
        return SlotError.BAD_PARAMS
    if int(rec["block_keys_offset"]) + BLOCK_KEY_WORDS * nk > view.geo.prompt_arena_tokens:
        return SlotError.BAD_PARAMS
    return SlotError.NONE


def block_keys(rec: np.void, view: RingView) -> list[bytes]:
    """The slot's block keys (validated by validate_keys), 16 bytes each."""
    nk, off = int(rec["n_block_keys"]), int(rec["block_keys_offset"])
    raw = view.prompt_arena[off : off + BLOCK_KEY_WORDS * nk].tobytes()
    w = 4 * BLOCK_KEY_WORDS
    return [raw[i : i + w] for i in range(0, len(raw), w)]
