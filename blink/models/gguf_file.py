"""A minimal little-endian GGUF (v2/v3) reader: metadata as Python values, tensors as mmap views.

`gguf.GGUFReader` builds a numpy memmap view per string, which costs ~2 s on the 49k-token
vocabulary of SmolLM2 and is paid by every process that starts the model. This reader parses
the header with `struct` from one bytes copy (a few MB) and maps the tensor data once; the
dequantisation itself still uses `gguf.quants`. Values match `GGUFReader.fields[k].contents()`
(tested): scalars as int/float/bool/str, arrays as lists.

Layout: magic "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv x (string key, u32 type, value);
n_tensors x (string name, u32 n_dims, u64 dims[n_dims] innermost first, u32 ggml type, u64 offset);
tensor data from the next multiple of general.alignment (default 32), each at its offset.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_HEADER = 64 << 20  # metadata + tensor infos larger than this means a corrupt file


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # numpy order (outermost first), in elements
    data: np.ndarray  # raw view: the element dtype for F32/F16, else uint8 (rows..., bytes per row)
    n_bytes: int


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.off = 0

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = self.buf[self.off : self.off + n].decode("utf-8", errors="replace")
        self.off += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.scalar("<I"), self.scalar("<Q")
            if itype in _SCALARS and itype != 7:
                fmt = _SCALARS[itype]
                a = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=n, offset=self.off)
                self.off += n * a.itemsize
                return a.tolist()
            return [self.value(itype) for _ in range(n)]
        raise ValueError(f"GGUF: unknown value type {vtype}")


class GGUFFile:
    """`metadata` (dict) and `tensors` (list of GGUFTensor) of a GGUF file; data stays mapped."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        head = self._map[: min(len(self._map), _MAX_HEADER)]
        cur = _Cursor(head)
        if head[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        cur.off = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2, 3; little-endian)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-cur.off // align) * align
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        for name, dims, ttype, off in infos:
            qt = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qt]
            shape = tuple(reversed(dims))
            n_elems = int(np.prod(dims))
            n_bytes = n_elems // block * type_size
            raw = whole[start + off : start + off + n_bytes]
            if qt == GGMLQuantizationType.F32:
                data = raw.view(np.float32).reshape(shape)
            elif qt == GGMLQuantizationType.F16:
                data = raw.view(np.float16).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors.append(GGUFTensor(name, int(qt), shape, data, n_bytes))
