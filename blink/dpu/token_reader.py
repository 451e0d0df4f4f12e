"""Token reader: the background task that moves generated tokens from the ring to requests (paper §4.4).

Each cycle does one bulk read of the slot records (the same read refreshes the slot tracker's
availability cache), the header and a window of tokens per active slot, all in one transport
round trip (see poll_once), then, for each active slot, compares the device's `generated` with
the tokens already delivered. Slots admitted since the last cycle are
"urgent" and served first, so a first token waits at most one poll interval. New tokens are read
from the slot's output ring (at most two contiguous reads, since it wraps), `consumed` is stored
back (the device's flow control), and a TokenEvent goes to the request's asyncio queue. A slot
that reached DECODE_COMPLETED is released (state EMPTY) once all its tokens were read. A request
whose consumer has `max_backlog` undelivered events is skipped: its tokens stay in the ring and the
device's output-ring flow control pauses it, so a slow client never makes the frontend buffer
an unbounded generation.

Polling adapts to the device's step time: for `spin_s` after the last cycle that had news the
loop only yields to the event loop between cycles (a fast device's next step lands within it),
then it polls every `max_idle_s` (1 ms: asyncio timers, uvloop's included, are no finer). A
device whose steps take 10 ms is polled ~10 times a step rather than spun on: the frontend's
event loop, which also serves HTTP, stays free (a 64-cycle spin after every step cost ~20 % of
a core per replica at 8B step times). With no request in flight it parks on an event (waking
every `health_interval_s` to watch the device). Device failure: header.device_status FAILED/STOPPED, or a heartbeat that has not
advanced for `heartbeat_timeout_s`; every in-flight request then ends with an error event and
`health()` reports not ok (the server answers /health with 503). A stall is not final: when the
heartbeat advances again the frontend serves again (the requests it failed were cancelled on the
ring and are drained and released when the device gets to them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from blink.protocol.layout import (
    LOGPROB_DTYPE,
    TOKEN_DTYPE,
    DeviceStatus,
    FinishReason,
    SlotError,
    SlotState,
    prompt_logprob_record,
)
from blink.protocol.transport import TransportError
from blink.protocol.wire import DeviceHealth, Logprob, TokenEvent

from .slot_tracker import SlotTracker, read_header

log = logging.getLogger("blink.token_reader")


@dataclass
class _Active:
    request_id: int
    sink: Callable[[TokenEvent], None] | None  # None: an orphan slot, drained and released silently
    delivered: int = 0  # tokens read from the output ring
    timing: list[int] | None = None  # filled at the first token: t_submit, t_admit, t_launch, t_first, t_read (ns)
    backlog: Callable[[], int] | None = None  # events delivered but not yet taken by the consumer
    logprobs: int = -1  # alternatives per generated token's record to deliver; -1: no records
    prompt: tuple[int, int, int, int] | None = None  # prompt records: (word offset, prompt_len, n in slot, n wanted)


class TokenReader:
    def __init__(
        self,
        tracker: SlotTracker,
        heartbeat_timeout_s: float = 30.0,
        spin_s: float = 200e-6,
        max_idle_s: float = 0.001,
        health_interval_s: float = 0.25,
        max_backlog: int = 64,
        liveness: Callable[[], str | None] | None = None,
        on_fail: Callable[[str], None] | None = None,
        on_release: Callable[[int], None] | None = None,
        window: int | None = None,
    ):
        self.tracker = tracker
        self.t = tracker.t
        self.geo = tracker.geo
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.spin_s = spin_s
        self.max_idle_s = max_idle_s
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
        self._cap = self.geo.output_capacity

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
    ) -> None:
        """logprobs / prompt: what the request asked of the device (SlotTracker.claim wrote it)."""
        self.active[slot] = _Active(request_id, sink, delivered, timing, backlog, logprobs, prompt)
        self._active_mask[slot] = True
        self._delivered[slot] = delivered
        self._urgent.append(slot)
        self._registered = True
        self._wake.set()

    def detach(self, slot: int) -> None:
        """Stop delivering to a request (client gone); the slot is still drained and released."""
        a = self.active.get(slot)
        if a is not None:
            a.sink = None

    # -- health -------------------------------------------------------------------------
    def health(self) -> DeviceHealth:
        status = int(self.header["device_status"])
        if self.failed:
            return DeviceHealth(False, status, self._hb, self.failed)
        if status != DeviceStatus.READY:
            return DeviceHealth(False, status, self._hb, f"device status {DeviceStatus(status).name}")
        return DeviceHealth(True, status, self._hb)

    def _check_device(self, now: float) -> None:
        hb = int(self.header["heartbeat"])
        beat = hb != self._hb
        if beat:
            self._hb, self._hb_changed_at = hb, now
        if self.failed:
            if self._stalled and beat and int(self.header["device_status"]) == DeviceStatus.READY:
                # The device was only stalled (paused, swapped out, a very long step): it beats
                # again, so serve again. Requests failed meanwhile were cancelled and are drained.
                log.warning("device heartbeat resumed; serving again")
                self.failed, self._stalled = None, False
            return
        if self.liveness is not None and now - self._liveness_at >= 0.1:
            self._liveness_at = now
            why = self.liveness()
            if why:
                self._fail(why)
                return
        status = int(self.header["device_status"])
        if status in (DeviceStatus.FAILED, DeviceStatus.STOPPED):
            self._fail(f"device {DeviceStatus(status).name.lower()} (fault {int(self.header['fault'])})")
        elif status == DeviceStatus.READY and now - self._hb_changed_at > self.heartbeat_timeout_s:
            self._fail(f"device heartbeat stalled for {now - self._hb_changed_at:.1f} s", stalled=True)

    def _fail(self, why: str, stalled: bool = False) -> None:
        """Declare the device down. Every in-flight request ends with an error event. A stall may
        end (see _check_device), so then the slots are cancelled and kept to be drained and
        released if the device comes back; otherwise they stay held (nobody will free them)."""
        self.failed = why
        self._stalled = stalled
        for slot, a in list(self.active.items()):
            if a.sink is not None:
                try:
                    a.sink(TokenEvent(a.request_id, [], FinishReason.ERROR, SlotError.DEVICE_FAULT, why))
                except Exception:  # one broken consumer must not keep the others from hearing
                    log.exception("request %d: delivering the failure event", a.request_id)
                a.sink = None
            if stalled:
                try:
                    self.tracker.cancel(slot)
                except TransportError as e:
                    log.warning("slot %d: cancel not delivered: %s", slot, e)
            else:
                del self.active[slot]
                self._active_mask[slot] = False
        self._urgent.clear()
        if self.on_fail is not None:
            self.on_fail(why)

    # -- one cycle ------------------------------------------------------------------------
    def poll_once(self) -> int:
        """One cycle: bulk read, deliver new tokens, release completed slots. Returns tokens delivered.

        Round trips (what a remote transport pays): one `transact` reads the slot records, the
        header and, for every active slot, a window of `window` tokens from the first undelivered
        one, so a slot that gained up to `window` tokens since the last cycle needs nothing more;
        one `post` stores `consumed` and releases (not awaited). Only a slot that gained more than
        a window, or completed (its final `generated` must be read after its state, see below),
        costs a second transact in that cycle; logprob records (opt-in per request) are read with
        a transact of their own."""
        self.cycles += 1
        win_slots = [s for s, a in self.active.items() if not self._backlogged(a)]
        windows = np.empty((len(win_slots), self.window), TOKEN_DTYPE)
        reads = [(0, self.header.reshape(1))]
        spans = self._window_reads(win_slots, windows, reads)
        recs = self.tracker.refresh(reads)
        self._check_device(time.monotonic())
        if not self.active:
            return 0
        # Vectorized change detection over all slots; the Python loop only visits slots with
        # news (new tokens or completion), urgent (newly registered) ones first.
        news = (recs["generated"] > self._delivered) | (recs["state"] == SlotState.DECODE_COMPLETED)
        news &= self._active_mask
        self._registered = False
        order = np.flatnonzero(news).tolist()
        if self._urgent:
            # slots still waiting for their first token, in registration order, go first
            first = [s for s in self._urgent if news[s]]
            if first:
                fs = set(first)
                order = first + [s for s in order if s not in fs]
                self._urgent = [s for s in self._urgent if s not in fs and s in self.active]
        win = dict(zip(win_slots, spans, strict=True))
        gens = recs["generated"].astype(np.int64)
        done = [s for s in order if recs["state"][s] == SlotState.DECODE_COMPLETED and s in win]
        if done:
            # The device stores generated before the state, but one bulk read does not order the
            # bytes it fetches: a record may show COMPLETED with an older generated. So the final
            # count comes from a read issued after that one: the records again, with fresh token
            # windows of the completing slots, in a second round trip (completions only).
            again = np.zeros_like(recs)
            w2 = np.empty((len(done), self.window), TOKEN_DTYPE)
            r2: list = []
            spans2 = self._window_reads(done, w2, r2)
            self.t.transact((), [(self.geo.slots_offset, again), *r2])
            for s, span in zip(done, spans2, strict=True):
                gens[s] = int(again["generated"][s])
                win[s] = span
        n = 0
        writes = []
        released = []
        for slot in order:
            a = self.active.get(slot)
            if a is None or slot not in win:
                continue  # a slow consumer: its tokens stay in the ring (see _backlogged)
            rec = recs[slot]
            state = int(rec["state"])
            gen = int(gens[slot])
            if gen > a.delivered:
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
                w, start = win[slot]
                assert start == a.delivered
                k = min(gen - a.delivered, w.size)
                ids = w[:k].tolist()
                if gen > a.delivered + k:  # more than a window: read the rest now
                    ids += self._read_tokens(slot, a.delivered + k, gen)
                lps = self._read_logprobs(slot, a.delivered, gen, a.logprobs) if a.logprobs >= 0 else []
                plps = self._read_prompt_logprobs(a.prompt) if a.delivered == 0 and a.prompt else None
                a.delivered = gen
                self._delivered[slot] = gen
                writes.append(self.tracker.consumed_write(slot, gen))
                n += len(ids)
                if a.sink is not None and state != SlotState.DECODE_COMPLETED:
                    a.sink(TokenEvent(a.request_id, ids, logprobs=lps, prompt_logprobs=plps))
                    ids = None
            else:
                ids, lps, plps = None, [], None
            if state == SlotState.DECODE_COMPLETED:
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
                        )
                    )
                del self.active[slot]
                self._active_mask[slot] = False
                writes.append(self.tracker.release_write(slot))
                released.append(slot)
        if writes:
            self.t.post(writes)  # consumed counters and releases, after the reads that justify them
        if self.on_release is not None:
            for slot in released:
                self.on_release(slot)
        self.tokens_read += n
        return n

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

    def _read_tokens(self, slot: int, start: int, end: int) -> list[int]:
        """Tokens [start, end) of a slot from its output ring (it wraps every output_capacity)."""
        cap = self._cap
        if end - start > cap:  # cannot happen with a conforming device (flow control)
            raise RuntimeError(f"slot {slot}: device overran the output ring ({end - start} > {cap})")
        out = np.empty(end - start, TOKEN_DTYPE)
        i0 = start % cap
        first = min(end - start, cap - i0)
        base = self.geo.output_offset(slot, 0)
        reads = [(base + 4 * i0, out[:first])]
        if first < out.size:
            reads.append((base, out[first:]))
        self.t.transact((), reads)
        return out.tolist()

    def _read_logprobs(self, slot: int, start: int, end: int, n: int) -> list[Logprob]:
        """Logprob records [start, end) of a slot (wrapping like its tokens), n alternatives each."""
        cap = self._cap
        out = np.empty(end - start, LOGPROB_DTYPE)
        i0 = start % cap
        first = min(end - start, cap - i0)
        base = self.geo.logprob_offset(slot, 0)
        reads = [(base + LOGPROB_DTYPE.itemsize * i0, out[:first])]
        if first < out.size:
            reads.append((base, out[first:]))
        self.t.transact((), reads)
        return _logprobs(out["logprob"], out["top_ids"][:, :n], out["top_logprobs"][:, :n])

    def _read_prompt_logprobs(self, prompt: tuple[int, int, int, int]) -> list[Logprob]:
        """Records of prompt tokens 1 .. prompt_len - 1 (the device wrote them before token 0)."""
        off, n_prompt, n_slot, n_want = prompt
        if n_prompt < 2:
            return []
        rec = prompt_logprob_record(n_slot)
        out = np.empty(n_prompt - 1, rec)
        self.t.read_into(self.geo.prompt_arena_offset + 4 * off + rec.itemsize, out)
        return _logprobs(out["logprob"], out["top_ids"][:, :n_want], out["top_logprobs"][:, :n_want])

    # -- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._run()
        except TransportError as e:
            # The ring cannot be reached (agent or network gone): the device may be fine, but no
            # token can come back through this transport. Every request ends with an error event.
            log.warning("ring unreachable: %s", e)
            self._fail(f"ring unreachable: {e}")
        except Exception as e:
            # A bug here must not leave every request waiting forever: fail them all.
            # Logged with its traceback and recorded in self.failed (/health shows it); not re-raised,
            # since nothing awaits this background task until shutdown.
            log.exception("token reader crashed")
            self._fail(f"token reader crashed: {e!r}")

    async def _run(self) -> None:
        last_news = time.monotonic()
        while not self._stop:
            n = self.poll_once()
            if n or self._registered:
                last_news = time.monotonic()
                await asyncio.sleep(0)
                continue
            if not self.active:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.health_interval_s)
                except TimeoutError:
                    pass  # periodic health check of an idle device
                last_news = time.monotonic()
                continue
            if time.monotonic() - last_news < self.spin_s:
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(self.max_idle_s)

    def stop(self) -> None:
        self._stop = True
        self._wake.set()


def _logprobs(lp: np.ndarray, ids: np.ndarray, lps: np.ndarray) -> list[Logprob]:
    return [Logprob(a, b, c) for a, b, c in zip(lp.tolist(), ids.tolist(), lps.tolist(), strict=True)]
