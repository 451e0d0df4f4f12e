"""KV block manager: which physical KV blocks each sequence holds, and the prefix cache over them.

The pool holds `num_blocks` blocks of `block_size` tokens; the executor holds the bytes, this
module only hands out block ids. A sequence of n tokens holds ceil(n / block_size) blocks, in
logical order (its block table).

Prefix caching (vLLM's automatic prefix caching, full blocks only). A full block of a prompt has a
128-bit key that the frontend chained over its tokens and every block before it (the slot's block
keys, blink/protocol/layout.py), so equal keys mean equal KV. Once a sequence has computed a full
block whose key it carries, the block is registered: key -> block. A later sequence whose leading
keys are registered takes a reference on those blocks instead of computing them (`match`, then
`allocate(..., hits)`); several running sequences may hold one block. A sequence's last, partial
block is always its own (a block is matched only when it is full and not the block of the prompt's
last token, which must be computed to give logits).

Every block not held by a running sequence (reference count 0) is in the free queue, cached or
not; `num_free` counts them all, so a cached block costs no capacity. A new allocation takes the
front of the queue; taking a cached block evicts its key. A freed block with a key goes to the
back (least recently used first out); a freed block without one goes to the front (reused before
any cached block). A sequence's blocks are freed tail first, so its deepest blocks, the least
likely to be shared, are evicted first. Two sequences that compute the same block at the same time
each keep their own copy; the first one registered is the one matched.

With caching off, or for sequences without keys, nothing is registered and this is a plain pool
(no block ever shared). This policy serves the emulated device and the CUDA host loop; the
GPU-resident scheduler implements the same one over device arrays
(blink/gpu/scheduler/csrc/scheduler_kv.cuh); tests/conformance/test_prefix.py checks both.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: next out
        self._ref = [0] * num_blocks  # running sequences holding each block
        self._key: list[bytes | None] = [None] * num_blocks  # the key a block is registered under
        self._cached: dict[bytes, int] = {}  # key -> block
        self._tables: dict[int, list[int]] = {}
        self._checked: dict[int, int] = {}  # seq -> leading table blocks already offered to register

    @property
    def num_free(self) -> int:
        """Blocks no running sequence holds (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered under a key (held or evictable)."""
        return len(self._cached)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks a sequence of n_tokens occupies."""
        return -(-n_tokens // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        """The sequence's block table (physical block of each logical block); empty if it holds none."""
        return self._tables.get(seq_id, [])

    def extra_blocks(self, seq_id: int, n_tokens: int) -> int:
        """Blocks the sequence still needs to hold n_tokens tokens."""
        return max(0, self.blocks_for(n_tokens) - len(self.table(seq_id)))

    # -- prefix cache -------------------------------------------------------------------
    def match(self, keys: Sequence[bytes], n_tokens: int) -> list[int]:
        """The cached blocks of the longest run of leading `keys`, for a sequence of n_tokens: at most
        the full blocks before the one of its last token (that token is always computed)."""
        if not self.caching:
            return []
        hits: list[int] = []
        for key in keys[: (n_tokens - 1) // self.block_size]:
            b = self._cached.get(key)
            if b is None:
                break
            hits.append(b)
        return hits

    def register(self, seq_id: int, keys: Sequence[bytes], n_computed: int) -> None:
        """Register the sequence's full blocks among its first n_computed tokens that have keys."""
        done = self._checked.get(seq_id, 0)
        upto = min(len(keys), n_computed // self.block_size)
        if not self.caching or upto <= done:
            return
        table = self._tables[seq_id]
        for i in range(done, upto):
            b, key = table[i], keys[i]
            if self._key[b] is None and key not in self._cached:
                self._cached[key] = b
                self._key[b] = key
        self._checked[seq_id] = upto

    def reset_cache(self) -> int:
        """Forget every key (blocks in use keep their KV, unnamed); returns how many there were."""
        n = len(self._cached)
        for b in self._cached.values():
            self._key[b] = None
        self._cached.clear()
        return n

    # -- allocation ---------------------------------------------------------------------
    def can_allocate(self, n_tokens: int, seq_id: int | None = None, hits: Sequence[int] = ()) -> bool:
        """Whether a new sequence (or `seq_id`, growing) can hold n_tokens tokens now; a new one
        starting with the cached blocks `hits` (from match)."""
        if seq_id is not None:
            return self.extra_blocks(seq_id, n_tokens) <= len(self._free)
        idle_hits = sum(1 for b in hits if self._ref[b] == 0)  # leave the free queue when taken
        return self.blocks_for(n_tokens) - len(hits) <= len(self._free) - idle_hits

    def allocate(self, seq_id: int, n_tokens: int, hits: Sequence[int] = ()) -> list[int]:
        """Blocks for a new sequence of n_tokens tokens, starting with the cached blocks `hits`."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if not self.can_allocate(n_tokens, hits=hits):
            raise MemoryError(f"no KV space for {n_tokens} tokens ({self.num_free} blocks free)")
        for b in hits:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        self._tables[seq_id] = list(hits)
        self._checked[seq_id] = len(hits)  # registered already
        self.grow(seq_id, n_tokens)
        return self._tables[seq_id]

    def grow(self, seq_id: int, n_tokens: int) -> bool:
        """Extend the sequence's table to hold n_tokens tokens (appending a slot as it grows).
        Returns False, changing nothing, when the pool lacks the blocks."""
        table = self._tables.setdefault(seq_id, [])
        need = self.blocks_for(n_tokens) - len(table)
        if need > len(self._free):
            if not table:
                del self._tables[seq_id]
            return False
        for _ in range(need):
            table.append(self._take())
        return True

    def _take(self) -> int:
        """The front of the free queue, its key evicted."""
        b, _ = self._free.popitem(last=False)
        key = self._key[b]
        if key is not None:
            del self._cached[key]
            self._key[b] = None
        self._ref[b] = 1
        return b

    def free(self, seq_id: int) -> int:
        """Drop the sequence's references; returns how many blocks it held (0 if none). Blocks no
        other sequence holds join the free queue (cached ones at the back, tail first)."""
        table = self._tables.pop(seq_id, [])
        self._checked.pop(seq_id, None)
        for b in reversed(table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._key[b] is None:
                    self._free.move_to_end(b, last=False)
        return len(table)

    def owners(self) -> list[int]:
        return list(self._tables)

    def refcount(self, block: int) -> int:
        return self._ref[block]
