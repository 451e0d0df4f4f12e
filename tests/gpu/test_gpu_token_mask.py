"""The CUDA token mask (sampling.cu token_mask) against blink/device/sampling.py's apply_token_mask:
masked rows of the logits (or of proc, for rows with a penalty state) equal the definition's bit for
bit, unmasked rows and ext_on = mask_on = 0 leave everything untouched, and a greedy sample of a masked row
picks the best allowed token."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_rig import KernelRig

from blink.device import sampling

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def rig() -> KernelRig:
    return KernelRig()


def _case(rng, rows, vocab, mask_words):
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    proc = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    masks = rng.integers(0, 2**32, (4, mask_words), dtype=np.uint64).astype(np.uint32)
    masks[1] = 0
    masks[1, 3] = 1 << 7  # one token allowed: 3 * 32 + 7
    mask_row = rng.integers(-1, 4, rows).astype(np.int32)
    pen_row = np.where(rng.random(rows) < 0.5, np.arange(rows), -1).astype(np.int32)
    return logits, proc, masks, mask_row, pen_row


@pytest.mark.parametrize("vocab,mask_words", [(1000, 32), (151936, 4752), (49152, 1600)])
@pytest.mark.parametrize("ext_on", [1, 0])
def test_token_mask_matches_the_definition(rig, vocab, mask_words, ext_on):
    import cupy as cp

    rng = np.random.default_rng(vocab + ext_on)
    rows = 24
    logits, proc, masks, mask_row, pen_row = _case(rng, rows, vocab, mask_words)
    d = {
        k: cp.asarray(v)
        for k, v in dict(logits=logits, proc=proc, masks=masks, mask_row=mask_row, pen_row=pen_row).items()
    }
    n = cp.asarray(np.array([rows - 2], np.uint32))  # the last two rows are past num_seqs
    on = cp.asarray(np.array([ext_on], np.uint32))
    rig.launch(
        "token_mask", (8, rows, 1), (256, 1, 1), logits=d["logits"], proc=d["proc"], V=vocab, pen_row=d["pen_row"],
        masks=d["masks"], mask_words=mask_words, mask_row=d["mask_row"], num_seqs=n, ext_on=on, mask_on=on,
    )  # fmt: skip
    want_l, want_p = logits.copy(), proc.copy()
    if ext_on:
        for s in range(rows - 2):
            if mask_row[s] >= 0:
                sampling.apply_token_mask((want_p if pen_row[s] >= 0 else want_l)[s], masks[mask_row[s]])
    np.testing.assert_array_equal(cp.asnumpy(d["logits"]), want_l)
    np.testing.assert_array_equal(cp.asnumpy(d["proc"]), want_p)
    one = [s for s in range(rows - 2) if mask_row[s] == 1]
    for s in one if ext_on else []:
        row = (want_p if pen_row[s] >= 0 else want_l)[s]
        assert int(np.argmax(row)) == 3 * 32 + 7 and np.isinf(row).sum() == vocab - 1
