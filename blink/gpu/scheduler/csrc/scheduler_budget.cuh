// The policy's arithmetic: the token budget of a step that carries decodes and a group's share of
// the batch (blink/device/policy.py step_budget and group_cap, which document the rules). Host-compilable (no CUDA types), so a CPU test builds this header with the
// host compiler and replays the Python policy's cases through it (tests/test_scheduler_policy_header.py).
#pragma once
#include <stdint.h>

#include "scheduler_policy.cuh"

#ifdef __CUDACC__
#define BLINK_POLICY_FN __device__ inline
#else
#define BLINK_POLICY_FN inline
#endif

namespace blink {

// Tokens a step with n_dec decodes may carry, given the prompt tokens queued behind the first
// waiting sequence (backlog). b - n_dec cannot wrap: the left operand of || failed, so b >= n_dec.
BLINK_POLICY_FN uint32_t step_budget(uint32_t max_num_batched_tokens, uint32_t mixed, uint32_t n_dec, uint32_t backlog) {
  if (mixed == 0 || n_dec == 0 || mixed >= max_num_batched_tokens) return max_num_batched_tokens;
  uint32_t b = mixed;
  while (b < max_num_batched_tokens && (b < n_dec + mixed / 2 || backlog >= BACKLOG_FACTOR * (b - n_dec))) b *= 2;
  return b < max_num_batched_tokens ? b : max_num_batched_tokens;
}

// Most running rows of one group (the choices of one API request).
BLINK_POLICY_FN uint32_t group_cap(uint32_t max_batch) {
  return max_batch / GROUP_SHARE_DIVISOR > 1 ? max_batch / GROUP_SHARE_DIVISOR : 1;
}

}  // namespace blink
