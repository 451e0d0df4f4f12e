// On-device sampling, exactly blink/device/sampling.py's definition (read its docstring first).
//
// One block of 1024 threads per sequence; the row of fp32 logits [V] is never sorted or copied. A NaN
// logit is read as -inf everywhere (nan_low), so every row gives a token id in [0, V):
//   greedy (T < SAMPLING_EPS, or NaN): argmax, lowest index on ties (row_argmax; 0 for a row of -inf).
//   else z_i = logit_i / T; when max z is not finite (+inf: overflow; -inf: every token masked) the
//   row falls back to the greedy argmax; else p_i = expf(z_i - max z) / sum, recomputed on every pass
//   (same inputs, same instructions -> the same float each time).
//   top-k: the k-th largest p by a 4-pass radix select on the float bits (p >= 0, so the bit
//   patterns order like the values), 8 bits a pass, 256-bin count histograms in shared memory.
//   top-p: tau = the largest kept value v with mass(kept p >= v) >= top_p * kept mass, by the same
//   radix walk over fp64 mass histograms: scanning bins from the top, the first bin whose mass
//   brings the running sum to the target holds tau.
//   draw: u = splitmix64(seed ^ (k+1)*golden) >> 40 / 2^24; the token is the first kept index in
//   vocabulary order whose running mass exceeds u * kept mass: each thread owns a contiguous
//   vocabulary range, a block scan of the range sums finds the range that crosses, and its owner
//   walks it.
// Sums are fp64 (the reference accumulates in float64), so only the order of additions differs.
//
// Sampling extensions (steps 0-2, 5 and 10 of the definition), for the rows that use them:
//   penalty_mark (before the LM head's logits are read): a fresh sequence's penalty-state row is
//     zeroed, then the step's input tokens of that sequence are marked seen.
//   logits_ext: raw logprobs (max, log-sum-exp, the top n by n block argmax passes, each taking the
//     next element in (value desc, id asc) order: no exclusion list, ties ordered like the
//     reference); logit_bias and the penalties write the row's processed logits into `proc`.
//   sample_tokens: samples from `proc` for those rows; min_p is one more threshold on p.
//   sample_post: the chosen token's raw logprob, and its count (and seen bit) in the state.
// Prompt logprobs (SlotFlags.PROMPT_LOGPROBS), for the step's scored rows j < *plp_count (packed
//   token plp_tok[j] scores prompt token plp_target[j]); each kernel returns at once unless ext_on
//   and plp_count are set, so a step without such rows pays three empty launches:
//   plp_norm: the final RMSNorm of each scored row (final_norm_gather's arithmetic) -> hid [P, H];
//   plp_lm_head: logits [P, V] fp32 = hid Wlm^T (a tiled bf16 GEMM with fp32 accumulation; its grid
//     covers the vocabulary and each block loops over the live rows only);
//   plp_records: per row, logits_ext's raw logprob record: lp[target] and the top plp_prompt_logprobs[j].
// Penalty state: uint32 per (state row, vocabulary id): bit 31 = seen (prompt or output), the low
// bits = occurrences in the output. The state row of a sequence is pen_row[s] (-1: no state, no
// logit_bias: the row is sampled from the raw logits).
#include "blink_ring.h"  // SAMPLING_EPS (blink/protocol/sampling_params.py)
#include "common.cuh"
#include "fp8_codes.cuh"  // decode_e4m3 (the FP8 head's prompt logprobs)
#include "sys_memory.cuh"  // the gate's acquire (token_mask)
#include <cuda_fp16.h>
#include <cuda_fp8.h>

using blink::SAMPLING_EPS;

constexpr int SB = 1024;  // threads per row

struct SampleShared {
  double dscratch[32];
  float fscratch[32];
  int iscratch[32];
  unsigned int hist[256];
  double mhist[256];
  unsigned int prefix;
  int sel;
  double above;
  int winner;
};

__device__ __forceinline__ double block_sum_d(double v, SampleShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  __syncthreads();
  if (lane == 0) sh.dscratch[warp] = v;
  __syncthreads();
  double r = lane < (int)(blockDim.x >> 5) ? sh.dscratch[lane] : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(FULL_MASK, r, o);
  return r;
}

__device__ __forceinline__ float block_max_f(float v, SampleShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh.fscratch[warp] = v;
  __syncthreads();
  float r = lane < (int)(blockDim.x >> 5) ? sh.fscratch[lane] : -INFINITY;
  return warp_max(r);
}

__device__ __forceinline__ uint64_t splitmix64_s(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr uint32_t SEEN = 0x80000000u;

// A logit as the definition reads it: NaN counts as -inf.
__device__ __forceinline__ float nan_low(float x) { return isnan(x) ? -INFINITY : x; }

// The block's (value desc, index asc) maximum of (v, i) pairs; every thread gets it.
__device__ __forceinline__ void block_argmax(float& bv, int& bi, SampleShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
    const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) {
      bv = ov;
      bi = oi;
    }
  }
  __syncthreads();
  if (lane == 0) {
    sh.fscratch[warp] = bv;
    sh.iscratch[warp] = bi;
  }
  __syncthreads();
  bv = lane < (int)(blockDim.x >> 5) ? sh.fscratch[lane] : -INFINITY;
  bi = lane < (int)(blockDim.x >> 5) ? sh.iscratch[lane] : 0x7fffffff;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
    const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) {
      bv = ov;
      bi = oi;
    }
  }
}

// Grid (S), block 256. state: [rows, V]; input_ids / cu_q_lens: the step's packed tokens.
extern "C" __global__ void penalty_mark(uint32_t* __restrict__ state, int V, const int* __restrict__ pen_row,
                                        const int* __restrict__ fresh, const int* __restrict__ input_ids,
                                        const int* __restrict__ cu_q_lens, const uint32_t* __restrict__ num_seqs,
                                        const uint32_t* __restrict__ ext_on) {
  const int s = blockIdx.x;
  if (!*ext_on || s >= (int)*num_seqs || pen_row[s] < 0) return;
  uint32_t* st = state + (size_t)pen_row[s] * V;
  if (fresh[s]) {
    for (int i = threadIdx.x; i < V; i += blockDim.x) st[i] = 0u;
    __syncthreads();
  }
  for (int j = cu_q_lens[s] + threadIdx.x; j < cu_q_lens[s + 1]; j += blockDim.x) atomicOr(&st[input_ids[j]], SEEN);
}

// Step 0 of the definition for one row (every thread of the SB-thread block calls it): *m = max,
// *lse = log-sum-exp of logits - max (fp64 sum), and thread 0 writes ids / lps [n]: the n largest
// logits by n block argmax passes, each taking the next element in (value desc, id asc) order (no
// exclusion list, ties ordered like the reference); every id is in [0, V) whatever the values.
__device__ void row_top_logprobs(const float* __restrict__ row, int V, int n, int* __restrict__ ids,
                                 float* __restrict__ lps, float* m_out, float* lse_out, SampleShared& sh) {
  const int tid = threadIdx.x;
  float m = -INFINITY;
  for (int i = tid; i < V; i += SB) m = fmaxf(m, nan_low(row[i]));
  m = block_max_f(m, sh);
  double e = 0.0;
  for (int i = tid; i < V; i += SB) e += (double)expf(nan_low(row[i]) - m);
  const float lse = (float)log(block_sum_d(e, sh));
  float pv = INFINITY;  // the previous pick, in (value desc, id asc) order
  int pi = -1;
  for (int j = 0; j < n; ++j) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = tid; i < V; i += SB) {
      const float v = nan_low(row[i]);
      const bool after = v < pv || (v == pv && i > pi);
      if (after && (v > bv || (v == bv && i < bi))) {
        bv = v;
        bi = i;
      }
    }
    block_argmax(bv, bi, sh);
    if (tid == 0) {
      ids[j] = bi;
      lps[j] = (bv - m) - lse;
    }
    pv = bv;
    pi = bi;
  }
  *m_out = m;
  *lse_out = lse;
}

// Step 3 of the definition (every thread of the block calls it; all get the index): argmax with NaN
// as -inf, lowest index on ties; a row with nothing above -inf gives its first index, 0.
__device__ int row_argmax(const float* __restrict__ row, int V, SampleShared& sh) {
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < V; i += SB) {
    const float v = nan_low(row[i]);
    if (v > bv || (v == bv && i < bi)) {
      bv = v;
      bi = i;
    }
  }
  block_argmax(bv, bi, sh);
  return bi == 0x7fffffff ? 0 : bi;
}

// Grid (S), block SB. Rows with logprobs[s] >= 0: top_ids / top_lps [S, max_lp] (the first
// logprobs[s] of each row written) and stats [S, 2] = (max, log-sum-exp of logits - max). Rows with
// pen_row[s] = r >= 0: proc[s] = the logits with logit_bias (the state row's table: logit_bias_n[r]
// entries at logit_bias_ids / logit_bias_vals [r * max_logit_bias ...], copied there when the request was
// admitted) and the penalties of the state row applied.
extern "C" __global__ void __launch_bounds__(SB)
    logits_ext(const float* __restrict__ logits, float* __restrict__ proc, int V, const uint32_t* __restrict__ state,
               const int* __restrict__ pen_row, const float* __restrict__ presence_penalty,
               const float* __restrict__ frequency_penalty, const float* __restrict__ repetition_penalty,
               const int* __restrict__ logit_bias_n, const int* __restrict__ logit_bias_ids,
               const float* __restrict__ logit_bias_vals, int max_logit_bias, const int* __restrict__ logprobs,
               int max_lp, int* __restrict__ top_ids, float* __restrict__ top_lps, float* __restrict__ stats,
               const uint32_t* __restrict__ num_seqs, const uint32_t* __restrict__ ext_on) {
  __shared__ SampleShared sh;
  const int s = blockIdx.x;
  if (!*ext_on || s >= (int)*num_seqs) return;
  const int tid = threadIdx.x;
  const float* row = logits + (size_t)s * V;
  const int n = min(logprobs[s], max_lp);
  if (n >= 0) {
    float m, lse;
    row_top_logprobs(row, V, n, top_ids + (size_t)s * max_lp, top_lps + (size_t)s * max_lp, &m, &lse, sh);
    if (tid == 0) {
      stats[2 * s] = m;
      stats[2 * s + 1] = lse;
    }
  }
  const int r = pen_row[s];
  if (r < 0) return;
  float* out = proc + (size_t)s * V;
  for (int i = tid; i < V; i += SB) out[i] = row[i];
  __syncthreads();
  const size_t b0 = (size_t)r * max_logit_bias;
  for (int b = tid; b < logit_bias_n[r]; b += SB)  // ids may repeat
    atomicAdd(&out[logit_bias_ids[b0 + b]], logit_bias_vals[b0 + b]);
  __syncthreads();
  const float rep = repetition_penalty[s], f = frequency_penalty[s], p = presence_penalty[s];
  const bool use_rep = rep != 1.f && rep > 0.f, use_fp = f != 0.f || p != 0.f;
  if (!use_rep && !use_fp) return;
  const uint32_t* st = state + (size_t)r * V;
  for (int i = tid; i < V; i += SB) {
    const uint32_t c = st[i];
    float x = out[i];
    if (use_rep && (c & SEEN)) x = x > 0.f ? __fdiv_rn(x, rep) : __fmul_rn(x, rep);
    if (use_fp) {
      const uint32_t k = c & ~SEEN;
      x = __fsub_rn(x, __fadd_rn(__fmul_rn(f, (float)k), __fmul_rn(p, k ? 1.f : 0.f)));
    }
    out[i] = x;
  }
}

// The raw logprob record of one row of fp32 logits (every thread of the SB-thread block calls it):
// *lp = lp[target]; ids / lps [n] the n most likely, in (value desc, id asc) order.
__device__ void logprob_record_row(const float* __restrict__ row, int V, int target, int n, float* __restrict__ lp,
                                   int* __restrict__ ids, float* __restrict__ lps, SampleShared& sh) {
  float m, lse;
  row_top_logprobs(row, V, n, ids, lps, &m, &lse, sh);
  if (threadIdx.x == 0) *lp = (nan_low(row[target]) - m) - lse;
}

// Grid (G), block 256, rows j = blockIdx.x, blockIdx.x + G, ... < *plp_count: hid[j] = the final
// RMSNorm of packed token plp_tok[j] (delta: null when the last projection added into residual).
extern "C" __global__ void plp_norm(const bf16* __restrict__ residual, const bf16* __restrict__ delta,
                                    const bf16* __restrict__ w, bf16* __restrict__ hid,
                                    const int* __restrict__ plp_tok, const uint32_t* __restrict__ plp_count,
                                    const uint32_t* __restrict__ ext_on, int H, float eps) {
  __shared__ float scratch[32];
  if (!*ext_on) return;
  const int P = (int)*plp_count;
  for (int j = blockIdx.x; j < P; j += gridDim.x) {
    const size_t row = (size_t)plp_tok[j] * H;
    sum_rmsnorm_row(residual + row, delta != nullptr ? delta + row : nullptr, w, hid + (size_t)j * H, H, eps, scratch);
    __syncthreads();  // scratch is reused by the next row's block_sum
  }
}

// logits [P, V] fp32 = hid [P, K] x W [V, K]^T, bf16 inputs, fp32 accumulation. Grid (ceil(V / 64)),
// block 256: a block owns 64 vocabulary columns and walks the live rows in tiles of 32; each thread
// accumulates 2 rows x 4 columns over K in steps of 32 staged in shared memory. K % 8 == 0.
// plp_lm_head_fp8: the FP8 LM head (blink.models.fp8: codes [V, K] e4m3, scales [V]): the codes' values
// summed the same way, each column's sum times its scale.
constexpr int PLP_BM = 32, PLP_BN = 64, PLP_BK = 32;

// 8 values of row gc at k (K % 8 == 0): bf16 weights, or FP8 codes decoded (exact: e4m3 values are fp16s).
__device__ __forceinline__ void plp_load8(const bf16* W, size_t off, float* t) { load8(W + off, t); }
__device__ __forceinline__ void plp_load8(const uint8_t* W, size_t off, float* t) {
  const uint2 q = *reinterpret_cast<const uint2*>(W + off);
  const uint32_t w[2] = {q.x, q.y};
  decode_e4m3<2>(w, t);
}

template <typename WT>
__device__ __forceinline__ void plp_lm_head_impl(const bf16* __restrict__ hid, const WT* __restrict__ W,
                                                 const float* __restrict__ scales, float* __restrict__ logits, int V,
                                                 int K, const uint32_t* __restrict__ plp_count,
                                                 const uint32_t* __restrict__ ext_on) {
  __shared__ float xs[PLP_BK][PLP_BM + 1];
  __shared__ float ws[PLP_BK][PLP_BN + 1];
  if (!*ext_on) return;
  const int P = (int)*plp_count;
  const int n0 = blockIdx.x * PLP_BN, tid = threadIdx.x;
  const int tr = tid / 16, tc = tid % 16;  // rows tr, tr + 16; columns tc + 16 c
  for (int m0 = 0; m0 < P; m0 += PLP_BM) {
    float acc[2][4] = {};
    for (int k0 = 0; k0 < K; k0 += PLP_BK) {
      // stage X [32 rows][32 k] (4 bf16 per thread) and W [64 cols][32 k] (8 per thread), transposed
      {
        const int r = tid / 8, k = (tid % 8) * 4;
        const int gr = m0 + r;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          xs[k + i][r] = (gr < P && k0 + k + i < K) ? bf(hid[(size_t)gr * K + k0 + k + i]) : 0.f;
      }
      {
        const int c = tid / 4, k = (tid % 4) * 8;
        const int gc = n0 + c;
        float t[8] = {};
        if (gc < V && k0 + k < K) plp_load8(W, (size_t)gc * K + k0 + k, t);  // K % 8 == 0: all 8 in range
#pragma unroll
        for (int i = 0; i < 8; ++i) ws[k + i][c] = t[i];
      }
      __syncthreads();
#pragma unroll 8
      for (int k = 0; k < PLP_BK; ++k) {
        const float a0 = xs[k][tr], a1 = xs[k][tr + 16];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float b = ws[k][tc + 16 * c];
          acc[0][c] = fmaf(a0, b, acc[0][c]);
          acc[1][c] = fmaf(a1, b, acc[1][c]);
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int gr = m0 + tr + 16 * i;
      if (gr >= P) continue;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int gc = n0 + tc + 16 * c;
        if (gc < V) logits[(size_t)gr * V + gc] = scales != nullptr ? acc[i][c] * scales[gc] : acc[i][c];
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(256)
    plp_lm_head(const bf16* __restrict__ hid, const bf16* __restrict__ W, float* __restrict__ logits, int V, int K,
                const uint32_t* __restrict__ plp_count, const uint32_t* __restrict__ ext_on) {
  plp_lm_head_impl<bf16>(hid, W, nullptr, logits, V, K, plp_count, ext_on);
}

extern "C" __global__ void __launch_bounds__(256)
    plp_lm_head_fp8(const bf16* __restrict__ hid, const uint8_t* __restrict__ W, const float* __restrict__ scales,
                    float* __restrict__ logits, int V, int K, const uint32_t* __restrict__ plp_count,
                    const uint32_t* __restrict__ ext_on) {
  plp_lm_head_impl<uint8_t>(hid, W, scales, logits, V, K, plp_count, ext_on);
}

// Grid (G), block SB, rows j = blockIdx.x, blockIdx.x + G, ... < *plp_count: the record of row j
// (plp_lp[j], plp_ids / plp_lps [j][max_lp], the first plp_prompt_logprobs[j] written) from logits [P, V].
extern "C" __global__ void __launch_bounds__(SB)
    plp_records(const float* __restrict__ logits, int V, const int* __restrict__ plp_target,
                const int* __restrict__ plp_prompt_logprobs, int max_lp, float* __restrict__ plp_lp,
                int* __restrict__ plp_ids, float* __restrict__ plp_lps, const uint32_t* __restrict__ plp_count,
                const uint32_t* __restrict__ ext_on) {
  __shared__ SampleShared sh;
  if (!*ext_on) return;
  const int P = (int)*plp_count;
  for (int j = blockIdx.x; j < P; j += gridDim.x) {
    logprob_record_row(logits + (size_t)j * V, V, plp_target[j], min(plp_prompt_logprobs[j], max_lp), plp_lp + j,
                       plp_ids + (size_t)j * max_lp, plp_lps + (size_t)j * max_lp, sh);
    __syncthreads();
  }
}

// Grid (S), block 32 (one thread works). After sample_tokens, for rows whose token is published (not a
// row whose gate was closed: NO_TOKEN, nothing counts).
extern "C" __global__ void sample_post(const float* __restrict__ logits, int V, const int* __restrict__ out_tokens,
                                       const int* __restrict__ emit, const int* __restrict__ logprobs,
                                       const float* __restrict__ stats, float* __restrict__ chosen_lp,
                                       uint32_t* __restrict__ state, const int* __restrict__ pen_row,
                                       const uint32_t* __restrict__ num_seqs, const uint32_t* __restrict__ ext_on) {
  const int s = blockIdx.x;
  if (!*ext_on || s >= (int)*num_seqs || threadIdx.x != 0 || !emit[s]) return;
  const int tok = out_tokens[s];
  if (tok < 0) return;
  if (logprobs[s] >= 0) chosen_lp[s] = (nan_low(logits[(size_t)s * V + tok]) - stats[2 * s]) - stats[2 * s + 1];
  if (pen_row[s] >= 0) {
    uint32_t* c = state + (size_t)pen_row[s] * V + tok;
    *c = (((*c & ~SEEN) + 1u) & ~SEEN) | SEEN;
  }
}

// Token masks (structured output, sampling.py step 2b), read from the ring itself when the row is
// sampled (blink/protocol/layout.py, mask arena): a row with mask_gate[s] != 0 (the device address of
// its slot's mask_position) is sampled only when the frontend has published the mask of its token
// sample_pos[s]: thread 0 loads mask_position with ld.acquire.sys, and a barrier orders the block's
// loads of the bits after it (the frontend stores the bits, then releases mask_position). Open: the
// tokens whose bit is clear in the ring's bitmask at mask_bits[s] (bit t % 32 of word t / 32; tokens
// past ring_mask_words words are not allowed) become -inf in the row sample_tokens reads (proc when
// pen_row[s] >= 0, else the logits, in place). mask_open[s] = 1 (open), 0 (closed: sample_tokens
// writes NO_TOKEN, sample_post skips the row), -1 (no mask). Launched after logits_ext (the raw
// logprobs are the unmasked logits') and before sample_tokens: the last thing before the draw, so a
// mask published while the step's forward pass ran is used. Returns at once unless ext_on and mask_on.
// Grid (S), block 1024; the bits go through shared memory MASK_TILE words at a time, each thread's
// loads issued before their first use (ld.relaxed.sys: nothing cached from an earlier step is read).
constexpr int MASK_TILE = 8192;  // 262,144 tokens a tile
constexpr int MASK_THREADS = 1024;

extern "C" __global__ void __launch_bounds__(MASK_THREADS)
    token_mask(float* __restrict__ logits, float* __restrict__ proc, int V, const int* __restrict__ pen_row,
               const uint64_t* __restrict__ mask_gate, const uint64_t* __restrict__ mask_bits,
               const uint32_t* __restrict__ ring_mask_words, const uint32_t* __restrict__ sample_pos,
               int* __restrict__ mask_open, const uint32_t* __restrict__ num_seqs,
               const uint32_t* __restrict__ ext_on, const uint32_t* __restrict__ mask_on) {
  __shared__ uint32_t words[MASK_TILE];
  __shared__ int open;
  const int s = blockIdx.x, tid = threadIdx.x;
  if (!*ext_on || !*mask_on || s >= (int)*num_seqs) return;
  if (mask_gate[s] == 0) {
    if (tid == 0) mask_open[s] = -1;
    return;
  }
  if (tid == 0) {
    open = blink::ld_acq_sys((const uint32_t*)mask_gate[s]) == sample_pos[s] + 1u;
    mask_open[s] = open;
  }
  __syncthreads();
  if (!open) return;
  float* row = (pen_row[s] >= 0 ? proc : logits) + (size_t)s * V;
  const uint32_t* m = (const uint32_t*)mask_bits[s];
  const int W = (int)*ring_mask_words, VW = (V + 31) >> 5;
  constexpr int U = MASK_TILE / MASK_THREADS;
  for (int w0 = 0; w0 < VW; w0 += MASK_TILE) {
    const int nw = min(MASK_TILE, VW - w0);
    uint32_t v[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int w = w0 + tid + k * MASK_THREADS;
      v[k] = tid + k * MASK_THREADS < nw && w < W ? blink::ld_sys(m + w) : 0u;
    }
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (tid + k * MASK_THREADS < nw) words[tid + k * MASK_THREADS] = v[k];
    __syncthreads();
    const int t0 = w0 * 32, nt = min(V - t0, nw * 32);
    for (int i = tid; i < nt; i += MASK_THREADS)
      if (!((words[i >> 5] >> (i & 31)) & 1u)) row[t0 + i] = -INFINITY;
    __syncthreads();
  }
}

// One row's probability of token i at temperature T, from the softmax pieces zmax (the max of
// z = logit / T) and denom; the helpers below take (row, T, zmax, denom) under these names.
#define PROB(i) (expf(nan_low(row[(i)]) / T - zmax) / denom)

// top-k threshold: the k-th largest probability, by four 8-bit radix passes over its bits (0 < k < V).
__device__ __forceinline__ float top_k_threshold(const float* row, float T, float zmax, float denom, int V, int k,
                                                 int tid, SampleShared& sh) {
  unsigned int prefix = 0, mask = 0;
  int remaining = k;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int b = tid; b < 256; b += SB) sh.hist[b] = 0;
    __syncthreads();
    for (int i = tid; i < V; i += SB) {
      const unsigned int bits = __float_as_uint(PROB(i));
      if ((bits & mask) == prefix) atomicAdd(&sh.hist[(bits >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      int cum = 0, sel = 0;
      for (int b = 255; b >= 0; --b) {
        if (sh.hist[b] > 0 && cum + (int)sh.hist[b] >= remaining) {
          sel = b;
          break;
        }
        cum += sh.hist[b];
      }
      sh.sel = sel;
      sh.iscratch[0] = remaining - cum;
    }
    __syncthreads();
    prefix |= (unsigned int)sh.sel << shift;
    mask |= 255u << shift;
    remaining = sh.iscratch[0];
    __syncthreads();
  }
  return __uint_as_float(prefix);
}

// top-p threshold (tp < 1): the smallest probability whose mass from the top, among the tokens that
// pass kth and mthr, reaches tp of theirs; four 8-bit radix passes over the bits of p.
__device__ __forceinline__ float top_p_threshold(const float* row, float T, float zmax, float denom, int V, float tp,
                                                 float kth, float mthr, int tid, SampleShared& sh) {
  double kept = 0.0;
  for (int i = tid; i < V; i += SB) {
    const float p = PROB(i);
    if (p >= kth && p >= mthr) kept += (double)p;
  }
  const double target = (double)tp * block_sum_d(kept, sh);
  unsigned int prefix = 0, mask = 0;
  double above = 0.0;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int b = tid; b < 256; b += SB) sh.mhist[b] = 0.0;
    __syncthreads();
    for (int i = tid; i < V; i += SB) {
      const float p = PROB(i);
      const unsigned int bits = __float_as_uint(p);
      if (p >= kth && p >= mthr && (bits & mask) == prefix) atomicAdd(&sh.mhist[(bits >> shift) & 255u], (double)p);
    }
    __syncthreads();
    if (tid == 0) {
      double cum = above;
      int sel = -1, lowest = 0;
      for (int b = 255; b >= 0; --b) {
        if (sh.mhist[b] > 0.0) {
          lowest = b;
          if (cum + sh.mhist[b] >= target) {
            sel = b;
            break;
          }
          cum += sh.mhist[b];
        }
      }
      if (sel < 0) {  // rounding left the target unreached: take the lowest nonempty bin
        sel = lowest;
        cum -= sh.mhist[lowest];
      }
      sh.sel = sel;
      sh.above = cum;
    }
    __syncthreads();
    prefix |= (unsigned int)sh.sel << shift;
    mask |= 255u << shift;
    above = sh.above;
    __syncthreads();
  }
  return __uint_as_float(prefix);
}

// Exclusive block scan of each thread's kept mass `local` (inc: its inclusive warp scan); leaves the
// block's total kept mass in sh.above and sh.winner at "none". Returns the thread's exclusive prefix.
__device__ __forceinline__ double kept_mass_prefix(double local, int tid, int lane, int warp, SampleShared& sh) {
  double inc = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(FULL_MASK, inc, o);
    if (lane >= o) inc += y;
  }
  __syncthreads();  // dscratch may still be read by an earlier reduction
  if (lane == 31) sh.dscratch[warp] = inc;
  if (tid == 0) sh.winner = 0x7fffffff;
  __syncthreads();
  if (warp == 0) {
    double w = sh.dscratch[lane];
    double wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const double y = __shfl_up_sync(FULL_MASK, wi, o);
      if (lane >= o) wi += y;
    }
    sh.dscratch[lane] = wi - w;  // exclusive prefix of warp totals
  }
  __syncthreads();
  const double excl = sh.dscratch[warp] + inc - local;
  // total kept mass = exclusive prefix of the last thread + its local sum
  if (tid == SB - 1) sh.above = excl + local;
  __syncthreads();
  return excl;
}

// u in [0, 1): 24 bits of splitmix64(seed ^ (position + 1) * golden ratio) for row s.
__device__ __forceinline__ double uniform_draw(const uint64_t* seed, const uint32_t* sample_pos, int s) {
  const uint64_t kk = (uint64_t)sample_pos[s];
  const uint64_t r = splitmix64_s(seed[s] ^ ((kk + 1ull) * 0x9E3779B97F4A7C15ull));
  return (double)(r >> 40) * (1.0 / 16777216.0);
}

// proc / pen_row / min_p: read only when ext_on is non-null and *ext_on (the step uses an extension):
// rows with pen_row[s] >= 0 then sample from proc (logits_ext's output), min_p applies; otherwise
// every row samples from the logits with min_p 0. With ext_on and mask_on, a row whose gate token_mask
// found closed (mask_open[s] == 0) gets NO_TOKEN: its mask was not published, it samples next step.
extern "C" __global__ void __launch_bounds__(SB)
    sample_tokens(const float* __restrict__ logits, int V, const float* __restrict__ temperature,
                  const float* __restrict__ top_p, const int* __restrict__ top_k, const uint64_t* __restrict__ seed,
                  const uint32_t* __restrict__ sample_pos, int* __restrict__ out_tokens,
                  const uint32_t* __restrict__ num_seqs, const float* __restrict__ proc,
                  const int* __restrict__ pen_row, const float* __restrict__ min_p,
                  const uint32_t* __restrict__ ext_on, const uint32_t* __restrict__ mask_on,
                  const int* __restrict__ mask_open) {
  __shared__ SampleShared sh;
  const int s = blockIdx.x;
  if (s >= (int)*num_seqs) return;
  const bool ext = ext_on != nullptr && *ext_on;
  if (ext && *mask_on && mask_open[s] == 0) {
    if (threadIdx.x == 0) out_tokens[s] = blink::NO_TOKEN;
    return;
  }
  const float* row = (ext && pen_row[s] >= 0 ? proc : logits) + (size_t)s * V;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float T = temperature[s];
  if (!(T >= SAMPLING_EPS)) {
    const int g = row_argmax(row, V, sh);
    if (tid == 0) out_tokens[s] = g;
    return;
  }
  // softmax pieces; without a finite max z (overflow, or every token masked): the greedy argmax
  float zmax = -INFINITY;
  for (int i = tid; i < V; i += SB) zmax = fmaxf(zmax, nan_low(row[i]) / T);
  zmax = block_max_f(zmax, sh);
  if (!isfinite(zmax)) {
    const int g = row_argmax(row, V, sh);
    if (tid == 0) out_tokens[s] = g;
    return;
  }
  double esum = 0.0;
  for (int i = tid; i < V; i += SB) esum += (double)expf(nan_low(row[i]) / T - zmax);
  const float denom = (float)block_sum_d(esum, sh);
  // min_p: p >= min_p * max p, and max p = expf(0) / denom
  const float mp = ext ? min_p[s] : 0.f, mthr = mp > 0.f ? __fmul_rn(mp, 1.f / denom) : 0.f;
  const int k = top_k[s];
  const float kth = k > 0 && k < V ? top_k_threshold(row, T, zmax, denom, V, k, tid, sh) : 0.f;
  const float tp = top_p[s], tau = tp < 1.f ? top_p_threshold(row, T, zmax, denom, V, tp, kth, mthr, tid, sh) : 0.f;
  const float thr = fmaxf(fmaxf(kth, tau), mthr);
  // draw: each thread's kept mass over its contiguous range, the block's prefix, the first crossing
  const int per = (V + SB - 1) / SB, lo = min(V, tid * per), hi = min(V, lo + per);
  double local = 0.0;
  int last_kept = -1;
  for (int i = lo; i < hi; ++i) {
    const float p = PROB(i);
    if (p >= thr) {
      local += (double)p;
      last_kept = i;
    }
  }
  const double excl = kept_mass_prefix(local, tid, lane, warp, sh);
  const double x = uniform_draw(seed, sample_pos, s) * sh.above;
  if (local > 0.0 && excl + local > x) {
    double run = excl;
    for (int i = lo; i < hi; ++i) {
      const float p = PROB(i);
      if (p >= thr) {
        run += (double)p;
        if (run > x) {
          atomicMin(&sh.winner, i);
          break;
        }
      }
    }
  }
  __syncthreads();
  if (sh.winner == 0x7fffffff) {  // rounding left no crossing: the last kept token
    if (tid == 0) sh.iscratch[0] = -1;
    __syncthreads();
    if (last_kept >= 0) atomicMax(&sh.iscratch[0], last_kept);
    __syncthreads();
    if (tid == 0) out_tokens[s] = max(sh.iscratch[0], 0);  // some token is kept: the max passes every threshold
  } else if (tid == 0) {
    out_tokens[s] = sh.winner;
  }
}
#undef PROB

// Holds its stream for `ns` nanoseconds of the global timer. Timing loops (the engine's GEMM tuner)
// enqueue it first, so the host's launch calls run ahead of the GPU and the events around the timed
// work measure the GPU, not the launch rate.
extern "C" __global__ void spin_ns(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
