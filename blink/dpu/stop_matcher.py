"""Stop strings found in streamed text in time linear in the text: an Aho-Corasick automaton.

A request's stop strings become one automaton (a trie of the strings with failure links), built
once per distinct set of strings and shared by every request that uses that set. Text is fed to
it character by character as it is decoded, never rescanned: the state after each character is
the longest suffix of all text so far that begins some stop string, so the state says both when a
stop string has just ended and how many trailing characters must be held back because a stop
string may be beginning there. The cost per request is the sum of the strings' lengths (the build,
bounded by server.max_stop_strings x server.max_stop_string_chars) plus a constant per generated
character, however long the strings and the output.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import NamedTuple


class Match(NamedTuple):
    state: int  # the automaton's state after the fed text (or after the match's last character)
    end: int  # index in the fed text just past the first stop string to end there; -1: none
    length: int  # that stop string's length (the longest one ending there)


class StopMatcher:
    """An automaton over `stops` (non-empty strings). State 0 is the start; states are ints, so a
    request keeps its own state and the automaton is shared."""

    def __init__(self, stops: tuple[str, ...]):
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
        fail = [0] * len(goto)
        out = [0] * len(goto)  # length of the longest stop string ending at this state (0: none)
        queue = deque(goto[0].values())
        for child in queue:
            out[child] = depth[child] if terminal[child] else 0
        while queue:  # breadth first: a state's failure link is shallower, so already done
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)  # node is not the root: never child itself
                out[child] = depth[child] if terminal[child] else out[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._out, self.depth = goto, fail, out, depth

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


@functools.lru_cache(maxsize=256)
def matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The automaton of a set of stop strings (requests that share stop strings share it)."""
    return StopMatcher(stops)
