"""Block keys for prefix caching: the frontend names each full KV block of a prompt, the device
matches the names (blink/device/kv_blocks.py; the ring carries them, blink/protocol/layout.py).

Key i = blake2b-128(key i-1 || token ids of block i as int32 little-endian), key -1 = the chain's
root = blake2b-128("blink-prefix-v1" || header.kv_cache_key || kv_block_size). A key therefore
covers every token up to the end of its block and what the device says makes its KV (the model:
kv_cache_key); equal keys mean equal KV. Nothing else in Blink changes the KV of given tokens
(no adapters, no multimodal inputs); whatever comes to do so must join the root.

Why blake2b at 128 bits: two different prefixes with one key would serve one request another's
KV, so the hash must make a collision impractical even for a client who crafts prompts on
purpose (a shared server): a cryptographic hash, and 128 bits puts a chance collision among
2^40 cached blocks near 2^-48. blake2b is in hashlib, takes a digest size natively (no
truncation step), and runs faster than sha256 on CPUs without SHA extensions; a 2,000-token
prompt of 16-token blocks is 125 digests, a few hundred microseconds in Python. Python's own
hash() is 64-bit and salted per process (frontends sharing a ring would disagree).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16  # layout.BLOCK_KEY_WORDS int32 words
_DOMAIN = b"blink-prefix-v1"


def chain_root(kv_cache_key: int, block_size: int) -> bytes:
    """The parent of a prompt's first block key."""
    seed = _DOMAIN + struct.pack("<QI", kv_cache_key & 0xFFFFFFFFFFFFFFFF, block_size)
    return hashlib.blake2b(seed, digest_size=KEY_BYTES).digest()


def block_keys(prompt_ids: Sequence[int], block_size: int, root: bytes) -> bytes:
    """The keys of the prompt's full blocks, concatenated (KEY_BYTES each)."""
    n = len(prompt_ids) // block_size
    if n == 0:
        return b""
    toks = np.asarray(prompt_ids[: n * block_size], dtype="<i4").tobytes()
    step = 4 * block_size
    out = bytearray()
    parent = root
    blake2b = hashlib.blake2b
    for i in range(0, n * step, step):
        parent = blake2b(parent + toks[i : i + step], digest_size=KEY_BYTES).digest()
        out += parent
    return bytes(out)
