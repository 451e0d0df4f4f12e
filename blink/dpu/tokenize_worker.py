"""Tokenizer worker process: encodes texts for the frontend, so that the GIL the tokenizer holds
while it encodes (the `tokenizers` binding keeps it for the whole call) is not the frontend's.

    python -m blink.dpu.tokenize_worker      (started by blink.dpu.prompt_encoder; stdin/stdout)

Frames both ways are a 4-byte little-endian length and a msgpack body. The first frame in is the
tokenizer as `tokenizers` serializes it (Tokenizer.to_str); each later one is a text to encode, and
its answer is [True, the ids as little-endian int32 bytes] or [False, an error message]. Nothing but
`tokenizers` and msgspec is imported; the process ends when its stdin closes. It runs at a lower
CPU priority than the frontend (nice +5).
"""

from __future__ import annotations

import os
import struct
import sys
from typing import BinaryIO

import msgspec

_LEN = struct.Struct("<I")
_NICE = 5  # added to the worker's niceness


def read_frame(f: BinaryIO) -> bytes | None:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    body = f.read(n)
    return body if len(body) == n else None


def write_frame(f: BinaryIO, body: bytes) -> None:
    f.write(_LEN.pack(len(body)) + body)
    f.flush()


def main() -> int:
    import numpy as np
    from tokenizers import Tokenizer

    # Below the frontend in priority: where cores are few, streams and health checks come first
    # and a long prompt waits a little longer.
    os.nice(_NICE)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    first = read_frame(stdin)
    if first is None:
        return 1
    tok = Tokenizer.from_str(msgspec.msgpack.decode(first, type=str))
    enc = msgspec.msgpack.Encoder()
    while (frame := read_frame(stdin)) is not None:
        try:
            ids = tok.encode(msgspec.msgpack.decode(frame, type=str), add_special_tokens=False).ids
            reply = enc.encode((True, np.asarray(ids, dtype="<i4").tobytes()))
        except Exception as e:  # a text the tokenizer rejects: the request's error, not the worker's end
            reply = enc.encode((False, f"{type(e).__name__}: {e}"))
        write_frame(stdout, reply)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
