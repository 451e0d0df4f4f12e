"""The GPU scheduler's KV pool and prefix cache (csrc/scheduler_kv.cuh) against blink/device/kv_blocks.py:
the CUDA header built for the host (tests/kv_pool_host.cpp, g++) and the Python BlockManager driven
by the same random operations (admissions with shared prefixes, growth, registration, frees, resets)
must hand out the same blocks, match the same prefixes and count the same free and cached blocks."""

from __future__ import annotations

import ctypes
import pathlib
import random
import shutil
import subprocess

import numpy as np
import pytest

from blink.device.kv_blocks import BlockManager
from blink.dpu.prefix_keys import KEY_BYTES, block_keys
from blink.gpu.scheduler import scheduler as S

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not installed")
    out = tmp_path_factory.mktemp("kvh") / "kv_pool_host.so"
    cmd = [
        gxx,
        "-std=c++17",
        "-O1",
        "-shared",
        "-fPIC",
        "-I",
        str(S.CSRC),
        str(HERE / "kv_pool_host.cpp"),
        "-o",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    u32, p = ctypes.c_uint32, ctypes.c_void_p
    lib.kvh_init.argtypes = [u32, u32, u32, u32]
    lib.kvh_admit.argtypes = [u32, p, u32, u32, u32, u32]
    lib.kvh_admit.restype = ctypes.c_int64
    lib.kvh_grow.argtypes = [u32, u32]
    lib.kvh_register.argtypes = [u32, u32]
    lib.kvh_free.argtypes = [u32]
    lib.kvh_table.argtypes = [u32, p]
    lib.kvh_table.restype = u32
    lib.kvh_num_free.restype = u32
    lib.kvh_num_cached.restype = u32
    return lib


def _table(lib: ctypes.CDLL, r: int, mbps: int) -> list[int]:
    out = np.zeros(mbps, np.int32)
    n = lib.kvh_table(r, out.ctypes.data)
    return out[:n].tolist()


@pytest.mark.parametrize("dense", [False, True], ids=["table", "dense-table"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_cuda_pool_and_prefix_cache_equal_the_python_policy(lib: ctypes.CDLL, seed: int, bs: int, dense: bool):
    """dense: a key table barely larger than the pool (long probe runs: deletion's backward shifts
    are exercised far more than at the scheduler's load of at most one half)."""
    rng = random.Random(seed * 31 + bs)
    nb, mbps = 24 * 16 // bs + 4, 2 * 64 // bs + 4
    lib.kvh_init(nb, bs, mbps, 1 << nb.bit_length() if dense else S.hash_entries(nb))
    bm = BlockManager(nb, bs)
    bases = [[rng.randrange(1, 40) for _ in range(64)] for _ in range(3)]
    live: dict[int, dict] = {}  # row -> keys, tokens allocated
    for _ in range(400):
        op = rng.random()
        free_rows = [r for r in range(32) if r not in live]
        if op < 0.4 and free_rows:  # admit: a prompt sharing a prefix with others
            r = rng.choice(free_rows)
            prompt = bases[rng.randrange(3)][: rng.randrange(1, 64)] + [rng.randrange(1, 40)] * rng.randrange(3)
            raw = block_keys(prompt, bs, b"k" * 16)
            keys = [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]
            cache_read, budget = rng.random() < 0.9, rng.randrange(1, 80)
            hits = bm.match(keys, len(prompt)) if cache_read else []
            start = len(hits) * bs
            n = min(len(prompt) - start, budget)
            want = start if bm.can_allocate(start + n, hits=hits) else -1
            if want >= 0:
                bm.allocate(r, start + n, hits)
                live[r] = {"keys": keys, "tokens": start + n}
            words = np.frombuffer(raw, np.uint32) if raw else np.zeros(1, np.uint32)
            got = lib.kvh_admit(r, words.ctypes.data, len(keys), len(prompt), budget, int(cache_read))
            assert got == want, (r, prompt, got, want)
        elif op < 0.6 and live:  # grow (prefill chunks, decodes)
            r = rng.choice(list(live))
            n = live[r]["tokens"] + rng.randrange(1, 20)
            ok = bm.grow(r, n)
            assert bool(lib.kvh_grow(r, n)) == ok
            if ok:
                live[r]["tokens"] = n
        elif op < 0.8 and live:  # a step computed up to here: register
            r = rng.choice(list(live))
            computed = rng.randrange(0, live[r]["tokens"] + 1)
            bm.register(r, live[r]["keys"], computed)
            lib.kvh_register(r, computed)
        elif op < 0.97 and live:  # finish or abort
            r = rng.choice(list(live))
            bm.free(r)
            lib.kvh_free(r)
            del live[r]
        else:
            bm.reset_cache()
            lib.kvh_reset()
        for r in live:
            assert _table(lib, r, mbps) == bm.table(r), r
        assert (lib.kvh_num_free(), lib.kvh_num_cached()) == (bm.num_free, bm.num_cached)
    for r in list(live):
        bm.free(r)
        lib.kvh_free(r)
    assert lib.kvh_num_free() == nb == bm.num_free
