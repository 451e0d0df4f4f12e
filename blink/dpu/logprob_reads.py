"""The token reader's logprob reads (opt-in per request): a slot's records of its generated tokens
from the logprob arena, and its prompt's records from its region of the prompt arena (layout.py's
memory map). Each is one transact of its own, after the cycle's masks are posted."""

from __future__ import annotations

import numpy as np

from blink.protocol.layout import LOGPROB_DTYPE, prompt_logprob_record
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import Transport
from blink.protocol.wire import Logprob


def read_logprobs(t: Transport, geo: RingGeometry, slot: int, start: int, end: int, n: int) -> list[Logprob]:
    """Logprob records [start, end) of a slot (wrapping like its tokens), n alternatives each."""
    cap = geo.output_capacity
    out = np.empty(end - start, LOGPROB_DTYPE)
    i0 = start % cap
    first = min(end - start, cap - i0)
    base = geo.logprob_offset(slot, 0)
    reads = [(base + LOGPROB_DTYPE.itemsize * i0, out[:first])]
    if first < out.size:
        reads.append((base, out[first:]))
    t.transact((), reads)
    return logprobs(out["logprob"], out["top_ids"][:, :n], out["top_logprobs"][:, :n])


def read_prompt_logprobs(t: Transport, geo: RingGeometry, prompt: tuple[int, int, int, int]) -> list[Logprob]:
    """Records of prompt tokens 1 .. prompt_len - 1 (the device wrote them before token 0); prompt:
    (word offset, prompt_len, alternatives in the slot's records, alternatives wanted)."""
    off, n_prompt, n_slot, n_want = prompt
    if n_prompt < 2:
        return []
    rec = prompt_logprob_record(n_slot)
    out = np.empty(n_prompt - 1, rec)
    t.read_into(geo.prompt_arena_offset + 4 * off + rec.itemsize, out)
    return logprobs(out["logprob"], out["top_ids"][:, :n_want], out["top_logprobs"][:, :n_want])


def logprobs(lp: np.ndarray, ids: np.ndarray, lps: np.ndarray) -> list[Logprob]:
    return [Logprob(a, b, c) for a, b, c in zip(lp.tolist(), ids.tolist(), lps.tolist(), strict=True)]
