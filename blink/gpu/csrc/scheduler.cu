// Blink GPU-resident scheduler: a persistent kernel (one block, 256 threads) that serves the ring.
//
// The host captures `blink_sched` into a graph instantiated with DeviceLaunch and launches it once.
// Each loop iteration:
//   plan     pick the next step exactly as blink/device/scheduler.py does (FCFS continuous batching,
//            prefill and decode alternating, chunked prefill, recompute preemption) and write it into
//            the engine's step buffers (blink_engine.h);
//   launch   cudaGraphLaunch(exec, FireAndForget) of the tightest graph from the engine's table,
//            two execs per shape in round robin (an exec relaunched right after its completion token
//            can still count as running and return cudaErrorInvalidValue: retried, bounded);
//   overlap  while the graph runs, the 256 threads scan the ring (claim PREFILL_PENDING slots with a
//            CAS on a device-side claim word, validate, queue FCFS by t_submit_ns), read cancel flags
//            and the `consumed` counters of sequences whose output ring is full;
//   poll     thread 0 spins on *done_seq (ld.acquire.gpu), beating the heartbeat meanwhile;
//   account  device side of the results: tokens into the rows, finish decisions, KV blocks and rows
//            freed, cancels applied; the ring writes are queued;
//   flush    (next iteration, right after the next launch, so off the critical path) tokens into
//            the output arena, then `generated` (st.release.sys), then finish word and COMPLETED;
//            slot states; statistics mirrored into the header.
// After `window` (<= 120) fire-and-forget launches the instance tail-launches its own exec
// (cudaGetCurrentGraphExec) and returns: a graph execution may have at most 120 such launches
// outstanding. Everything that must survive lives in global memory (SchedCtl + module globals).
// Only one step is ever in flight, so the tail launch (which waits for the FF children) never waits.
#include "scheduler.cuh"

namespace blink {

constexpr uint32_t MAX_CLAIMS = 512;     // claims per scan; more wait for the next scan
constexpr uint32_t DEAD = 0xFFFFFFFFu;   // a cancelled waitq entry
enum : uint32_t { KIND_NONE = 0, KIND_PREFILL = 1, KIND_DECODE = 2 };
enum : uint32_t { ACT_RUN = 0, ACT_RELAUNCH = 1, ACT_EXIT = 2 };
// fault codes in header.fault (CUDA errors are stored as themselves, below 0x10000)
constexpr uint32_t FAULT_GRAPH_TIMEOUT = 0x10001u;
constexpr uint32_t FAULT_NO_GRAPH = 0x10002u;
static_assert(offsetof(RingSlot, error) == offsetof(RingSlot, finish_reason) + 2, "finish word");

__device__ Row g_rows[SCHED_MAX_ROWS];
__device__ uint32_t g_run[SCHED_MAX_ROWS];        // running rows, arrival order
__device__ uint32_t g_wait[SCHED_MAX_ROWS];       // preempted rows, arrival order
__device__ uint32_t g_free_rows[SCHED_MAX_ROWS];  // stack
__device__ uint32_t g_tmp[SCHED_MAX_ROWS];
// the step being built / in flight: chunk i computes tokens [start, start + n) of row plan_row[i]
__device__ uint32_t g_plan_row[SCHED_MAX_ROWS];
__device__ uint32_t g_plan_start[SCHED_MAX_ROWS];
__device__ uint32_t g_plan_n[SCHED_MAX_ROWS];
__device__ uint32_t g_plan_sample[SCHED_MAX_ROWS];
__device__ uint32_t g_plan_cu[SCHED_MAX_ROWS + 1];
__device__ uint32_t g_copy_cu[SCHED_MAX_ROWS + 1];
// which row's block table sits in the engine's block_tables row i, and how many entries of it
__device__ uint32_t g_eng_owner[SCHED_MAX_ROWS];
__device__ uint32_t g_eng_nb[SCHED_MAX_ROWS];
__device__ uint32_t g_eng_gen[SCHED_MAX_ROWS];  // the owner's kv_gen when copied
// ring writes deferred to flush(), which runs while the next step's graph executes:
// token events of the last step (index = its plan index; k == DEAD: no token) and finishes
__device__ uint32_t g_ev_slot[SCHED_MAX_ROWS];
__device__ uint32_t g_ev_k[SCHED_MAX_ROWS];
__device__ int32_t g_ev_tok[SCHED_MAX_ROWS];
__device__ uint32_t g_ev_fin[SCHED_MAX_ROWS];
__device__ uint32_t g_n_ev;
__device__ u64 g_ev_ns;
__device__ uint32_t g_fin_slot[SCHED_MAX_ROWS];
__device__ uint32_t g_fin_word[SCHED_MAX_ROWS];
__device__ uint32_t g_n_fin;
__device__ uint32_t g_mirror;  // statistics changed since the last mirror into the header

struct Shared {
  uint32_t warp_sums[33];
  RingHeader* H;
  RingSlot* slots;
  const int32_t* arena;
  int32_t* out;
  const EngineABI* E;
  uint32_t n_slots, cap, arena_tokens, vocab, mbps, bs;
  cudaGraphExec_t self;
  uint32_t action, shutdown, kind, nseq, ntok, do_scan, do_cancel, launch_ok, fault, dirty;
  uint32_t beat, tokens, completed, flags;
  u64 t_iter, t_launch, t_launched, t_done, seq;
  uint32_t nclaim, overflow, n_ok, tok_total;
  uint32_t claim_slot[MAX_CLAIMS];
  u64 claim_key[MAX_CLAIMS];
  uint32_t claim_sorted[MAX_CLAIMS];
  uint32_t claim_err[MAX_CLAIMS];
  uint32_t claim_cu[MAX_CLAIMS + 1];
  uint32_t preempted[64];  // rows preempted by the step being planned (more: the rest stop admission)
  uint32_t n_preempted;
};

// ---- small helpers (callers hold the data race-free by the phase structure) ----------------------
__device__ __forceinline__ uint32_t generated(const Row& R) { return R.len - R.prompt_len; }
__device__ __forceinline__ bool output_full(const Row& R, uint32_t cap) { return generated(R) - R.consumed >= cap; }
__device__ __forceinline__ bool prefilling(const Row& R) { return R.len - R.computed > 1 || R.len == R.prompt_len; }
__device__ __forceinline__ int32_t* row_tokens(const SchedCtl* c, uint32_t r) {
  return (int32_t*)c->row_tokens + (size_t)r * c->max_context;
}
__device__ __forceinline__ int32_t* row_blocks(const SchedCtl* c, const Shared& sh, uint32_t r) {
  return (int32_t*)c->row_blocks + (size_t)r * sh.mbps;
}
__device__ __forceinline__ u64 unix_ns(const SchedCtl* c) { return gtime() + (u64)c->clock_offset_ns; }

__device__ void finish_slot(Shared& sh, uint32_t slot, uint32_t reason, uint32_t err) {
  RingSlot* s = &sh.slots[slot];
  st_sys((uint32_t*)&s->finish_reason, reason | (err << 16));  // finish_reason (u16) + error (u16)
  st_rel_sys(&s->state, SLOT_DECODE_COMPLETED);                // after every earlier store
  atomicAdd(&sh.completed, 1u);
}

// Returns a row's blocks and the row itself (device state only). The slot's claim word is
// cleared here; the slot's COMPLETED store follows in flush(), before the next scan, and the
// frontend recycles a slot only after it sees COMPLETED. Pushes only (no pops) may run
// concurrently with this: pops happen in the plan phase, behind a barrier.
__device__ void free_row(SchedCtl* c, Shared& sh, uint32_t r) {
  Row& R = g_rows[r];
  uint32_t* kv = (uint32_t*)c->kv_free;
  const int32_t* b = row_blocks(c, sh, r);
  const int top = atomicAdd(&c->kv_free_top, (int)R.n_blocks);
  for (uint32_t i = 0; i < R.n_blocks; ++i) kv[top + i] = (uint32_t)b[R.n_blocks - 1 - i];
  R.n_blocks = 0;
  R.kv_gen++;
  R.used = 0;
  R.running = 0;
  ((uint32_t*)c->claim)[R.slot] = 0;
  g_free_rows[atomicAdd(&c->n_free_rows, 1u)] = r;
  sh.dirty = 1;
}

// Finish a row now, ring included (shutdown and fault paths).
__device__ void release_row(SchedCtl* c, Shared& sh, uint32_t r, uint32_t reason, uint32_t err) {
  const uint32_t slot = g_rows[r].slot;
  free_row(c, sh, r);
  finish_slot(sh, slot, reason, err);
}

// Finish a row whose COMPLETED store is deferred to the next flush() (no token with it).
__device__ void retire_row(SchedCtl* c, Shared& sh, uint32_t r, uint32_t reason, uint32_t err) {
  const uint32_t slot = g_rows[r].slot;
  free_row(c, sh, r);
  const uint32_t i = atomicAdd(&g_n_fin, 1u);
  g_fin_slot[i] = slot;
  g_fin_word[i] = reason | (err << 16);
  atomicAdd(&sh.completed, 1u);
}

// Keep the entries of `list` whose row is live with running == want, in order (all threads).
__device__ void compact(uint32_t* list, uint32_t* n, uint32_t want, Shared& sh) {
  const uint32_t cnt = *n, per = (cnt + SCHED_THREADS - 1) / SCHED_THREADS;
  const uint32_t lo = min(cnt, threadIdx.x * per), hi = min(cnt, lo + per);
  uint32_t keep = 0;
  for (uint32_t i = lo; i < hi; ++i) keep += g_rows[list[i]].used && g_rows[list[i]].running == want;
  uint32_t total;
  uint32_t o = block_scan(keep, &total, sh.warp_sums);
  for (uint32_t i = lo; i < hi; ++i) {
    const uint32_t r = list[i];
    if (g_rows[r].used && g_rows[r].running == want) g_tmp[o++] = r;
  }
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < total; i += SCHED_THREADS) list[i] = g_tmp[i];
  if (threadIdx.x == 0) *n = total;
  __syncthreads();
}

// ---- KV blocks (thread 0 only, plan phase) ---------------------------------------------------------
__device__ bool kv_grow(SchedCtl* c, Shared& sh, uint32_t r, uint32_t ntok) {
  Row& R = g_rows[r];
  const uint32_t need = ceil_div(ntok, sh.bs);
  if (need <= R.n_blocks) return true;
  if ((int)(need - R.n_blocks) > c->kv_free_top) return false;
  int32_t* b = row_blocks(c, sh, r);
  const uint32_t* kv = (const uint32_t*)c->kv_free;
  while (R.n_blocks < need) b[R.n_blocks++] = (int32_t)kv[--c->kv_free_top];
  return true;
}

__device__ void kv_free_row(SchedCtl* c, Shared& sh, uint32_t r) {
  Row& R = g_rows[r];
  uint32_t* kv = (uint32_t*)c->kv_free;
  const int32_t* b = row_blocks(c, sh, r);
  for (uint32_t i = R.n_blocks; i-- > 0;) kv[c->kv_free_top++] = (uint32_t)b[i];
  R.n_blocks = 0;
  R.kv_gen++;
}

// Preempt the newest running sequence (recompute later). Returns its row.
__device__ uint32_t preempt_newest(SchedCtl* c, Shared& sh) {
  const uint32_t v = g_run[--c->n_run];
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
  R.temperature = (q.flags & SLOTFLAG_GREEDY) ? 0.0f : q.temperature;
  R.top_p = q.top_p;
  R.ring_state = SLOT_PREFILL_PROCESSING;
  R.need_copy = 1;
  R.cancel = 0;
  R.seed = q.seed;
  R.arrival = arrival;
  for (uint32_t i = 0; i < MAX_STOP_IDS; ++i) R.stop_ids[i] = q.stop_ids[i];
  return r;
}

// blink/device/scheduler.py: Scheduler._schedule_prefill (thread 0).
__device__ void plan_prefill(SchedCtl* c, Shared& sh) {
  uint32_t budget = c->max_tokens;
  for (uint32_t p = 0; p < c->n_run && budget > 0; ++p) {
    const uint32_t r = g_run[p];
    Row& R = g_rows[r];
    if (!R.running || !prefilling(R)) continue;
    const uint32_t n = min(R.len - R.computed, budget);
    const uint32_t sample = R.computed + n == R.len;
    if (sample && output_full(R, sh.cap)) continue;
    const uint32_t start = R.computed;
    if (reserve(c, sh, r, start + n)) {
      add_chunk(sh, r, start, n, sample);
      budget -= n;
    }
    // a preemption removed rows from g_run's tail; p still indexes this row's successors
  }
  bool stop = false;
  uint32_t w = 0;
  while (w < c->n_wait) {  // preempted rows first: they arrived before every queued request
    if (budget == 0 || c->n_run >= c->max_batch) { stop = true; break; }
    const uint32_t r = g_wait[w];
    Row& R = g_rows[r];
    if (preempted_now(sh, r)) { stop = true; break; }
    if (output_full(R, sh.cap)) { ++w; continue; }
    const uint32_t n = min(R.len, budget);
    if (ceil_div(n, sh.bs) > (uint32_t)c->kv_free_top) { stop = true; break; }
    kv_grow(c, sh, r, n);
    for (uint32_t i = w + 1; i < c->n_wait; ++i) g_wait[i - 1] = g_wait[i];
    c->n_wait--;
    R.running = 1;
    insert_running(c, r);
    add_chunk(sh, r, 0, n, n == R.len);
    budget -= n;
  }
  if (stop) return;  // FCFS: queued requests never overtake a waiting row that could not go
  uint32_t* wq = (uint32_t*)c->waitq;
  const RingSlot* copy = (const RingSlot*)c->slot_copy;
  while (c->waitq_head != c->waitq_tail) {
    const uint32_t slot = wq[c->waitq_head % sh.n_slots];
    if (slot == DEAD) { c->waitq_head++; continue; }
    if (budget == 0 || c->n_run >= c->max_batch || c->n_free_rows == 0) break;
    const uint32_t plen = copy[slot].prompt_len;
    const uint32_t n = min(plen, budget);
    if (ceil_div(n, sh.bs) > (uint32_t)c->kv_free_top) break;
    const uint32_t r = new_row(c, slot, c->waitq_head);  // the FIFO index is the arrival order
    kv_grow(c, sh, r, n);
    g_rows[r].running = 1;
    g_run[c->n_run++] = r;  // newest arrival
    c->waitq_head++;
    add_chunk(sh, r, 0, n, n == plen);
    budget -= n;
  }
}

// Scheduler._schedule_decode, sequential form with preemption (thread 0; the pool ran short).
__device__ void plan_decode_seq(SchedCtl* c, Shared& sh) {
  for (uint32_t p = 0; p < c->n_run; ++p) g_tmp[p] = g_run[p];
  const uint32_t n = c->n_run;
  for (uint32_t p = 0; p < n; ++p) {
    const uint32_t r = g_tmp[p];
    Row& R = g_rows[r];
    if (!R.running || prefilling(R) || output_full(R, sh.cap)) continue;
    if (reserve(c, sh, r, R.len)) add_chunk(sh, r, R.len - 1, 1, 1);
  }
}

// Decode plan in parallel: every ready running row, arrival order, one block each at most.
// Falls back to the sequential form when the pool cannot cover every row (preemption needed).
__device__ void plan_decode(SchedCtl* c, Shared& sh) {
  const uint32_t cnt = c->n_run, per = (cnt + SCHED_THREADS - 1) / SCHED_THREADS;
  const uint32_t lo = min(cnt, threadIdx.x * per), hi = min(cnt, lo + per);
  uint32_t ready = 0, need = 0;
  for (uint32_t i = lo; i < hi; ++i) {
    const Row& R = g_rows[g_run[i]];
    if (R.running && !prefilling(R) && !output_full(R, sh.cap)) {
      ready++;
      need += ceil_div(R.len, sh.bs) - min(R.n_blocks, ceil_div(R.len, sh.bs));
    }
  }
  uint32_t n_ready, n_need;
  uint32_t o = block_scan(ready, &n_ready, sh.warp_sums);
  uint32_t ob = block_scan(need, &n_need, sh.warp_sums);
  if (n_need > (uint32_t)c->kv_free_top) {
    if (threadIdx.x == 0) plan_decode_seq(c, sh);
    __syncthreads();
    return;
  }
  const uint32_t* kv = (const uint32_t*)c->kv_free;
  const int top = c->kv_free_top;
  for (uint32_t i = lo; i < hi; ++i) {
    const uint32_t r = g_run[i];
    Row& R = g_rows[r];
    if (!(R.running && !prefilling(R) && !output_full(R, sh.cap))) continue;
    int32_t* b = row_blocks(c, sh, r);
    while (R.n_blocks < ceil_div(R.len, sh.bs)) b[R.n_blocks++] = (int32_t)kv[top - 1 - (int)ob++];
    g_plan_row[o] = r;
    g_plan_start[o] = R.len - 1;
    g_plan_n[o] = 1;
    g_plan_sample[o] = 1;
    g_plan_cu[o] = o;
    ++o;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    c->kv_free_top -= (int)n_need;
    sh.nseq = n_ready;
    sh.ntok = n_ready;
  }
  __syncthreads();
}

// Engine row i of the step: chunk [start, start + n) of row r, packed at token offset cu.
// A decode chunk (n == 1) also writes its input token here; prefill tokens are packed separately.
__device__ void fill_seq(SchedCtl* c, Shared& sh, uint32_t i, uint32_t r, uint32_t start, uint32_t n, uint32_t cu,
                         bool decode) {
  const EngineABI* E = sh.E;
  const Row& R = g_rows[r];
  ((int32_t*)E->seq_lens)[i] = (int32_t)(start + n);
  ((int32_t*)E->cu_q_lens)[i + 1] = (int32_t)(cu + n);
  ((float*)E->temperature)[i] = R.temperature;
  ((float*)E->top_p)[i] = R.top_p;
  ((int32_t*)E->top_k)[i] = R.top_k;
  ((u64*)E->seeds)[i] = R.seed;
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
  for (uint32_t i = threadIdx.x; i < nseq; i += SCHED_THREADS)
    fill_seq(c, sh, i, g_plan_row[i], g_plan_start[i], g_plan_n[i], g_plan_cu[i], sh.kind == KIND_DECODE);
  if (sh.kind == KIND_PREFILL) {
    for (uint32_t j = threadIdx.x; j < ntok; j += SCHED_THREADS) {
      uint32_t a = 0, b = nseq;
      while (b - a > 1) { const uint32_t m = (a + b) / 2; if (g_plan_cu[m] <= j) a = m; else b = m; }
      const uint32_t pos = g_plan_start[a] + (j - g_plan_cu[a]);
      input_ids[j] = row_tokens(c, g_plan_row[a])[pos];
      positions[j] = (int32_t)pos;
    }
  }
  if (threadIdx.x == 0) {
    cu_q[0] = 0;
    *(uint32_t*)E->num_seqs = nseq;
    *(uint32_t*)E->num_tokens = ntok;
  }
}

__device__ void beat(SchedCtl* c, Shared& sh, u64 now) {
  c->last_beat_ns = now;
  c->heartbeat++;
  st_sys64(&sh.H->heartbeat_ns, now + (u64)c->clock_offset_ns);
  st_sys64(&sh.H->heartbeat, c->heartbeat);
}

__device__ void set_status(SchedCtl* c, Shared& sh, uint32_t status) {
  c->status = status;
  st_rel_sys(&sh.H->device_status, status);
}

#include "scheduler_ring.cuh"

// ---- the kernel ---------------------------------------------------------------------------------
// The tightest captured graph: decode_execs[b], else the smallest captured prefill shape
// (b' >= b, t' >= t) as the engine's host path picks it (blink/gpu/engine.py, pick_exec).
__device__ cudaGraphExec_t pick_exec(const SchedCtl* c, const Shared& sh) {
  const EngineABI* E = sh.E;
  const uint32_t eps = E->execs_per_shape, e = (uint32_t)(c->launches % eps);
  const uint32_t b = ((const uint16_t*)E->batch_bucket_of)[sh.nseq];
  const uint32_t t = ((const uint16_t*)E->token_bucket_of)[sh.ntok];
  const u64* dec = (const u64*)E->decode_execs;
  const u64* pre = (const u64*)E->prefill_execs;
  const uint32_t nb = E->n_batch_buckets, nt = E->n_token_buckets;
  if (sh.kind == KIND_DECODE && b < nb && dec[(size_t)b * eps + e]) return (cudaGraphExec_t)dec[(size_t)b * eps + e];
  for (uint32_t bb = b; bb < nb; ++bb)
    for (uint32_t tt = t; tt < nt; ++tt) {
      const u64 g = pre[((size_t)bb * nt + tt) * eps + e];
      if (g) return (cudaGraphExec_t)g;
    }
  return (cudaGraphExec_t)0;
}

__device__ cudaError_t launch(SchedCtl* c, cudaGraphExec_t g) {
  for (uint32_t tries = 0;; ++tries) {
    const cudaError_t e = cudaGraphLaunch(g, cudaStreamGraphFireAndForget);
    if (e == cudaSuccess) {
      c->retries += tries;
      if (tries > c->max_retries) c->max_retries = tries;
      return e;
    }
    if (e != cudaErrorInvalidValue || tries >= c->retry_max) return e;
  }
}

extern "C" __global__ void __launch_bounds__(SCHED_THREADS, 1) blink_sched(SchedCtl* c) {
  __shared__ Shared sh;
  const uint32_t tid = threadIdx.x;
  if (tid == 0) {
    sh.H = (RingHeader*)c->ring;
    sh.E = (const EngineABI*)c->engine;
    sh.n_slots = sh.H->n_slots;
    sh.cap = sh.H->output_capacity;
    sh.arena_tokens = sh.H->prompt_arena_tokens;
    sh.slots = (RingSlot*)((char*)sh.H + sh.H->slots_offset);
    sh.arena = (const int32_t*)((const char*)sh.H + sh.H->prompt_arena_offset);
    sh.out = (int32_t*)((char*)sh.H + sh.H->output_arena_offset);
    sh.vocab = sh.E->vocab_size;
    sh.mbps = sh.E->max_blocks_per_seq;
    sh.bs = sh.E->block_size;
    sh.self = cudaGetCurrentGraphExec();
    if (!sh.self) sh.self = (cudaGraphExec_t)c->self_exec;
    sh.dirty = 0;
    sh.fault = 0;
    sh.overflow = 0;
    sh.shutdown = ld_acq_sys(&sh.H->shutdown);
    c->instances++;
    c->here = 0;
    if (c->instances == 1) {
      c->seq = ld_acq_gpu64((const void*)sh.E->done_seq);  // an earlier driver's last step: start above it
      describe(c, sh);
    }
    else c->relaunches++;
  }
  __syncthreads();
  for (;;) {
    if (tid == 0) iteration_begin(c, sh);
    __syncthreads();
    if (sh.action != ACT_RUN) flush(c, sh);  // the last step's tokens reach the ring first
    if (sh.action == ACT_EXIT) {
      if (sh.shutdown >= 2 || sh.fault) abort_all(c, sh);
      mirror_stats(c, sh);
      __syncthreads();
      if (tid == 0) set_status(c, sh, sh.fault ? DEV_FAILED : DEV_STOPPED);
      return;
    }
    if (sh.action == ACT_RELAUNCH) {
      if (tid == 0) {
        __threadfence();
        const cudaError_t e = cudaGraphLaunch(sh.self, cudaStreamGraphTailLaunch);
        if (e != cudaSuccess) {
          c->fault = (uint32_t)e;
          st_sys(&sh.H->fault, (uint32_t)e);
          set_status(c, sh, DEV_FAILED);
        }
      }
      return;
    }
    plan(c, sh);  // sets sh.kind, fills the engine buffers
    if (tid == 0 && sh.kind != KIND_NONE) {
      const cudaGraphExec_t g = pick_exec(c, sh);
      sh.seq = ++c->seq;
      *(volatile u64*)sh.E->step_seq = sh.seq;
      __threadfence();
      sh.t_launch = gtime();
      const cudaError_t e = g ? launch(c, g) : cudaErrorInvalidValue;
      sh.t_launched = gtime();
      sh.t_done = sh.t_launched;  // until wait_done sees the completion
      c->here++;
      c->launches++;
      sh.launch_ok = e == cudaSuccess;
      if (!sh.launch_ok) {
        c->launch_errors++;
        c->last_error = g ? (uint32_t)e : FAULT_NO_GRAPH;
      }
    }
    __syncthreads();
    flush(c, sh);    // the previous step's tokens and states to the ring (the graph runs meanwhile)
    overlap(c, sh);  // ring scan, cancels, consumed counters
    if (tid == 0 && sh.kind != KIND_NONE && sh.launch_ok) wait_done(c, sh);
    __syncthreads();
    if (sh.fault) continue;  // iteration_begin turns it into ACT_EXIT
    if (sh.kind != KIND_NONE) account(c, sh);
    retire(c, sh);  // cancels, list compaction, statistics
  }
}

// Host-launched: the device clock, to calibrate SchedCtl.clock_offset_ns against the host's.
extern "C" __global__ void blink_sched_clock(u64* out) { *out = gtime(); }

// Host-launched once before the scheduler: resets every global and the free lists.
extern "C" __global__ void blink_sched_init(SchedCtl* c, uint32_t n_slots, uint32_t num_kv_blocks) {
  const uint32_t tid = threadIdx.x + blockIdx.x * blockDim.x, nth = blockDim.x * gridDim.x;
  for (uint32_t i = tid; i < SCHED_MAX_ROWS; i += nth) {
    g_rows[i].used = 0;
    g_rows[i].running = 0;
    g_rows[i].n_blocks = 0;
    g_rows[i].kv_gen = 0;
    g_eng_owner[i] = DEAD;
    g_eng_nb[i] = 0;
    if (i < c->rows_cap) g_free_rows[c->rows_cap - 1 - i] = i;
  }
  for (uint32_t i = tid; i < n_slots; i += nth) ((uint32_t*)c->claim)[i] = 0;
  // pop() yields block 0 first, as blink/device/kv_blocks.py does
  for (uint32_t i = tid; i < num_kv_blocks; i += nth) ((uint32_t*)c->kv_free)[i] = num_kv_blocks - 1 - i;
  if (tid == 0) {
    g_n_ev = g_n_fin = g_mirror = 0;
    c->kv_free_top = (int)num_kv_blocks;
    c->n_free_rows = c->rows_cap;
    c->n_run = c->n_wait = 0;
    c->waitq_head = c->waitq_tail = 0;
  }
}

}  // namespace blink
