"""Incremental detokenizer: token ids in, text deltas out, never broken UTF-8, stop strings honoured.

Byte-level BPE tokens are byte strings; one character (an emoji, a CJK character) may span
several tokens, and decoding a partial character yields U+FFFD. Following vLLM's incremental
detokenizer, two offsets into the token list are kept: `prefix` (start of a short window of
already-emitted tokens that gives the decoder context, e.g. for leading spaces) and `read` (end of
the emitted tokens). Each step decodes window[prefix:read] and window[prefix:]; the difference is
the new text, unless it ends in U+FFFD, in which case nothing is emitted and the bytes wait for
the next token. `finish()` flushes whatever is held back.

Stop strings: text is emitted only up to the longest suffix that could still begin a stop string,
so a stop string split across tokens is caught before any of it reaches the client; on a match the
text is cut right before the stop string (OpenAI/vLLM behaviour: the stop string is not returned),
or right after it with include_stop (vLLM's include_stop_str_in_output).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Per-request state. `decode(ids) -> str` must skip special tokens (EOS is not text)."""

    def __init__(self, decode: Decode, stop: Sequence[str] = (), include_stop: bool = False):
        self._decode = decode
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""  # all decoded text so far (emitted or held back by the stop-string rule)
        self._emitted = 0  # chars of self.text already returned
        self.stopped = False  # a stop string matched; no more text will be returned

    @property
    def token_ids(self) -> list[int]:
        """The generated token ids seen so far."""
        return list(self._ids)

    def _decode_new(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix_text):
            return ""  # incomplete character (or nothing printable yet): hold the bytes back
        self._prefix = self._read
        self._read = len(self._ids)
        return full[len(prefix_text) :]

    def push(self, ids: Sequence[int]) -> str:
        """Add new tokens; return the text that is safe to send now (maybe "")."""
        if self.stopped:
            return ""
        self._ids.extend(ids)
        # One decode over all new tokens: a character split across them comes out whole.
        self.text += self._decode_new()
        return self._emit(final=False)

    def finish(self) -> str:
        """End of generation: flush held-back bytes (an incomplete character stays U+FFFD) and text."""
        if self.stopped:
            return ""
        if self._read < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            full = self._decode(self._ids[self._prefix :])
            self.text += full[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        text = self.text
        if self.stop:
            # Any match must start at or after the first unemitted char minus (max_stop - 1):
            # everything earlier was emitted because no stop string could start there.
            start = max(0, self._emitted - self._max_stop + 1)
            cut, end_of_stop = -1, -1
            for s in self.stop:
                i = text.find(s, start)
                if i != -1 and (cut == -1 or i < cut):
                    cut, end_of_stop = i, i + len(s)
            if cut != -1:
                if self.include_stop:
                    cut = end_of_stop
                out = text[self._emitted : cut]
                self.text = text[:cut]
                self._emitted = cut
                self.stopped = True
                return out
            if not final:
                end = len(text) - self._held_suffix(text)
                out = text[self._emitted : end]
                self._emitted = max(self._emitted, end)
                return out
        out = text[self._emitted :]
        self._emitted = len(text)
        return out

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
