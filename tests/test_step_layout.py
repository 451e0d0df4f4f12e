"""The step batch layout (blink/protocol/step.py) is the one definition its users follow: StepBatch,
build_batch (blink/device/step_batch.py), the CUDA engine's arena, load_step and ABI record, and the
generated C header; a change to a field makes the header check fail. No GPU needed."""

from __future__ import annotations

import re
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from blink.gpu.engine import abi
from blink.gpu.engine.engine import Engine
from blink.gpu.engine.step_arena import Dims, arena_layout, host_views
from blink.protocol.layout import SLOT_DTYPE
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.sampling_params import SamplingParams
from blink.protocol.step import BATCH_FIELDS, FIELDS, STEP_FIELDS, StepBatch


def _batch(S: int = 3, T: int = 7, W: int = 4) -> StepBatch:
    rng = np.random.default_rng(0)
    return StepBatch(
        input_ids=rng.integers(0, 1000, T),
        positions=np.arange(T),
        cu_q_lens=[0, 1, 2, T],
        seq_lens=rng.integers(1, 60, S),
        block_tables=rng.integers(0, 100, (S, W)),
        temperature=[0.0, 0.7, 1.0],
        top_p=[1.0, 0.9, 0.5],
        top_k=[0, 5, 50],
        seed=[1, 2, 2**63 + 5],
        sample_pos=[0, 3, 9],
    )


def test_step_batch_fields_are_the_layouts():
    b = _batch()
    assert StepBatch.__slots__ == (*(f.name for f in BATCH_FIELDS), "ext") and b.ext is None
    for f in BATCH_FIELDS:
        assert getattr(b, f.name).dtype == f.dtype, f.name
    assert (b.num_seqs, b.num_tokens) == (3, 7)
    assert b.seed[2] == 2**63 + 5
    with pytest.raises(TypeError, match="missing"):
        StepBatch(input_ids=[1])
    fields = {f.name: getattr(b, f.name) for f in BATCH_FIELDS}
    with pytest.raises(TypeError, match="unknown"):
        StepBatch(**fields, logprobs=[0])


def test_build_batch_gives_the_field_dtypes():
    from blink.device.kv_blocks import BlockManager
    from blink.device.scheduler import ScheduledChunk, Seq, StepKind, StepPlan
    from blink.device.step_batch import build_batch

    blocks = BlockManager(16, 4)
    seqs = []
    for i, n in enumerate((5, 2)):
        seqs.append(
            Seq(i, list(range(10, 10 + n)), n, sampling=SamplingParams(temperature=0.5, top_p=0.9, top_k=3, seed=i))
        )
        blocks.allocate(i, n + 1)
    plan = StepPlan(StepKind.PREFILL, [ScheduledChunk(seqs[0], 0, 5, True), ScheduledChunk(seqs[1], 0, 2, True)])
    b = build_batch(plan, blocks, 4)
    for f in BATCH_FIELDS:
        assert getattr(b, f.name).dtype == f.dtype, f.name
    assert b.cu_q_lens.tolist() == [0, 5, 7] and b.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]


def test_arena_layout_follows_the_fields():
    d = Dims(max_seqs=5, max_num_batched_tokens=33, max_blocks_per_seq=6, block_size=16, num_blocks=50, max_context=96)
    layout, nbytes = arena_layout(d)
    assert list(layout) == [f.name for f in STEP_FIELDS]
    end = 0
    for f in STEP_FIELDS:
        off, n = layout[f.name]
        assert off % 16 == 0 and off >= end
        end = off + n * f.dtype.itemsize
    assert nbytes == end and layout["block_tables"] == (nbytes - 5 * 6 * 4, 5 * 6)
    assert layout["input_ids"][1] == 33 and layout["cu_q_lens"][1] == 6 and layout["seed"][1] == 5


def test_a_constrained_row_gets_the_ring_addresses_of_its_gate_and_bits():
    """Engine._load_masks (host loop): a row with mask_slot m >= 0 gets the device address of its slot's
    mask_position and of bitmask m in the mapped ring (token_mask reads them at sampling); others 0."""
    d = Dims(max_seqs=4, max_num_batched_tokens=16, max_blocks_per_seq=5, block_size=16, num_blocks=50, max_context=80)
    layout, nbytes = arena_layout(d)
    buf = np.zeros(nbytes, np.uint8)
    eng = object.__new__(Engine)
    eng.dims, eng.arena = d, SimpleNamespace(host=host_views(buf, layout))
    geo = RingGeometry(8, 64, 16, 2, 1000)
    base = 0x7F00_0000_0000
    eng.map_ring(base, geo)
    x = SimpleNamespace(slots=np.array([5, 2, 7], np.int32), mask_slot=np.array([1, -1, 0], np.int32))
    eng._load_masks(x, 3)
    h = eng.arena.host
    pos = SLOT_DTYPE.fields["mask_position"][1]
    assert int(h["mask_on"][0]) == 1 and int(h["ring_mask_words"][0]) == geo.mask_words
    assert h["mask_gate"][:3].tolist() == [base + geo.slot_offset(5) + pos, 0, base + geo.slot_offset(7) + pos]
    assert h["mask_bits"][:3].tolist() == [base + geo.mask_offset(1), 0, base + geo.mask_offset(0)]
    eng._ring = None
    eng._load_masks(SimpleNamespace(slots=x.slots, mask_slot=np.full(3, -1, np.int32)), 3)
    assert int(h["mask_on"][0]) == 0  # no constrained row: no ring needed


def test_load_step_writes_every_field_where_the_arena_has_it():
    """Engine.load_step over a host arena in plain memory: each field's bytes land at its layout offset."""
    d = Dims(max_seqs=4, max_num_batched_tokens=16, max_blocks_per_seq=5, block_size=16, num_blocks=50, max_context=80)
    layout, nbytes = arena_layout(d)
    buf = np.zeros(nbytes, np.uint8)
    eng = object.__new__(Engine)
    eng.dims, eng.arena = d, SimpleNamespace(host=host_views(buf, layout))
    eng.fwd = SimpleNamespace(sampling_rows=8)
    b = _batch()
    buf[layout["ext_on"][0]] = 1  # a previous step's: cleared by a step without extensions
    assert eng.load_step(b, step_seq=77) is False  # 7 tokens for 3 sequences: not a decode step
    for f in STEP_FIELDS:
        off, n = layout[f.name]
        got = buf[off : off + n * f.dtype.itemsize].view(f.dtype)
        if f.name == "block_tables":
            np.testing.assert_array_equal(got.reshape(4, 5)[:3, :4], b.block_tables)
        elif f.extent == "1":
            assert (
                int(got[0])
                == {
                    "num_seqs": 3,
                    "num_tokens": 7,
                    "step_seq": 77,
                    "ext_on": 0,
                    "plp_count": 0,
                    "mask_on": 0,
                    "ring_mask_words": 0,
                }[f.name]
            )
        elif f.ext:
            assert not got.any(), f.name  # not read while ext_on is 0
        else:
            np.testing.assert_array_equal(got[: b.rows(f)], getattr(b, f.name))


def _ext(S: int = 3, T: int = 7):
    from blink.device.executor import SamplingExt

    params = [
        SamplingParams(presence_penalty=0.5, logit_bias=((3, 1.0), (9, -5.0))),
        SamplingParams(min_p=0.1, logprobs=20),
        SamplingParams(frequency_penalty=1.5, repetition_penalty=1.2, logprobs=3),
    ]
    return SamplingExt(
        params=params[:S],
        slots=np.array([5, 0, 7], np.int32),
        fresh=np.array([True, False, True]),
        emit=np.array([True, True, False]),
        targets=np.full(T, -1, np.int32),
    )


def test_load_step_writes_the_extension_fields():
    """A step with SamplingExt: ext_on set, pen_row = the slot for penalized rows (-1 otherwise), the
    per-row parameters in their fields, the scored prompt tokens (targets >= 0) as plp rows with
    their sequence's alternatives (capped at MAX_LOGPROBS); slots past the engine's sampling rows are
    refused."""
    d = Dims(max_seqs=4, max_num_batched_tokens=16, max_blocks_per_seq=5, block_size=16, num_blocks=50, max_context=80)
    layout, nbytes = arena_layout(d)
    buf = np.zeros(nbytes, np.uint8)
    eng = object.__new__(Engine)
    eng.dims, eng.arena = d, SimpleNamespace(host=host_views(buf, layout))
    eng.fwd = SimpleNamespace(sampling_rows=8)
    b = _batch()
    b.ext = _ext()
    eng.load_step(b)
    h = eng.arena.host
    assert h["ext_on"][0] == 1
    np.testing.assert_array_equal(h["pen_row"][:3], [5, -1, 7])
    np.testing.assert_array_equal(h["fresh"][:3], [1, 0, 1])
    np.testing.assert_array_equal(h["emit"][:3], [1, 1, 0])
    np.testing.assert_array_equal(h["presence_penalty"][:3], [0.5, 0, 0])
    np.testing.assert_array_equal(h["frequency_penalty"][:3], [0, 0, 1.5])
    np.testing.assert_array_equal(h["repetition_penalty"][:3], np.float32([1, 1, 1.2]))
    np.testing.assert_array_equal(h["min_p"][:3], np.float32([0, 0.1, 0]))
    np.testing.assert_array_equal(h["logprobs"][:3], [-1, 20, 3])
    assert h["plp_count"][0] == 0
    b.ext.targets[[0, 3, 5]] = [11, 12, 13]  # token 0 of sequence 0, tokens 1 and 3 of sequence 2
    b.ext.params = [
        msgspec.structs.replace(p, prompt_logprobs=n) for p, n in zip(b.ext.params, [4, -1, 30], strict=True)
    ]
    eng.load_step(b)
    assert h["plp_count"][0] == 3
    np.testing.assert_array_equal(h["plp_tok"][:3], [0, 3, 5])
    np.testing.assert_array_equal(h["plp_target"][:3], [11, 12, 13])
    np.testing.assert_array_equal(h["plp_prompt_logprobs"][:3], [4, 20, 20])
    eng.fwd.sampling_rows = 7  # slot 7 has no state row
    with pytest.raises(ValueError, match="sampling rows"):
        eng.load_step(b)


def test_engine_record_and_header_point_at_every_field_with_its_type():
    text = abi.render()
    ctype = {"<u4": "uint32_t", "<u8": "uint64_t", "<i4": "int32_t", "<f4": "float"}
    for f in STEP_FIELDS:
        assert abi.ENGINE_DTYPE.fields[f.name][0] == np.dtype("<u8")
        off = abi.ENGINE_DTYPE.fields[f.name][1]
        assert re.search(rf"^  {ctype[f.dtype.str]}\* {f.name};  // offset {off}\b", text, re.M), f.name
        assert f'static_assert(offsetof(EngineABI, {f.name}) == {off}, "EngineABI.{f.name} offset");' in text
    assert FIELDS["block_tables"].extent == "S,W"


def test_changed_step_field_makes_the_header_check_fail(monkeypatch):
    assert abi.main(["--check"]) == 0
    monkeypatch.setitem(abi.POINTERS, "top_k", np.dtype("<u4"))  # as if STEP_FIELDS said top_k is u32
    assert abi.main(["--check"]) == 1
