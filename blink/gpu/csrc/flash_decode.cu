// Paged decode attention, flash-decoding style (the engine's default, "flashq"): one CTA of
// 4 warps per (context split, KV head, sequence), all G = nq/nkv query heads of the KV head at
// once, so every K/V byte is read from HBM once. KV layout as in attention.cu: k_cache, v_cache
// [num_blocks, block_size, nkv, HD] bf16, token p of sequence s in block block_tables[s][p / bs].
//
// Splits: the grid is (NS, nkv, S) with NS fixed per captured batch bucket (flash_grid_splits in
// forward.py: up to about 4 waves of CTAs); the keys per split ("chunk") are chosen at run time
// from the live num_seqs and seq_lens by flash_chunk, which the combine kernel repeats, and CTAs
// whose split starts past the sequence exit at once. A sequence covered by one split is written to `out` directly; otherwise each
// split writes its normalised output and log2-sum-exp and attn_flash_combine merges them.
//
// Inside a CTA the warps take interleaved tiles of KT = N * KPI keys with no block barrier in
// the loop; each warp keeps its own online softmax (base 2, q pre-scaled by log2(e)/sqrt(HD)).
// A lane owns 8 dims (one 16-byte vector) of KPI = 32 / (HD/8) keys per load, N loads of K and
// N of V per tile in flight at once. Its q slice stays in registers. Scores: each lane holds N
// partial dot products; a reduce-scatter over the HD/8 lanes of a key leaves every lane with
// R = N >> STEPS whole scores (log2(N) + few shuffles per head instead of log2(HD/8) per key).
// The probabilities go through a per-warp shared array to the lanes that hold the V rows.
// STAGES > 0 (flashq): the K/V vectors go through a per-warp ring of STAGES tiles in dynamic
// shared memory filled by cp.async (zero-filled past the end), so STAGES - 1 tiles stay in flight
// while one is computed without holding registers. Each lane reads back only the 16-byte
// vectors it copied itself, so cp.async.wait_group alone orders a lane's reads (no barrier).
#include "common.cuh"

constexpr int FLASH_WARPS = 4;

__host__ __device__ constexpr int ilog2c(int x) { return x <= 1 ? 0 : 1 + ilog2c(x / 2); }

// Chunks are multiples of this many keys: at least one warp tile, at least 32 keys.
__host__ __device__ constexpr int flash_quantum(int hd, int n) { return n * (256 / hd) > 32 ? n * (256 / hd) : 32; }

// Keys per split of a sequence of length L. Splits run in waves of `target` CTAs (one CTA per
// split x KV head x live sequence), so the cost of n splits is waves(n) x (keys per split + one
// quantum of fixed per-CTA latency); the cheapest n <= grid_splits (<= 32) wins, ties to fewer
// splits (each costs the combine a read). Every sequence is costed as if all had its length.
// Lane n-1 costs n splits and a warp min picks (so call it with the whole warp). Shared by the
// attention and combine kernels, so both agree on the split count.
__device__ __forceinline__ int flash_chunk(int L, int num_seqs, int grid_splits, int nkv, int target, int quantum) {
  const int lane = threadIdx.x & 31, n = lane + 1;
  const int per = max(1, num_seqs * nkv);
  const int units = max(1, (L + quantum - 1) / quantum);
  unsigned key = 0xffffffffu;
  if (n == 1 || (n <= grid_splits && n <= units)) {
    const int q = (units + n - 1) / n, used = (units + q - 1) / q;
    key = (unsigned)(((per * used + target - 1) / target) * (q + 1)) * 32u + (unsigned)lane;
  }
  const int best_n = (int)(__reduce_min_sync(FULL_MASK, key) & 31u) + 1;
  return (units + best_n - 1) / best_n * quantum;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool ok) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

template <int HD, int G, int N, int STAGES>
__device__ __forceinline__ void attn_flash_impl(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                                                const bf16* __restrict__ v_cache, float* __restrict__ part_o,
                                                float* __restrict__ part_lse, bf16* __restrict__ out,
                                                const int* __restrict__ cu_q_lens, const int* __restrict__ seq_lens,
                                                const int* __restrict__ block_tables,
                                                const uint32_t* __restrict__ num_seqs, int nkv, int bs, int mbps,
                                                float scale_log2, int target) {
  constexpr int LPT = HD / 8;         // lanes per key row
  constexpr int KPI = 32 / LPT;       // keys per warp-wide load
  constexpr int KT = N * KPI;         // keys per warp tile
  constexpr int NW = FLASH_WARPS;
  constexpr int LOG_LPT = ilog2c(LPT), LOG_N = ilog2c(N);
  constexpr int STEPS = LOG_N < LOG_LPT ? LOG_N : LOG_LPT;  // reduce-scatter steps
  constexpr int R = N >> STEPS;       // whole scores per lane afterwards
  constexpr int DUP = LOG_LPT - STEPS;  // log2(lanes holding a copy of the same score)
  static_assert((1 << LOG_N) == N && N <= 16, "N must be a power of two");
  __shared__ float ps[NW][KT][G];
  __shared__ float wm[NW][G], wl[NW][G];
  __shared__ float wo[NW][G][HD];
  // grid.z is the bucket (<= max_seqs), so these three loads stay in bounds and go out together.
  const int s = blockIdx.z;
  const int ns = (int)*num_seqs, L = seq_lens[s], tok = cu_q_lens[s + 1] - 1;
  if (s >= ns) return;
  const int split = blockIdx.x, kvh = blockIdx.y, nq = nkv * G, NS = gridDim.x;
  const int chunk = flash_chunk(L, ns, NS, nkv, target, flash_quantum(HD, N));
  const int start = split * chunk;
  if (start >= L) return;
  const int end = min(L, start + chunk), nused = (L + chunk - 1) / chunk;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, c = lane % LPT, h = lane / LPT;
  float qr[G][8], m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    load8(q + ((size_t)tok * nq + kvh * G + g) * HD + c * 8, qr[g]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      qr[g][e] *= scale_log2;
      acc[g][e] = 0.f;
    }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  const int* bt = block_tables + (size_t)s * mbps;
  const bf16x8 zero8 = {};
  const int ib = (c >> DUP) * R;                 // tile index of this lane's first whole score
  const bool owner = (c & ((1 << DUP) - 1)) == 0;  // one lane per score counts and stores it
  // STAGES > 0: this warp's ring, slot (stage, k|v, i) at ring[((stage * 2 + kv) * N + i) * 32 + lane].
  extern __shared__ __align__(16) unsigned char flash_smem[];
  bf16x8* ring = reinterpret_cast<bf16x8*>(flash_smem) + (size_t)warp * (STAGES > 0 ? STAGES : 1) * 2 * N * 32;
  auto issue = [&](int tt0, int stage) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int t = tt0 + KPI * i + h;
      const bool ok = t < end;
      const size_t off = ok ? (((size_t)bt[t / bs] * bs + t % bs) * nkv + kvh) * HD + c * 8 : 0;
      cp_async16(ring + ((stage * 2) * N + i) * 32 + lane, k_cache + off, ok);
      cp_async16(ring + ((stage * 2 + 1) * N + i) * 32 + lane, v_cache + off, ok);
    }
  };
  if constexpr (STAGES > 0) {
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
      issue(start + warp * KT + st * NW * KT, st);
      cp_async_commit();
    }
  }
  int stage = 0;
  for (int t0 = start + warp * KT; t0 < end; t0 += NW * KT) {
    bf16x8 kr[N], vr[N];
    if constexpr (STAGES > 0) {
      // Tile j + STAGES - 1 goes into the slot tile j - 1 used; then tile j's group is complete.
      issue(t0 + (STAGES - 1) * NW * KT, stage == 0 ? STAGES - 1 : stage - 1);
      cp_async_commit();
      cp_async_wait<STAGES - 1>();
#pragma unroll
      for (int i = 0; i < N; ++i) {
        kr[i] = ring[((stage * 2) * N + i) * 32 + lane];
        vr[i] = ring[((stage * 2 + 1) * N + i) * 32 + lane];
      }
      stage = stage + 1 == STAGES ? 0 : stage + 1;
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int t = t0 + KPI * i + h;
        if (t < end) {
          const size_t off = (((size_t)bt[t / bs] * bs + t % bs) * nkv + kvh) * HD + c * 8;
          kr[i] = *reinterpret_cast<const bf16x8*>(k_cache + off);
          vr[i] = *reinterpret_cast<const bf16x8*>(v_cache + off);
        } else {
          kr[i] = zero8;
          vr[i] = zero8;
        }
      }
    }
    float sc[G][N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float kf[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) kf[e] = bf(kr[i].v[e]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d = fmaf(qr[g][e], kf[e], d);
        sc[g][i] = d;
      }
    }
    // Reduce-scatter: step st pairs lanes across bit (LPT/2 >> st) of c; the lane with the bit
    // set keeps the upper half of its scores. Afterwards sc[g][j] is key index ib + j.
#pragma unroll
    for (int st = 0; st < STEPS; ++st) {
      const int w = N >> (st + 1), mask = (LPT >> 1) >> st;
      const bool up = (lane & mask) != 0;
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int j = 0; j < w; ++j) {
          const float send = up ? sc[g][j] : sc[g][j + w];
          const float keep = up ? sc[g][j + w] : sc[g][j];
          sc[g][j] = keep + __shfl_xor_sync(FULL_MASK, send, mask);
        }
    }
#pragma unroll
    for (int mask = (LPT >> 1) >> STEPS; mask > 0; mask >>= 1)
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int j = 0; j < R; ++j) sc[g][j] += __shfl_xor_sync(FULL_MASK, sc[g][j], mask);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < R; ++j) {
        if (t0 + KPI * (ib + j) + h >= end) sc[g][j] = -INFINITY;
        mx = fmaxf(mx, sc[g][j]);
      }
      const float m_new = fmaxf(m[g], warp_max(mx));  // finite: key t0 is in every tile
      const float alpha = exp2f(m[g] - m_new);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const float p = exp2f(sc[g][j] - m_new);
        sum += p;
        if (owner) ps[warp][KPI * (ib + j) + h][g] = p;
      }
      l[g] = l[g] * alpha + warp_sum(owner ? sum : 0.f);
      m[g] = m_new;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float vf[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) vf[e] = bf(vr[i].v[e]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = ps[warp][KPI * i + h][g];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
      }
    }
    __syncwarp();  // ps is rewritten by the next tile
  }
  if constexpr (STAGES > 0) cp_async_wait<0>();  // copies of tiles past the end (zero-filled)
  // Lanes of the same dims (different keys) hold parts of one sum: same m within a warp.
#pragma unroll
  for (int mask = LPT; mask < 32; mask <<= 1)
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] += __shfl_xor_sync(FULL_MASK, acc[g][e], mask);
  if (h == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) wo[warp][g][c * 8 + e] = acc[g][e];
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      wm[warp][g] = m[g];
      wl[warp][g] = l[g];
    }
  }
  __syncthreads();
  for (int idx = tid; idx < G * HD; idx += NW * 32) {
    const int g = idx / HD, d = idx % HD;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, wm[w][g]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      if (wl[w][g] > 0.f) {  // warps without a tile hold m = -inf
        const float f = exp2f(wm[w][g] - M);
        num += f * wo[w][g][d];
        den += f * wl[w][g];
      }
    }
    const float o = num / den;  // den > 0: warp 0 always has key `start`
    if (nused == 1) {
      out[((size_t)tok * nq + kvh * G + g) * HD + d] = tobf(o);
    } else {
      const size_t row = ((size_t)s * nq + kvh * G + g) * NS + split;
      part_o[row * HD + d] = o;
      if (d == 0) part_lse[row] = M + log2f(den);
    }
  }
}

// One warp per (query head, sequence): out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M) over
// the splits in use. Sequences covered by one split were written by the attention kernel.
template <int HD, int N>
__device__ __forceinline__ void attn_flash_combine_impl(const float* __restrict__ part_o,
                                                        const float* __restrict__ part_lse, bf16* __restrict__ out,
                                                        const int* __restrict__ cu_q_lens,
                                                        const int* __restrict__ seq_lens,
                                                        const uint32_t* __restrict__ num_seqs, int nkv, int nq,
                                                        int grid_splits, int target) {
  const int s = blockIdx.y;
  const int lane = threadIdx.x & 31, hq = blockIdx.x * FLASH_WARPS + (threadIdx.x >> 5);
  const int ns = (int)*num_seqs, L = seq_lens[s], tok = cu_q_lens[s + 1] - 1;  // s < bucket <= max_seqs
  if (s >= ns || hq >= nq) return;
  const int chunk = flash_chunk(L, ns, grid_splits, nkv, target, flash_quantum(HD, N));
  const int nused = (L + chunk - 1) / chunk;  // <= grid_splits <= 32
  if (nused <= 1) return;
  // The merge is L2-latency-bound (at batch 1: 32 splits of 32 heads), so every load (the lane's
  // DPL dims of all splits, and the split's LSE) is issued before any is used.
  constexpr int DPL = HD >= 32 ? HD / 32 : 1;
  const bool active = lane * DPL < HD;
  const size_t row0 = ((size_t)s * nq + hq) * grid_splits;
  const float lse = lane < nused ? part_lse[row0 + lane] : -INFINITY;
  float v[32][DPL];
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const float* src = part_o + (row0 + k) * HD + lane * DPL;
    if (k < nused && active) {
      if constexpr (DPL == 4) {
        const float4 t = *reinterpret_cast<const float4*>(src);
        v[k][0] = t.x, v[k][1] = t.y, v[k][2] = t.z, v[k][3] = t.w;
      } else if constexpr (DPL == 2) {
        const float2 t = *reinterpret_cast<const float2*>(src);
        v[k][0] = t.x, v[k][1] = t.y;
      } else {
#pragma unroll
        for (int e = 0; e < DPL; ++e) v[k][e] = src[e];
      }
    } else {
#pragma unroll
      for (int e = 0; e < DPL; ++e) v[k][e] = 0.f;
    }
  }
  const float M = warp_max(lse);
  const float w = lane < nused ? exp2f(lse - M) : 0.f;
  const float inv = 1.f / warp_sum(w);
  float acc[DPL];
#pragma unroll
  for (int e = 0; e < DPL; ++e) acc[e] = 0.f;
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const float wi = __shfl_sync(FULL_MASK, w, k);  // 0 past nused
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[e] = fmaf(wi, v[k][e], acc[e]);
  }
  if (active) {
#pragma unroll
    for (int e = 0; e < DPL; ++e) out[((size_t)tok * nq + hq) * HD + lane * DPL + e] = tobf(acc[e] * inv);
  }
}

#define FLASH(NAME, HD, G, N, STAGES, MINB)                                                                     \
  extern "C" __global__ void __launch_bounds__(128, MINB) attn_##NAME##_hd##HD##_g##G(                         \
      const bf16* q, const bf16* kc, const bf16* vc, float* po, float* plse, bf16* out, const int* cu,          \
      const int* sl, const int* bt, const uint32_t* ns, int nkv, int bs, int mbps, float sc, int target) {      \
    attn_flash_impl<HD, G, N, STAGES>(q, kc, vc, po, plse, out, cu, sl, bt, ns, nkv, bs, mbps, sc, target);   \
  }
#define FLASH_COMBINE(NAME, HD, N)                                                                              \
  extern "C" __global__ void __launch_bounds__(128) attn_##NAME##_combine_hd##HD(                              \
      const float* po, const float* plse, bf16* out, const int* cu, const int* sl, const uint32_t* ns, int nkv, \
      int nq, int grid_splits, int target) {                                                                    \
    attn_flash_combine_impl<HD, N>(po, plse, out, cu, sl, ns, nkv, nq, grid_splits, target);                   \
  }
// The engine's decode attention, "flashq": 4 K + 4 V vectors per lane per tile through a 4-tile
// cp.async ring (64 KiB of dynamic shared memory). The template's other settings live in
// bench/kernels/flash_decode_variants.cu ("flash8", "flashq8": 8 + 8 vectors, never timed
// against flashq). Retired: "flash" (4 + 4 loaded into registers), slower at every batch
// (attention alone 0.36 vs 0.33 ms at batch 1, 21.1 vs 11.3 ms at 256, Llama-3-8B, context 1024:
// bench/results/archive/decode_h200_run5.json); "flashqc" (flashq with the combine folded into the last
// split) at most 0.6 % faster at batches 2-16 and slower from 32 up
// (bench/results/archive/gemm_tuning_h200_e3962d3_decode_flashqc.json).
#define FLASH_PER_HD(HD)                       \
  FLASH(flashq, HD, 1, 4, 4, 3)                \
  FLASH(flashq, HD, 2, 4, 4, 3)                \
  FLASH(flashq, HD, 3, 4, 4, 3)                \
  FLASH(flashq, HD, 4, 4, 4, 3)                \
  FLASH(flashq, HD, 5, 4, 4, 2)                \
  FLASH(flashq, HD, 6, 4, 4, 2)                \
  FLASH(flashq, HD, 7, 4, 4, 2)                \
  FLASH(flashq, HD, 8, 4, 4, 2)                \
  FLASH_COMBINE(flashq, HD, 4)
FLASH_PER_HD(16)
FLASH_PER_HD(32)
FLASH_PER_HD(64)
FLASH_PER_HD(128)
