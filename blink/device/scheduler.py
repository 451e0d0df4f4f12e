"""Scheduling policy: FCFS continuous batching with inline (chunked) prefill and recompute preemption.

A pure state machine, no ring and no model: `schedule()` returns the next `StepPlan`, the caller
runs it, `update(plan, sampled)` advances the sequences and returns the published tokens. Unit
tests drive it with fabricated samples; `blink.device.ring_device` drives it from the ring.

Every sequence keeps `tokens` (prompt + generated) and `num_computed`, the tokens whose K/V is in
the cache. A step computes a chunk tokens[num_computed : num_computed + n]; when the chunk reaches
the end of `tokens`, the logits of its last token give the next generated token. Decode is the
case n == 1; prefill, chunked prefill and the recompute of a preempted sequence are the same
operation with larger n.

Policy (paper §4.2; chunked prefill piggybacked on decode as Sarathi-Serve and vLLM do, so the
comparison isolates the scheduler's placement):
- Every step carries every running sequence that is ready to decode (one token each, arrival
  order), so a decoding sequence is never stalled by a prompt. When the pool cannot cover them, the
  newest running sequence is preempted (its blocks are freed, it is recomputed later: prompt +
  generated re-prefilled).
- The rest of the step's token budget (step_budget() minus the decodes) goes to prefill chunks: first
  the running sequences whose prefill is unfinished, then waiting sequences in arrival order while
  the batch (max_batch) and the KV pool allow. A prompt longer than the budget is prefilled over
  several steps. The step is DECODE (decodes only), PREFILL (chunks only) or MIXED; a graph is
  chosen by (batch, tokens), so a MIXED step runs a prefill graph with one-token rows in it.
- A step that carries decodes has the smaller budget `mixed_tokens` (Sarathi-Serve's token budget;
  0 = max_num_batched_tokens), doubled until it leaves prefill at least half of mixed_tokens and a fair share
  of the queue of waiting prompts (step_budget; never above max_num_batched_tokens): a mixed step fills a budget that
  is one of the engine's token buckets exactly (no graph padded to the next power of two), a lone
  prompt among decodes makes steps little slower than decode steps, a prompt advances by at least
  mixed_tokens / 2 per step however many decodes run, and a queue of prompts waiting behind the
  one admitted gets larger steps. A step without decodes takes up to max_num_batched_tokens.
- While a request waits for admission, a running prefill takes at most `long_prefill_tokens` of a
  step (vLLM's long_prefill_token_threshold), so a short request is served while a long prompt is
  still prefilling; alone, a prefill takes the whole budget.
- A prefill chunk that shares its step never preempts (the victim, the newest running sequence,
  could be in the step already): it is cut to the blocks that are free. When not even one token
  fits, prefill and admission stop for this step (FCFS: nobody overtakes). A chunk that would run
  alone preempts the newest running sequence, as decodes do, so a pool full of half-prefilled
  prompts still makes progress.
- A sequence whose output ring is full (generated - consumed >= output_capacity) sits out until
  the reader catches up; it keeps its KV blocks and its batch place meanwhile.
- Fair share: the choices of one API request (Seq.group, from slot.group) are one group, whose share
  is group_cap(max_batch), half the batch. Admission takes the waiting sequences whose group is
  below its share first (arrival order), then the others (arrival order): a lone request with a
  large `n` still fills an idle batch. When the batch is full, a sequence below its share waits, and
  some group holds more than its share, that group's newest running sequence is preempted (the
  recompute preemption above), so the waiting one is admitted in the same step: one request's
  choices never keep another request waiting for them to end.
- A gated sequence (structured output: its next token is sampled under a token mask the frontend
  publishes) is planned like any other: its gate (that mask published) is the sampler's business, read
  when the step samples the row, at the end of the step, so the mask may arrive while the step runs.
  A row whose gate is still closed then gives no token (NO_TOKEN, a negative sample): `update` leaves it
  where it was, one position short (the K/V the step wrote at that position is written again by the
  rerun, and no block is registered on its strength), and it samples that position again next step.
  Nobody else waits for it.
- Admission never preempts; a running sequence never fails for lack of KV, because max_context
  fits the pool (the caller's duty).
- Prefix caching (blink/device/kv_blocks.py): at admission (a re-admission after preemption too) a
  sequence takes the cached blocks of its longest run of leading block keys and is prefilled from
  the first token after them; the token of the prompt's last position is always computed (its
  logits give the first token). The blocks a step completes are registered in `update`. A
  sequence with `cache_read` False (it asked for prompt logprobs, which need every prompt
  position's logits, as in vLLM) matches nothing but still registers its blocks. `cache_queries`
  and `cache_hits` count prompt tokens at first admissions (vLLM's prefix cache queries and hits).
- `mask_late` counts the rows that gave no token because their mask was late (header.mask_late_rows;
  the GPU scheduler counts the same rows in its `account`).
"""

from __future__ import annotations

import bisect
import collections
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from blink.protocol.layout import UNLIMITED, FinishReason, SlotState
from blink.protocol.sampling_params import SamplingParams
from blink.protocol.step import NO_TOKEN

from .kv_blocks import BlockManager
from .policy import BACKLOG_SCAN, default_long_prefill, group_cap, step_budget

DEFAULT_SAMPLING = SamplingParams()

# Enum member lookups go through the enum metaclass; the per-step paths use plain ints.
_PREFILL_PROCESSING = int(SlotState.PREFILL_PROCESSING)
_DECODE_PROCESSING = int(SlotState.DECODE_PROCESSING)
_DECODE_PAUSED = int(SlotState.DECODE_PAUSED)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int
    """Sequences in the batch (running, holding KV), and so per step."""
    max_num_batched_tokens: int
    """Tokens per step (>= max_batch: a step carries every decode, the rest goes to prefill chunks)."""
    max_context: int
    """prompt + generated tokens per sequence; must fit the KV pool."""
    output_capacity: int
    """Tokens of a sequence's output ring: generated - consumed never exceeds it."""
    long_prefill_tokens: int = 0
    """Most tokens a running prefill takes in one step while a request waits for admission;
    0 = default_long_prefill(max_num_batched_tokens)."""
    mixed_tokens: int = 0
    """Token budget of a step that carries decodes (decodes + prefill chunks), doubled while it
    leaves prefill less than half of itself or prompts queue; 0 = max_num_batched_tokens. See step_budget."""

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_num_batched_tokens", "max_context", "output_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_batch:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_batch ({self.max_batch})"
            )
        if self.long_prefill_tokens < 0 or self.mixed_tokens < 0:
            raise ValueError("long_prefill_tokens and mixed_tokens must be >= 0")
        if self.max_context < 2:
            raise ValueError("max_context must be >= 2 (a prompt token and a generated one)")


class SeqStatus(enum.Enum):
    WAITING = 0  # not holding KV (new, or preempted)
    RUNNING = 1  # holds KV and a batch place
    FINISHED = 2


class StepKind(enum.Enum):
    PREFILL = 0  # prefill chunks only
    DECODE = 1  # decodes only (one token per sequence)
    MIXED = 2  # decodes first, then prefill chunks


@dataclass(eq=False)
class Seq:
    """One request. `seq_id` is the caller's key (the ring slot)."""

    seq_id: int
    tokens: list[int]  # prompt + generated
    prompt_len: int
    max_new_tokens: int = UNLIMITED
    min_new_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()
    sampling: SamplingParams = DEFAULT_SAMPLING  # how its tokens are chosen (opaque to the policy)
    group: int = 0  # the API request it is a choice of (0: none): group_cap bounds a group's places
    arrival: int = 0  # FCFS order, set by Scheduler.add
    num_computed: int = 0
    consumed: int = 0  # output tokens the reader has taken (output ring flow control)
    status: SeqStatus = SeqStatus.WAITING
    preemptions: int = 0
    finish: FinishReason = FinishReason.NONE

    num_generated: int = 0  # == len(tokens) - prompt_len (kept, not derived: read every step)
    mask: int = -1  # token mask of its samples (-1: none); a sample whose mask was late is NO_TOKEN
    block_keys: list[bytes] = field(default_factory=list)  # key of each full prompt block (prefix cache)
    cache_read: bool = True  # may start from cached blocks (False: every prompt token is computed)
    cached_tokens: int = -1  # prompt tokens taken from the cache at the first admission (-1: not yet)

    @property
    def prefilling(self) -> bool:
        """More than the last token is missing from the cache (decode computes only the last)."""
        return self.num_generated == 0 or len(self.tokens) - self.num_computed > 1


@dataclass(slots=True)
class ScheduledChunk:
    seq: Seq
    start: int  # first position computed
    n: int  # tokens computed
    sample: bool  # the chunk reaches the end of seq.tokens: its last logits give a new token


@dataclass
class StepPlan:
    kind: StepKind
    chunks: list[ScheduledChunk]  # the decodes first (arrival order), then the prefill chunks
    preempted: list[Seq] = field(default_factory=list)
    num_decodes: int = 0  # chunks[:num_decodes] are decodes

    @property
    def prefill_tokens(self) -> int:
        return sum(c.n for c in self.chunks[self.num_decodes :])

    @property
    def num_tokens(self) -> int:
        return sum(c.n for c in self.chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)


class TokenEvent(NamedTuple):  # a tuple: built for every token, so it must be cheap
    """A token to publish: token `index` of sequence `seq_id`; finish != NONE on its last."""

    seq_id: int
    index: int
    token: int
    finish: FinishReason


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        if blocks.blocks_for(config.max_context - 1) > blocks.num_blocks:
            raise ValueError(
                f"max_context {config.max_context} needs {blocks.blocks_for(config.max_context - 1)} KV blocks, "
                f"the pool has {blocks.num_blocks}"
            )
        self.config = config
        self.blocks = blocks
        self.seqs: dict[int, Seq] = {}
        self.waiting: list[Seq] = []  # arrival order (preempted ones re-inserted in place)
        self.running: list[Seq] = []
        self._arrivals = 0
        self.cache_queries = 0  # prompt tokens of first admissions
        self.cache_hits = 0  # of those, tokens taken from the prefix cache
        self.mask_late = 0  # sampled rows whose token mask was not published yet (no token this step)

    # -- requests ---------------------------------------------------------------
    def add(
        self,
        seq_id: int,
        prompt: Iterable[int],
        *,
        max_new_tokens: int = UNLIMITED,
        min_new_tokens: int = 0,
        stop_ids: Iterable[int] = (),
        sampling: SamplingParams = DEFAULT_SAMPLING,
        group: int = 0,
        block_keys: Sequence[bytes] = (),
        cache_read: bool = True,
    ) -> Seq:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} is already scheduled")
        tokens = [int(t) for t in prompt]
        if not tokens or len(tokens) + 1 > self.config.max_context:
            raise ValueError(f"prompt of {len(tokens)} tokens does not fit max_context {self.config.max_context}")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        s = Seq(
            seq_id=seq_id,
            tokens=tokens,
            prompt_len=len(tokens),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            stop_ids=frozenset(int(t) for t in stop_ids),
            sampling=sampling,
            group=group,
            arrival=self._arrivals,
            block_keys=list(block_keys),
            cache_read=cache_read,
        )
        self._arrivals += 1
        self.seqs[seq_id] = s
        self.waiting.append(s)
        return s

    def abort(self, seq_id: int) -> Seq | None:
        """Drop a sequence at once (cancel): its KV blocks return to the pool."""
        s = self.seqs.pop(seq_id, None)
        if s is None:
            return None
        (self.running if s.status is SeqStatus.RUNNING else self.waiting).remove(s)
        self.blocks.free(seq_id)
        s.status = SeqStatus.FINISHED
        s.finish = FinishReason.CANCELLED
        return s

    def set_consumed(self, seq_id: int, consumed: int) -> None:
        self.seqs[seq_id].consumed = consumed

    def output_full(self, s: Seq) -> bool:
        return s.num_generated - s.consumed >= self.config.output_capacity

    def ring_state(self, s: Seq) -> int:
        """The SlotState a live sequence shows on the ring (a plain int: this runs every step)."""
        if s.num_generated == 0:
            return _PREFILL_PROCESSING
        if s.status is SeqStatus.RUNNING and not s.prefilling and not self.output_full(s):
            return _DECODE_PROCESSING
        return _DECODE_PAUSED

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.seqs)

    # -- policy -----------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step, or None when nothing can run now (idle, or every sequence blocked)."""
        plan = StepPlan(StepKind.DECODE, [])
        self._make_room_for_a_share(plan)
        ready, partial = self._split_running()
        # decided before the decodes are planned (their preemptions do not make prefill wanted)
        wants_prefill = partial or (len(self.running) < self.config.max_batch and self._admissible_waiting())
        if ready:
            self._schedule_decode(ready, plan)
        plan.num_decodes = len(plan.chunks)
        if wants_prefill:
            cfg = self.config
            budget = cfg.max_num_batched_tokens
            if cfg.mixed_tokens and plan.num_decodes:
                budget = step_budget(cfg.max_num_batched_tokens, cfg.mixed_tokens, plan.num_decodes, self._backlog())
            self._schedule_prefill(plan, budget - plan.num_decodes)
        if not plan.chunks:
            return None
        if len(plan.chunks) > plan.num_decodes:
            plan.kind = StepKind.MIXED if plan.num_decodes else StepKind.PREFILL
        return plan

    def _backlog(self) -> int:
        """The queue behind the first waiting sequence: the tokens of the next BACKLOG_SCAN waiting
        ones (step_budget)."""
        return sum(len(s.tokens) for s in self.waiting[1 : 1 + BACKLOG_SCAN])

    def _admissible_waiting(self) -> bool:
        return any(not self.output_full(s) for s in self.waiting)

    def _split_running(self) -> tuple[list[Seq], bool]:
        """(running sequences ready to decode, whether any running one is still prefilling)."""
        ready: list[Seq] = []
        partial = False
        cap = self.config.output_capacity
        for s in self.running:
            if s.num_generated == 0 or len(s.tokens) - s.num_computed > 1:
                partial = True
            elif s.num_generated - s.consumed < cap:
                ready.append(s)
        return ready, partial

    def _preempt_newest(self, plan: StepPlan) -> Seq:
        return self._preempt(max(self.running, key=lambda s: s.arrival), plan)

    def _preempt(self, victim: Seq, plan: StepPlan) -> Seq:
        self.running.remove(victim)
        self.blocks.free(victim.seq_id)
        victim.num_computed = 0
        victim.status = SeqStatus.WAITING
        victim.preemptions += 1
        bisect.insort(self.waiting, victim, key=lambda s: s.arrival)
        plan.preempted.append(victim)
        return victim

    def _reserve(self, s: Seq, n_tokens: int, plan: StepPlan) -> bool:
        """Blocks for s to hold n_tokens, preempting newer running sequences; False if s itself went."""
        while not self.blocks.grow(s.seq_id, n_tokens):
            if self._preempt_newest(plan) is s:
                return False
        return True

    def _schedule_decode(self, ready: list[Seq], plan: StepPlan) -> None:
        ready.sort(key=lambda s: s.arrival)
        for s in ready:
            if s.status is not SeqStatus.RUNNING:
                continue  # preempted for an older sequence earlier in this loop
            if self._reserve(s, len(s.tokens), plan):
                plan.chunks.append(ScheduledChunk(s, len(s.tokens) - 1, 1, True))

    def _schedule_prefill(self, plan: StepPlan, budget: int) -> None:
        cfg = self.config
        bs = self.blocks.block_size
        cap = budget
        if len(self.running) < cfg.max_batch and self._admissible_waiting():
            cap = min(budget, cfg.long_prefill_tokens or default_long_prefill(cfg.max_num_batched_tokens))
        for s in sorted((s for s in self.running if s.prefilling), key=lambda s: s.arrival):
            if budget == 0:
                break
            if s.status is not SeqStatus.RUNNING:
                continue  # preempted by an older chunk's reservation in this loop
            n = min(len(s.tokens) - s.num_computed, budget, cap)
            if s.num_computed + n == len(s.tokens) and self.output_full(s):
                continue  # a recompute that would publish into a full output ring waits
            if plan.chunks:  # shares the step: never preempt, cut the chunk to the free blocks
                room = (len(self.blocks.table(s.seq_id)) + self.blocks.num_free) * bs - s.num_computed
                if room <= 0:
                    return  # FCFS: nobody overtakes a prefill that cannot go
                n = min(n, room)
                self.blocks.grow(s.seq_id, s.num_computed + n)
            elif not self._reserve(s, s.num_computed + n, plan):
                continue
            plan.chunks.append(ScheduledChunk(s, s.num_computed, n, s.num_computed + n == len(s.tokens)))
            budget -= n
        held = self._places()
        left = self._admit(plan, budget, held, over=False)  # within their group's share first
        if left is not None:
            self._admit(plan, left, held, over=True)  # then beyond it: a lone group may fill the batch

    def _admit(self, plan: StepPlan, budget: int, held: collections.Counter[int], over: bool) -> int | None:
        """Admit waiting sequences in arrival order: those whose group is below its share of the batch
        (over=False), or those beyond it (over=True). Returns the budget left, or None when admission
        stops for this step (budget, batch or KV exhausted, or a sequence this step preempted is next)."""
        cfg = self.config
        gcap = group_cap(cfg.max_batch)
        for s in list(self.waiting):
            if budget == 0 or len(self.running) >= cfg.max_batch:
                return None
            if bool(s.group and held[s.group] >= gcap) != over:
                continue  # the other pass's
            if s in plan.preempted:
                return None  # preempted by this very step: admitting it back would undo that
            if self.output_full(s):
                continue
            n = self._admit_one(s, budget)
            if n is None:
                return None  # FCFS: no overtaking the head for lack of KV
            held[s.group] += 1
            plan.chunks.append(ScheduledChunk(s, s.num_computed, n, s.num_computed + n == len(s.tokens)))
            budget -= n
        return budget

    def _places(self) -> collections.Counter[int]:
        """Running sequences per group (group 0, no group, is not counted)."""
        return collections.Counter(s.group for s in self.running if s.group)

    def _make_room_for_a_share(self, plan: StepPlan) -> None:
        """With the batch full, a waiting sequence whose group is below its share (group_cap), and a
        group above it: the newest running sequence of such a group is preempted (recomputed later),
        so that the waiting one is admitted in this step."""
        cfg = self.config
        if len(self.running) < cfg.max_batch or not self.waiting:
            return
        held, gcap = self._places(), group_cap(cfg.max_batch)
        over = [s for s in self.running if s.group and held[s.group] > gcap]
        if over and any(held[s.group] < gcap and not self.output_full(s) for s in self.waiting):
            self._preempt(max(over, key=lambda s: s.arrival), plan)

    def _admit_one(self, s: Seq, budget: int) -> int | None:
        """Give a waiting sequence its cached prefix and blocks for its first chunk; returns the
        chunk's tokens (from s.num_computed), or None when the pool cannot hold it (nothing changed)."""
        hits = self.blocks.match(s.block_keys, len(s.tokens)) if s.cache_read else []
        start = len(hits) * self.blocks.block_size
        n = min(len(s.tokens) - start, budget)
        if not self.blocks.can_allocate(start + n, hits=hits):
            return None
        self.blocks.allocate(s.seq_id, start + n, hits)
        s.num_computed = start
        if s.cached_tokens < 0:
            s.cached_tokens = start
            self.cache_queries += s.prompt_len
            self.cache_hits += start
        self.waiting.remove(s)
        self.running.append(s)
        s.status = SeqStatus.RUNNING
        return n

    # -- results ----------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: Sequence[int] | np.ndarray) -> list[TokenEvent]:
        """Advance the sequences of `plan` by the step's sampled tokens (one per chunk). A sampled chunk
        whose sample is NO_TOKEN (its token mask was not published when the row was sampled) advances to
        one position short of its end: that position is computed again, and sampled, by a later step."""
        if len(sampled) != len(plan.chunks):
            raise ValueError(f"{len(sampled)} samples for {len(plan.chunks)} chunks")
        events: list[TokenEvent] = []
        toks = sampled.tolist() if isinstance(sampled, np.ndarray) else [int(t) for t in sampled]
        for c, tok in zip(plan.chunks, toks, strict=True):
            s = c.seq
            if s.status is not SeqStatus.RUNNING:
                continue  # aborted between schedule and update: its result is dropped
            late = c.sample and tok == NO_TOKEN
            s.num_computed = c.start + c.n - late  # a late mask: the last position's K/V is not final
            self.mask_late += late
            if s.block_keys:
                self.blocks.register(s.seq_id, s.block_keys, s.num_computed)
            if not c.sample or late:
                continue
            k = s.num_generated
            s.tokens.append(tok)
            s.num_generated = k + 1
            finish = self._finish_reason(s, k, tok)
            events.append(TokenEvent(s.seq_id, k, tok, finish))
            if finish is not FinishReason.NONE:
                self._retire(s, finish)
        return events

    def _finish_reason(self, s: Seq, k: int, tok: int) -> FinishReason:
        if tok in s.stop_ids and k >= s.min_new_tokens:
            return FinishReason.STOP
        if s.max_new_tokens != UNLIMITED and k + 1 >= s.max_new_tokens:
            return FinishReason.LENGTH
        if len(s.tokens) >= self.config.max_context:
            return FinishReason.CONTEXT
        return FinishReason.NONE

    def _retire(self, s: Seq, finish: FinishReason) -> None:
        self.running.remove(s)
        del self.seqs[s.seq_id]
        self.blocks.free(s.seq_id)
        s.status = SeqStatus.FINISHED
        s.finish = finish
