"""Engine._pool_blocks sizes the KV pool from the device's free memory. Memory that CuPy's pool keeps
cached after the weights loaded (FP8 random weights are made in bf16 and quantized; a checkpoint's FP8
staging buffer) is free for the KV pool too: the sizing must count it, or FP8 weights, half the bytes,
leave the pool no larger than bf16 ones do (no GPU: CuPy's runtime query and pool stand in)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from blink.gpu.engine.engine import Engine
from blink.gpu.engine.engine_config import EngineConfig
from blink.models.config import preset

GIB = 1 << 30


class _Device:
    """A device of `total` bytes: `used` by live arrays, `cached` held by the pool after frees."""

    def __init__(self, total: int, used: int, cached: int) -> None:
        self.total, self.used, self.cached = total, used, cached

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.used - self.cached, self.total

    def free_all_blocks(self) -> None:
        self.cached = 0


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> _Device:
    d = _Device(total=140 * GIB, used=9 * GIB, cached=8 * GIB)
    pool = SimpleNamespace(free_all_blocks=d.free_all_blocks)
    cp = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(memGetInfo=d.mem_get_info)),
                         get_default_memory_pool=lambda: pool)  # fmt: skip
    monkeypatch.setitem(sys.modules, "cupy", cp)
    return d


def test_memory_cached_by_the_pool_counts_for_the_kv_pool(device: _Device) -> None:
    c, e = preset("llama3-8b"), EngineConfig()
    n = Engine._pool_blocks(e, c, 8192)
    per_block = c.num_layers * 2 * e.block_size * c.kv_size * 2
    device.cached = 0  # the same device with nothing cached
    assert Engine._pool_blocks(e, c, 8192) == n
    assert n * per_block > 0.8 * (140 - 9) * GIB  # about kv_fraction (0.85) of what the weights left
