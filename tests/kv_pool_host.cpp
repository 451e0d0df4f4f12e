// The GPU scheduler's KV pool and prefix cache (blink/gpu/scheduler/csrc/scheduler_kv.cuh), the very
// source, built for the host by g++ and driven through a C API by tests/test_kv_pool_cuda.py, which
// diffs it against blink/device/kv_blocks.py operation by operation. The rest of the scheduler is
// stubbed here by what the header reads: a row, the step's shared state, the engine's pool size.
#include <stdint.h>
#include <stdlib.h>

#include <algorithm>

#define __device__
#define __forceinline__ inline
#include "blink_ring.h"
#include "scheduler_ctl.cuh"

namespace blink {
using std::min;
struct ThreadIdx { uint32_t x; };
static ThreadIdx threadIdx;
inline void __syncthreads() {}
struct Row { uint32_t slot, len, computed, n_blocks, n_keys, checked, cache_read; };
struct EngineStub { uint32_t num_kv_blocks; };
struct Shared { uint32_t mbps, bs; const EngineStub* E; };
static Row g_rows[64];
inline int32_t* row_blocks(const SchedCtl* c, const Shared& sh, uint32_t r) {
  return (int32_t*)c->row_blocks + (size_t)r * sh.mbps;
}
#include "scheduler_kv.cuh"
}  // namespace blink

using namespace blink;
static SchedCtl ctl;
static Shared sh;
static EngineStub eng;

template <typename T>
static uint64_t buf(size_t n) { return (uint64_t)(uintptr_t)calloc(n ? n : 1, sizeof(T)); }

extern "C" {
// The pool of nb blocks of bs tokens, rows of up to mbps blocks, a key table of `entries` (a power of
// two): every block free, in order (blink_sched_init).
void kvh_init(uint32_t nb, uint32_t bs, uint32_t mbps, uint32_t entries) {
  ctl = SchedCtl{};
  eng.num_kv_blocks = nb;
  sh = Shared{mbps, bs, &eng};
  ctl.kv_ref = buf<uint32_t>(nb);
  ctl.kv_link = buf<int32_t>(2 * nb);
  ctl.kv_key = buf<uint32_t>((size_t)HASH_WORDS * nb);
  ctl.kv_hash = buf<uint32_t>((size_t)HASH_WORDS * entries);
  ctl.kv_takes = buf<int32_t>(nb);
  ctl.slot_keys = buf<uint32_t>((size_t)64 * mbps * KEY_WORDS);
  ctl.row_blocks = buf<int32_t>((size_t)64 * mbps);
  ctl.kv_free = buf<uint32_t>((size_t)64 * mbps);
  ctl.hash_mask = entries - 1;
  ctl.prefix_caching = 1;
  int32_t* link = (int32_t*)ctl.kv_link;
  for (uint32_t i = 0; i < nb; ++i) {
    link[i] = i + 1 < nb ? (int32_t)(i + 1) : -1;
    link[nb + i] = (int32_t)i - 1;
  }
  ctl.kv_free_top = (int)nb;
  ctl.kv_head = nb ? 0 : -1;
  ctl.kv_tail = (int)nb - 1;
}

// Scheduler._admit's pool part for row r (its keys given): the tokens it starts from, its blocks
// for min(len - start, budget) tokens after them; -1 (nothing changed) when the pool lacks them.
int64_t kvh_admit(uint32_t r, const uint32_t* keys, uint32_t n_keys, uint32_t len, uint32_t budget,
                  uint32_t cache_read) {
  Row& R = g_rows[r];
  R = Row{r, len, 0, 0, n_keys, 0, cache_read};
  uint32_t* dst = (uint32_t*)ctl.slot_keys + (size_t)r * sh.mbps * KEY_WORDS;
  for (uint32_t i = 0; i < n_keys * KEY_WORDS; ++i) dst[i] = keys[i];
  uint32_t idle;
  const uint32_t hits = prefix_hits(&ctl, sh, R, &idle), start = hits * sh.bs;
  const uint32_t n = min(len - start, budget);
  if ((start + n + sh.bs - 1) / sh.bs - hits > (uint32_t)ctl.kv_free_top - idle) return -1;
  prefix_take(&ctl, sh, r, hits);
  R.computed = start;
  int32_t* t = row_blocks(&ctl, sh, r);
  while (R.n_blocks < (start + n + sh.bs - 1) / sh.bs) t[R.n_blocks++] = kv_take(&ctl, eng.num_kv_blocks);
  return start;
}

// kv_grow: the row's table extended to hold ntok tokens; 0 (nothing changed) when the pool lacks it.
int kvh_grow(uint32_t r, uint32_t ntok) {
  Row& R = g_rows[r];
  const uint32_t need = (ntok + sh.bs - 1) / sh.bs;
  if (need <= R.n_blocks) return 1;
  if ((int)(need - R.n_blocks) > ctl.kv_free_top) return 0;
  int32_t* t = row_blocks(&ctl, sh, r);
  while (R.n_blocks < need) t[R.n_blocks++] = kv_take(&ctl, eng.num_kv_blocks);
  return 1;
}

void kvh_register(uint32_t r, uint32_t computed) {
  g_rows[r].computed = computed;
  prefix_register(&ctl, sh, r);
}

// free_row (the row's blocks into the pending list, tail first), then the next plan's drain.
void kvh_free(uint32_t r) {
  Row& R = g_rows[r];
  uint32_t* p = (uint32_t*)ctl.kv_free;
  const int32_t* t = row_blocks(&ctl, sh, r);
  for (uint32_t i = 0; i < R.n_blocks; ++i) p[ctl.kv_pending++] = (uint32_t)t[R.n_blocks - 1 - i];
  R.n_blocks = 0;
  kv_drain(&ctl, eng.num_kv_blocks);
}

void kvh_reset(void) {
  for (uint32_t x = 0; x < SCHED_THREADS; ++x) {  // the block's threads, one after the other
    threadIdx.x = x;
    prefix_reset(&ctl, eng.num_kv_blocks);
  }
  threadIdx.x = 0;
}

uint32_t kvh_table(uint32_t r, int32_t* out) {
  const int32_t* t = row_blocks(&ctl, sh, r);
  for (uint32_t i = 0; i < g_rows[r].n_blocks; ++i) out[i] = t[i];
  return g_rows[r].n_blocks;
}

uint32_t kvh_num_free(void) { return (uint32_t)ctl.kv_free_top; }
uint32_t kvh_num_cached(void) { return ctl.kv_cached; }
}
