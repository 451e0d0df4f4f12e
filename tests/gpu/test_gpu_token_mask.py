"""The CUDA token mask (sampling.cu token_mask) against blink/device/sampling.py's apply_token_mask: the
kernel reads each masked row's gate (the slot's mask_position, from mapped host memory as the ring is)
and, when it is open (== sample_pos + 1), the row's bits there; masked rows of the logits (or of proc,
for rows with a penalty state) equal the definition's bit for bit, rows whose gate is closed or that
have no mask are untouched, mask_open says which, and sample_tokens gives NO_TOKEN to a closed row."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_rig import KernelRig

from blink.device import sampling
from blink.protocol.step import NO_TOKEN

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def rig() -> KernelRig:
    return KernelRig()


def _pinned(cp, a: np.ndarray):
    """A pinned, device-mapped host copy of `a` (a ring is host memory the GPU reads): (host array, device address)."""
    mem = cp.cuda.alloc_pinned_memory(a.nbytes)
    host = np.frombuffer(mem, a.dtype, a.size).reshape(a.shape)
    host[...] = a
    return mem, host, int(mem.ptr)  # pinned under unified addressing: mapped, at the same address


@pytest.mark.parametrize("vocab,mask_words", [(1000, 32), (151936, 4752), (49152, 1600), (1000, 20)])
@pytest.mark.parametrize("ext_on", [1, 0])
def test_token_mask_reads_the_gate_and_the_bits_in_the_ring(rig, vocab, mask_words, ext_on):
    import cupy as cp

    rng = np.random.default_rng(vocab + ext_on + mask_words)
    rows = 24
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    proc = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    masks = rng.integers(0, 2**32, (4, mask_words), dtype=np.uint64).astype(np.uint32)
    masks[1] = 0
    masks[1, 3] = 1 << 7  # one token allowed: 3 * 32 + 7
    mask_of = rng.integers(-1, 4, rows).astype(np.int32)  # -1: unconstrained
    pen_row = np.where(rng.random(rows) < 0.5, np.arange(rows), -1).astype(np.int32)
    sample_pos = rng.integers(0, 50, rows).astype(np.uint32)
    opened = rng.random(rows) < 0.7
    position = np.where(opened, sample_pos + 1, sample_pos).astype(np.uint32)  # mask_position per row
    keep = [_pinned(cp, masks), _pinned(cp, position)]
    (_, _, bits_at), (_, _, pos_at) = keep
    # device addresses (mask_gate, mask_bits: uint64 kernel parameters) computed in uint64: a 64-bit address
    # plus an int32 array overflows int32 (numpy 2 keeps the array's type)
    u, m = np.uint64, np.maximum(mask_of, 0).astype(np.uint64)
    gate = np.where(mask_of >= 0, u(pos_at) + u(4) * np.arange(rows, dtype=u), u(0))
    bits = np.where(mask_of >= 0, u(bits_at) + u(4 * mask_words) * m, u(0))
    d = {
        k: cp.asarray(v)
        for k, v in dict(logits=logits, proc=proc, pen_row=pen_row, gate=gate, bits=bits, pos=sample_pos).items()
    }
    mask_open = cp.full(rows, 7, cp.int32)
    n = cp.asarray(np.array([rows - 2], np.uint32))  # the last two rows are past num_seqs
    on = cp.asarray(np.array([ext_on], np.uint32))
    words = cp.asarray(np.array([mask_words], np.uint32))
    rig.launch(
        "token_mask", (rows, 1, 1), (1024, 1, 1), logits=d["logits"], proc=d["proc"], V=vocab, pen_row=d["pen_row"],
        mask_gate=d["gate"], mask_bits=d["bits"], ring_mask_words=words, sample_pos=d["pos"], mask_open=mask_open,
        num_seqs=n, ext_on=on, mask_on=on,
    )  # fmt: skip
    want_l, want_p = logits.copy(), proc.copy()
    live = range(rows - 2)
    if ext_on:
        for s in live:
            if mask_of[s] >= 0 and opened[s]:
                sampling.apply_token_mask((want_p if pen_row[s] >= 0 else want_l)[s], masks[mask_of[s]])
        want_open = np.where(mask_of >= 0, opened.astype(np.int32), -1)[: rows - 2]
        np.testing.assert_array_equal(cp.asnumpy(mask_open)[: rows - 2], want_open)
    np.testing.assert_array_equal(cp.asnumpy(d["logits"]), want_l)
    np.testing.assert_array_equal(cp.asnumpy(d["proc"]), want_p)
    for s in [s for s in live if mask_of[s] == 1 and opened[s]] if ext_on else []:
        row = (want_p if pen_row[s] >= 0 else want_l)[s]
        assert int(np.argmax(row)) == 3 * 32 + 7 and np.isinf(row).sum() == vocab - 1
    if ext_on:  # sample_tokens: NO_TOKEN for the rows whose gate was closed, a token for the others
        out = cp.zeros(rows, cp.int32)
        V = vocab
        z = cp.zeros(rows, cp.float32)
        rig.launch(
            "sample_tokens", (rows, 1, 1), (1024, 1, 1), logits=d["logits"], V=V, temperature=z,
            top_p=cp.ones(rows, cp.float32), top_k=cp.zeros(rows, cp.int32), seed=cp.zeros(rows, cp.uint64),
            sample_pos=d["pos"], out_tokens=out, num_seqs=n, proc=d["proc"], pen_row=d["pen_row"], min_p=z,
            ext_on=on, mask_on=on, mask_open=mask_open,
        )  # fmt: skip
        got = cp.asnumpy(out)[: rows - 2]
        closed = (mask_of >= 0) & ~opened
        assert (got[closed[: rows - 2]] == NO_TOKEN).all() and (got[~closed[: rows - 2]] >= 0).all()
    del keep
