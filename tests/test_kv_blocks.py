"""KV block manager: allocation, growth, free, exhaustion."""

from __future__ import annotations

import pytest

from blink.device.kv_blocks import BlockManager


def test_allocate_grow_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_free == 8
    t = bm.allocate(7, 5)  # 5 tokens -> 2 blocks
    assert len(t) == 2 and bm.num_free == 6
    assert bm.grow(7, 8)  # still 2 blocks
    assert bm.table(7) == t and bm.num_free == 6
    assert bm.grow(7, 9)  # a third block once token 9 arrives
    assert len(bm.table(7)) == 3 and bm.num_free == 5
    assert bm.free(7) == 3
    assert bm.num_free == 8 and bm.table(7) == []


def test_blocks_are_never_shared():
    bm = BlockManager(num_blocks=16, block_size=2)
    for sid in range(4):
        bm.allocate(sid, 7)
    owned = [b for sid in range(4) for b in bm.table(sid)]
    assert len(owned) == len(set(owned)) == 16
    assert bm.num_free == 0
    bm.free(2)
    bm.allocate(9, 8)
    owned = [b for sid in (0, 1, 3, 9) for b in bm.table(sid)]
    assert len(set(owned)) == 16


def test_exhaustion_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 12)
    assert not bm.can_allocate(5)
    assert bm.can_allocate(4)
    with pytest.raises(MemoryError):
        bm.allocate(1, 5)
    assert bm.table(1) == [] and bm.num_free == 1
    assert not bm.grow(0, 17)  # needs 2 more, 1 free
    assert len(bm.table(0)) == 3 and bm.num_free == 1
    assert bm.can_allocate(16, seq_id=0) and not bm.can_allocate(17, seq_id=0)


def test_double_allocate_and_bad_sizes_rejected():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 1)
    with pytest.raises(ValueError):
        bm.allocate(0, 1)
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    assert bm.free(5) == 0
