"""bf16 as bit patterns in uint16 arrays (numpy has no bf16): what the CUDA engine uploads and the
kernels read. Rounding is to nearest even, so a float32 that holds a bf16 value (a bf16 checkpoint
widened by a 16-bit shift) rounds back to exactly its bits."""

from __future__ import annotations

import numpy as np


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bit patterns (uint16); other float dtypes are first
    converted to float32. One uint32 temporary: a tensor of n elements costs 6n bytes beside it."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = (u >> np.uint32(16)) & np.uint32(1)
    r += np.uint32(0x7FFF)
    r += u  # modulo 2**32, as u + 0x7FFF + lsb
    r >>= np.uint32(16)
    return r.astype(np.uint16)


def bf16_bits_to_f32(a: np.ndarray) -> np.ndarray:
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
