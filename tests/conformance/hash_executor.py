"""A stand-in model for protocol tests: next-token logits are a hash of the whole context *as read
back from the executor's KV pool* through the block table.

So a wrong block table, a block reused while still owned, or a stale K/V entry changes the
context it sees and so the tokens: the outputs match `reference_greedy` (computed without any
cache) only when the device's KV bookkeeping is right. It is fast (no matmuls), so protocol
tests spend their time on the protocol.
"""

from __future__ import annotations

import zlib

import numpy as np

from blink.device.executor import StepBatch
from blink.device.sampling import sample

_UNWRITTEN = -1


def context_logits(context: np.ndarray, vocab_size: int) -> np.ndarray:
    """(vocab,) float32 logits of the next token after `context` (int32 token ids)."""
    h = zlib.crc32(np.ascontiguousarray(context, dtype=np.int32).tobytes())
    return (np.random.default_rng(h).standard_normal(vocab_size) * 4.0).astype(np.float32)


def reference_greedy(prompt: list[int], n: int, vocab_size: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(int(np.argmax(context_logits(np.asarray(ctx, np.int32), vocab_size))))
    return ctx[len(prompt) :]


class HashExecutor:
    def __init__(
        self,
        vocab_size: int = 512,
        num_blocks: int = 64,
        block_size: int = 16,
        max_batch: int = 8,
        max_num_batched_tokens: int = 64,
        max_context: int = 1024,
        step_delay_s: float = 0.0,
    ):
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_context = max_context
        self.step_delay_s = step_delay_s
        self.pool = np.full((num_blocks, block_size), _UNWRITTEN, np.int32)  # the "KV": token ids
        self.steps: list[tuple[int, int]] = []  # (num_seqs, num_tokens) of every step

    def execute(self, batch: StepBatch) -> np.ndarray:
        S, T = batch.num_seqs, batch.num_tokens
        if S > self.max_batch or T > self.max_num_batched_tokens:
            raise ValueError(f"step of {S} seqs / {T} tokens exceeds {self.max_batch} / {self.max_num_batched_tokens}")
        self.steps.append((S, T))
        bs = self.block_size
        logits = np.empty((S, self.vocab_size), np.float32)
        for i in range(S):
            lo, hi = int(batch.cu_q_lens[i]), int(batch.cu_q_lens[i + 1])
            table = batch.block_tables[i]
            pos = batch.positions[lo:hi]
            if hi > lo and int(pos[-1]) + 1 != int(batch.seq_lens[i]):
                raise ValueError("seq_lens must be the last position + 1")
            self.pool[table[pos // bs], pos % bs] = batch.input_ids[lo:hi]
            n = int(batch.seq_lens[i])
            if n > self.max_context:
                raise ValueError(f"sequence of {n} tokens exceeds max_context {self.max_context}")
            p = np.arange(n)
            ctx = self.pool[table[p // bs], p % bs]
            if (ctx == _UNWRITTEN).any():
                raise ValueError("read a KV entry that was never written")
            logits[i] = context_logits(ctx, self.vocab_size)
        if self.step_delay_s:
            import time

            time.sleep(self.step_delay_s)
        return sample(logits, batch.temperature, batch.top_p, batch.top_k, batch.seed, batch.sample_pos)

    def close(self) -> None:
        self.pool = np.zeros((0, self.block_size), np.int32)


def make(
    model: str,
    *,
    num_blocks: int,
    block_size: int,
    max_batch: int,
    max_num_batched_tokens: int,
    max_blocks_per_seq: int | None = None,
) -> HashExecutor:
    """Executor factory for `python -m blink.device.emulated --executor conformance.hash_executor:make`.
    `model` is "hash" or "hash:<vocab>"."""
    name, _, vocab = model.partition(":")
    if name != "hash":
        raise ValueError(f"the hash executor takes model 'hash[:vocab]', got {model!r}")
    width = num_blocks if max_blocks_per_seq is None else max_blocks_per_seq
    return HashExecutor(
        vocab_size=int(vocab or 512),
        num_blocks=num_blocks,
        block_size=block_size,
        max_batch=max_batch,
        max_num_batched_tokens=max_num_batched_tokens,
        max_context=width * block_size,
    )
