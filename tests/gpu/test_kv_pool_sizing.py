"""The KV pool's size counts the device memory CuPy's pool keeps cached after frees (FP8 random
weights are made in bf16 and quantized: 8 GB of bf16 freed for Llama-3-8B; a checkpoint's staging
buffer), and an FP8 engine holds more KV blocks than a bf16 one of the same model."""

from __future__ import annotations

import gc

import pytest

pytestmark = pytest.mark.gpu


def test_memory_cached_by_cupys_pool_counts_for_the_kv_pool():
    import cupy as cp

    from blink.gpu.engine.engine import Engine
    from blink.gpu.engine.engine_config import EngineConfig
    from blink.models.config import preset

    c, e = preset("llama3-8b"), EngineConfig()
    per_block = c.num_layers * 2 * e.block_size * c.kv_size * 2
    cp.get_default_memory_pool().free_all_blocks()
    clean = Engine._pool_blocks(e, c, 8192)
    a = cp.empty(16 << 30, dtype=cp.uint8)
    del a  # 16 GiB cached by the pool, free for anything CuPy allocates next
    cached = Engine._pool_blocks(e, c, 8192)
    assert abs(cached - clean) * per_block < 256 << 20, (clean, cached)


def test_fp8_weights_leave_room_for_more_kv_blocks():
    import cupy as cp

    from blink.gpu.engine.engine import Engine
    from blink.gpu.engine.engine_config import EngineConfig
    from blink.models.config import preset

    c = preset("llama3-8b")
    blocks = {}
    for q in ("", "fp8"):
        eng = Engine.create(c, EngineConfig(max_seqs=8, quantization=q))
        blocks[q] = eng.dims.num_blocks
        eng.close()
        del eng
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
    per_block = c.num_layers * 2 * EngineConfig().block_size * c.kv_size * 2
    # The layers' weights: 13.96 GB in bf16, 6.98 GB in fp8 (6.5 GiB saved); the FP8 path's activation
    # buffers and kv_fraction (0.85) take part of that back: 4.85 GiB more KV measured on the H200
    # (47,884 -> 50,365 blocks here). With the pool's cache uncounted the FP8 engine got fewer blocks
    # than the bf16 one (52,217 vs 52,461 in bench.engine.throughput).
    saved = (blocks["fp8"] - blocks[""]) * per_block
    assert saved > 4 << 30, blocks
