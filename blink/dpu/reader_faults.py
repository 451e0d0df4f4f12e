"""The token reader's failures (blink/dpu/token_reader.py, its module doc): the device's health (its
status and heartbeat; a failure or a stall ends every in-flight request with an error event) and the
faults of one slot (a record no conforming device could produce ends that slot's request only, and so
does a structured output constraint whose grammar engine failed). A mixin of TokenReader, whose state it reads and updates."""

from __future__ import annotations

import logging

import numpy as np

from blink.protocol.layout import DeviceStatus, FinishReason, SlotError, SlotState
from blink.protocol.transport import TransportError
from blink.protocol.wire import DeviceHealth, TokenEvent

log = logging.getLogger("blink.token_reader")
_COMPLETED = int(SlotState.DECODE_COMPLETED)
_EMPTY = int(SlotState.EMPTY)


class ReaderFaults:
    # -- health -------------------------------------------------------------------------
    def health(self) -> DeviceHealth:
        status = int(self.header["device_status"])
        if self.failed:
            return DeviceHealth(False, status, self._hb, self.failed)
        if status != DeviceStatus.READY:
            return DeviceHealth(False, status, self._hb, f"device status {_status_name(status)}")
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
            self._fail(f"device {_status_name(status).lower()} (fault {int(self.header['fault'])})")
        elif status == DeviceStatus.READY and now - self._hb_changed_at > self.heartbeat_timeout_s:
            self._fail(f"device heartbeat stalled for {now - self._hb_changed_at:.1f} s", stalled=True)

    def _fail(self, why: str, stalled: bool = False) -> None:
        """Declare the device down. Every in-flight request ends with an error event. A stall may
        end (see _check_device), so then the slots are cancelled and kept to be drained and
        released if the device comes back; otherwise they stay held (nobody will free them)."""
        self.failed = why
        self._stalled = stalled
        for slot, a in list(self.active.items()):
            self._end_with_error(a, why)
            if stalled:
                self._cancel(slot)
            else:
                self._forget(slot)
        self._urgent.clear()
        if self.on_fail is not None:
            self.on_fail(why)

    # -- faults of one slot ---------------------------------------------------------------
    def _check_slots(self, recs: np.ndarray) -> None:
        """Fault the active slots whose records no conforming device could show (module doc)."""
        st = recs["state"]
        gen = recs["generated"].astype(np.int64)
        bad = (st == _EMPTY) | (st > _COMPLETED) | (gen < self._delivered) | (gen - self._delivered > self._cap)
        bad &= self._active_mask & ~self._faulted
        for s in np.flatnonzero(bad).tolist():
            self._slot_fault(
                s,
                f"impossible slot record (state {int(st[s])}, generated {int(gen[s])}, read {int(self._delivered[s])})",
            )

    def _slot_fault(self, slot: int, why: str) -> None:
        a = self.active[slot]
        self.slot_faults += 1
        log.error("slot %d (request %d): %s; ending that request", slot, a.request_id, why)
        self._end_slot(slot, f"slot fault: {why}", SlotError.DEVICE_FAULT)

    def _constraint_failed(self, slot: int) -> None:
        """A constrained request whose matcher failed: the grammar engine gave up on its grammar at
        this position (e.g. its parser's row limit) or read a token the grammar forbids. Its mask
        would now allow only EOS, and the client would get an output its schema rejects, ended as an
        ordinary stop; instead the request ends with an error that quotes the engine (a 400: the
        constraint is the client's), and its slot is cancelled and drained like a faulted one."""
        a = self.active[slot]
        why = a.constraint.matcher.error.strip() or "the grammar engine rejected a token"
        self.constraint_failures += 1
        log.warning("slot %d (request %d): structured output constraint failed: %s", slot, a.request_id, why)
        msg = f"the structured output constraint failed after {int(self._delivered[slot])} tokens: {why}"
        self._end_slot(slot, msg, SlotError.BAD_PARAMS)

    def _end_slot(self, slot: int, why: str, error: SlotError) -> None:
        """End the request in `slot` with an error event and cancel the slot; the reader drains and
        releases it once the device completes it (_drop_faulted)."""
        a = self.active[slot]
        a.faulted = True
        self._faulted[slot] = True
        self._end_with_error(a, why, error)
        self._cancel(slot)

    def _drop_faulted(self, slot: int, rec: np.ndarray, writes: list, released: list) -> None:
        """A faulted slot is released once the device completed it (or it shows EMPTY already)."""
        if int(rec["state"]) not in (_COMPLETED, _EMPTY):
            return
        self._forget(slot)
        self._faulted[slot] = False
        writes += self.tracker.release_writes(slot)
        released.append(slot)

    def _forget(self, slot: int) -> None:
        a = self.active.pop(slot)
        self._active_mask[slot] = False
        self._n_masked -= a.constraint is not None

    def _end_with_error(self, a, why: str, error: SlotError = SlotError.DEVICE_FAULT) -> None:
        """Tell a request it ended with an error, a device fault unless `error` says otherwise (once:
        its sink is dropped)."""
        if a.sink is None:
            return
        try:
            a.sink(TokenEvent(a.request_id, [], FinishReason.ERROR, error, why))
        except Exception:  # one broken consumer must not keep the others from hearing
            log.exception("request %d: delivering the error event", a.request_id)
        a.sink = None

    def _cancel(self, slot: int) -> None:
        try:
            self.tracker.cancel(slot)
        except TransportError as e:
            log.warning("slot %d: cancel not delivered: %s", slot, e)


def _status_name(status: int) -> str:
    try:
        return DeviceStatus(status).name
    except ValueError:  # not a status any device writes
        return f"unknown ({status})"
