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
or right after it with include_stop (vLLM's include_stop_str_in_output). The first stop string to
end in the text wins. Each decoded character is looked at once (stop_matcher.py): the work is
linear in the output, whatever the stop strings, and only the held-back suffix is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .stop_matcher import key, matcher

_REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Per-request state. `decode(ids) -> str` must skip special tokens (EOS is not text)."""

    def __init__(self, decode: Decode, stop: Sequence[str] = (), include_stop: bool = False):
        self._decode = decode
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self._matcher = matcher(key(self.stop)) if self.stop else None
        self._state = 0  # the matcher's state after all text so far
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._held = ""  # decoded text not yet returned: a suffix that may begin a stop string
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
        return self._emit(self._decode_new(), final=False)

    def finish(self) -> str:
        """End of generation: flush held-back bytes (an incomplete character stays U+FFFD) and text."""
        if self.stopped:
            return ""
        new = ""
        if self._read < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            new = self._decode(self._ids[self._prefix :])[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)
        return self._emit(new, final=True)

    def _emit(self, new: str, final: bool) -> str:
        if self._matcher is None:
            return new
        m = self._matcher.feed(new, self._state)
        text = self._held + new
        if m.end != -1:  # a stop string ends at new[m.end - 1]
            end = len(self._held) + m.end
            self._held, self.stopped = "", True
            return text[: end if self.include_stop else end - m.length]
        self._state = m.state
        keep = 0 if final else self._matcher.depth[m.state]  # may begin a stop string
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]
