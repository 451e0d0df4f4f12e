// Blink GPU scheduler, plan side: KV blocks, rows, the policy of blink/device/scheduler.py, and
// the engine's step buffers. Included by scheduler.cu (one translation unit: the kernel is one graph).
#pragma once

// ---- KV blocks (thread 0 only, plan phase) ---------------------------------------------------------
__device__ bool kv_grow(SchedCtl* c, Shared& sh, uint32_t r, uint32_t ntok) {
  Row& R = g_rows[r];
  const uint32_t need = ceil_div(ntok, sh.bs);
  if (need <= R.n_blocks) return true;
  if ((int)(need - R.n_blocks) > c->kv_free_top) return false;
  int32_t* b = row_blocks(c, sh, r);
  while (R.n_blocks < need) b[R.n_blocks++] = kv_take(c, sh.E->num_kv_blocks);
  return true;
}

// A preempted row's blocks, released now (tail first: BlockManager.free).
__device__ void kv_free_row(SchedCtl* c, Shared& sh, uint32_t r) {
  Row& R = g_rows[r];
  const int32_t* b = row_blocks(c, sh, r);
  for (uint32_t i = R.n_blocks; i-- > 0;) kv_release(c, sh.E->num_kv_blocks, b[i]);
  R.n_blocks = 0;
  R.checked = 0;
  R.kv_gen++;
}


// Preempt the running row at position pos of g_run (recompute later). Returns the row.
__device__ uint32_t preempt_at(SchedCtl* c, Shared& sh, uint32_t pos) {
  const uint32_t v = g_run[pos];
  for (uint32_t i = pos + 1; i < c->n_run; ++i) g_run[i - 1] = g_run[i];
  c->n_run--;
  Row& V = g_rows[v];
  kv_free_row(c, sh, v);
  V.computed = 0;
  V.running = 0;
  uint32_t i = c->n_wait++;
  while (i > 0 && g_rows[g_wait[i - 1]].arrival > V.arrival) { g_wait[i] = g_wait[i - 1]; --i; }
  g_wait[i] = v;
  if (sh.n_preempted < 64) sh.preempted[sh.n_preempted] = v;
  sh.n_preempted++;
  c->preemptions++;
  return v;
}

// Preempt the newest running sequence (the last of g_run, which is in arrival order).
__device__ uint32_t preempt_newest(SchedCtl* c, Shared& sh) { return preempt_at(c, sh, c->n_run - 1); }

__device__ bool reserve(SchedCtl* c, Shared& sh, uint32_t r, uint32_t ntok) {
  while (!kv_grow(c, sh, r, ntok))
    if (preempt_newest(c, sh) == r) return false;
  return true;
}

__device__ bool preempted_now(const Shared& sh, uint32_t r) {
  if (sh.n_preempted > 64) return true;  // lost track: be conservative (stop admitting this step)
  for (uint32_t i = 0; i < sh.n_preempted; ++i)
    if (sh.preempted[i] == r) return true;
  return false;
}

__device__ void add_chunk(Shared& sh, uint32_t r, uint32_t start, uint32_t n, uint32_t sample) {
  const uint32_t i = sh.nseq++;
  g_plan_row[i] = r;
  g_plan_start[i] = start;
  g_plan_n[i] = n;
  g_plan_sample[i] = sample;
  g_plan_cu[i] = sh.ntok;
  sh.ntok += n;
}

__device__ void insert_running(SchedCtl* c, uint32_t r) {
  uint32_t i = c->n_run++;
  while (i > 0 && g_rows[g_run[i - 1]].arrival > g_rows[r].arrival) { g_run[i] = g_run[i - 1]; --i; }
  g_run[i] = r;
}

// Scheduler._admit_one for row r (waiting, no blocks): its cached prefix and blocks for its first
// chunk of at most `budget` tokens. Returns the chunk's tokens (from R.computed), or NO_KV when the
// pool cannot hold it (nothing changed). Counts the first admission's queries and hits, and tells the
// slot.
constexpr uint32_t NO_KV = 0xFFFFFFFFu;
__device__ uint32_t admit_row(SchedCtl* c, Shared& sh, uint32_t r, uint32_t budget) {
  Row& R = g_rows[r];
  uint32_t idle;
  const uint32_t hits = prefix_hits(c, sh, R, &idle), start = hits * sh.bs;
  const uint32_t n = min(R.len - start, budget);
  if (ceil_div(start + n, sh.bs) - hits > (uint32_t)c->kv_free_top - idle) return NO_KV;
  prefix_take(c, sh, r, hits);
  R.computed = start;
  kv_grow(c, sh, r, start + n);
  if (!R.cache_seen) {
    R.cache_seen = 1;
    c->prefix_cache_queries += R.prompt_len;
    c->prefix_cache_hits += start;
    st_sys(&sh.slots[R.slot].cached_tokens, start);  // before the first token's `generated` store
  }
  return n;
}

// A decode may be planned for running row R (Scheduler._split_running's ready).
__device__ __forceinline__ bool decode_ready(const Row& R, uint32_t cap) {
  return R.running && !prefilling(R) && !output_full(R, cap);
}

// A new row from a claimed slot (fields copied at claim time).
__device__ uint32_t new_row(SchedCtl* c, uint32_t slot, u64 arrival) {
  const uint32_t r = g_free_rows[--c->n_free_rows];
  const RingSlot& q = ((const RingSlot*)c->slot_copy)[slot];
  Row& R = g_rows[r];
  R.used = 1;
  R.running = 0;
  R.slot = slot;
  R.prompt_len = q.prompt_len;
  R.prompt_offset = q.prompt_offset;
  R.len = q.prompt_len;
  R.computed = 0;
  R.consumed = 0;
  R.n_blocks = 0;
  R.max_new = q.max_new_tokens;
  R.min_new = q.min_new_tokens;
  R.n_stop = q.n_stop;
  R.top_k = (int32_t)q.top_k;
  R.temperature = q.temperature < SAMPLING_EPS ? 0.0f : q.temperature;  // greedy (step_batch.py)
  R.top_p = q.top_p;
  R.ring_state = SLOT_PREFILL_PROCESSING;
  R.need_copy = 1;
  R.cancel = 0;
  R.seed = q.seed;
  R.arrival = arrival;
  R.group = q.group;
  R.presence_penalty = q.presence_penalty;
  R.frequency_penalty = q.frequency_penalty;
  R.repetition_penalty = q.repetition_penalty == 0.0f ? 1.0f : q.repetition_penalty;  // 0 reads as off
  R.min_p = q.min_p;
  R.logprobs = (q.flags & SLOTFLAG_LOGPROBS) ? (int32_t)min(q.n_logprobs, MAX_LOGPROBS) : -1;
  R.pen = R.presence_penalty != 0.0f || R.frequency_penalty != 0.0f || R.repetition_penalty != 1.0f ||
          q.n_logit_bias != 0;
  R.prompt_logprobs = (q.flags & SLOTFLAG_PROMPT_LOGPROBS) ? (int32_t)min(q.n_logprobs, MAX_LOGPROBS) : -1;
  R.prompt_lp_off = q.prompt_logprobs_offset;
  R.ext = R.pen || R.logprobs >= 0 || R.prompt_logprobs >= 0 || R.min_p != 0.0f;
  R.mask = q.mask_slot;
  R.n_keys = c->prefix_caching ? q.n_block_keys : 0;  // validated and copied at claim
  R.checked = 0;
  R.cache_read = R.prompt_logprobs < 0 && !R.pen;  // prompt logprobs and penalties see every prompt token
  R.cache_seen = 0;
  for (uint32_t i = 0; i < MAX_STOP_IDS; ++i) R.stop_ids[i] = q.stop_ids[i];
  return r;
}

// Running rows of group g (thread 0). `cache` keeps the last group counted: a group's choices are
// claimed together, so consecutive candidates mostly share it.
struct GroupCount {
  u64 group;
  uint32_t n;
};
__device__ uint32_t group_held(const SchedCtl* c, u64 g, GroupCount& cache) {
  if (g != cache.group) {
    uint32_t n = 0;
    for (uint32_t p = 0; p < c->n_run; ++p) n += g_rows[g_run[p]].group == g;
    cache.group = g;
    cache.n = n;
  }
  return cache.n;
}

// Scheduler._backlog (thread 0): the tokens of the BACKLOG_SCAN waiting sequences behind the first,
// in arrival order (the preempted rows, then the claimed slots).
__device__ uint32_t prefill_backlog(const SchedCtl* c, const Shared& sh) {
  uint32_t n = 0, seen = 0;
  for (uint32_t p = 0; p < c->n_wait && seen <= BACKLOG_SCAN; ++p, ++seen)
    if (seen) n += g_rows[g_wait[p]].len;
  const uint32_t* wq = (const uint32_t*)c->waitq;
  const RingSlot* copy = (const RingSlot*)c->slot_copy;
  for (uint32_t i = c->waitq_head; i != c->waitq_tail && seen <= BACKLOG_SCAN; ++i) {
    const uint32_t slot = wq[i % sh.n_slots];
    if (slot == DEAD) continue;
    if (seen) n += copy[slot].prompt_len;
    ++seen;
  }
  return n;
}

// Scheduler._admit (thread 0): waiting sequences in arrival order, the preempted rows (older than
// every queued request) then the FIFO of claimed slots: those whose group is below its share
// (over = false) or those beyond it (over = true). Returns false when admission stops for this
// step. A FIFO entry passed over stays queued (taken entries behind the head become DEAD; the head
// moves over DEAD entries).
__device__ bool admit_pass(SchedCtl* c, Shared& sh, uint32_t& budget, bool over, GroupCount& held) {
  const uint32_t gcap = group_cap(c->max_batch);
  uint32_t w = 0;
  while (w < c->n_wait) {
    if (budget == 0 || c->n_run >= c->max_batch) return false;
    const uint32_t r = g_wait[w];
    Row& R = g_rows[r];
    if ((R.group != 0 && group_held(c, R.group, held) >= gcap) != over) { ++w; continue; }
    if (preempted_now(sh, r)) return false;
    if (output_full(R, sh.cap)) { ++w; continue; }
    const uint32_t n = admit_row(c, sh, r, budget);
    if (n == NO_KV) return false;  // FCFS: no overtaking for lack of KV
    if (R.group != 0 && R.group == held.group) held.n++;
    for (uint32_t i = w + 1; i < c->n_wait; ++i) g_wait[i - 1] = g_wait[i];
    c->n_wait--;
    R.running = 1;
    insert_running(c, r);
    add_chunk(sh, r, R.computed, n, R.computed + n == R.len);
    budget -= n;
  }
  uint32_t* wq = (uint32_t*)c->waitq;
  const RingSlot* copy = (const RingSlot*)c->slot_copy;
  for (uint32_t i = c->waitq_head; i != c->waitq_tail; ++i) {
    const uint32_t slot = wq[i % sh.n_slots];
    if (slot == DEAD) {
      if (i == c->waitq_head) c->waitq_head++;
      continue;
    }
    if (budget == 0 || c->n_run >= c->max_batch || c->n_free_rows == 0) return false;
    const u64 g = copy[slot].group;
    if ((g != 0 && group_held(c, g, held) >= gcap) != over) continue;
    const uint32_t plen = copy[slot].prompt_len;
    const uint32_t r = new_row(c, slot, i);  // the FIFO index is the arrival order
    const uint32_t n = admit_row(c, sh, r, budget);
    if (n == NO_KV) {  // FCFS: the head waits for KV; the row goes back
      g_rows[r].used = 0;
      g_free_rows[c->n_free_rows++] = r;
      return false;
    }
    if (g != 0 && g == held.group) held.n++;
    g_rows[r].running = 1;
    insert_running(c, r);  // an entry passed over earlier may be admitted after newer ones
    wq[i % sh.n_slots] = DEAD;
    if (i == c->waitq_head) c->waitq_head++;
    add_chunk(sh, r, g_rows[r].computed, n, g_rows[r].computed + n == plen);
    budget -= n;
  }
  return true;
}

// Scheduler._make_room_for_a_share (all threads; ends with a barrier): with the batch full, a
// waiting sequence whose group is below its share and a running group above it, that group's newest
// running row is preempted. g_run is in arrival order, so the newest such row is the last one whose
// group holds more than group_cap rows (each thread counts the groups of its rows).
__device__ void fair_share_preempt(SchedCtl* c, Shared& sh) {
  const uint32_t cnt = c->n_run;
  if (cnt < c->max_batch || (c->n_wait == 0 && c->waitq_head == c->waitq_tail)) return;  // uniform
  const uint32_t gcap = group_cap(c->max_batch);
  if (threadIdx.x == 0) sh.victim = 0;
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < cnt; i += SCHED_THREADS) {
    const u64 g = g_rows[g_run[i]].group;
    if (g == 0) continue;
    uint32_t n = 0;
    for (uint32_t j = 0; j < cnt; ++j) n += g_rows[g_run[j]].group == g;
    if (n > gcap) atomicMax(&sh.victim, i + 1);
  }
  __syncthreads();
  if (threadIdx.x == 0 && sh.victim) {
    GroupCount held = {0, 0};
    bool want = false;
    for (uint32_t p = 0; p < c->n_wait && !want; ++p) {
      const Row& R = g_rows[g_wait[p]];
      want = !output_full(R, sh.cap) && (R.group == 0 || group_held(c, R.group, held) < gcap);
    }
    const uint32_t* wq = (const uint32_t*)c->waitq;
    const RingSlot* copy = (const RingSlot*)c->slot_copy;
    for (uint32_t i = c->waitq_head; i != c->waitq_tail && !want; ++i) {
      const uint32_t slot = wq[i % sh.n_slots];
      if (slot == DEAD) continue;
      const u64 g = copy[slot].group;
      want = g == 0 || group_held(c, g, held) < gcap;
    }
    if (want) preempt_at(c, sh, sh.victim - 1);
  }
  __syncthreads();
}

// blink/device/scheduler.py: Scheduler._schedule_prefill (thread 0), after the decodes of the step
// (sh.nseq of them) are planned: prefill chunks in the rest of the token budget.
__device__ void plan_prefill(SchedCtl* c, Shared& sh) {
  uint32_t budget = c->max_num_batched_tokens - sh.ntok;  // max_num_batched_tokens >= max_batch >= the decodes
  if (c->mixed_tokens && sh.ntok)
    budget = step_budget(c->max_num_batched_tokens, c->mixed_tokens, sh.ntok, prefill_backlog(c, sh)) - sh.ntok;
  uint32_t* wq = (uint32_t*)c->waitq;
  while (c->waitq_head != c->waitq_tail && wq[c->waitq_head % sh.n_slots] == DEAD) c->waitq_head++;
  bool waiting = c->waitq_head != c->waitq_tail;
  for (uint32_t p = 0; p < c->n_wait && !waiting; ++p) waiting = !output_full(g_rows[g_wait[p]], sh.cap);
  // a request waits for admission: a running prefill takes at most long_prefill tokens of the step
  const uint32_t cap = c->n_run < c->max_batch && waiting ? min(budget, c->long_prefill) : budget;
  for (uint32_t p = 0; p < c->n_run && budget > 0; ++p) {
    const uint32_t r = g_run[p];
    Row& R = g_rows[r];
    if (!R.running || !prefilling(R)) continue;
    uint32_t n = min(min(R.len - R.computed, budget), cap);
    if (R.computed + n == R.len && output_full(R, sh.cap)) continue;
    const uint32_t start = R.computed;
    if (sh.nseq > 0) {  // shares the step: never preempt, cut the chunk to the free blocks
      const int room = (int)((R.n_blocks + (uint32_t)c->kv_free_top) * sh.bs) - (int)start;
      if (room <= 0) return;  // FCFS: nobody overtakes a prefill that cannot go
      n = min(n, (uint32_t)room);
      kv_grow(c, sh, r, start + n);
    } else if (!reserve(c, sh, r, start + n)) {
      continue;
    }
    add_chunk(sh, r, start, n, start + n == R.len);
    budget -= n;
    // a preemption removed rows from g_run's tail; p still indexes this row's successors
  }
  GroupCount held = {0, 0};
  if (admit_pass(c, sh, budget, false, held)) admit_pass(c, sh, budget, true, held);
}

// Scheduler._schedule_decode, sequential form with preemption (thread 0; the pool ran short).
__device__ void plan_decode_seq(SchedCtl* c, Shared& sh) {
  for (uint32_t p = 0; p < c->n_run; ++p) g_tmp[p] = g_run[p];
  const uint32_t n = c->n_run;
  for (uint32_t p = 0; p < n; ++p) {
    const uint32_t r = g_tmp[p];
    Row& R = g_rows[r];
    if (!decode_ready(R, sh.cap)) continue;
    if (reserve(c, sh, r, R.len)) add_chunk(sh, r, R.len - 1, 1, 1);
  }
}

// Decode row r at plan position o: the blocks its next token needs from takes[ob..] (ob advances),
// one token from position len - 1, sampled (the decode-only plans, either path).
__device__ __forceinline__ void plan_decode_row(SchedCtl* c, Shared& sh, uint32_t r, uint32_t o, const int32_t* takes,
                                                uint32_t& ob) {
  Row& R = g_rows[r];
  int32_t* b = row_blocks(c, sh, r);
  while (R.n_blocks < ceil_div(R.len, sh.bs)) b[R.n_blocks++] = takes[ob++];
  g_plan_row[o] = r;
  g_plan_start[o] = R.len - 1;
  g_plan_n[o] = 1;
  g_plan_sample[o] = 1;
  g_plan_cu[o] = o;
}

// Decode plan in parallel: every ready running row, arrival order, one block each at most.
// Falls back to the sequential form when the pool cannot cover every row (preemption needed).
__device__ void plan_decode(SchedCtl* c, Shared& sh) {
  const uint32_t cnt = c->n_run, per = (cnt + SCHED_THREADS - 1) / SCHED_THREADS;
  const uint32_t lo = min(cnt, threadIdx.x * per), hi = min(cnt, lo + per);
  uint32_t ready = 0, need = 0;
  for (uint32_t i = lo; i < hi; ++i) {
    const Row& R = g_rows[g_run[i]];
    if (decode_ready(R, sh.cap)) {
      ready++;
      need += ceil_div(R.len, sh.bs) - min(R.n_blocks, ceil_div(R.len, sh.bs));
    }
  }
  uint32_t n_ready, n_need;
  uint32_t o = block_scan(ready, &n_ready, sh.warp_sums);
  uint32_t ob = block_scan(need, &n_need, sh.warp_sums);
  const bool short_pool = n_need > (uint32_t)c->kv_free_top;
  __syncthreads();  // every thread has read kv_free_top before thread 0 changes it
  if (short_pool) {
    if (threadIdx.x == 0) plan_decode_seq(c, sh);
    __syncthreads();
    return;
  }
  if (threadIdx.x == 0) kv_take_n(c, sh.E->num_kv_blocks, n_need);
  __syncthreads();
  const int32_t* takes = (const int32_t*)c->kv_takes;
  for (uint32_t i = lo; i < hi; ++i) {
    const uint32_t r = g_run[i];
    if (!decode_ready(g_rows[r], sh.cap)) continue;
    plan_decode_row(c, sh, r, o, takes, ob);
    ++o;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sh.nseq = n_ready;
    sh.ntok = n_ready;
  }
  __syncthreads();
}

// fill_seq's result: the row uses a sampling extension (the step's ext_on), and it samples under a
// token mask (the step's mask_on; FILL_MASK implies FILL_EXT).
constexpr uint32_t FILL_EXT = 1, FILL_MASK = 2;

// Engine row i of the step: chunk [start, start + n) of row r, packed at token offset cu.
// A decode chunk (n == 1) also writes its input token here; prefill tokens are packed separately.
// Returns FILL_EXT / FILL_MASK bits (its fields are written when the engine has the extension
// tables; the step's ext_on and mask_on say whether the kernels read them).
__device__ uint32_t fill_seq(SchedCtl* c, Shared& sh, uint32_t i, uint32_t r, uint32_t start, uint32_t n, uint32_t cu,
                         bool decode) {
  const EngineABI* E = sh.E;
  const Row& R = g_rows[r];
  ((int32_t*)E->seq_lens)[i] = (int32_t)(start + n);
  ((int32_t*)E->cu_q_lens)[i + 1] = (int32_t)(cu + n);
  ((float*)E->temperature)[i] = R.temperature;
  ((float*)E->top_p)[i] = R.top_p;
  ((int32_t*)E->top_k)[i] = R.top_k;
  ((u64*)E->seed)[i] = R.seed;
  ((uint32_t*)E->sample_pos)[i] = generated(R);
  const int32_t* b = row_blocks(c, sh, r);
  int32_t* t = (int32_t*)E->block_tables + (size_t)i * sh.mbps;
  const bool same = g_eng_owner[i] == r && g_eng_gen[i] == R.kv_gen;  // blocks freed since: recopy
  for (uint32_t k = same ? min(g_eng_nb[i], R.n_blocks) : 0; k < R.n_blocks; ++k) t[k] = b[k];
  g_eng_owner[i] = r;
  g_eng_gen[i] = R.kv_gen;
  g_eng_nb[i] = R.n_blocks;
  if (decode) {
    ((int32_t*)E->input_ids)[i] = row_tokens(c, r)[start];
    ((int32_t*)E->positions)[i] = (int32_t)start;
  }
  if (E->sampling_rows) {  // blink/device/ring_device.py _build_ext
    E->pen_row[i] = R.pen ? (int32_t)R.slot : -1;
    E->fresh[i] = start == 0 && generated(R) == 0;  // a new request: its penalty state is cleared
    E->emit[i] = (int32_t)g_plan_sample[i];
    E->presence_penalty[i] = R.presence_penalty;
    E->frequency_penalty[i] = R.frequency_penalty;
    E->repetition_penalty[i] = R.repetition_penalty;
    E->min_p[i] = R.min_p;
    E->logprobs[i] = R.logprobs;
  }
  // a sampled row of a constrained request: the sampler reads its gate and bits in the ring (token_mask)
  const bool masked = R.mask != 0 && g_plan_sample[i] && E->mask_words;
  if (E->sampling_rows) {
    E->mask_gate[i] = masked ? (u64)&sh.slots[R.slot].mask_position : 0ull;
    E->mask_bits[i] = masked ? (u64)(sh.masks + (size_t)(R.mask - 1) * sh.mask_words) : 0ull;
  }
  if (!E->sampling_rows) return 0;
  return (R.ext || masked ? FILL_EXT : 0u) | (masked ? FILL_MASK : 0u);
}

// The step's mask_on (all threads; f: this thread's fill_seq bits). The gates are not read here: the
// sampler reads each masked row's mask_position and bits from the ring at the end of the step.
__device__ void fill_masks(Shared& sh, uint32_t f) {
  const int mask_on = __syncthreads_or(f & FILL_MASK);
  if (threadIdx.x == 0) {
    *sh.E->mask_on = (uint32_t)mask_on;
    *sh.E->ring_mask_words = sh.mask_words;
  }
}

// Prompt tokens of chunk i scored by this step (ring_device._build_ext): the packed token at position
// p scores prompt token p + 1, for p < prompt_len - 1, while the row has generated nothing (a
// recompute after preemption with output does not score again).
__device__ __forceinline__ uint32_t plp_rows(const Row& R, uint32_t start, uint32_t n) {
  if (R.prompt_logprobs < 0 || generated(R) != 0) return 0;
  const uint32_t hi = min(start + n, R.prompt_len - 1);
  return hi > start ? hi - start : 0;
}

// The step's scored rows into plp_count / plp_tok / plp_target / plp_prompt_logprobs (all threads; the prompts
// are in row_tokens already).
__device__ void fill_prompt_logprobs(SchedCtl* c, Shared& sh) {
  const EngineABI* E = sh.E;
  const uint32_t nseq = sh.nseq;
  const uint32_t per = (nseq + SCHED_THREADS - 1) / SCHED_THREADS;
  const uint32_t lo = min(nseq, threadIdx.x * per), hi = min(nseq, lo + per);
  uint32_t mine = 0;
  for (uint32_t i = lo; i < hi; ++i) mine += plp_rows(g_rows[g_plan_row[i]], g_plan_start[i], g_plan_n[i]);
  uint32_t total;
  uint32_t o = block_scan(mine, &total, sh.warp_sums);
  for (uint32_t i = lo; i < hi; ++i) {
    const uint32_t r = g_plan_row[i];
    const Row& R = g_rows[r];
    const uint32_t n = plp_rows(R, g_plan_start[i], g_plan_n[i]);
    const int32_t* toks = row_tokens(c, r);
    for (uint32_t k = 0; k < n; ++k, ++o) {
      E->plp_tok[o] = (int32_t)(g_plan_cu[i] + k);
      E->plp_target[o] = toks[g_plan_start[i] + k + 1];
      E->plp_prompt_logprobs[o] = R.prompt_logprobs;
    }
  }
  if (threadIdx.x == 0) *E->plp_count = total;
}

// Copy the prompts of newly admitted rows from the ring's arena, then write the plan into the
// engine's step buffers (all threads).
__device__ void fill_engine(SchedCtl* c, Shared& sh) {
  const EngineABI* E = sh.E;
  const uint32_t nseq = sh.nseq, ntok = sh.ntok;
  if (sh.kind == KIND_PREFILL) {
    // flattened copy: row i needs prompt_len tokens if need_copy
    const uint32_t per = (nseq + SCHED_THREADS - 1) / SCHED_THREADS;
    const uint32_t lo = min(nseq, threadIdx.x * per), hi = min(nseq, lo + per);
    uint32_t mine = 0;
    for (uint32_t i = lo; i < hi; ++i) {
      const Row& R = g_rows[g_plan_row[i]];
      mine += R.need_copy ? R.prompt_len : 0;
    }
    uint32_t total;
    uint32_t o = block_scan(mine, &total, sh.warp_sums);
    for (uint32_t i = lo; i < hi; ++i) {
      g_copy_cu[i] = o;
      const Row& R = g_rows[g_plan_row[i]];
      o += R.need_copy ? R.prompt_len : 0;
    }
    if (threadIdx.x == 0) g_copy_cu[nseq] = total;
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < total; j += SCHED_THREADS) {
      uint32_t a = 0, b = nseq;  // last i with g_copy_cu[i] <= j
      while (b - a > 1) { const uint32_t m = (a + b) / 2; if (g_copy_cu[m] <= j) a = m; else b = m; }
      const uint32_t r = g_plan_row[a];
      const uint32_t k = j - g_copy_cu[a];
      row_tokens(c, r)[k] = (int32_t)ld_sys((const uint32_t*)&sh.arena[g_rows[r].prompt_offset + k]);
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < nseq; i += SCHED_THREADS) g_rows[g_plan_row[i]].need_copy = 0;
  }
  int32_t* input_ids = (int32_t*)E->input_ids;
  int32_t* positions = (int32_t*)E->positions;
  int32_t* cu_q = (int32_t*)E->cu_q_lens;
  uint32_t f = 0;
  for (uint32_t i = threadIdx.x; i < nseq; i += SCHED_THREADS)
    f |= fill_seq(c, sh, i, g_plan_row[i], g_plan_start[i], g_plan_n[i], g_plan_cu[i], sh.kind == KIND_DECODE);
  const int ext_on = __syncthreads_or(f & FILL_EXT);  // the extension kernels return at once without one
  fill_masks(sh, f);
  if (sh.kind == KIND_PREFILL) {
    for (uint32_t j = threadIdx.x; j < ntok; j += SCHED_THREADS) {
      uint32_t a = 0, b = nseq;
      while (b - a > 1) { const uint32_t m = (a + b) / 2; if (g_plan_cu[m] <= j) a = m; else b = m; }
      const uint32_t pos = g_plan_start[a] + (j - g_plan_cu[a]);
      input_ids[j] = row_tokens(c, g_plan_row[a])[pos];
      positions[j] = (int32_t)pos;
    }
  }
  if (sh.kind == KIND_PREFILL && ext_on) fill_prompt_logprobs(c, sh);
  if (threadIdx.x == 0) {
    cu_q[0] = 0;
    *(uint32_t*)E->num_seqs = nseq;
    *(uint32_t*)E->num_tokens = ntok;
    *E->ext_on = (uint32_t)ext_on;
  }
}
