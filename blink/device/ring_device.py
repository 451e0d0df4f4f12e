"""The ring interpreter: a device loop that serves a ring with any `Executor`.

With the numpy executor this is the emulated device; with the CUDA host executor it is the
host-driven baseline of the scheduler ablation. Either way it speaks the ring protocol of
`blink.protocol.layout` exactly as the GPU-resident scheduler does, so one conformance suite
(tests/conformance) checks all of them through the ring alone.

One iteration: beat; read the doorbells (submit_seq, cancel_seq) and, when one moved or a rescan
is due, scan the slots (claim PREFILL_PENDING, validate, hand to the scheduler; apply cancel
flags); refresh `consumed` of sequences whose output ring is full; schedule; run the step; publish
each sampled token (token into the output arena first, then `generated`: the release order the
readers rely on); finish slots; write the header statistics. A claimed slot's request is read
and checked by slot_request.py; a plan is packed into the executor's StepBatch by step_batch.py.

Idle polling spins for `spin_s` after the last activity, then sleeps with exponential backoff up
to `max_sleep_s` (<= 1 ms), so an idle device does not hold a core and still beats every ms.
During a step the loop is inside the executor; an executor with a progress hook (`set_progress`,
the numpy one: after every layer) beats the heartbeat from inside the step, as the GPU scheduler
beats while it waits for a graph. Prefill is chunked under the step's token budget either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from blink.protocol.layout import (
    DEVICE_COUNTERS,
    DeviceFeatures,
    DeviceStatus,
    FinishReason,
    SlotError,
    SlotState,
    prompt_logprob_record,
)
from blink.protocol.ring_geometry import RingView

from .executor import Executor, StepBatch
from .kv_blocks import BlockManager
from .policy import step_limits
from .scheduler import Scheduler, SchedulerConfig, StepKind, StepPlan
from .slot_request import block_keys, sampling_of, validate, validate_keys
from .step_batch import build_batch


@dataclass(frozen=True)
class RingDeviceConfig:
    max_batch: int = 0
    """Sequences per step; 0 = the executor's max_batch (never more than it)."""
    max_num_batched_tokens: int = 0
    """Tokens per step (decodes + prefill chunks); 0 = the executor's max_num_batched_tokens (never more than it)."""
    long_prefill_tokens: int = 0
    """Most tokens a running prefill takes per step while a request waits; 0 = a quarter of max_num_batched_tokens."""
    mixed_tokens: int = 0
    """Token budget of a step that carries decodes (blink.device.policy.step_budget); 0 = max_num_batched_tokens."""
    spin_s: float = 200e-6
    """Busy-poll this long after the last activity before sleeping."""
    max_sleep_s: float = 500e-6
    """Longest idle sleep: with the wake-up overshoot of time.sleep, beats stay under 1 ms apart."""
    rescan_s: float = 5e-3
    """Scan the slots this often even when no doorbell moved."""
    prefix_caching: bool = True
    """Match the slots' block keys against the cached blocks (blink/device/kv_blocks.py)."""
    kv_cache_key: int = 0
    """Identity of the KV this device computes for given tokens (the model): header.kv_cache_key,
    which seeds the frontends' block-key chains (blink.launch derives it from the model spec)."""

    def __post_init__(self) -> None:
        if min(self.max_batch, self.max_num_batched_tokens, self.long_prefill_tokens, self.mixed_tokens) < 0:
            raise ValueError("max_batch, max_num_batched_tokens, long_prefill_tokens and mixed_tokens must be >= 0")
        if not 0 < self.max_sleep_s <= 1e-3:
            raise ValueError(f"max_sleep_s must be in (0, 1 ms], got {self.max_sleep_s}")
        if self.spin_s < 0 or self.rescan_s <= 0:
            raise ValueError("spin_s must be >= 0 and rescan_s > 0")


class RingDevice:
    """Serves one ring with one executor until header.shutdown says stop."""

    def __init__(self, view: RingView, executor: Executor, config: RingDeviceConfig | None = None):
        self.view = view
        self.ex = executor
        self.config = config or RingDeviceConfig()
        cfg = self.config
        lim = step_limits(
            executor.max_batch,
            executor.max_num_batched_tokens,
            executor.max_context,
            executor.num_blocks,
            executor.block_size,
            max_batch=cfg.max_batch,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            long_prefill_tokens=cfg.long_prefill_tokens,
            mixed_tokens=cfg.mixed_tokens,
        )
        self.max_batch, self.max_num_batched_tokens, self.max_context = (
            lim.max_batch,
            lim.max_num_batched_tokens,
            lim.max_context,
        )
        self.blocks = BlockManager(executor.num_blocks, executor.block_size, cfg.prefix_caching)
        sched_cfg = SchedulerConfig(
            lim.max_batch,
            lim.max_num_batched_tokens,
            lim.max_context,
            view.geo.output_capacity,
            lim.long_prefill_tokens,
            lim.mixed_tokens,
        )
        self.sched = Scheduler(sched_cfg, self.blocks)
        self.table_width = self.blocks.blocks_for(executor.max_context)
        self.hdr = view.header
        self.features = DeviceFeatures(int(getattr(executor, "features", 0)))
        if cfg.prefix_caching:
            self.features |= DeviceFeatures.PREFIX_CACHING
        slots = view.slots
        self._state = slots["state"]
        self._cancel = slots["cancel"]
        self._generated = slots["generated"]
        self._consumed = slots["consumed"]
        self._finish_reason = slots["finish_reason"]
        self._error = slots["error"]
        self._t_submit = slots["t_submit_ns"]
        self._t_admit = slots["t_admit_ns"]
        self._t_first = slots["t_first_ns"]
        self._t_launch = slots["t_launch_ns"]
        self._mask_position = slots["mask_position"]
        self._cached_tokens = slots["cached_tokens"]
        # Counters continue from the header: a device restarted on the same ring keeps them monotonic.
        self.stats = {k: int(self.hdr[k]) for k in DEVICE_COUNTERS}
        self._cache_base = (self.stats["prefix_cache_queries"], self.stats["prefix_cache_hits"])
        self._late_base = self.stats["mask_late_rows"]
        self._shown: dict[int, int] = {}  # slot -> state last written by _sync_states
        self._plp_offset: dict[int, int] = {}  # slot -> its prompt logprob record 0 (int32 word)
        self._beats = int(self.hdr["heartbeat"])
        self._last_submit = -1
        self._last_cancel = -1
        self._last_reset = int(self.hdr["reset_cache_seq"])
        self._next_rescan = 0.0
        set_progress = getattr(executor, "set_progress", None)
        if set_progress is not None:
            set_progress(self._beat)

    # -- header -----------------------------------------------------------------
    def _beat(self) -> None:
        self._beats += 1
        self.hdr["heartbeat"] = self._beats
        self.hdr["heartbeat_ns"] = time.time_ns()

    def _flush_stats(self) -> None:
        h = self.hdr
        self.stats["prefix_cache_queries"] = self._cache_base[0] + self.sched.cache_queries
        self.stats["prefix_cache_hits"] = self._cache_base[1] + self.sched.cache_hits
        self.stats["mask_late_rows"] = self._late_base + self.sched.mask_late
        for k, v in self.stats.items():
            h[k] = v
        h["running"] = self.sched.num_running
        h["waiting"] = self.sched.num_waiting
        h["kv_blocks_free"] = self.blocks.num_free
        h["kv_blocks_cached"] = self.blocks.num_cached

    def _describe(self) -> None:
        h = self.hdr
        h["vocab_size"] = self.ex.vocab_size
        h["max_context"] = self.max_context
        h["max_batch"] = self.max_batch
        h["kv_block_size"] = self.blocks.block_size
        h["kv_blocks_total"] = self.blocks.num_blocks
        h["kv_blocks_free"] = self.blocks.num_free
        h["fault"] = 0
        h["features"] = self.features
        h["kv_cache_key"] = self.config.kv_cache_key
        self._reap_orphans()
        self._flush_stats()
        self._beat()
        h["device_status"] = DeviceStatus.READY  # last: the description is complete before READY

    # -- slots ------------------------------------------------------------------
    def _reap_orphans(self) -> None:
        """Slots a previous device on this ring claimed and never finished: nobody owns them now,
        so they end with DEVICE_FAULT (the frontend then frees them as usual)."""
        live = (SlotState.PREFILL_PROCESSING, SlotState.DECODE_PROCESSING, SlotState.DECODE_PAUSED)
        for slot in np.flatnonzero(np.isin(self._state, live)):
            self._finish(int(slot), FinishReason.ERROR, SlotError.DEVICE_FAULT)

    def _finish(self, slot: int, reason: FinishReason, error: SlotError = SlotError.NONE) -> None:
        self._shown.pop(slot, None)
        self._finish_reason[slot] = reason
        self._error[slot] = error
        self._state[slot] = SlotState.DECODE_COMPLETED
        self.stats["requests_completed"] += 1

    def _admit(self, slot: int) -> None:
        """Claim a PREFILL_PENDING slot and hand its request to the scheduler (or finish it)."""
        self._state[slot] = SlotState.PREFILL_PROCESSING
        self._shown[slot] = SlotState.PREFILL_PROCESSING
        self._t_admit[slot] = time.time_ns()
        self._cached_tokens[slot] = 0
        self.stats["requests_admitted"] += 1
        rec = self.view.slots[slot].copy()  # the frontend wrote every field before the state
        if rec["cancel"]:
            self._finish(slot, FinishReason.CANCELLED)
            return
        err = validate(rec, self.view, self.max_context, self.ex.vocab_size, self.features)
        if err is SlotError.NONE:
            err = validate_keys(rec, self.view, self.blocks.block_size)
        if err is not SlotError.NONE:
            self._finish(slot, FinishReason.ERROR, err)
            return
        off, n = int(rec["prompt_offset"]), int(rec["prompt_len"])
        self._plp_offset[slot] = int(rec["prompt_logprobs_offset"])
        sampling = sampling_of(rec, self.view)
        # Computed in full, never from cached blocks: prompt logprobs (every prompt position's logits,
        # as vLLM) and penalties (the executor marks the prompt's ids as its chunks pass, and a
        # sequence's first chunk from position 0 starts its penalty state and logit bias).
        cache_read = sampling.prompt_logprobs < 0 and not sampling.penalized
        seq = self.sched.add(
            slot,
            self.view.prompt_arena[off : off + n].tolist(),  # a copy: recompute after preemption needs it
            max_new_tokens=int(rec["max_new_tokens"]),
            min_new_tokens=int(rec["min_new_tokens"]),
            stop_ids=rec["stop_ids"][: int(rec["n_stop"])].tolist(),
            sampling=sampling,
            group=int(rec["group"]),
            block_keys=block_keys(rec, self.view) if self.blocks.caching else (),
            cache_read=cache_read,
        )
        seq.mask = int(rec["mask_slot"]) - 1  # validate checked it against the arena and the features

    def _mask_gate(self, slot: int, mask: int, k: int) -> np.ndarray | None:
        """The sampler's gate (executor.MaskGate) of token k of `slot`: mask `mask`'s bits when the frontend
        has published them for token k (slot.mask_position == k + 1, read before the bits: x86 keeps
        loads in order, and the frontend stores the position after the bits), else None."""
        if int(self._mask_position[slot]) != k + 1:
            return None
        return self.view.mask_arena[mask].copy()

    def _scan(self) -> bool:
        t0 = time.perf_counter_ns()
        pending = np.flatnonzero(self._state == SlotState.PREFILL_PENDING)
        if pending.size:
            # FCFS by the frontend's submit clock; the slot index breaks ties.
            order = np.lexsort((pending, self._t_submit[pending]))
            for slot in pending[order]:
                self._admit(int(slot))
        self.stats["scans"] += 1
        self.stats["scan_ns_total"] += time.perf_counter_ns() - t0
        return bool(pending.size)

    def _apply_cancels(self) -> bool:
        hit = [sid for sid in self.sched.seqs if self._cancel[sid]]
        for sid in hit:
            self.sched.abort(sid)
            self._finish(sid, FinishReason.CANCELLED)
        return bool(hit)

    def _poll(self, admit: bool) -> bool:
        """Doorbells, scan, cancels, consumed counters. Returns whether anything changed."""
        now = time.monotonic()
        submit, cancel = int(self.hdr["submit_seq"]), int(self.hdr["cancel_seq"])
        rescan = now >= self._next_rescan
        if rescan:
            self._next_rescan = now + self.config.rescan_s
        changed = False
        if admit and (submit != self._last_submit or rescan):
            self._last_submit = submit
            changed |= self._scan()
        if cancel != self._last_cancel or rescan:
            self._last_cancel = cancel
            changed |= self._apply_cancels()
        reset = int(self.hdr["reset_cache_seq"])
        if reset != self._last_reset:
            self._last_reset = reset
            self.blocks.reset_cache()
            self.stats["prefix_cache_resets"] += 1
            changed = True
        for s in self.sched.seqs.values():
            if self.sched.output_full(s):
                c = int(self._consumed[s.seq_id])
                if c != s.consumed:
                    s.consumed = c
                    changed = True
        if changed:
            self._sync_states()
        return changed

    def _sync_states(self) -> None:
        shown = self._shown
        for sid, s in self.sched.seqs.items():
            st = self.sched.ring_state(s)
            if shown.get(sid) != st:
                shown[sid] = st
                self._state[sid] = st

    # -- steps ------------------------------------------------------------------
    def _step(self, plan: StepPlan) -> int:
        """Run one step and publish its tokens; returns the executor's time (ns)."""
        batch = build_batch(plan, self.blocks, self.table_width)
        x = batch.ext
        if x is not None and (x.mask_slot >= 0).any():  # gates and masks are read when the rows are sampled
            x.mask_gate = self._mask_gate
        for c in plan.chunks[plan.num_decodes :]:  # before the first token's `generated` store
            if c.seq.num_generated == 0:
                self._cached_tokens[c.seq.seq_id] = max(c.seq.cached_tokens, 0)
        t_launch = time.time_ns()
        t0 = time.perf_counter_ns()
        sampled = self.ex.execute(batch)
        dt = time.perf_counter_ns() - t0
        if batch.ext is not None:
            self._write_prompt_logprobs(plan, batch)
        self.stats["launches"] += 1
        if plan.kind is not StepKind.DECODE:  # a mixed step counts as a prefill launch
            self.stats["prefill_steps"] += 1
            self.stats["prompt_tokens"] += plan.prefill_tokens
        else:
            self.stats["steps"] += 1
            self.stats["step_ns_total"] += dt
        events = self.sched.update(plan, sampled)
        if events:
            sids_t, idx_t, toks, fins = zip(*events, strict=True)
            sids, idx = np.array(sids_t), np.array(idx_t)
            # Publication order per slot: tokens into the arena, t_launch/t_first, then `generated` (the
            # release the readers acquire), then finish_reason and state. Whole-array stores keep
            # that order (each statement completes before the next; x86 keeps stores in order).
            cap = self.view.geo.output_capacity
            if batch.ext is not None:  # logprob records before `generated` covers them
                row = {c.seq.seq_id: i for i, c in enumerate(plan.chunks)}
                x = batch.ext
                for sid, k in zip(sids_t, idx_t, strict=True):
                    if x.params[row[sid]].logprobs >= 0:
                        self.view.logprob_arena[sid, k % cap] = x.logprobs[row[sid]]
            self.view.output_arena[sids, idx % cap] = toks
            first = sids[idx == 0]
            if first.size:
                self._t_launch[first] = t_launch
                self._t_first[first] = time.time_ns()
            self._generated[sids] = idx + 1
            self.stats["tokens_generated"] += len(events)
            for sid, fin in zip(sids_t, fins, strict=True):
                if fin is not FinishReason.NONE:
                    self._finish(sid, fin)
        self._sync_states()
        return dt

    def _write_prompt_logprobs(self, plan: StepPlan, batch: StepBatch) -> None:
        """Prompt logprob records of the step's scored tokens into their slots' prompt regions."""
        x = batch.ext
        assert x is not None
        t0 = 0
        for c in plan.chunks:
            pn = c.seq.sampling.prompt_logprobs
            rows = x.targets[t0 : t0 + c.n] >= 0
            if pn >= 0 and rows.any():
                rec = prompt_logprob_record(pn)
                w = rec.itemsize // 4
                out = np.zeros(int(rows.sum()), rec)
                src = x.prompt_logprobs[t0 : t0 + c.n][rows]
                out["logprob"] = src["logprob"]
                out["top_ids"] = src["top_ids"][:, :pn]
                out["top_logprobs"] = src["top_logprobs"][:, :pn]
                first = c.start + 1  # record j scores prompt token j
                lo = self._plp_offset[c.seq.seq_id] + first * w
                self.view.prompt_arena[lo : lo + out.size * w] = out.view(np.int32)
            t0 += c.n

    def _abort_all(self, reason: FinishReason, error: SlotError = SlotError.NONE) -> None:
        for sid in list(self.sched.seqs):
            self.sched.abort(sid)
            self._finish(sid, reason, error)

    # -- loop -------------------------------------------------------------------
    def run(self) -> DeviceStatus:
        """Serve until header.shutdown (1: finish in-flight requests, 2: cancel them); requests still
        PREFILL_PENDING then stay unclaimed. Returns the final status (STOPPED; a fault raises). An
        executor whose sampler reads the ring itself (map_ring) has it mapped while this runs, and
        released (unmap_ring) when it returns or raises."""
        map_ring = getattr(self.ex, "map_ring", None)
        if map_ring is not None:  # its sampler reads each constrained row's gate and bits from the ring
            map_ring(self.view)
        try:
            return self._serve()
        finally:
            unmap_ring = getattr(self.ex, "unmap_ring", None)
            if unmap_ring is not None:
                unmap_ring()

    def _serve(self) -> DeviceStatus:
        self._describe()
        last_active = time.monotonic()
        sleep_s = 10e-6
        status = DeviceStatus.READY
        try:
            while True:
                t_iter = time.perf_counter_ns()
                self._beat()
                shutdown = int(self.hdr["shutdown"])
                if shutdown >= 2:
                    self._abort_all(FinishReason.CANCELLED)
                    break
                if shutdown == 1 and status is not DeviceStatus.STOPPING:
                    status = DeviceStatus.STOPPING
                    self.hdr["device_status"] = status
                active = self._poll(admit=shutdown == 0)
                if shutdown == 1 and not self.sched.has_work():
                    break
                plan = self.sched.schedule()
                if plan is not None:
                    exec_ns = self._step(plan)
                    self.stats["sched_ns_total"] += time.perf_counter_ns() - t_iter - exec_ns
                    active = True
                if active:
                    self._flush_stats()
                    last_active = time.monotonic()
                    sleep_s = 10e-6
                elif time.monotonic() - last_active > self.config.spin_s:
                    time.sleep(sleep_s)
                    sleep_s = min(sleep_s * 2, self.config.max_sleep_s)
        except BaseException:
            self.hdr["fault"] = SlotError.DEVICE_FAULT
            self._abort_all(FinishReason.ERROR, SlotError.DEVICE_FAULT)
            self._flush_stats()
            self.hdr["device_status"] = DeviceStatus.FAILED
            raise
        self._flush_stats()
        self.hdr["device_status"] = DeviceStatus.STOPPED
        return DeviceStatus.STOPPED
