"""Prompt encoding that never holds the event loop: short texts are encoded here, long ones by a
pool of tokenizer processes (tokenize_worker.py); chats beyond a few short messages are templated in
a thread.

The `tokenizers` binding keeps the GIL for a whole encode (a 4 MB prompt: seconds), so a worker
thread does not help: every stream, /health included, would wait. A text over INLINE_CHARS (about
8 ms of encoding) goes to a worker process instead, over a pipe that the event loop reads like any
socket. A worker serves one text at a time; texts wait for a free one. A request that goes away
while its text is encoded kills that worker (the text may take seconds more) and a fresh one starts
on the next long text. The workers start on the first long text, and end with close().
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from .tokenize_worker import _LEN
from .tokenizer import FrontendTokenizer, PromptError

log = logging.getLogger("blink.server")
INLINE_CHARS = 16 << 10  # texts up to this long are encoded on the event loop (~8 ms at most)
INLINE_MESSAGES = 64  # chats up to this many messages, without tools, are templated on the loop (< 1 ms)
_SLICE = 1 << 16  # ids turned into Python ints between two turns of the event loop


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, tokenizer_json: bytes) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "blink.dpu.tokenize_worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        w = cls(proc)
        await w._send(tokenizer_json)
        return w

    async def _send(self, body: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(_LEN.pack(len(body)) + body)
        await self.proc.stdin.drain()

    async def encode(self, text: str) -> list[int]:
        assert self.proc.stdout is not None
        await self._send(msgspec.msgpack.encode(text))
        (n,) = _LEN.unpack(await self.proc.stdout.readexactly(_LEN.size))
        ok, payload = msgspec.msgpack.decode(await self.proc.stdout.readexactly(n))
        if not ok:
            raise PromptError(f"the prompt cannot be tokenized: {payload}", "prompt")
        arr = np.frombuffer(payload, dtype="<i4")
        ids: list[int] = []
        for i in range(0, len(arr), _SLICE):  # a million ids are ~20 ms of list building: in slices
            ids += arr[i : i + _SLICE].tolist()
            await asyncio.sleep(0)
        return ids

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def stop(self) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


def _small_chat(messages: Any, template_kwargs: Mapping[str, Any] | None) -> bool:
    """A chat whose template is cheap to render on the event loop: a few messages of short string
    contents, no tools (a template may render every tool's schema as JSON)."""
    if template_kwargs and template_kwargs.get("tools"):
        return False
    if not isinstance(messages, list) or len(messages) > INLINE_MESSAGES:
        return False
    chars = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if content is not None and not isinstance(content, str):
            return False  # a list of parts: joined by the checks, part by part
        chars += len(content or "")
    return chars <= INLINE_CHARS


class PromptEncoder:
    """The token ids of prompts (chat messages through the template, or text), off the event loop
    when they are long. pool_size 0: long texts are encoded in a thread of this process."""

    def __init__(self, tokenizer: FrontendTokenizer, pool_size: int):
        self.tok = tokenizer
        self.pool_size = pool_size
        self._idle: asyncio.Queue[_Worker | None] | None = None  # None: a worker to start
        self._workers: set[_Worker] = set()
        self._json: bytes | None = None

    async def chat(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        args = (messages, add_generation_prompt, template_kwargs)
        if _small_chat(messages, template_kwargs):
            return await self.text(self.tok.chat_text(*args), add_bos=False)
        # Checking each message and rendering the template is Python work that grows with the chat
        # (70,000 short messages: 0.22 s); in a thread the loop still gets the GIL every switch interval.
        return await self.text(await asyncio.to_thread(self.tok.chat_text, *args), add_bos=False)

    async def completion(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return self.tok.completion_prompt(prompt)
        ids = await self.text(prompt)
        if not ids:
            raise PromptError("the prompt is empty", "prompt")
        return ids

    async def text(self, text: str, add_bos: bool | None = None) -> list[int]:
        """`text` as the model's tokenizer encodes it (add_bos None: with the BOS the model adds, if any)."""
        if len(text) <= INLINE_CHARS:
            return self.tok.tok.encode(text, add_bos)
        if self.pool_size == 0:
            return await asyncio.to_thread(self.tok.tok.encode, text, add_bos)
        return self.tok.tok.with_bos(await self._pooled(text), add_bos)

    async def _pooled(self, text: str) -> list[int]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.pool_size):
                self._idle.put_nowait(None)
        w = await self._idle.get()
        try:
            if w is None or not w.alive:
                if self._json is None:
                    self._json = msgspec.msgpack.encode(self.tok.tok.backend_json())
                w = await _Worker.start(self._json)
                self._workers.add(w)
            ids = await w.encode(text)
        except BaseException as e:
            # cancelled mid-text (its client left), or the worker died: a fresh one next time
            if w is not None:
                self._workers.discard(w)
                await asyncio.shield(w.stop())
            self._idle.put_nowait(None)
            if isinstance(e, (OSError, asyncio.IncompleteReadError)):
                log.warning("tokenizer worker failed (%s); starting another", e)
                raise PromptError("the tokenizer worker failed on this prompt", "prompt") from e
            raise
        self._idle.put_nowait(w)
        return ids

    async def close(self) -> None:
        workers, self._workers = self._workers, set()
        for w in workers:
            await w.stop()
