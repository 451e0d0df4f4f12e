"""What a streamed response reads from its choices' generations: items (choice, kind, payload),
kind "sub" (submitted), "ev" (a TextEvent), "end" or "err" (an exception). With several choices a
pump task per choice queues them (completions.py); a request of one choice reads its generation
directly through `OneChoice`, without the task hop.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Any

from .generation import TextEvent


class OneChoice:
    """The items of a request of one choice: pulled from its generation when asked for (what a pump
    task would have queued, in the same order, without the task)."""

    def __init__(self, gen: AsyncIterator[TextEvent]):
        self.gen = gen
        self.ready: collections.deque[tuple[int, str, Any]] = collections.deque()
        self.ended = False

    def put_nowait(self, item: tuple[int, str, Any]) -> None:
        self.ready.append(item)

    async def get(self) -> tuple[int, str, Any]:
        if self.ready:
            return self.ready.popleft()
        assert not self.ended, "read past the end of the choice"
        kind, x = await next_item(self.gen)
        self.ended = kind != "ev"
        if self.ready:  # the generation was submitted meanwhile: "sub" goes first
            self.ready.append((0, kind, x))
            return self.ready.popleft()
        return (0, kind, x)


async def next_item(gen: AsyncIterator[TextEvent]) -> tuple[str, Any]:
    """A choice's next item for the response: ("ev", event), ("end", None) when its generation is
    over, or ("err", exception), handed to the response as an error status or an error event."""
    try:
        return "ev", await anext(gen)
    except StopAsyncIteration:
        return "end", None
    except asyncio.CancelledError:
        raise
    except Exception as e:
        return "err", e
