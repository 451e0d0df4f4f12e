// Blink GPU-resident scheduler: a persistent kernel (one block, 256 threads) that serves the ring.
//
// The host captures `blink_sched` into a graph instantiated with DeviceLaunch and launches it once.
// Each loop iteration:
//   claim    when the submit doorbell moved since the last scan: claim the new requests first, so
//            the step planned now carries them (see iteration_begin);
//   plan     pick the next step exactly as blink/device/scheduler.py does (FCFS continuous batching,
//            every decode in every step with prefill chunks in the rest of the token budget,
//            recompute preemption) and write it into the engine's step buffers (blink_engine.h);
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
#ifdef offsetof  // (NVRTC before 13.5 has none: see build.py)
static_assert(offsetof(RingSlot, error) == offsetof(RingSlot, finish_reason) + 2, "finish word");
#endif

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
__device__ int32_t g_ev_nlp[SCHED_MAX_ROWS];         // the row's logprobs (-1: no record)
__device__ LogprobRecord g_ev_lp[SCHED_MAX_ROWS];    // its logprob record (engine outputs, copied in account)
__device__ u64 g_ev_ns;         // unix ns when the step's results were accounted (t_first_ns)
__device__ u64 g_ev_launch_ns;  // unix ns of the step's launch (t_launch_ns)
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
  LogprobRecord* lp;  // the ring's logprob arena [n_slots][cap]
  const uint32_t* masks;  // the ring's mask arena [n_masks][mask_words] (frontend-written)
  uint32_t n_masks, mask_words;
  const EngineABI* E;
  uint32_t n_slots, cap, arena_tokens, vocab, mbps, bs;
  cudaGraphExec_t self;
  uint32_t action, shutdown, kind, nseq, ntok, n_dec, do_scan, do_cancel, launch_ok, fault, dirty;
  uint32_t beat, tokens, completed, flags;
  uint32_t late;  // constrained rows of the step whose mask was late (header.mask_late_rows)
  u64 t_iter, t_launch, t_launched, t_done, seq;
  uint32_t nclaim, overflow, n_ok, tok_total;
  uint32_t claim_slot[MAX_CLAIMS];
  u64 claim_key[MAX_CLAIMS];
  uint32_t claim_sorted[MAX_CLAIMS];
  uint32_t claim_err[MAX_CLAIMS];
  uint32_t claim_cu[MAX_CLAIMS + 1];
  uint32_t preempted[64];  // rows preempted by the step being planned (more: the rest stop admission)
  uint32_t n_preempted;
  uint32_t victim;  // fair_share_preempt: 1 + the g_run position of the row to preempt, 0 = none
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

// Returns a row's blocks (into the pending list, tail first: the next plan drains it into the
// free queue, scheduler_kv.cuh) and the row itself (device state only). The slot's claim word is
// cleared here; the slot's COMPLETED store follows in flush(), before the next scan, and the
// frontend recycles a slot only after it sees COMPLETED. The row's table and keys stay readable
// until the next plan (prefix_register after account reads them).
__device__ void free_row(SchedCtl* c, Shared& sh, uint32_t r) {
  Row& R = g_rows[r];
  uint32_t* kv = (uint32_t*)c->kv_free;
  const int32_t* b = row_blocks(c, sh, r);
  const uint32_t top = atomicAdd(&c->kv_pending, R.n_blocks);
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

#include "scheduler_kv.cuh"
#include "scheduler_plan.cuh"

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
// (b' >= b, t' >= t) as the engine's host path picks it (blink/gpu/engine/engine.py, pick_exec).
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

// Thread 0: the ring's and the engine's addresses and sizes into shared memory, the counters of this
// instance (the first describes the device; a tail-launched one counts a relaunch).
__device__ __forceinline__ void sched_setup(SchedCtl* c, Shared& sh) {
  sh.H = (RingHeader*)c->ring;
  sh.E = (const EngineABI*)c->engine;
  sh.n_slots = sh.H->n_slots;
  sh.cap = sh.H->output_capacity;
  sh.arena_tokens = sh.H->prompt_arena_tokens;
  sh.slots = (RingSlot*)((char*)sh.H + sh.H->slots_offset);
  sh.arena = (const int32_t*)((const char*)sh.H + sh.H->prompt_arena_offset);
  sh.out = (int32_t*)((char*)sh.H + sh.H->output_arena_offset);
  sh.lp = (LogprobRecord*)((char*)sh.H + sh.H->logprob_arena_offset);
  sh.masks = (const uint32_t*)((const char*)sh.H + sh.H->mask_arena_offset);
  sh.n_masks = sh.H->n_masks;
  sh.mask_words = sh.H->mask_words;
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

// ACT_EXIT (all threads): rows aborted on a fault or a forced shutdown, the pool drained, the
// statistics mirrored, then the final status.
__device__ __forceinline__ void sched_exit(SchedCtl* c, Shared& sh, uint32_t tid) {
  if (sh.shutdown >= 2 || sh.fault) abort_all(c, sh);
  if (tid == 0) kv_drain(c, sh.E->num_kv_blocks);  // the header's last word on the pool: all of it
  __syncthreads();
  mirror_stats(c, sh);
  __syncthreads();
  if (tid == 0) set_status(c, sh, sh.fault ? DEV_FAILED : DEV_STOPPED);
}

// ACT_RELAUNCH (thread 0): this graph tail-launched again; a failed launch is the device's fault.
__device__ __forceinline__ void sched_relaunch(SchedCtl* c, Shared& sh) {
  __threadfence();
  const cudaError_t e = cudaGraphLaunch(sh.self, cudaStreamGraphTailLaunch);
  if (e != cudaSuccess) {
    c->fault = (uint32_t)e;
    st_sys(&sh.H->fault, (uint32_t)e);
    set_status(c, sh, DEV_FAILED);
  }
}

// Thread 0, a step planned: its number published to the engine, its graph launched and timed.
__device__ __forceinline__ void launch_step(SchedCtl* c, Shared& sh) {
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

extern "C" __global__ void __launch_bounds__(SCHED_THREADS, 1) blink_sched(SchedCtl* c) {
  __shared__ Shared sh;
  const uint32_t tid = threadIdx.x;
  if (tid == 0) sched_setup(c, sh);
  __syncthreads();
  for (;;) {
    if (tid == 0) iteration_begin(c, sh);
    __syncthreads();
    if (sh.action == ACT_RUN && sh.do_scan) scan_claims(c, sh);  // arrivals during the last step
    if (sh.action != ACT_RUN) flush(c, sh);  // the last step's tokens reach the ring first
    if (sh.action == ACT_EXIT) {
      sched_exit(c, sh, tid);
      return;
    }
    if (sh.action == ACT_RELAUNCH) {
      if (tid == 0) sched_relaunch(c, sh);
      return;
    }
    plan(c, sh);  // sets sh.kind, fills the engine buffers
    if (tid == 0 && sh.kind != KIND_NONE) launch_step(c, sh);
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
  // the free queue holds every block in order (block 0 out first, as blink/device/kv_blocks.py)
  int32_t* link = (int32_t*)c->kv_link;
  for (uint32_t i = tid; i < num_kv_blocks; i += nth) {
    link[i] = i + 1 < num_kv_blocks ? (int32_t)(i + 1) : -1;
    link[num_kv_blocks + i] = (int32_t)i - 1;
    ((uint32_t*)c->kv_ref)[i] = 0;
    ((uint32_t*)c->kv_key)[(size_t)i * HASH_WORDS + KV_KEYED] = 0;
  }
  for (uint32_t i = tid; i <= c->hash_mask; i += nth) ((uint32_t*)c->kv_hash)[(size_t)i * HASH_WORDS + KEY_WORDS] = 0;
  if (tid == 0) {
    g_n_ev = g_n_fin = g_mirror = 0;
    c->kv_free_top = (int)num_kv_blocks;
    c->kv_head = num_kv_blocks ? 0 : -1;
    c->kv_tail = (int)num_kv_blocks - 1;
    c->kv_pending = c->kv_cached = 0;
    c->n_free_rows = c->rows_cap;
    c->n_run = c->n_wait = 0;
    c->waitq_head = c->waitq_tail = 0;
  }
}

}  // namespace blink
