// Blink GPU-resident scheduler: per-row state, block-wide helpers (the memory-ordering primitives are
// sys_memory.cuh's).
//
// Memory model. The ring is host memory mapped into the device (cudaHostRegister, device pointer
// == host pointer). GPU atomics on it are not atomic with respect to the host, so every ring word
// has exactly one writer (blink/protocol/layout.py). The device reads frontend-written words with
// ld.relaxed.sys (polling) or ld.acquire.sys (a doorbell whose store orders later reads), and
// publishes with st.release.sys: a token is stored into the output arena first, then `generated`
// with release semantics, so a reader that sees `generated` also sees the token.
// The engine's completion word (*done_seq) is device memory written by the graph's last kernel with
// st.release.gpu; the scheduler reads it with ld.acquire.gpu and then a barrier extends the
// ordering to the other threads of the block (bar.sync is morally strong in the PTX model).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "blink_engine.h"
#include "blink_ring.h"
#include "scheduler_budget.cuh"
#include "scheduler_ctl.cuh"
#include "sys_memory.cuh"  // ld_sys, ld_acq_sys, st_rel_sys, ... (blink/gpu/engine/csrc)

namespace blink {

typedef uint64_t u64;

__device__ __forceinline__ u64 gtime() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// One live sequence (running, or preempted and waiting for recompute). Rows are module globals:
// only the kernel reads them, and they survive tail relaunches like every global.
struct Row {
  uint32_t used;         // 1: holds a live sequence
  uint32_t running;      // 1: RUNNING (holds KV, counts towards max_batch); 0: preempted
  uint32_t slot;         // ring slot (the sequence id)
  uint32_t prompt_len;
  uint32_t prompt_offset;
  uint32_t len;          // prompt + generated tokens (all in row_tokens[row])
  uint32_t computed;     // tokens whose K/V is in the cache
  uint32_t consumed;     // the frontend's `consumed`, refreshed while the output ring is full
  uint32_t n_blocks;     // KV blocks owned: row_blocks[row][0..n_blocks)
  uint32_t max_new;
  uint32_t min_new;
  uint32_t n_stop;
  int32_t top_k;
  float temperature;     // 0 for a temperature below SAMPLING_EPS (greedy)
  float top_p;
  uint32_t ring_state;   // last SlotState stored to the slot
  uint32_t need_copy;    // prompt still to be copied from the arena into row_tokens
  uint32_t cancel;       // cancel flag seen
  uint32_t kv_gen;       // bumped whenever the row's blocks are freed (engine table copies go stale)
  // sampling extensions (blink/device/sampling.py), from the slot at claim time; named as the
  // SamplingParams fields (blink/protocol/sampling_params.py) and the step fields they fill
  float presence_penalty, frequency_penalty, repetition_penalty, min_p;
  int32_t logprobs;         // -1: no logprob records; else their alternatives
  int32_t prompt_logprobs;  // -1: no prompt logprob records; else their alternatives
  uint32_t prompt_lp_off;  // int32 word of prompt record 0 in the prompt arena
  uint32_t pen;          // keeps a penalty state (any penalty or logit_bias): engine pen_row = slot
  uint32_t ext;          // uses an extension (pen, logprobs, prompt logprobs or min_p): the step's ext_on
  uint32_t mask;         // slot.mask_slot: 0 = unconstrained; m + 1 = samples under bitmask m (the sampler's gate)
  // prefix caching (scheduler_kv.cuh): the slot's block keys are in slot_keys[slot]
  uint32_t n_keys;       // block keys of the prompt
  uint32_t checked;      // leading blocks of the table offered for registration (or matched)
  uint32_t cache_read;   // may start from cached blocks (not with prompt logprobs or penalties)
  uint32_t cache_seen;   // the first admission counted its queries and hits
  u64 seed;
  u64 arrival;           // FCFS order (claim order)
  u64 group;             // slot.group: the API request it is a choice of (0: none)
  int32_t stop_ids[MAX_STOP_IDS];
};

__device__ __forceinline__ uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// Exclusive prefix sum of one value per thread over the block; *total gets the sum.
// `warp_sums` is shared scratch of >= 33 words. Contains barriers: call from all threads.
__device__ __forceinline__ uint32_t block_scan(uint32_t v, uint32_t* total, uint32_t* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    uint32_t y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t acc = 0;
    for (int w = 0; w < SCHED_THREADS / 32; ++w) {
      uint32_t s = warp_sums[w];
      warp_sums[w] = acc;
      acc += s;
    }
    warp_sums[32] = acc;
  }
  __syncthreads();
  const uint32_t r = warp_sums[warp] + x - v;
  *total = warp_sums[32];
  __syncthreads();
  return r;
}

}  // namespace blink
