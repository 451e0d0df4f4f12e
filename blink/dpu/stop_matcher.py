"""Stop strings found in streamed text in time linear in the text: an Aho-Corasick automaton.

A request's stop strings become one automaton (a trie of the strings with failure links), built
once per distinct set of strings (a slice at a time, between turns of the event loop) and shared
by the requests that use that set. Text is fed to
it character by character as it is decoded, never rescanned: the state after each character is
the longest suffix of all text so far that begins some stop string, so the state says both when a
stop string has just ended and how many trailing characters must be held back because a stop
string may be beginning there. The cost per request is the sum of the strings' lengths (the build,
bounded by server.max_stop_strings x server.max_stop_string_chars) plus a constant per generated
character, however long the strings and the output.
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import NamedTuple

_SLICE = 256  # trie strings or automaton states built between two turns of the event loop


class Match(NamedTuple):
    state: int  # the automaton's state after the fed text (or after the match's last character)
    end: int  # index in the fed text just past the first stop string to end there; -1: none
    length: int  # that stop string's length (the longest one ending there)


class StopMatcher:
    """An automaton over `stops` (non-empty strings). State 0 is the start; states are ints, so a
    request keeps its own state and the automaton is shared."""

    def __init__(self, stops: tuple[str, ...]):
        for _ in self._build(stops):
            pass

    @classmethod
    async def build(cls, stops: tuple[str, ...]) -> StopMatcher:
        """The same automaton, built a slice at a time between turns of the event loop (16 strings
        of 1024 characters are tens of milliseconds of Python)."""
        m = cls.__new__(cls)
        for _ in m._build(stops):
            await asyncio.sleep(0)
        return m

    def _build(self, stops: tuple[str, ...]) -> Iterator[None]:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal = [False]
        for s in stops:
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    terminal.append(False)
                node = nxt
            terminal[node] = True
            yield
        fail = [0] * len(goto)
        out = [0] * len(goto)  # length of the longest stop string ending at this state (0: none)
        queue = deque(goto[0].values())
        for child in queue:
            out[child] = depth[child] if terminal[child] else 0
        done = 0
        while queue:  # breadth first: a state's failure link is shallower, so already done
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)  # node is not the root: never child itself
                out[child] = depth[child] if terminal[child] else out[fail[child]]
                queue.append(child)
            done += 1
            if done % _SLICE == 0:
                yield
        self._goto, self._fail, self._out, self.depth = goto, fail, out, depth

    @property
    def states(self) -> int:
        return len(self._goto)

    def feed(self, text: str, state: int) -> Match:
        """Advance from `state` over `text`, stopping at the first character that ends a stop string."""
        goto, fail, out = self._goto, self._fail, self._out
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if out[state]:
                return Match(state, i + 1, out[state])
        return Match(state, -1, 0)


def key(stops: Iterable[str]) -> tuple[str, ...]:
    """The automaton's key of a request's stop strings (order and repeats do not matter)."""
    return tuple(sorted({s for s in stops if s}))


# Automata of small stop-string sets, shared by the requests that use them. A large one lives as
# long as a request holds it (built by prepare() a slice at a time); caching those would let a
# client that varies its stop strings hold memory.
_CACHE: collections.OrderedDict[tuple[str, ...], StopMatcher] = collections.OrderedDict()
_CACHE_ENTRIES = 64
_CACHE_MAX_STATES = 1024
# prepare()'s automata while a request holds them (its Call keeps the reference)
_prepared: weakref.WeakValueDictionary[tuple[str, ...], StopMatcher] = weakref.WeakValueDictionary()


def _remember(k: tuple[str, ...], m: StopMatcher) -> None:
    if m.states <= _CACHE_MAX_STATES:
        _CACHE[k] = m
        if len(_CACHE) > _CACHE_ENTRIES:
            _CACHE.popitem(last=False)


def matcher(k: tuple[str, ...]) -> StopMatcher:
    """The automaton of key(stops): cached, prepared, or built now."""
    m = _CACHE.get(k)
    if m is not None:
        _CACHE.move_to_end(k)
        return m
    m = _prepared.get(k) or StopMatcher(k)
    _remember(k, m)
    return m


async def prepare(stops: Iterable[str]) -> StopMatcher | None:
    """Build a request's automaton without holding the event loop; hand it to its detokenizer."""
    k = key(stops)
    if not k:
        return None
    m = _CACHE.get(k) or _prepared.get(k)
    if m is None:
        m = await StopMatcher.build(k)
        _remember(k, m)
        _prepared[k] = m
    return m
