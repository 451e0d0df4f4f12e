"""The GPU scheduler's control block, generated header and configuration (its build: test_gpu_compile.py)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from blink.gpu.scheduler import scheduler as S


def test_ctl_header_is_generated_from_the_dtype():
    assert S.CTL_HEADER_PATH.read_text() == S.render_ctl_header(), "run `python -m blink.gpu.scheduler.scheduler`"
    assert S.main(["--check"]) == 0


def test_ctl_dtype_is_aligned_and_complete():
    d = S.SCHED_CTL_DTYPE
    for name in d.names:
        base = d.fields[name][0]
        assert d.fields[name][1] % base.itemsize == 0, name
    # the host fills these before the launch; the kernel never runs without them
    for name in ("ring", "engine", "claim", "waitq", "kv_free", "row_blocks", "row_tokens", "slot_copy", "self_exec"):
        assert d.fields[name][0] == np.dtype("<u8"), name


def test_config_rejects_out_of_range_values():
    with pytest.raises(ValueError):
        S.GpuSchedulerConfig(window=121)
    with pytest.raises(ValueError):
        S.GpuSchedulerConfig(beat_s=0.01)
    with pytest.raises(ValueError):
        S.GpuSchedulerConfig(max_batch=-1)


# The kernel's NVRTC build and its one-block budget: tests/test_gpu_compile.py (every target arch).


# -- the CUDA device process's engine settings, derived from its spec (blink.gpu.serve), no GPU needed --


def test_engine_settings_derive_from_the_blink_serve_spec():
    from blink.config import build
    from blink.gpu.serve import engine_config
    from blink.launch import device_spec

    cfg = build(None, {"device": {"kind": "cuda", "max_batch": 64, "max_num_batched_tokens": 32, "num_kv_blocks": 900}})
    e = engine_config(device_spec(cfg, "ring-x"), max_position=100_000)
    assert (e.max_seqs, e.num_kv_blocks, e.block_size) == (64, 900, cfg.device.kv_block_size)
    assert e.max_num_batched_tokens == 64  # a step holds at least one token per sequence
    assert e.max_context == 100_000 - 100_000 % 16  # the model's max_position_embeddings: no 8192 cap
    assert e.kv_fraction == cfg.device.kv_cache_fraction == 0.9  # one default, in blink/config.py


def test_engine_context_is_whole_kv_blocks():
    from blink.config import build
    from blink.gpu.serve import engine_config
    from blink.launch import device_spec

    cfg = build(None, {"device": {"kind": "cuda", "max_context": 1000, "kv_block_size": 16}})
    spec = device_spec(cfg, "r")
    assert engine_config(spec, max_position=2048).max_context == 992
    assert engine_config(msgspec.structs.replace(spec, max_context=0), max_position=500).max_context == 496


def test_the_mixed_step_budget_reaches_the_spec_and_its_budgets_are_token_buckets():
    """blink serve on cuda: mixed steps get DEFAULT_MIXED_TOKENS, and every budget a mixed step of
    up to max_batch decodes can fill is a captured token bucket (no padding to the next power of 2)."""
    from blink.config import DEFAULT_MIXED_TOKENS, build
    from blink.device.policy import step_budget
    from blink.gpu.serve import engine_config
    from blink.launch import device_spec

    spec = device_spec(build(None, {"device": {"kind": "cuda", "max_batch": 256}}), "r")
    assert (spec.max_num_batched_tokens, spec.mixed_tokens) == (2048, DEFAULT_MIXED_TOKENS)
    e = engine_config(spec, max_position=8192)
    budgets = {step_budget(2048, spec.mixed_tokens, d, n) for d in range(1, 257) for n in (0, 300, 3000, 30_000)}
    assert budgets <= set(e.token_buckets) and {192, 384, 768, 1536} <= budgets
    off = device_spec(build(None, {"device": {"kind": "cuda", "mixed_tokens": 0}}), "r")
    assert off.mixed_tokens == 0 and 192 not in engine_config(off, max_position=8192).token_buckets
    emulated = device_spec(build(None, {"device": {"kind": "emulated"}}), "r")
    assert emulated.mixed_tokens == 0  # no graphs to fill: the whole max_num_batched_tokens


def test_slot_copy_holds_one_ring_slot_per_slot():
    """slot_copy is a RingSlot[n_slots] on the device: sized from the ring layout, never by hand
    (a hand-written 128 overflowed it when slots grew to 192 bytes and hung the GPU scheduler)."""
    import re

    header = (S.CSRC / "blink_ring.h").read_text()
    slot_bytes = int(re.search(r"constexpr uint32_t SLOT_BYTES = (\d+);", header).group(1))
    bufs = S.device_buffers(n_slots=7, num_blocks=3, max_blocks_per_seq=2, rows_cap=5, max_context=11)
    n, dtype = bufs["slot_copy"]
    assert n * np.dtype(dtype).itemsize == 7 * slot_bytes
    # every buffer pointer of SchedCtl that the host allocates is in the table
    kv = {"kv_ref", "kv_link", "kv_key", "kv_hash", "kv_takes", "slot_keys"}
    assert set(bufs) == {"claim", "waitq", "kv_free", "row_blocks", "row_tokens", "slot_copy", *kv}
    assert all(S.SCHED_CTL_DTYPE.fields[k][0] == np.dtype("<u8") for k in kv)


def test_prefix_cache_buffers_are_sized_for_the_pool():
    """The key table has a power of two of at least twice the pool's entries (linear probing stays
    short and never fills: at most one key per block); the per-slot keys hold a full context's."""
    for nb in (1, 2, 3, 1000, 1024, 1025, 100_000):
        h = S.hash_entries(nb)
        assert h >= 2 * nb and h & (h - 1) == 0 and h < 4 * nb + 2
    bufs = S.device_buffers(n_slots=7, num_blocks=3, max_blocks_per_seq=2, rows_cap=5, max_context=11)
    assert bufs["slot_keys"][0] == 7 * 2 * 4 and bufs["kv_link"][0] == 2 * 3
    assert bufs["kv_hash"][0] == 5 * S.hash_entries(3) and bufs["kv_key"][0] == 5 * 3
    # every row may free a shared block: the pending list has room for every table entry
    assert bufs["kv_free"][0] >= 5 * 2


def test_scheduler_launches_are_checked_against_the_kernels_signatures():
    """The scheduler's three kernels are launched by parameter name, packed from their signatures in
    kernel_params.json (was: positional ctypes lists kept by hand)."""
    import ctypes

    args = S.launch_args(S.INIT_KERNEL, c=0x1000, n_slots=7, num_kv_blocks=9)
    assert [type(a) for a in args] == [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32]
    assert [a.value for a in args] == [0x1000, 7, 9]
    assert [a.value for a in S.launch_args(S.KERNEL, c=0x2000)] == [0x2000]
    assert [a.value for a in S.launch_args("blink_sched_clock", out=0x3000)] == [0x3000]
    with pytest.raises(TypeError, match="missing"):
        S.launch_args(S.INIT_KERNEL, c=0x1000, n_slots=7)
