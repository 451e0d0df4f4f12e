"""Prefix caching policy on the CPU: the block manager's key table, reference counts and LRU free
queue (blink.device.kv_blocks), the scheduler's admission from cached blocks, and the frontend's
block keys (blink.dpu.prefix_keys)."""

from __future__ import annotations

import hashlib

import pytest
from test_scheduler_policy import drain, make, step, token_for

from blink.device.kv_blocks import BlockManager
from blink.dpu.prefix_keys import KEY_BYTES, block_keys, chain_root


def keys_of(tokens, bs=4, root=b"r" * 16) -> list[bytes]:
    raw = block_keys(list(tokens), bs, root)
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


# -- block keys --------------------------------------------------------------------------------
def test_block_keys_chain_over_parent_tokens_and_root():
    root = chain_root(7, 4)
    k = keys_of(range(10), 4, root)
    assert len(k) == 2 and all(len(x) == 16 for x in k)  # full blocks only
    first = hashlib.blake2b(root + _le(range(4)), digest_size=16)
    assert k[0] == first.digest()
    assert k[1] == hashlib.blake2b(k[0] + _le(range(4, 8)), digest_size=16).digest()
    assert keys_of([9, 1, 2, 3, 4, 5, 6, 7], 4, root)[1] != k[1]  # a change in block 0 changes block 1's key
    assert keys_of(range(8), 4, chain_root(8, 4)) != keys_of(range(8), 4, root)  # another model
    assert chain_root(7, 8) != root  # another block size


def _le(tokens) -> bytes:
    return b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens)


# -- block manager -----------------------------------------------------------------------------
def test_registered_blocks_are_matched_shared_and_freed_to_the_lru_queue():
    bm = BlockManager(8, 4)
    keys = keys_of(range(13))  # 3 full blocks
    t = bm.allocate(0, 13)
    bm.register(0, keys, 8)  # blocks 0, 1 computed
    assert bm.num_cached == 2 and bm.match(keys, 13) == t[:2]
    hits = bm.match(keys, 13)
    bm.allocate(1, 13, hits)  # a running sequence's blocks, shared
    assert bm.table(1)[:2] == t[:2] and bm.table(1)[2] not in t
    assert bm.refcount(t[0]) == 2 and bm.num_free == 8 - 4 - 2
    bm.free(0)
    assert bm.refcount(t[0]) == 1 and bm.num_free == 4  # t[2], t[3] back; t[0], t[1] still held
    bm.free(1)
    assert bm.num_free == 8 and bm.num_cached == 2  # cached blocks are free (evictable) and still named
    assert bm.match(keys, 13) == t[:2]


def test_the_last_prompt_token_is_never_matched():
    bm = BlockManager(8, 4)
    keys = keys_of(range(8))
    bm.allocate(0, 8)
    bm.register(0, keys, 8)
    assert len(bm.match(keys, 8)) == 1  # 8 tokens: block 1 holds the last one, computed again
    assert len(bm.match(keys, 9)) == 2


def test_eviction_takes_uncached_blocks_first_then_least_recently_used():
    bm = BlockManager(6, 4)
    a, b = keys_of(range(100, 108)), keys_of(range(200, 208))
    ta = bm.allocate(0, 8)
    bm.register(0, a, 8)
    bm.free(0)
    tb = bm.allocate(1, 8)
    bm.register(1, b, 8)
    bm.free(1)
    assert bm.num_cached == 4 and bm.num_free == 6
    bm.allocate(2, 8)  # the 2 never-keyed blocks first
    assert bm.num_cached == 4
    bm.free(2)
    bm.allocate(3, 12)  # 2 uncached, then a's blocks (least recently used), tail block first
    assert bm.table(3)[2] == ta[1] and bm.num_cached == 3
    assert bm.match(a, 9) == ta[:1] and bm.match(b, 9) == tb  # a keeps its head block
    bm.free(3)


def test_a_hit_refreshes_recency():
    bm = BlockManager(4, 4)
    a, b = keys_of(range(100, 104)), keys_of(range(200, 204))
    for sid, k in ((0, a), (1, b)):
        bm.allocate(sid, 4)
        bm.register(sid, k, 4)
        bm.free(sid)
    bm.allocate(2, 5, bm.match(a, 5))  # a used again: b is now the older one
    bm.free(2)
    bm.allocate(3, 8)  # 2 uncached blocks
    bm.allocate(4, 4)  # evicts b
    assert bm.match(a, 5) and not bm.match(b, 5)


def test_can_allocate_counts_idle_hits_as_taken():
    bm = BlockManager(3, 4)
    keys = keys_of(range(8))
    bm.allocate(0, 8)
    bm.register(0, keys, 8)
    bm.free(0)
    hits = bm.match(keys, 9)
    assert len(hits) == 2 and bm.num_free == 3
    assert bm.can_allocate(12, hits=hits)  # 2 hits + 1 new
    assert not bm.can_allocate(13, hits=hits)


def test_a_block_computed_twice_is_registered_once_and_reset_forgets_all():
    bm = BlockManager(8, 4)
    keys = keys_of(range(8))
    bm.allocate(0, 8)
    bm.allocate(1, 8)
    bm.register(0, keys, 8)
    bm.register(1, keys, 8)
    assert bm.num_cached == 2 and bm.match(keys, 9) == bm.table(0)
    assert bm.reset_cache() == 2 and bm.match(keys, 9) == [] and bm.num_cached == 0
    bm.free(0)
    bm.free(1)
    assert bm.num_free == 8


def test_caching_off_matches_and_registers_nothing():
    bm = BlockManager(8, 4, caching=False)
    keys = keys_of(range(8))
    bm.allocate(0, 8)
    bm.register(0, keys, 8)
    assert bm.num_cached == 0 and bm.match(keys, 9) == []


# -- scheduler ---------------------------------------------------------------------------------
def test_admission_starts_after_the_cached_prefix_and_counts_queries_and_hits():
    s = make(block_size=4)
    prompt = list(range(1, 15))  # 14 tokens, 3 full blocks
    s.add(0, prompt, max_new_tokens=2, block_keys=keys_of(prompt))
    drain(s)
    assert s.blocks.num_cached == 3 and s.cache_hits == 0 and s.cache_queries == 14
    s.add(1, prompt, max_new_tokens=2, block_keys=keys_of(prompt))
    plan, _ = step(s)
    (c,) = plan.chunks
    assert (c.start, c.n, c.sample) == (12, 2, True) and c.seq.cached_tokens == 12
    assert s.cache_hits == 12 and s.cache_queries == 28
    drain(s)
    assert s.blocks.num_free == s.blocks.num_blocks and not s.seqs


def test_a_running_sequences_blocks_are_shared_and_outputs_match():
    s = make(block_size=4, max_num_batched_tokens=64)
    prompt = list(range(1, 21))  # 5 full blocks; block 4 holds the last token
    s.add(0, prompt, max_new_tokens=30, block_keys=keys_of(prompt))
    step(s)  # prefilled, now decoding
    s.add(1, prompt, max_new_tokens=30, block_keys=keys_of(prompt))
    plan, _ = step(s)
    chunk = [c for c in plan.chunks if c.seq.seq_id == 1][0]
    assert chunk.start == 16  # the 4 blocks before the last token's
    assert s.blocks.table(1)[:4] == s.blocks.table(0)[:4]
    assert s.blocks.table(1)[4] != s.blocks.table(0)[4]


def test_cache_read_off_computes_every_token_but_registers():
    s = make(block_size=4)
    prompt = list(range(1, 15))
    s.add(0, prompt, max_new_tokens=1, block_keys=keys_of(prompt))
    drain(s)
    s.add(1, prompt, max_new_tokens=1, block_keys=keys_of(prompt), cache_read=False)
    plan, _ = step(s)
    assert plan.chunks[0].start == 0 and plan.chunks[0].seq.cached_tokens == 0
    drain(s)


def test_preempted_sequence_is_readmitted_from_its_own_cached_blocks():
    s = make(max_batch=2, max_num_batched_tokens=64, max_context=40, num_blocks=10, block_size=4)
    p0, p1 = list(range(1, 17)), list(range(101, 117))
    s.add(0, p0, max_new_tokens=20, block_keys=keys_of(p0))
    s.add(1, p1, max_new_tokens=20, block_keys=keys_of(p1))
    starts = {}  # (seq, preemption) -> where its first chunk after that preemption began
    for _ in range(200):
        plan = s.schedule()
        if plan is None:
            break
        for c in plan.chunks:
            starts.setdefault((c.seq.seq_id, c.seq.preemptions), c.start)
        s.update(plan, [token_for(c.seq.seq_id, c.seq.num_generated) for c in plan.chunks])
    assert not s.seqs and s.blocks.num_free == 10
    again = [st for (sid, n), st in starts.items() if n > 0]
    assert again and all(st % 4 == 0 for st in again) and max(again) >= 4, starts


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_leaked_blocks_none_after_a_random_mix(bs):
    import random

    rnd = random.Random(bs)
    s = make(max_batch=4, max_num_batched_tokens=64, max_context=120, num_blocks=40 * 4 // bs + 8, block_size=bs)
    bases = [[rnd.randrange(1, 50) for _ in range(60)] for _ in range(3)]
    sid = 0
    for _ in range(60):
        p = bases[rnd.randrange(3)][: rnd.randrange(1, 60)] + [rnd.randrange(1, 50) for _ in range(rnd.randrange(4))]
        s.add(sid, p, max_new_tokens=rnd.randrange(1, 8), block_keys=keys_of(p, bs))
        sid += 1
        step(s)
        if rnd.random() < 0.1 and s.seqs:
            s.abort(rnd.choice(list(s.seqs)))
    drain(s)
    assert not s.seqs and s.blocks.num_free == s.blocks.num_blocks and s.cache_hits > 0


def test_the_kv_cache_key_names_what_makes_the_kv():
    """header.kv_cache_key, the seed of every block key chain, changes with whatever changes a token's
    K/V: the model, its random seed, the weights' quantization and the KV cache's dtype."""
    from blink.device.process import kv_cache_key
    from blink.protocol.wire import DeviceSpec

    base = dict(ring="r", kind="emulated", model="random:tiny-llama", scheduler="host", max_batch=4)
    base.update(max_num_batched_tokens=64, kv_block_size=16, num_kv_blocks=32, kv_cache_fraction=0.9, max_context=0)
    key = lambda **kw: kv_cache_key(DeviceSpec(**{**base, **kw}))  # noqa: E731
    assert key() == key(max_batch=8)  # scheduling does not change the KV
    changed = [key(model="random:tiny-qwen3"), key(seed=1), key(quantization="fp8"), key(kv_cache_dtype="fp8")]
    assert len({key(), *changed}) == 5
