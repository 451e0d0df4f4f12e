"""Request tracker: per-request state between submission and the last token (paper §4.4).

Joins the slot tracker (where a request goes) and the token reader (what comes back) behind one
async API used by the HTTP server, `blink generate` and the benchmarks:

    handle = await tracker.submit(SubmitRequest(...))   # waits in a bounded FIFO for a free slot
    async for ev in handle: ...                           # TokenEvents; the last one has finish_reason
    handle.cancel()                                       # client gone / stop string: slot is freed

A full ring never drops a request: it waits in the queue (FIFO, woken one per released slot)
until a slot frees up, and only when the queue itself is full does submit raise QueueFullError
(the server's 429). On attach, slots left non-EMPTY by a previous frontend on the same ring are
reclaimed: completed ones are released, live ones are cancelled, drained and released.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from blink.protocol.layout import FinishReason, SlotState
from blink.protocol.transport import Transport, TransportError
from blink.protocol.wire import DeviceHealth, RingStats, SubmitRequest, TokenEvent

from .slot_tracker import SlotTracker, attach_geometry, region_words
from .structured import GrammarError, Grammars, Matcher
from .token_masks import Constraint, MaskArena
from .token_reader import TokenReader

if TYPE_CHECKING:
    from blink.config import ServerConfig

    from .tokenizer import FrontendTokenizer

log = logging.getLogger("blink.request_tracker")


class QueueFullError(RuntimeError):
    """Every slot is busy and the wait queue is full."""


class DeviceDownError(RuntimeError):
    """The device is not serving (failed, stopped, or its heartbeat stalled)."""


class RequestHandle:
    """One submitted request: iterate it for TokenEvents; cancel() frees its slot early."""

    def __init__(self, tracker: RequestTracker, request_id: int, slot: int, n_prompt: int):
        self._tracker = tracker
        self.request_id = request_id
        self.slot = slot
        self.n_prompt = n_prompt
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.finished = False
        self.t_submit = time.perf_counter()
        # Wall-clock ns (the device stamps the ring with the same clock on one machine):
        # [slot published, device admitted, first token in the ring, first token read].
        self.timing: list[int] = []

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        q, held = self.queue, None
        while not self.finished:
            ev = held if held is not None else await q.get()
            held = None
            # Events that queued up meanwhile (the consumer fell a step or more behind) go out as
            # one: one detokenization, one SSE chunk, one write for all their tokens. An error
            # event stays apart (its tokens are not text; the ones before it are).
            while not ev.finished and not q.empty():
                nxt = q.get_nowait()
                if nxt.finish_reason == FinishReason.ERROR:
                    held = nxt
                    break
                ev = _merged(ev, nxt)
            if ev.finished:
                self.finished = True
            yield ev

    def cancel(self) -> None:
        """Stop the request on the device (no more events are delivered); idempotent."""
        if not self.finished:
            self.finished = True
            self._tracker._cancel(self)


class RequestTracker:
    def __init__(
        self,
        transport: Transport,
        max_queue: int = 1024,
        heartbeat_timeout_s: float = 30.0,
        reader_kwargs: dict | None = None,
        owner: int = 0,
        owners: int = 1,
        grammars: Grammars | None = None,
    ):
        """owner / owners: this frontend's index and the number of frontend processes sharing the
        ring; it serves only its share of the slots (blink.dpu.slot_tracker). grammars: the model
        tokenizer's grammar engine, for structured output (None: such requests are refused)."""
        self.t = transport
        self.geo = attach_geometry(transport)
        self.slots = SlotTracker(transport, self.geo, owner, owners)
        self.reader = TokenReader(
            self.slots,
            heartbeat_timeout_s=heartbeat_timeout_s,
            on_release=self._on_release,
            on_fail=self._on_fail,
            **(reader_kwargs or {}),
        )
        self.max_queue = max_queue
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ids = itertools.count(int(time.time_ns() & 0xFFFFFFFF) << 20)
        self._task: asyncio.Task[None] | None = None
        self.reclaimed = 0  # orphan slots taken over on attach
        self.grammars = grammars
        self.masks = MaskArena(self.geo, owner, owners)
        self._slot_masks: dict[int, int] = {}  # slot -> the bitmask its constrained request holds
        self._constraints: dict[int, Constraint] = {}  # claimed, not yet registered with the reader

    @classmethod
    def for_server(
        cls,
        transport: Transport,
        server: ServerConfig,
        tokenizer: FrontendTokenizer | None,
        owner: int = 0,
        owners: int = 1,
        reader_kwargs: dict | None = None,
    ) -> RequestTracker:
        """A serving frontend's tracker over one ring, the one recipe of `blink serve` (blink.stack) and
        the frontend actor: the server's queue bound and heartbeat timeout, and the tokenizer's grammar
        engine, so structured output and enforced tool calls work wherever the frontend runs."""
        grammars = tokenizer.grammars if tokenizer is not None else None
        return cls(
            transport, server.max_queue, server.heartbeat_timeout_s, reader_kwargs, owner, owners, grammars=grammars
        )

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self.reclaim_orphans()
        self._task = asyncio.get_running_loop().create_task(self.reader.run(), name="token-reader")

    async def close(self) -> None:
        self.reader.stop()
        if self._task is not None:
            task, self._task = self._task, None
            await task
        self._on_fail("frontend shutting down")

    def reclaim_orphans(self) -> int:
        """Take over slots a previous frontend left behind (attach to an existing ring)."""
        n = 0
        for slot in self.slots.orphans():
            rec = self.slots.records[slot]
            self.slots.adopt(slot)
            if int(rec["state"]) == SlotState.DECODE_COMPLETED:
                self.slots.release(slot)
            else:
                self.slots.cancel(slot)
                self.reader.register(slot, int(rec["request_id"]), None, delivered=int(rec["consumed"]))
            n += 1
        self.reclaimed += n
        return n

    def fail(self, why: str) -> None:
        """Declare the device down from outside (e.g. its ring was replaced): every in-flight
        request ends with an error event, queued ones with DeviceDownError; /health turns 503."""
        if not self.reader.failed:
            self.reader._fail(why)

    # -- state ---------------------------------------------------------------------------
    def health(self) -> DeviceHealth:
        return self.reader.health()

    def stats(self) -> RingStats:
        return RingStats(self.slots.n_owned, self.slots.n_held, len(self._waiters), self.slots.n_free)

    def load(self) -> int:
        """Requests on this ring from every frontend (slots in use) plus this frontend's queue."""
        return self.slots.n_busy_ring + len(self._waiters)

    def reset_prefix_cache(self) -> bool:
        """Ask the device to forget its cached prefixes; False when it caches none."""
        if not self.slots.key_block:
            return False
        self.slots.reset_prefix_cache()
        return True

    def mask_latency(self) -> list[int]:
        """Counts per bucket of the constrained tokens' "cycle that read the token -> mask posted"
        (blink.dpu.mask_timing.MASK_LATENCY_EDGES_S), then their sum in nanoseconds."""
        return self.reader.mask_latency.snapshot()

    def frontend_counters(self) -> dict[str, int]:
        """The token reader's counts of requests it ended itself: slot_faults (a slot record no
        conforming device writes), constraint_failures (the grammar engine failed the request)."""
        return {"slot_faults": self.reader.slot_faults, "constraint_failures": self.reader.constraint_failures}

    def device_counters(self) -> dict[str, int]:
        """Device statistics from the ring header (as of the token reader's last cycle)."""
        from .metrics import DEVICE_FIELDS

        return {f: int(self.reader.header[f]) for f in DEVICE_FIELDS}

    @property
    def max_context(self) -> int:
        return int(self.reader.header["max_context"])

    @property
    def vocab_size(self) -> int:
        return int(self.reader.header["vocab_size"])

    def new_request_id(self) -> int:
        return next(self._ids)

    # -- submit / cancel -----------------------------------------------------------------
    @property
    def features(self) -> int:
        """layout.DeviceFeatures of the device serving the ring."""
        return int(self.reader.header["features"])

    def check_prompt(self, n_prompt: int, words: int | None = None) -> str | None:
        """Why a prompt of n_prompt tokens cannot be served (None if it can); words: the prompt-arena
        words the whole request needs (logit_bias, prompt logprob records), when more than n_prompt."""
        if n_prompt < 1:
            return "the prompt is empty"
        limit = min(self.slots.prompt_capacity, self.max_context - 1 if self.max_context else 1 << 62)
        if n_prompt > limit:
            return (
                f"the prompt has {n_prompt} tokens; this server accepts at most {limit} "
                f"(max_context {self.max_context}, one token left to generate)"
            )
        if words is not None and words > self.slots.prompt_capacity:
            return (
                f"the request needs {words} words of the ring's prompt arena (prompt, logit_bias and "
                f"prompt logprobs); a slot has {self.slots.prompt_capacity}"
            )
        return None

    async def submit(self, req: SubmitRequest) -> RequestHandle:
        """Claim a slot for `req` (waiting in the FIFO queue while the ring is full) and publish it."""
        if self.reader.failed:
            raise DeviceDownError(self.reader.failed)
        why = self.check_prompt(len(req.prompt_ids), region_words(req)) or self.check_grammar(req)
        if why:
            raise ValueError(why)
        matcher = None
        if req.grammar:  # its own matcher now, not at the claim: a grammar the cache dropped compiles off the loop
            assert self.grammars is not None
            try:
                matcher = await self.grammars.request_matcher(req.grammar)
            except GrammarError as e:
                raise ValueError(f"the structured output constraint does not compile: {e}") from e
        if not self.slots.described:  # attached before the device was READY
            self.slots.describe(self.reader.header)
        slot = None if self._waiters else self._try_claim(req, matcher)
        front = False  # a woken waiter that lost its slot to a newcomer keeps its place
        while slot is None:
            if not front and len(self._waiters) >= self.max_queue:
                raise QueueFullError(f"all {self.slots.n_owned} slots busy and {len(self._waiters)} requests queued")
            fut = asyncio.get_running_loop().create_future()
            (self._waiters.appendleft if front else self._waiters.append)(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut in self._waiters:
                    self._waiters.remove(fut)
                elif fut.done() and not fut.cancelled() and fut.exception() is None:
                    self._wake_one()  # we were handed a slot we will not use: pass it on
                raise
            if self.reader.failed:
                raise DeviceDownError(self.reader.failed)
            slot = self._try_claim(req, matcher)
            front = True
        h = RequestHandle(self, req.request_id, slot, len(req.prompt_ids))
        prompt = None
        sp = req.sampling
        if sp.prompt_logprobs >= 0:
            off = self.slots.prompt_logprobs_offset(slot, req)
            prompt = (off, len(req.prompt_ids), max(sp.logprobs, sp.prompt_logprobs, 0), sp.prompt_logprobs)
        self.reader.register(
            slot,
            req.request_id,
            h.queue.put_nowait,
            timing=h.timing,
            backlog=h.queue.qsize,
            logprobs=sp.logprobs,
            prompt=prompt,
            constraint=self._constraints.pop(slot, None),
        )
        return h

    def check_grammar(self, req: SubmitRequest) -> str | None:
        """Why a structured-output request cannot be served here (None if it can, or is not one); whether
        its grammar compiles is known when its matcher is made (submit)."""
        if not req.grammar:
            return None
        if self.grammars is None:
            return "structured output is not enabled on this frontend (it has no grammar engine)"
        if not self.masks.n_owned:
            return "structured output is not enabled on this server (ring.mask_slots = 0)"
        if self.grammars.words > self.geo.mask_words:
            return f"the vocabulary ({self.grammars.vocab_size}) exceeds the ring's masks (ring.mask_vocab)"
        return None

    def _claim(self, req: SubmitRequest, matcher: Matcher | None) -> int | None:
        constraint = None
        if matcher is not None:
            mask = self.masks.take()
            if mask is None:
                return None  # waits for a constrained request to end, as for a slot
            constraint = Constraint(matcher, mask, self.geo)
        try:
            slot = self.slots.claim(req, constraint=constraint)
        except BaseException:
            if constraint is not None:
                self.masks.give(constraint.mask)
            raise
        if slot is None:
            if constraint is not None:
                self.masks.give(constraint.mask)
            return None
        if constraint is not None:
            self._slot_masks[slot] = constraint.mask
            self._constraints[slot] = constraint
        return slot

    def _try_claim(self, req: SubmitRequest, matcher: Matcher | None) -> int | None:
        try:
            return self._claim(req, matcher)
        except TransportError as e:  # the ring cannot be reached: the device is down for us
            self.fail(f"ring unreachable: {e}")
            raise DeviceDownError(self.reader.failed) from e

    def _on_fail(self, why: str) -> None:
        """The device is down: requests waiting for a slot will never get one."""
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(DeviceDownError(why))

    def _on_release(self, slot: int) -> None:
        mask = self._slot_masks.pop(slot, None)
        if mask is not None:
            self.masks.give(mask)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    def _cancel(self, h: RequestHandle) -> None:
        if h.slot in self.reader.active and not self.reader.failed:
            self.reader.detach(h.slot)
            try:
                self.slots.cancel(h.slot)
            except TransportError as e:  # the token reader fails every request at its next cycle
                log.warning("request %d: cancel not delivered: %s", h.request_id, e)


def _merged(a: TokenEvent, b: TokenEvent) -> TokenEvent:
    """Two consecutive events of one request as one (b may be the last)."""
    return TokenEvent(
        a.request_id,
        a.token_ids + b.token_ids,
        b.finish_reason,
        b.error,
        b.message,
        logprobs=a.logprobs + b.logprobs,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        cached_tokens=a.cached_tokens or b.cached_tokens,
    )


def finish_name(reason: int) -> str:
    """OpenAI finish_reason for a device FinishReason."""
    if reason in (FinishReason.LENGTH, FinishReason.CONTEXT):
        return "length"
    return "stop"
