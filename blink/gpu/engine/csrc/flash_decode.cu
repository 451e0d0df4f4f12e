// Paged decode attention, flash-decoding style ("flashq" on CUDA cores, "flashmma" on tensor cores):
// one CTA of 4 warps per (context split, KV head, sequence), all G = nq/nkv query heads of the KV
// head at once, so every K/V byte is read from HBM once. KV layout: k_cache, v_cache
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
#include "kv_cache.cuh"

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

template <int HD, int G, int N, int STAGES, typename KV>
__device__ __forceinline__ void attn_flash_impl(const bf16* __restrict__ q, const typename KV::T* __restrict__ k_cache,
                                                const typename KV::T* __restrict__ v_cache, float* __restrict__ part_o,
                                                float* __restrict__ part_lse, bf16* __restrict__ out,
                                                const int* __restrict__ cu_q_lens, const int* __restrict__ seq_lens,
                                                const int* __restrict__ block_tables,
                                                const uint32_t* __restrict__ num_seqs, int nkv, int bs, int mbps,
                                                float scale_log2, int target) {
  pdl_launch_dependents();  // the projection after attention may start its weight loads (common.cuh)
  constexpr int LPT = HD / 8;         // lanes per key row
  constexpr int KPI = 32 / LPT;       // keys per warp-wide load
  constexpr int KT = N * KPI;         // keys per warp tile
  constexpr int NW = FLASH_WARPS;
  constexpr int LOG_LPT = ilog2c(LPT), LOG_N = ilog2c(N);
  constexpr int STEPS = LOG_N < LOG_LPT ? LOG_N : LOG_LPT;  // reduce-scatter steps
  constexpr int R = N >> STEPS;       // whole scores per lane afterwards
  constexpr int DUP = LOG_LPT - STEPS;  // log2(lanes holding a copy of the same score)
  static_assert((1 << LOG_N) == N && N <= 16, "N must be a power of two");
  // KvFp8 (kv_cache.cuh): the ring holds codes, a slot (stage, k|v) the tile's KT keys x HD bytes in
  // cache order, copied 16 bytes a cp.async by any lane (N / 2 per lane) and read back 8 bytes a lane
  // (bytes i * 256 + lane * 8: load i's key KPI * i + h, dims c * 8..) after a __syncwarp. Same bytes of
  // shared memory as the bf16 ring, so twice the tiles in flight.
  constexpr bool F8 = KV::PATH == 2 && STAGES > 0;
  constexpr int RS = F8 ? 2 * STAGES : STAGES;  // ring stages
  static_assert(!F8 || (N >= 2 && HD >= 16), "fp8 ring: N / 2 copies of 16 bytes per lane");
  if constexpr (F8) scale_log2 *= KV_SCALE;  // K's scale, folded into q
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
  unsigned char* ring8 = reinterpret_cast<unsigned char*>(ring);  // F8: slot (stage, kv) at (stage * 2 + kv) * N * 256
  auto issue = [&](int tt0, int stage) {
    if constexpr (F8) {
      unsigned char* kd = ring8 + (size_t)stage * 2 * N * 256;
#pragma unroll
      for (int u = 0; u < N / 2; ++u) {
        const int j = lane + 32 * u, t = tt0 + j / (HD / 16);  // chunk j: key j / (HD/16), bytes 16 (j % (HD/16))..
        const bool ok = t < end;
        const size_t off = ok ? (((size_t)bt[t / bs] * bs + t % bs) * nkv + kvh) * HD + (j % (HD / 16)) * 16 : 0;
        cp_async16(kd + 16 * j, k_cache + off, ok);
        cp_async16(kd + N * 256 + 16 * j, v_cache + off, ok);
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int t = tt0 + KPI * i + h;
      const bool ok = t < end;
      const size_t off = ok ? (((size_t)bt[t / bs] * bs + t % bs) * nkv + kvh) * HD + c * 8 : 0;
      if constexpr (KV::PATH == 0) {
        cp_async16(ring + ((stage * 2) * N + i) * 32 + lane, k_cache + off, ok);
        cp_async16(ring + ((stage * 2 + 1) * N + i) * 32 + lane, v_cache + off, ok);
      } else {
        kv_tile8(ring + ((stage * 2) * N + i) * 32 + lane, k_cache + off, ok);
        kv_tile8(ring + ((stage * 2 + 1) * N + i) * 32 + lane, v_cache + off, ok);
      }
    }
  };
  if constexpr (STAGES > 0) {
#pragma unroll
    for (int st = 0; st < RS - 1; ++st) {
      issue(start + warp * KT + st * NW * KT, st);
      cp_async_commit();
    }
  }
  int stage = 0;
  for (int t0 = start + warp * KT; t0 < end; t0 += NW * KT) {
    bf16x8 kr[N], vr[N];
    uint2 k8[N], v8[N];  // F8: the lane's 8 codes of each load
    if constexpr (STAGES > 0) {
      // Tile j + RS - 1 goes into the slot tile j - 1 used; then tile j's group is complete.
      issue(t0 + (RS - 1) * NW * KT, stage == 0 ? RS - 1 : stage - 1);
      cp_async_commit();
      cp_async_wait<RS - 1>();
      if constexpr (F8) {
        __syncwarp();  // the codes of a lane's load were copied by other lanes of the warp
        const unsigned char* kd = ring8 + (size_t)stage * 2 * N * 256 + lane * 8;
#pragma unroll
        for (int i = 0; i < N; ++i) {
          k8[i] = *reinterpret_cast<const uint2*>(kd + i * 256);
          v8[i] = *reinterpret_cast<const uint2*>(kd + N * 256 + i * 256);
        }
      } else {
#pragma unroll
        for (int i = 0; i < N; ++i) {
          kr[i] = ring[((stage * 2) * N + i) * 32 + lane];
          vr[i] = ring[((stage * 2 + 1) * N + i) * 32 + lane];
        }
      }
      stage = stage + 1 == RS ? 0 : stage + 1;
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int t = t0 + KPI * i + h;
        if (t < end) {
          const size_t off = (((size_t)bt[t / bs] * bs + t % bs) * nkv + kvh) * HD + c * 8;
          kr[i] = kv_load8(k_cache + off);
          vr[i] = kv_load8(v_cache + off);
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
      if constexpr (F8) {
        kv_f32x8(k8[i], kf);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) kf[e] = bf(kr[i].v[e]);
      }
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
      if constexpr (F8) {
        kv_f32x8(v8[i], vf);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) vf[e] = bf(vr[i].v[e]);
      }
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
    float o = num / den;  // den > 0: warp 0 always has key `start`
    if constexpr (F8) o *= KV_SCALE;  // V's scale
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
  pdl_launch_dependents();  // the projection after attention may start its weight loads (common.cuh)
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

#define FLASH_KV(NAME, HD, G, N, STAGES, MINB, T, KV, SUFFIX)                                                   \
  extern "C" __global__ void __launch_bounds__(128, MINB) attn_##NAME##_hd##HD##_g##G##SUFFIX(                 \
      const bf16* q, const T* kc, const T* vc, float* po, float* plse, bf16* out, const int* cu,                \
      const int* sl, const int* bt, const uint32_t* ns, int nkv, int bs, int mbps, float sc, int target) {      \
    attn_flash_impl<HD, G, N, STAGES, KV>(q, kc, vc, po, plse, out, cu, sl, bt, ns, nkv, bs, mbps, sc, target); \
  }
// Each decode kernel twice: over a bf16 cache and, suffixed _fp8kv, over an fp8 one (kv_cache.cuh's
// KvFp8Engine read policy).
#define FLASH(NAME, HD, G, N, STAGES, MINB)            \
  FLASH_KV(NAME, HD, G, N, STAGES, MINB, bf16, KvBf16, ) \
  FLASH_KV(NAME, HD, G, N, STAGES, MINB, kv8, KvFp8Engine, _fp8kv)
#define FLASH_COMBINE(NAME, HD, N)                                                                              \
  extern "C" __global__ void __launch_bounds__(128) attn_##NAME##_combine_hd##HD(                              \
      const float* po, const float* plse, bf16* out, const int* cu, const int* sl, const uint32_t* ns, int nkv, \
      int nq, int grid_splits, int target) {                                                                    \
    attn_flash_combine_impl<HD, N>(po, plse, out, cu, sl, ns, nkv, nq, grid_splits, target);                   \
  }
// The engine's decode attention below batch 128, "flashq": 4 K + 4 V vectors per lane per tile
// through a 4-tile cp.async ring (64 KiB of dynamic shared memory). The template's other settings
// live in bench/kernels/flash_decode_variants.cu ("flash8", "flashq8": 8 + 8 vectors); the variants
// that lost are in docs/decisions.md.
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
#ifndef KV_ATTENTION_TEMPLATES_ONLY  // bench/kernels/fp8kv_variants.cu instantiates its own
FLASH_PER_HD(16)
FLASH_PER_HD(32)
FLASH_PER_HD(64)
FLASH_PER_HD(128)
#endif

// ---- "flashmma": GQA decode attention on tensor cores (the engine's from batch 128) ---------------
// flashq does the G x keys dot products and the P V sums on CUDA cores in fp32 (per 8 keys per warp:
// 32 FMAs per lane each way, a reduce-scatter and two warp-wide softmax reductions), which costs
// about as many issue slots as the K/V bytes take to arrive at batch >= 128. Here the G query heads
// of a KV head are the rows of one m16n8k16 tile (rows >= G zero), as FlashAttention-2 does for
// prefill (prefill_attention.cu "fa2": same fragment layouts and ldmatrix addressing): per 64-key
// tile, loaded by the whole CTA with cp.async into a 2-stage ring, each of the 4 warps takes 16
// keys: S = Q K^T (8 mma), online softmax over a quad of lanes per row, O += P V (16 mma). Same
// grid, splits (flash_chunk with flashq's quantum) and partial-output layout as flashq, so flashq's
// combine kernel merges the splits (attention_launch.py FLASH_COMBINE_OF). Dynamic shared memory: Q 16 x (HD+8) + 2 x (K, V) 64 x (HD+8)
// bf16 (74 KiB at HD=128: 3 CTAs per SM).
__device__ __forceinline__ uint32_t mm_smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mm_ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(mm_smem(p)));
}
__device__ __forceinline__ void mm_ldsm4t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(mm_smem(p)));
}
__device__ __forceinline__ void mm_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t mm_pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
// KvFp8: the same tile on f16 operands (the decoded codes are exact in f16; Q converted once).
template <bool F16>
__device__ __forceinline__ void mm_mma_t(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (F16) {
    kv_mma_f16(d, a, b0, b1);
  } else {
    mm_mma(d, a, b0, b1);
  }
}

constexpr int MMA_BN = 64;  // keys per CTA tile (16 per warp)

__host__ __device__ constexpr int flashmma_smem(int hd) { return (16 + 4 * MMA_BN) * (hd + 8) * 2; }

template <int HD, int G, typename KV>
__device__ __forceinline__ void attn_flashmma_impl(const bf16* __restrict__ q, const typename KV::T* __restrict__ k_cache,
                                                   const typename KV::T* __restrict__ v_cache, float* __restrict__ part_o,
                                                   float* __restrict__ part_lse, bf16* __restrict__ out,
                                                   const int* __restrict__ cu_q_lens, const int* __restrict__ seq_lens,
                                                   const int* __restrict__ block_tables,
                                                   const uint32_t* __restrict__ num_seqs, int nkv, int bs, int mbps,
                                                   float scale_log2, int target) {
  pdl_launch_dependents();  // the projection after attention may start its weight loads (common.cuh)
  constexpr int LD = HD + 8, NK = HD / 16, ND = HD / 8, CH = HD / 8, NW = FLASH_WARPS;
  static_assert(G <= 8 && HD % 16 == 0, "rows g + 8 are padding: G <= 8");
  extern __shared__ __align__(128) unsigned char mm_smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(mm_smem_raw);  // [16][LD]
  bf16* Kst = Qs + 16 * LD;                        // [2][BN][LD]
  bf16* Vst = Kst + 2 * MMA_BN * LD;               // [2][BN][LD]
  // KvFp8: Q, K and V tiles in f16, one stage ([BN][LD] each, at Kst and Kst + BN * LD), fed from two
  // stages of K and V codes [2][BN][HD] bytes behind them (within flashmma_smem); each thread decodes
  // the 16-byte chunks it copied itself.
  constexpr bool F8 = KV::PATH == 2;
  constexpr int CH8 = HD / 16;  // 16-code chunks of a key row
  unsigned char* K8 = reinterpret_cast<unsigned char*>(Kst + 2 * MMA_BN * LD);  // [2][BN][HD]
  unsigned char* V8 = K8 + 2 * MMA_BN * HD;                                     // [2][BN][HD]
  if constexpr (F8) scale_log2 *= KV_SCALE;  // K's scale, once
  __shared__ float wm[NW][G], wl[NW][G];
  const int s = blockIdx.z;
  const int ns = (int)*num_seqs, L = seq_lens[s], tok = cu_q_lens[s + 1] - 1;
  if (s >= ns) return;
  const int split = blockIdx.x, kvh = blockIdx.y, nq = nkv * G, NS = gridDim.x;
  const int chunk = flash_chunk(L, ns, NS, nkv, target, flash_quantum(HD, 4));  // flashq's: its combine merges
  const int start = split * chunk;
  if (start >= L) return;
  const int end = min(L, start + chunk), nused = (L + chunk - 1) / chunk;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int* bt = block_tables + (size_t)s * mbps;
  for (int idx = tid; idx < 16 * CH; idx += NW * 32) {  // Q: rows G.. zero
    const int r = idx / CH, c = (idx % CH) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < G) v = *reinterpret_cast<const uint4*>(q + ((size_t)tok * nq + kvh * G + r) * HD + c);
    if constexpr (F8) v = kv_q_f16x8(v);
    *reinterpret_cast<uint4*>(Qs + r * LD + c) = v;
  }
  auto load_kv = [&](int stage, int kt) {
    if constexpr (F8) {
      for (int idx = tid; idx < MMA_BN * CH8; idx += NW * 32) {
        const int r = idx / CH8, c = (idx % CH8) * 16, key = kt + r;
        const bool ok = key < end;
        const int kk = ok ? key : start;
        const size_t off = (((size_t)bt[kk / bs] * bs + kk % bs) * nkv + kvh) * HD + c;
        cp_async16(K8 + (stage * MMA_BN + r) * HD + c, k_cache + off, ok);
        cp_async16(V8 + (stage * MMA_BN + r) * HD + c, v_cache + off, ok);
      }
      return;
    }
    bf16* Kd = Kst + stage * MMA_BN * LD;
    bf16* Vd = Vst + stage * MMA_BN * LD;
    for (int idx = tid; idx < MMA_BN * CH; idx += NW * 32) {
      const int r = idx / CH, c = (idx % CH) * 8, key = kt + r;
      const bool ok = key < end;
      const int kk = ok ? key : start;
      const size_t off = (((size_t)bt[kk / bs] * bs + kk % bs) * nkv + kvh) * HD + c;
      if constexpr (KV::PATH == 0) {
        cp_async16(Kd + r * LD + c, k_cache + off, ok);
        cp_async16(Vd + r * LD + c, v_cache + off, ok);
      } else {
        kv_tile8(Kd + r * LD + c, k_cache + off, ok);
        kv_tile8(Vd + r * LD + c, v_cache + off, ok);
      }
    }
  };
  const int n_tiles = (end - start + MMA_BN - 1) / MMA_BN;
  load_kv(0, start);
  cp_async_commit();
  uint32_t qf[NK][4];
  float o[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m = -INFINITY, l = 0.f;  // row g (rows g + 8 are padding)
  const int kw = warp * 16;      // this warp's keys in a tile
  for (int it = 0; it < n_tiles; ++it) {
    const int kt = start + it * MMA_BN, stage = it & 1;
    if (it + 1 < n_tiles) {
      load_kv(stage ^ 1, kt + MMA_BN);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    if constexpr (F8) {  // this thread's chunks of the tile's codes -> the f16 tiles (free since the last barrier)
      for (int idx = tid; idx < MMA_BN * CH8; idx += NW * 32) {
        const int r = idx / CH8, c = (idx % CH8) * 16, o8 = (stage * MMA_BN + r) * HD + c;
        uint4 lo, hi;
        kv_f16x16(*reinterpret_cast<const uint4*>(K8 + o8), lo, hi);
        *reinterpret_cast<uint4*>(Kst + r * LD + c) = lo;
        *reinterpret_cast<uint4*>(Kst + r * LD + c + 8) = hi;
        kv_f16x16(*reinterpret_cast<const uint4*>(V8 + o8), lo, hi);
        *reinterpret_cast<uint4*>(Kst + (MMA_BN + r) * LD + c) = lo;
        *reinterpret_cast<uint4*>(Kst + (MMA_BN + r) * LD + c + 8) = hi;
      }
    }
    __syncthreads();  // this tile (and Q) in shared memory
    if (it == 0) {
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) mm_ldsm4(qf[kk], Qs + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);
    }
    const bf16* Ks = Kst + (F8 ? 0 : stage) * MMA_BN * LD;
    const bf16* Vs = F8 ? Kst + MMA_BN * LD : Vst + stage * MMA_BN * LD;
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {  // keys kw..kw+7 (sc[0]) and kw+8..kw+15 (sc[1])
      uint32_t b[4];
      mm_ldsm4(b, Ks + (kw + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
      mm_mma_t<F8>(sc[0], qf[kk], b[0], b[1]);
      mm_mma_t<F8>(sc[1], qf[kk], b[2], b[3]);
    }
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // row g: elements 0, 1 (2, 3 are row g + 8: padding)
        const int key = kt + kw + n * 8 + 2 * t + e;
        sc[n][e] = key < end ? sc[n][e] * scale_log2 : -INFINITY;
        mx = fmaxf(mx, sc[n][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
    const float mn = fmaxf(m, mx), mu = mn == -INFINITY ? 0.f : mn;
    const float alpha = exp2f(m - mu);
    m = mn;
    l *= alpha;
#pragma unroll
    for (int n = 0; n < ND; ++n) {
      o[n][0] *= alpha;
      o[n][1] *= alpha;
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[n][e] = exp2f(sc[n][e] - mu);
        l += sc[n][e];
      }
    uint32_t pf[4];  // P (rows g, g + 8 = 0) as the A fragment of P V over the warp's 16 keys
    if constexpr (F8) {
      pf[0] = kv_pack_f16(sc[0][0], sc[0][1]);
      pf[2] = kv_pack_f16(sc[1][0], sc[1][1]);
    } else {
      pf[0] = mm_pack(sc[0][0], sc[0][1]);
      pf[2] = mm_pack(sc[1][0], sc[1][1]);
    }
    pf[1] = 0u;
    pf[3] = 0u;
#pragma unroll
    for (int n = 0; n < ND; n += 2) {
      uint32_t b[4];
      mm_ldsm4t(b, Vs + (kw + (lane & 7) + (((lane >> 3) & 1) << 3)) * LD + n * 8 + (lane >> 4) * 8);
      mm_mma_t<F8>(o[n], pf, b[0], b[1]);
      mm_mma_t<F8>(o[n + 1], pf, b[2], b[3]);
    }
    __syncthreads();  // every warp done with this stage before it is refilled
  }
  l += __shfl_xor_sync(FULL_MASK, l, 1);
  l += __shfl_xor_sync(FULL_MASK, l, 2);
  // merge the 4 warps' (m, l, O) of each row through shared memory (the K/V ring is free now)
  float* wo = reinterpret_cast<float*>(Kst);  // [NW][G][HD]
  if (g < G) {
#pragma unroll
    for (int n = 0; n < ND; ++n) {
      wo[(warp * G + g) * HD + n * 8 + 2 * t] = o[n][0];
      wo[(warp * G + g) * HD + n * 8 + 2 * t + 1] = o[n][1];
    }
    if (t == 0) {
      wm[warp][g] = m;
      wl[warp][g] = l;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < G * HD; idx += NW * 32) {
    const int r = idx / HD, d = idx % HD;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, wm[w][r]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      if (wl[w][r] > 0.f) {
        const float f = exp2f(wm[w][r] - M);
        num += f * wo[(w * G + r) * HD + d];
        den += f * wl[w][r];
      }
    }
    float ov = num / den;  // den > 0: warp 0 holds key `start`
    if constexpr (F8) ov *= KV_SCALE;  // V's scale
    if (nused == 1) {
      out[((size_t)tok * nq + kvh * G + r) * HD + d] = tobf(ov);
    } else {
      const size_t row = ((size_t)s * nq + kvh * G + r) * NS + split;
      part_o[row * HD + d] = ov;
      if (d == 0) part_lse[row] = M + log2f(den);
    }
  }
}

#define FLASHMMA_KV(HD, G, T, KV, SUFFIX)                                                                       \
  extern "C" __global__ void __launch_bounds__(128, 3) attn_flashmma_hd##HD##_g##G##SUFFIX(                    \
      const bf16* q, const T* kc, const T* vc, float* po, float* plse, bf16* out, const int* cu,                \
      const int* sl, const int* bt, const uint32_t* ns, int nkv, int bs, int mbps, float sc, int target) {      \
    attn_flashmma_impl<HD, G, KV>(q, kc, vc, po, plse, out, cu, sl, bt, ns, nkv, bs, mbps, sc, target);       \
  }
#define FLASHMMA(HD, G)         \
  FLASHMMA_KV(HD, G, bf16, KvBf16, ) \
  FLASHMMA_KV(HD, G, kv8, KvFp8Engine, _fp8kv)
#define FLASHMMA_PER_HD(HD) \
  FLASHMMA(HD, 1)             \
  FLASHMMA(HD, 2)             \
  FLASHMMA(HD, 3)             \
  FLASHMMA(HD, 4)             \
  FLASHMMA(HD, 5)             \
  FLASHMMA(HD, 6)             \
  FLASHMMA(HD, 7)             \
  FLASHMMA(HD, 8)
#ifndef KV_ATTENTION_TEMPLATES_ONLY
FLASHMMA_PER_HD(16)
FLASHMMA_PER_HD(32)
FLASHMMA_PER_HD(64)
FLASHMMA_PER_HD(128)
#endif
