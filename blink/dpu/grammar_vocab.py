"""The grammar engine's view of the model's tokenizer: the bytes of every token id, which ids are
special, which end a sequence (blink/dpu/structured.py builds its matchers over it).

llguidance reads a `tokenizers` JSON itself, but it numbers the tokens it finds in order: a
tokenizer whose ids have holes (the synthetic byte-level tokenizer of the random-weight models has
no id 0, and puts BOS/EOS at the model's ids, 128,000 and up for Llama 3) is read shifted, so the
mask allows a token under one id's bytes and the matcher consumes it under another's, and an EOS past
the holes is "out of range". Such a tokenizer, when it is byte-level (GPT-2's byte-to-character
map: the synthetic one, Llama 3, Qwen, SmolLM2), is handed to the engine as an explicit table of
every id's bytes instead. A tokenizer without holes is read by the engine itself, as before.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

log = logging.getLogger("blink.structured")


@functools.cache
def byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level map, inverted: the character that spells each byte -> the byte."""
    byte_ids = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = list(byte_ids)  # a printable byte spells itself; the others take 256, 257, ... in order
    others = [b for b in range(256) if b not in byte_ids]
    byte_ids += others
    spelled += range(256, 256 + len(others))
    return {chr(c): b for b, c in zip(byte_ids, spelled, strict=True)}


def _ids(spec: dict) -> tuple[dict[str, int], dict[int, dict]]:
    vocab = spec.get("model", {}).get("vocab")
    vocab = vocab if isinstance(vocab, dict) else {}  # a list: unigram (pieces in id order)
    return vocab, {a["id"]: a for a in spec.get("added_tokens", [])}


def _is_byte_level(spec: dict) -> bool:
    parts = [spec.get("pre_tokenizer") or {}, spec.get("decoder") or {}]
    for p in list(parts):
        parts += p.get("pretokenizers", []) + p.get("decoders", [])
    return any(p.get("type") == "ByteLevel" for p in parts)


def token_table(spec: dict, vocab_size: int) -> tuple[list[bytes], list[int]]:
    """Every id's bytes (b"" for an id the tokenizer lacks) and the special ids, of a byte-level
    tokenizer's JSON `spec`."""
    chars = byte_level_chars()
    vocab, added = _ids(spec)
    table = [b""] * vocab_size
    for s, i in vocab.items():
        if i < vocab_size and all(c in chars for c in s):
            table[i] = bytes(chars[c] for c in s)
    special = []
    for i, a in added.items():
        if i < vocab_size:
            table[i] = a["content"].encode()
            if a.get("special"):
                special.append(i)
    return table, special


class _Table:
    """What llguidance.TokenizerWrapper reads: the token table, the ids and an encoder."""

    def __init__(self, hf: Any, tokens: list[bytes], special: list[int], eos: list[int], bos: int | None):
        self.tokens, self.special_token_ids = tokens, special
        self.eos_token_id, self.bos_token_id = (eos[0] if eos else None), bos
        self._hf = hf

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._hf.encode(text, add_special_tokens=False).ids


def engine_tokenizer(hf: Any, vocab_size: int, eos_ids: list[int], bos_id: int | None = None) -> Any:
    """llguidance's tokenizer for the `tokenizers.Tokenizer` `hf` of a model with `vocab_size` ids
    (module doc). EOS ids the tokenizer lacks are left out."""
    import llguidance

    text = hf.to_str()
    spec = json.loads(text)
    vocab, added = _ids(spec)
    have = set(vocab.values()) | set(added)
    eos = [t for t in eos_ids if t in have and t < vocab_size]
    if have == set(range(len(have))) or not vocab:
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos or None)
    if not _is_byte_level(spec):
        log.warning("the tokenizer's ids are not contiguous and it is not byte-level: structured output may misread it")
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=[t for t in eos if t < len(have)] or None)
    tokens, special = token_table(spec, vocab_size)
    bos = bos_id if bos_id in have else None
    wrapper = llguidance.TokenizerWrapper(_Table(hf, tokens, special, eos, bos))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos or None)
