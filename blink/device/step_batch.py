"""A scheduler plan packed into the executor's StepBatch (blink/protocol/step.py): the step's
tokens, positions, block tables and sampling parameters, and its SamplingExt when a sequence of
the plan uses a sampling extension.
"""

from __future__ import annotations

import itertools

import numpy as np

from .executor import SamplingExt, StepBatch
from .kv_blocks import BlockManager
from .scheduler import StepPlan


def _build_ext(plan: StepPlan, T: int) -> SamplingExt | None:
    """The step's SamplingExt, or None when no sequence of the plan uses an extension."""
    chunks = plan.chunks
    if not any(c.seq.sampling.extended or c.seq.mask >= 0 for c in chunks):
        return None
    targets = np.full(T, -1, np.int32)
    t0 = 0
    for c in chunks:
        s = c.seq
        if s.sampling.prompt_logprobs >= 0 and s.num_generated == 0:
            # packed token at position p scores prompt token p + 1 (prompt records 1 .. prompt_len - 1)
            hi = min(c.start + c.n, s.prompt_len - 1)
            if hi > c.start:
                targets[t0 : t0 + hi - c.start] = s.tokens[c.start + 1 : hi + 1]
        t0 += c.n
    return SamplingExt(
        params=[c.seq.sampling for c in chunks],
        slots=np.array([c.seq.seq_id for c in chunks], np.int32),
        fresh=np.array([c.start == 0 and c.seq.num_generated == 0 for c in chunks], bool),
        emit=np.array([c.sample for c in chunks], bool),
        targets=targets,
        mask_slot=np.array([c.seq.mask if c.sample else -1 for c in chunks], np.int32),
    )


def build_batch(plan: StepPlan, blocks: BlockManager, table_width: int) -> StepBatch:
    """Pack a plan into a StepBatch (Python lists first: one numpy conversion per field is much
    cheaper than per-element stores at decode batch sizes)."""
    S = plan.num_seqs
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    seq_lens, temperature, top_p, top_k, seed, sample_pos = [], [], [], [], [], []
    tables = np.zeros((S, table_width), np.int32)
    tabs: list[list[int]] = []
    for c in plan.chunks:
        s = c.seq
        end = c.start + c.n
        if c.n == 1:
            ids.append(s.tokens[c.start])
            pos.append(c.start)
        else:
            ids += s.tokens[c.start : end]
            pos += range(c.start, end)
        cu.append(cu[-1] + c.n)
        seq_lens.append(end)
        tabs.append(blocks.table(s.seq_id))
        sp = s.sampling
        temperature.append(0.0 if sp.greedy else sp.temperature)
        top_p.append(sp.top_p)
        top_k.append(sp.top_k)
        seed.append(sp.seed)
        sample_pos.append(s.num_generated)
    # Scatter every block table in one indexed store (row-by-row stores cost ~1 us each).
    lens = np.fromiter(map(len, tabs), np.int64, S)
    flat = np.fromiter(itertools.chain.from_iterable(tabs), np.int32, int(lens.sum()))
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    tables[np.repeat(np.arange(S), lens), np.arange(flat.size) - starts] = flat
    return StepBatch(  # lists: StepBatch converts each to its field's dtype
        input_ids=ids,
        positions=pos,
        cu_q_lens=cu,
        seq_lens=seq_lens,
        block_tables=tables,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        sample_pos=sample_pos,
        ext=_build_ext(plan, len(ids)),
    )
