"""Token reader: the background task that moves generated tokens from the ring to requests (paper §4.4).

Each cycle does one bulk read of the slot records (the same read refreshes the slot tracker's
availability cache), the header and a window of tokens per active slot, all in one transport
round trip (see poll_once), then, for each active slot, compares the device's `generated` with
the tokens already delivered. Slots admitted since the last cycle are
"urgent": their first tokens are delivered in a cycle of their own, before the other slots' news,
so that their consumers (a new request's headers and first chunk) run first. New tokens are read
from the slot's output ring (at most two contiguous reads, since it wraps), `consumed` is stored
back (the device's flow control), and a TokenEvent goes to the request's asyncio queue. A slot
that reached DECODE_COMPLETED is released (state EMPTY) once all its tokens were read. A request
whose consumer has `max_backlog` undelivered events is skipped: its tokens stay in the ring and the
device's output-ring flow control pauses it, so a slow client never makes the frontend buffer
an unbounded generation.

Polling follows the device's step cadence without spinning a core (poll_cadence.py). The device publishes tokens
at the end of each step, so the reader estimates the step period (EWMA of the gaps between cycles
that gave running sequences tokens, biased to the short ones; first tokens alone are no cadence)
and sleeps coarsely (at most `max_idle_s`) until `lead` (70 %) of a step has
passed, then every `fine_s` (200 us) until the step's tokens appear: a token waits at most about
`fine_s` in the ring, and a 5 ms step costs ~10 cycles. Without a cadence (nothing published in
the last 4 estimated steps) it polls every `fine_s` while a request awaits its first token (a
lone prompt's prefill), for at most `urgent_fine_s` (50 ms) after the latest registration, and
every `max_idle_s` otherwise; while constrained requests (structured output) are active, every
`fine_s` throughout a step (their next mask waits for their last token). Sub-millisecond sleeps are timerfd
sleeps (fine_timer.py): asyncio's timers are no finer than 1 ms, and uvloop's `sleep(0.0002)`
does not sleep at all. A cycle that finds nothing costs one bulk read and a few vector operations
(the Python work is per slot with news). With no request in flight it parks on an event (waking
every `health_interval_s` to watch the device). Device failure: header.device_status FAILED/STOPPED, or a heartbeat that has not
advanced for `heartbeat_timeout_s`; every in-flight request then ends with an error event and
`health()` reports not ok (the server answers /health with 503). A stall is not final: when the
heartbeat advances again the frontend serves again (the requests it failed were cancelled on the
ring and are drained and released when the device gets to them).

A slot of this frontend whose record no conforming device could produce (EMPTY or an unknown state
while it holds a request, `generated` going backwards or past the output ring's flow control) is a
fault of that slot only: its request ends with an error event, the slot is cancelled and left
alone until the device completes it (then released); the other requests go on. The reader itself
is supervised: a crash (a bug) ends the in-flight requests with an error event, as a device stall
does, and the loop starts again after a backoff (RESTART_BACKOFF_S), never left dead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from blink.protocol.layout import TOKEN_DTYPE, FinishReason, SlotError, SlotState
from blink.protocol.transport import TransportError
from blink.protocol.wire import TokenEvent

from .fine_timer import FineTimer
from .logprob_reads import read_logprobs, read_prompt_logprobs
from .mask_timing import MaskLatency
from .poll_cadence import PollCadence
from .reader_faults import ReaderFaults
from .slot_tracker import SlotTracker, read_header
from .token_masks import Constraint, MaskBatch

log = logging.getLogger("blink.token_reader")
_COMPLETED = int(SlotState.DECODE_COMPLETED)  # an IntEnum member's lookup costs a dict walk per use
RESTART_BACKOFF_S = (0.05, 5.0)  # after a crash of the loop: first wait (doubling) and the longest


@dataclass
class _Active:
    request_id: int
    sink: Callable[[TokenEvent], None] | None  # None: an orphan slot, drained and released silently
    delivered: int = 0  # tokens read from the output ring
    timing: list[int] | None = None  # filled at the first token: t_submit, t_admit, t_launch, t_first, t_read (ns)
    backlog: Callable[[], int] | None = None  # events delivered but not yet taken by the consumer
    logprobs: int = -1  # alternatives per generated token's record to deliver; -1: no records
    prompt: tuple[int, int, int, int] | None = None  # prompt records: (word offset, prompt_len, n in slot, n wanted)
    constraint: Constraint | None = None  # structured output: the matcher and bitmask it advances
    faulted: bool = False  # the slot showed an impossible record: no more reads, released once completed


class TokenReader(ReaderFaults):
    def __init__(
        self,
        tracker: SlotTracker,
        heartbeat_timeout_s: float = 30.0,
        fine_s: float = 200e-6,
        max_idle_s: float = 0.001,
        lead: float = 0.7,
        urgent_fine_s: float = 0.05,
        health_interval_s: float = 0.25,
        max_backlog: int = 64,
        liveness: Callable[[], str | None] | None = None,
        on_fail: Callable[[str], None] | None = None,
        on_release: Callable[[int], None] | None = None,
        window: int | None = None,
        mask_threads: int | None = None,
    ):
        self.tracker = tracker
        self.t = tracker.t
        self.geo = tracker.geo
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.cadence = PollCadence(fine_s, max_idle_s, lead, urgent_fine_s)  # when to poll next
        self.health_interval_s = health_interval_s
        # Optional local check of the device (e.g. its process exited): a reason string when dead.
        # It catches a crash at once instead of after heartbeat_timeout_s; polled every 0.1 s.
        self.liveness = liveness
        self.on_fail = on_fail  # called once when the device is declared down (fails queued submits)
        self._liveness_at = 0.0
        self.max_backlog = max_backlog  # undelivered events per request before its slot is left unread
        self.on_release = on_release  # called with the slot after it became EMPTY (wakes queued submits)
        # Tokens read per active slot with the records, so that a cycle is one round trip. Over shared
        # memory a read costs no round trip: none are read ahead, only the slots with news are read.
        self.window = window if window is not None else (0 if getattr(tracker.t, "kind", "") == "shm" else 16)
        self.active: dict[int, _Active] = {}
        self._active_mask = np.zeros(self.geo.n_slots, bool)  # slots in self.active
        self._faulted = np.zeros(self.geo.n_slots, bool)  # active slots with a fault (see _slot_fault)
        self._delivered = np.zeros(self.geo.n_slots, np.int64)  # tokens read per slot (mirror of _Active)
        self._urgent: list[int] = []  # registered slots that have not delivered a token yet
        self._registered = False  # a slot was registered since the last cycle
        self._wake = asyncio.Event()
        self._stop = False
        self.header = read_header(self.t)
        self._hb = int(self.header["heartbeat"])
        self._hb_changed_at = time.monotonic()
        self.failed: str | None = None  # why the device is considered down
        self._stalled = False  # failed only because the heartbeat stopped (recoverable)
        self.cycles = 0
        self.tokens_read = 0
        self.restarts = 0  # crashes of the loop survived
        self.slot_faults = 0
        self.constraint_failures = 0  # requests ended because their grammar engine failed
        self._cap = self.geo.output_capacity
        self.masks = MaskBatch(mask_threads)  # a cycle's masks, computed together
        self.mask_latency = MaskLatency()  # cycle start -> mask posted, per constrained token
        self._n_masked = 0  # active slots with a constraint (they poll without cadence sleeps)

    # -- registration (called by the request tracker) ---------------------------------------
    def register(
        self,
        slot: int,
        request_id: int,
        sink: Callable[[TokenEvent], None] | None,
        delivered: int = 0,
        timing: list[int] | None = None,
        backlog: Callable[[], int] | None = None,
        logprobs: int = -1,
        prompt: tuple[int, int, int, int] | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        """logprobs / prompt: what the request asked of the device (SlotTracker.claim wrote it);
        constraint: its token mask, advanced by every token read (structured output)."""
        if slot in self.active:
            self._forget(slot)
        self.active[slot] = _Active(request_id, sink, delivered, timing, backlog, logprobs, prompt, constraint)
        self._n_masked += constraint is not None
        self._active_mask[slot] = True
        self._faulted[slot] = False
        self._delivered[slot] = delivered
        self._urgent.append(slot)
        self._registered = True
        self.cadence.registered(time.monotonic())
        self._wake.set()

    def detach(self, slot: int) -> None:
        """Stop delivering to a request (client gone); the slot is still drained and released."""
        a = self.active.get(slot)
        if a is not None:
            a.sink = None

    # -- one cycle ------------------------------------------------------------------------
    def poll_once(self, first_apart: bool = False) -> int:
        """One cycle: bulk read, deliver new tokens, release completed slots. Returns tokens delivered.

        first_apart: when some of the slots with news have their first token, deliver only those and
        the constrained ones (the caller yields to their consumers, then calls again for the rest): a
        new request's first bytes then do not wait for the other streams' tokens of the same step,
        and no constrained slot's next mask waits for those consumers.

        Round trips (what a remote transport pays): one `transact` reads the slot records, the
        header and, for every active slot, a window of `window` tokens from the first undelivered
        one, so a slot that gained up to `window` tokens since the last cycle needs nothing more;
        one `post` stores `consumed` and releases (not awaited). The tokens beyond the windows of
        every slot with news (with window 0, the shm default: all of them), and the final count of
        the slots that completed (it must be read after their state, see below), cost one more
        transact in that cycle, whatever the number of slots; logprob records (opt-in per request)
        are read with a transact of their own.

        The masks of the constrained slots that read tokens go out first, all in one `post` of their
        own (_post_masks), before the tokens are handed to their requests: a constrained slot samples
        its next token only once its mask is published, so no per-stream work comes before that.

        The Python work is per slot with news, not per active slot: a cycle that finds nothing
        (most cycles of a polling reader) costs the bulk read and a few vector operations."""
        t0 = time.perf_counter_ns()
        self.cycles += 1
        found = self._read_news(first_apart)
        if found is None:
            return 0
        recs, completed, order, win, gens = found
        ids_of = self._tokens(order, win, gens)
        self._post_masks(ids_of, completed, gens, t0)
        n, stepped, writes, released = self._deliver(order, win, recs, completed, gens, ids_of)
        if writes:
            self.t.post(writes)  # consumed counters and releases, after the reads that justify them
        if self.on_release is not None:
            for slot in released:
                self.on_release(slot)
        if stepped:
            self.cadence.saw_step(time.monotonic())
        self.tokens_read += n
        return n

    def _read_news(self, first_apart: bool) -> tuple | None:
        """The cycle's bulk read and what it found: (records, completed mask, the slots with news in
        delivery order, their token windows, the final generated counts); None without news."""
        reads = [(0, self.header.reshape(1))]
        if self.window:
            win_slots = [s for s, a in self.active.items() if not self._backlogged(a)]
            windows = np.empty((len(win_slots), self.window), TOKEN_DTYPE)
            spans = self._window_reads(win_slots, windows, reads)
        recs = self.tracker.refresh(reads)
        self._check_device(time.monotonic())
        if not self.active:
            return None
        self._check_slots(recs)
        # Vectorized change detection over all slots; the Python loop only visits slots with
        # news (new tokens or completion), urgent (newly registered) ones first.
        completed = recs["state"] == _COMPLETED
        news = (recs["generated"] > self._delivered) | completed | self._faulted
        news &= self._active_mask
        self._registered = False
        order = np.flatnonzero(news).tolist()
        if not order:
            return None
        if self.window:
            win: dict[int, tuple[np.ndarray, int] | None] = dict(zip(win_slots, spans, strict=True))
        else:  # a slow consumer's slot is left unread (see _backlogged)
            win = {s: None for s in order if not self._backlogged(self.active[s])}
        if self._urgent:
            # slots still waiting for their first token, in registration order, go first
            first = [s for s in self._urgent if news[s]]
            if first:
                fs = set(first)
                if first_apart and len(first) < len(order):
                    # the rest at the next call, from a fresh read; but a constrained slot's next
                    # mask waits for nothing (the device samples it only once it is out)
                    order = first + [s for s in order if s not in fs and self.active[s].constraint is not None]
                    news = np.zeros_like(news)
                    news[order] = True
                else:
                    order = first + [s for s in order if s not in fs]
                self._urgent = [s for s in self._urgent if s not in fs and s in self.active]
        gens = recs["generated"].tolist()
        done = [s for s in np.flatnonzero(completed & news).tolist() if s in win]
        if done:
            # The device stores generated before the state, but one bulk read does not order the
            # bytes it fetches: a record may show COMPLETED with an older generated. So the final
            # count comes from a read issued after that one: the records again, in a second round
            # trip (completions only), which also fetches the completing slots' tokens.
            again = np.zeros_like(recs)
            self.t.transact((), [(self.geo.slots_offset, again)])
            for s in done:
                gens[s] = int(again["generated"][s])
        return recs, completed, order, win, gens

    def _post_masks(self, ids_of: dict[int, list[int]], completed: np.ndarray, gens: list[int], t0: int) -> None:
        """Advance every constrained slot that read tokens by them and post the masks of their next
        tokens (MaskBatch: computed together), one post for all, timed from the cycle's start t0."""
        items = []
        for s, ids in ids_of.items():
            a = self.active[s]
            if a.constraint is not None and ids and not completed[s] and not a.faulted:
                items.append((s, a.constraint, ids, gens[s]))
        if items:
            self.t.post(self.masks.advance(items))
            self.mask_latency.observe(time.perf_counter_ns() - t0, len(items))
            for s, c, _, _ in items:
                if c.failed:
                    self._constraint_failed(s)

    def _deliver(
        self,
        order: list[int],
        win: dict[int, tuple[np.ndarray, int] | None],
        recs: np.ndarray,
        completed: np.ndarray,
        gens: list[int],
        ids_of: dict[int, list[int]],
    ) -> tuple[int, bool, list, list[int]]:
        """Hand each slot's new tokens (and its end) to its sink. Returns (tokens delivered, whether a
        running sequence got tokens, the ring writes to post, the slots released)."""
        n = 0
        stepped = False  # a running sequence (not only first tokens) got tokens
        writes = []
        released = []
        for slot in order:
            a = self.active.get(slot)
            if a is None or slot not in win:
                continue  # a slow consumer: its tokens stay in the ring (see _backlogged)
            if a.faulted:
                self._drop_faulted(slot, recs[slot], writes, released)
                continue
            rec = recs[slot]
            gen = gens[slot]
            ids = ids_of.get(slot)
            if ids is not None:
                stepped |= a.delivered > 0
                if a.delivered == 0 and a.timing is not None:
                    t_read = time.time_ns()
                    a.timing[:] = (
                        int(rec["t_submit_ns"]),
                        int(rec["t_admit_ns"]),
                        int(rec["t_launch_ns"]),
                        int(rec["t_first_ns"]),
                        t_read,
                    )
                    writes.append(self.tracker.read_ns_write(slot, t_read))
                lps = read_logprobs(self.t, self.geo, slot, a.delivered, gen, a.logprobs) if a.logprobs >= 0 else []
                plps = read_prompt_logprobs(self.t, self.geo, a.prompt) if a.delivered == 0 and a.prompt else None
                cached = int(rec["cached_tokens"]) if a.delivered == 0 else 0
                a.delivered = gen
                self._delivered[slot] = gen
                writes.append(self.tracker.consumed_write(slot, gen))
                n += len(ids)
                if a.sink is not None and not completed[slot]:
                    a.sink(TokenEvent(a.request_id, ids, logprobs=lps, prompt_logprobs=plps, cached_tokens=cached))
                    ids = None
            else:
                lps, plps, cached = [], None, 0
            if completed[slot]:
                if a.sink is not None:
                    reason, err = int(rec["finish_reason"]), int(rec["error"])
                    msg = f"request rejected by the device: {SlotError(err).name}" if err else ""
                    a.sink(
                        TokenEvent(
                            a.request_id,
                            ids or [],
                            reason or FinishReason.STOP,
                            err,
                            msg,
                            logprobs=lps if ids else [],
                            prompt_logprobs=plps if ids else None,
                            cached_tokens=cached if ids else 0,
                        )
                    )
                self._forget(slot)
                writes += self.tracker.release_writes(slot)
                released.append(slot)
        return n, stepped, writes, released

    def _tokens(
        self, order: list[int], win: dict[int, tuple[np.ndarray, int] | None], gens: list[int]
    ) -> dict[int, list[int]]:
        """The new tokens of every slot in `order` that has some: from its window, and what lies
        beyond it read for all such slots in one transact (each at most two reads: the output ring
        wraps every output_capacity)."""
        out: dict[int, list[int]] = {}
        rest: list[tuple[int, int, int]] = []  # (slot, first token, end) still to read
        for s in order:
            if s not in win or s not in self.active or self.active[s].faulted:
                continue
            d, g = int(self._delivered[s]), gens[s]
            if g <= d:
                continue
            if g - d > self._cap:  # cannot happen with a conforming device (flow control)
                self._slot_fault(s, f"generated {g} overran the output ring ({g - d} tokens > {self._cap})")
                continue
            span = win[s]
            ids: list[int] = []
            if span is not None:
                w, start = span
                assert start == d
                k = min(g - d, w.size)
                ids = w[:k].tolist()
                d += k
            out[s] = ids
            if g > d:
                rest.append((s, d, g))
        if rest:
            bufs = np.empty(sum(g - d for _, d, g in rest), TOKEN_DTYPE)
            reads = []
            at = 0
            cap = self._cap
            for s, d, g in rest:
                buf = bufs[at : at + g - d]
                at += g - d
                i0 = d % cap
                first = min(g - d, cap - i0)
                base = self.geo.output_offset(s, 0)
                reads.append((base + 4 * i0, buf[:first]))
                if first < buf.size:
                    reads.append((base, buf[first:]))
            self.t.transact((), reads)
            at = 0
            for s, d, g in rest:
                out[s] += bufs[at : at + g - d].tolist()
                at += g - d
        return out

    def _backlogged(self, a: _Active) -> bool:
        """A slow consumer: leave its tokens in the ring. `consumed` stops advancing, so the device
        pauses this slot once its output ring is full (end-to-end backpressure)."""
        return a.backlog is not None and a.sink is not None and a.backlog() >= self.max_backlog

    def _window_reads(self, slots: list[int], out: np.ndarray, reads: list) -> list[tuple[np.ndarray, int]]:
        """Append to `reads` one read per slot of up to `window` tokens from its first undelivered
        one (not across the output ring's wrap); returns each (window, index of its first token)."""
        cap = self._cap
        spans = []
        for i, s in enumerate(slots):
            d = int(self._delivered[s])
            w = out[i, : min(self.window, cap - d % cap)]
            if w.size:
                reads.append((self.geo.output_offset(s, d), w))
            spans.append((w, d))
        return spans

    # -- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        delay = RESTART_BACKOFF_S[0]
        while not self._stop:
            started = time.monotonic()
            try:
                await self._run()
                return
            except TransportError as e:
                # The ring cannot be reached (agent or network gone): the device may be fine, but no
                # token can come back through this transport. Every request ends with an error event.
                log.warning("ring unreachable: %s", e)
                self._fail(f"ring unreachable: {e}")
                return
            except Exception as e:
                # A bug here must not leave every request waiting forever, nor the server without a
                # reader: the in-flight requests end with an error event (their slots are cancelled
                # and drained, as after a stall), /health says why meanwhile, and the loop restarts.
                if time.monotonic() - started > 60.0:
                    delay = RESTART_BACKOFF_S[0]
                log.exception("token reader crashed; restarting it in %.2f s", delay)
                self.restarts += 1
                self._fail(f"token reader crashed: {e!r}", stalled=True)
                await asyncio.sleep(delay)
                delay = min(2 * delay, RESTART_BACKOFF_S[1])
                self.failed, self._stalled = None, False

    async def _run(self) -> None:
        timer = FineTimer()
        try:
            await self._loop(timer)
        finally:
            timer.close()

    async def _loop(self, timer: FineTimer) -> None:
        while not self._stop:
            t0 = time.monotonic()
            n = self.poll_once(first_apart=True)
            if n or self._registered:
                await asyncio.sleep(0)  # the consumers first; then look again (a step may publish in parts)
                continue
            if not self.active:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.health_interval_s)
                except TimeoutError:
                    pass  # periodic health check of an idle device
                continue
            now = time.monotonic()
            await timer.sleep(max(self.next_wait(now) - (now - t0), 20e-6))  # from the cycle's start

    def next_wait(self, now: float) -> float:
        """How long to sleep before the next cycle (PollCadence.next_wait)."""
        return self.cadence.next_wait(now, bool(self._urgent), self._n_masked > 0)

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
