"""KV block manager: which physical KV blocks each sequence owns.

The pool holds `num_blocks` blocks of `block_size` tokens; the executor holds the bytes, this
module only hands out block ids. A sequence of n tokens owns ceil(n / block_size) blocks, in
logical order (its block table). Blocks are never shared (no prefix caching), so freeing a
sequence returns all of its blocks.

Free blocks are handed out lowest id first after a free (a LIFO stack): a freed block is
reused soon, which keeps the working set of the pool small on a GPU.
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks a sequence of n_tokens occupies."""
        return -(-n_tokens // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        """The sequence's block table (physical block of each logical block); empty if it owns none."""
        return self._tables.get(seq_id, [])

    def extra_blocks(self, seq_id: int, n_tokens: int) -> int:
        """Blocks the sequence still needs to hold n_tokens tokens."""
        return max(0, self.blocks_for(n_tokens) - len(self.table(seq_id)))

    def can_allocate(self, n_tokens: int, seq_id: int | None = None) -> bool:
        """Whether a new sequence (or `seq_id`, growing) can hold n_tokens tokens now."""
        need = self.blocks_for(n_tokens) if seq_id is None else self.extra_blocks(seq_id, n_tokens)
        return need <= len(self._free)

    def allocate(self, seq_id: int, n_tokens: int) -> list[int]:
        """Blocks for a new sequence of n_tokens tokens."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already owns blocks")
        if not self.grow(seq_id, n_tokens):
            raise MemoryError(f"no KV space for {n_tokens} tokens ({self.num_free} blocks free)")
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
            table.append(self._free.pop())
        return True

    def free(self, seq_id: int) -> int:
        """Return the sequence's blocks to the pool; returns how many (0 if it owned none)."""
        table = self._tables.pop(seq_id, [])
        self._free.extend(reversed(table))
        return len(table)

    def owners(self) -> list[int]:
        return list(self._tables)
