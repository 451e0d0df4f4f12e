// Paged attention, decode: one query token per sequence, split-K flash-decoding ("basic": the
// engine's fallback; its default, "flashq", lives in flash_decode.cu, prefill in prefill_attention.cu).
//
// KV cache of one layer: k_cache, v_cache [num_blocks, block_size, nkv, HD] bf16; token p of
// sequence s lives in block block_tables[s][p / block_size], row p % block_size. Causality: the
// query at position p attends keys 0..p, and the queries of a chunk sit at the end of the
// sequence (prefix = seq_len - q_len), so chunked prefill needs no extra metadata.
//
// Decode: grid (NS splits, nkv, S), 128 threads. A block takes the G = nq/nkv query heads of one
// KV head (GQA: K/V are read once for the whole group) and one contiguous chunk of the context,
// chunk = ceil(len/NS) rounded up to 64 keys, so short contexts leave trailing splits empty.
// Scores: HD/8 lanes share a key (16-byte loads), a warp scores 32/(HD/8) keys at once; q sits
// in shared memory, pre-scaled by log2(e)/sqrt(HD), and the online softmax runs in base 2 per
// tile of 32 keys (64 for HD < 64). All K and V loads of a tile are issued before any is used.
// 4 blocks/SM. (A "pipe" variant that issued the next tile's loads before the current tile's math,
// 3 blocks/SM, was retired: 53.2 vs 39.8 ms per Llama-3-8B decode step at batch 256,
// bench/results/archive/decode_h200_run4.json.) Each split writes (m, l, o) to a workspace; the last split to
// finish (a per-(sequence, KV head) counter, reset by that block) merges them, so decode
// attention is one kernel.
#include "common.cuh"

constexpr int MAX_SPLITS = 32;  // decode splits per sequence (Forward.max_splits)


template <int HD, int G>
__device__ __forceinline__ void attn_decode_impl(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                                                 const bf16* __restrict__ v_cache, float* __restrict__ part_o,
                                                 float* __restrict__ part_ml, int* __restrict__ counters,
                                                 bf16* __restrict__ out, const int* __restrict__ cu_q_lens,
                                                 const int* __restrict__ seq_lens, const int* __restrict__ block_tables,
                                                 const uint32_t* __restrict__ num_seqs, int nkv, int bs, int mbps,
                                                 float scale_log2) {
  constexpr int LPT = HD / 8;                 // lanes per key (16-byte loads)
  constexpr int TPW = 32 / LPT;               // keys per warp step
  constexpr int NG = 128 / LPT;               // key groups in the V pass
  constexpr int DT = HD >= 64 ? 32 : 64;      // keys per tile
  constexpr int KI = DT / 4 / TPW;            // K vectors a thread loads per tile
  constexpr int VI = DT / NG;                 // V vectors a thread loads per tile
  static_assert(KI >= 1 && VI >= 1, "tile too small for this head dim");
  __shared__ float sc[G][DT];
  __shared__ float m_s[G], l_s[G], alpha_s[G];
  __shared__ float red[NG][G][HD];
  __shared__ __align__(16) float q_s[G][HD];
  __shared__ int last;
  __shared__ float mw[G][MAX_SPLITS], lw[G][MAX_SPLITS], inv_den[G];
  const int s = blockIdx.z;
  if (s >= (int)*num_seqs) return;
  const int NS = gridDim.x, split = blockIdx.x, kvh = blockIdx.y, nq = nkv * G;
  const int L = seq_lens[s];
  int chunk = (L + NS - 1) / NS;
  chunk = (chunk + 63) / 64 * 64;
  const int start = split * chunk, end = min(L, start + chunk);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, sub = lane % LPT;
  const size_t pbase = ((size_t)s * nq + kvh * G) * NS + split;  // + g * NS
  const int tok = cu_q_lens[s + 1] - 1;
  if (start >= end) {
    if (tid < G) {
      part_ml[(pbase + tid * NS) * 2] = -INFINITY;
      part_ml[(pbase + tid * NS) * 2 + 1] = 0.f;
    }
  } else {
    // q lives in shared memory: the tile's K/V vectors take the registers, and occupancy, not
    // load width, limits this kernel at large batch.
    for (int idx = tid; idx < G * HD; idx += blockDim.x)
      q_s[idx / HD][idx % HD] = bf(q[((size_t)tok * nq + kvh * G) * HD + idx]) * scale_log2;
    if (tid < G) {
      m_s[tid] = -INFINITY;
      l_s[tid] = 0.f;
    }
    __syncthreads();
    float acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
    const int* bt = block_tables + (size_t)s * mbps;
    const int tg = tid / LPT, d8 = tid % LPT;
    const bf16x8 zero8 = {};
    // Every K and V load of a tile is issued before any is used: one memory latency a tile.
    bf16x8 knext[KI], vnext[VI];
    auto issue = [&](int t0) {
#pragma unroll
      for (int it = 0; it < KI; ++it) {
        const int t = t0 + warp * (DT / 4) + it * TPW + lane / LPT;
        knext[it] = t < end ? *reinterpret_cast<const bf16x8*>(
                                  k_cache + (((size_t)bt[t / bs] * bs + t % bs) * nkv + kvh) * HD + sub * 8)
                            : zero8;
      }
#pragma unroll
      for (int j = 0; j < VI; ++j) {
        const int t = t0 + tg + NG * j;
        vnext[j] = t < end ? *reinterpret_cast<const bf16x8*>(
                                 v_cache + (((size_t)bt[t / bs] * bs + t % bs) * nkv + kvh) * HD + d8 * 8)
                           : zero8;
      }
    };
    for (int t0 = start; t0 < end; t0 += DT) {
      issue(t0);
      bf16x8 kraw[KI], vraw[VI];
#pragma unroll
      for (int it = 0; it < KI; ++it) kraw[it] = knext[it];
#pragma unroll
      for (int j = 0; j < VI; ++j) vraw[j] = vnext[j];
#pragma unroll
      for (int it = 0; it < KI; ++it) {
        const int local = warp * (DT / 4) + it * TPW + lane / LPT;
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float4 qa = *reinterpret_cast<const float4*>(&q_s[g][sub * 8]);
          const float4 qb = *reinterpret_cast<const float4*>(&q_s[g][sub * 8 + 4]);
          const bf16x8 kv = kraw[it];
          float d = qa.x * bf(kv.v[0]) + qa.y * bf(kv.v[1]) + qa.z * bf(kv.v[2]) + qa.w * bf(kv.v[3]);
          d += qb.x * bf(kv.v[4]) + qb.y * bf(kv.v[5]) + qb.z * bf(kv.v[6]) + qb.w * bf(kv.v[7]);
#pragma unroll
          for (int o = LPT / 2; o > 0; o >>= 1) d += __shfl_xor_sync(FULL_MASK, d, o);
          if (sub == 0) sc[g][local] = t0 + local < end ? d : -INFINITY;
        }
      }
      __syncthreads();
      for (int g = warp; g < G; g += 4) {
        float v[DT / 32], mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < DT / 32; ++j) mx = fmaxf(mx, v[j] = sc[g][lane + 32 * j]);
        const float m_old = m_s[g];
        const float m_new = fmaxf(m_old, warp_max(mx));
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < DT / 32; ++j) {
          const float p = exp2f(v[j] - m_new);
          sc[g][lane + 32 * j] = p;
          sum += p;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
          const float a = exp2f(m_old - m_new);
          alpha_s[g] = a;
          l_s[g] = l_s[g] * a + sum;
          m_s[g] = m_new;
        }
      }
      __syncthreads();
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float a = alpha_s[g];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] *= a;
      }
#pragma unroll
      for (int j = 0; j < VI; ++j) {
        const int tt = tg + NG * j;
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float p = sc[g][tt];
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[g][i] += p * bf(vraw[j].v[i]);
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int i = 0; i < 8; ++i) red[tg][g][d8 * 8 + i] = acc[g][i];
    __syncthreads();
    for (int idx = tid; idx < G * HD; idx += blockDim.x) {
      const int g = idx / HD, d = idx % HD;
      float v = 0.f;
#pragma unroll
      for (int j = 0; j < NG; ++j) v += red[j][g][d];
      part_o[(pbase + (size_t)g * NS) * HD + d] = v;
    }
    if (tid < G) {
      part_ml[(pbase + tid * NS) * 2] = m_s[tid];
      part_ml[(pbase + tid * NS) * 2 + 1] = l_s[tid];
    }
  }
  // The last split of this (sequence, KV head) to finish merges all splits (no combine kernel).
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(&counters[s * nkv + kvh], 1) == NS - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const size_t base0 = pbase - split;  // split 0 of head g: base0 + g * NS
  for (int idx = tid; idx < G * NS; idx += blockDim.x) {
    const int g = idx / NS, i = idx % NS;
    mw[g][i] = __ldcg(&part_ml[(base0 + (size_t)g * NS + i) * 2]);
    lw[g][i] = __ldcg(&part_ml[(base0 + (size_t)g * NS + i) * 2 + 1]);
  }
  __syncthreads();
  if (tid < G) {
    float M = -INFINITY, den = 0.f;
    for (int i = 0; i < NS; ++i)
      if (lw[tid][i] > 0.f) M = fmaxf(M, mw[tid][i]);
    for (int i = 0; i < NS; ++i) {
      const float w = lw[tid][i] > 0.f ? exp2f(mw[tid][i] - M) : 0.f;
      mw[tid][i] = w;
      den += w * lw[tid][i];
    }
    inv_den[tid] = den > 0.f ? 1.f / den : 0.f;
  }
  __syncthreads();
  for (int idx = tid; idx < G * HD; idx += blockDim.x) {
    const int g = idx / HD, d = idx % HD;
    float num = 0.f;
#pragma unroll 4
    for (int i = 0; i < NS; ++i)
      if (mw[g][i] > 0.f) num += mw[g][i] * __ldcg(&part_o[(base0 + (size_t)g * NS + i) * HD + d]);
    out[((size_t)tok * nq + kvh * G + g) * HD + d] = tobf(num * inv_den[g]);
  }
  if (tid == 0) counters[s * nkv + kvh] = 0;
}

#define DECODE(HD, G)                                                                                          \
  extern "C" __global__ void __launch_bounds__(128, (G <= 4 ? 4 : 2)) attn_decode_hd##HD##_g##G(            \
      const bf16* q, const bf16* kc, const bf16* vc, float* po, float* pml, int* cnt, bf16* out, const int* cu, \
      const int* sl, const int* bt, const uint32_t* ns, int nkv, int bs, int mbps, float sc) {                  \
    attn_decode_impl<HD, G>(q, kc, vc, po, pml, cnt, out, cu, sl, bt, ns, nkv, bs, mbps, sc);                  \
  }
#define PER_HD(HD)                                                                                             \
  DECODE(HD, 1)                                                                                                \
  DECODE(HD, 2)                                                                                                \
  DECODE(HD, 3)                                                                                                \
  DECODE(HD, 4)                                                                                                \
  DECODE(HD, 5)                                                                                                \
  DECODE(HD, 6)                                                                                                \
  DECODE(HD, 7)                                                                                                \
  DECODE(HD, 8)
PER_HD(16)
PER_HD(32)
PER_HD(64)
PER_HD(128)
