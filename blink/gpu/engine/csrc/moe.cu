// Mixture-of-experts layer (Qwen3-MoE): router top-k, token -> expert permutation, grouped expert
// GEMMs and the weighted combine, all sized on the device so a captured graph serves any routing.
//
// One MoE layer of a step of T live tokens (*num_tokens), E experts, k picked per token, H hidden,
// I the expert's intermediate size; a "pair" is (token t, slot j), index p = t*k + j:
//
//   logits  [T, E] fp32      router GEMM output (cuBLAS / GEMV, as every other projection; moe_router_t<T>
//                            in graphs of at most 4 tokens)
//   moe_route        -> ids [T*k] int32, w [T*k] fp32: softmax over the bf16-rounded logits in fp32,
//                       the k largest in descending order, renormalised to sum 1 when norm_topk_prob,
//                       rounded to bf16 (transformers' Qwen3MoeTopKRouter, step for step)
//   moe_align        -> per expert its pair count cnt[e] and its first row off[e] in the sorted order,
//                       each expert's segment padded to a multiple of TILE_M rows (vLLM's
//                       moe_align_block_size); off[E] = rows in use; sorted[row] = pair; pos[pair] = row
//   moe_gate_up_m*   -> act [rows, I] bf16 = swiglu(x[token(row)] @ W_gu[e]^T) for real rows
//   moe_down_m*      -> y   [rows, H] bf16 = act[row] @ W_down[e]^T
//   moe_combine      -> out [T, H] bf16 = sum_j bf16(y[pos[t*k+j]] * w[t*k+j]), j = 0..k-1 in order
//
// Worst-case sizing (the Python side, blink/gpu/engine/moe_launch.py, allocates and launches with it): a
// tile is TILE_M consecutive rows of one expert, and the tiles of a step number at most
// min(T*k, (T*k + E*(TILE_M-1)) / TILE_M); the expert kernels' grid.y is that bound for the graph's
// token bucket and a block whose first row is >= off[E] returns at once.
//
// Expert paths, fixed per graph by its token bucket T (MoeLaunches picks; all give each row a result
// that depends only on its own input row, so within a graph the output does not depend on what else
// is in the batch; the combine sums a token's k slots in slot order, no float atomics):
//   pair  (T <= 4, decode)  no permutation: moe_pair_gate_up routes its token in one warp and streams
//                           the slot's expert, one block row per pair; moe_pair_down; each selected
//                           expert's weights are read once per token (batch 1: the GEMV over k experts)
//   tile GEMV (T < 64)      moe_route_align (one block) or moe_route + moe_align, then moe_gate_up_m16 /
//                           moe_down_m16: a block stages its tile's (<= 16) rows in shared memory and
//                           each warp streams whole weight rows with 16-byte loads, one weight row times
//                           every real row of the tile (fp32 accumulate, warp-shuffle reduction)
//   tensor cores (T >= 64)  moe_*_mma_m16, and 64-row tiles from 256 tokens (moe_align_m64,
//                           moe_*_mma_m64): WMMA 16x16x16, bf16 in, fp32 accumulate, the tile's row
//                           fragments sharing each weight fragment
// Rows past a tile's real count are neither computed nor written. Every MoE layer but the last
// combines with the next layer's add_rmsnorm (moe_combine_norm).
//
// FP8 experts (--quantization fp8; blink.models.fp8): each expert kernel also comes as <name>_fp8,
// the weights W as e4m3 codes (uint8, the same layout) with per-output-row scales S ([E, 2N] or
// [E, N] float32), the activations bf16 ("W8A16", blink.models.llama_numpy's expert definition): the
// same sums over the decoded codes (exact in fp32; the tensor-core variant decodes each warp's 16 x 16
// weight fragment into shared memory as bf16), each output multiplied by its row's scale once.
#include <mma.h>

#include "common.cuh"
#include "kv_cache.cuh"

using namespace nvcuda;

// ---------------------------------------------------------------------------------------- router
// One warp per token; E <= 32 * ROUTE_MAX_PER_LANE.
#define ROUTE_MAX_PER_LANE 8

// One warp routes one token: logits_t [E] -> ids_t [k], w_t [k] (global or shared memory).
__device__ __forceinline__ void route_token(const float* __restrict__ logits_t, int* ids_t, float* w_t, int lane, int E,
                                            int k, int norm_topk) {
  float v[ROUTE_MAX_PER_LANE];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i) {
    const int e = i * 32 + lane;
    v[i] = e < E ? rbf(logits_t[e]) : -INFINITY;  // the router's bf16 output
    mx = fmaxf(mx, v[i]);
  }
  mx = warp_max(mx);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i) {
    v[i] = (i * 32 + lane) < E ? expf(v[i] - mx) : -1.f;  // -1: never picked (probabilities are >= 0)
    s += v[i] > 0.f ? v[i] : 0.f;
  }
  s = warp_sum(s);
  const float inv = 1.f / s;
#pragma unroll
  for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i) v[i] = v[i] >= 0.f ? v[i] * inv : -1.f;
  float picked_sum = 0.f, my_p = 0.f;
  int my_id = 0;
  for (int j = 0; j < k; ++j) {
    float best = -2.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i)
      if (v[i] > best) best = v[i], bi = i * 32 + lane;  // ascending e per lane: ties keep the lower index
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(FULL_MASK, best, o);
      const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
      if (ob > best || (ob == best && oi < bi)) best = ob, bi = oi;
    }
    picked_sum += best;  // same order in every lane
    if (lane == j) my_p = best, my_id = bi;
    if ((bi & 31) == lane) {
#pragma unroll
      for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i)
        if (i == (bi >> 5)) v[i] = -1.f;
    }
  }
  if (lane < k) {
    const float w = norm_topk ? my_p / picked_sum : my_p;
    ids_t[lane] = my_id;
    w_t[lane] = rbf(w);  // transformers casts the routing weights to the model dtype
  }
}

extern "C" __global__ void moe_route(const float* __restrict__ logits, int* __restrict__ topk_ids,
                                     float* __restrict__ topk_w, const uint32_t* __restrict__ num_tokens, int E,
                                     int k, int norm_topk) {
  const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= (int)*num_tokens) return;
  route_token(logits + (size_t)t * E, topk_ids + t * k, topk_w + t * k, threadIdx.x & 31, E, k, norm_topk);
}

// ---------------------------------------------------------------------------------- permutation
// One block of 1024 threads; E <= 1024. Counts by shared-memory atomics, padded exclusive scan,
// then the scatter (each pair takes the next row of its expert's segment).
// topk_ids is read with __ldcg (L2, coherent): in moe_route_align this block wrote it before its barrier,
// and a read-only (non-coherent) load of it would be undefined.
template <int TM>
__device__ __forceinline__ void moe_align_impl(const int* topk_ids, const uint32_t* __restrict__ num_tokens,
                                               int k, int E, int* __restrict__ expert_off, int* __restrict__ expert_cnt,
                                               int* __restrict__ sorted_pair, int* __restrict__ pair_pos) {
  __shared__ int cnt[1024];
  __shared__ int cur[1024];
  __shared__ int warp_tot[32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n = (int)*num_tokens * k;
  for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int i = tid; i < n; i += blockDim.x) atomicAdd(&cnt[__ldcg(topk_ids + i)], 1);
  __syncthreads();
  // Exclusive scan of the padded counts over E (one value per thread, blockDim.x >= E).
  const int c = tid < E ? cnt[tid] : 0;
  const int padded = (c + TM - 1) / TM * TM;
  int incl = padded;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(FULL_MASK, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int wt = warp_tot[lane];
    int wi = wt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(FULL_MASK, wi, o);
      if (lane >= o) wi += y;
    }
    warp_tot[lane] = wi - wt;  // exclusive prefix of the warps' totals
  }
  __syncthreads();
  const int excl = warp_tot[warp] + incl - padded;
  if (tid < E) {
    cur[tid] = excl;
    expert_off[tid] = excl;
    expert_cnt[tid] = c;
    if (tid == E - 1) expert_off[E] = excl + padded;
  }
  __syncthreads();
  for (int i = tid; i < n; i += blockDim.x) {
    const int r = atomicAdd(&cur[__ldcg(topk_ids + i)], 1);
    sorted_pair[r] = i;
    pair_pos[i] = r;
  }
}

// --------------------------------------------------------------------------------- expert GEMVs
// Block: 8 warps, each owning COLS consecutive output columns (BN = 8 * COLS per block); grid
// (ceil(N / BN), max tiles). Dynamic shared memory: the tile's input rows, TM * K bf16.
#define MOE_WARPS 8
#define MOE_COLS 4

// Expert e of the tile starting at row0: the last e with off[e] <= row0 (empty experts share their
// successor's offset, so the last such e is the one whose segment holds row0).
__device__ __forceinline__ int expert_of_row(const int* __restrict__ off, int E, int row0) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (off[mid] <= row0) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The tile's nr (<= TM) staged rows xs [TM, K] times expert weights We ([2N, K] SWIGLU: gate rows then up
// rows, else [N, K]) into rows row0.. of Y [*, N]; the block's output columns by blockIdx.x.
// 8 weights from an expert row: bf16 values, or (FP8 experts) e4m3 codes decoded (exact).
__device__ __forceinline__ void load8_w(const bf16* p, float* out) { load8(p, out); }
__device__ __forceinline__ void load8_w(const kv8* p, float* out) {
  float f[8];
  kv_f32x8(*reinterpret_cast<const uint2*>(p), f);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = f[i];
}

// WT: bf16, or kv8 with Se the expert's row scales (FP8 experts).
template <int TM, bool SWIGLU, typename WT = bf16>
__device__ __forceinline__ void gemv_tile_body(const bf16* __restrict__ xs, const WT* __restrict__ We,
                                               bf16* __restrict__ Y, int row0, int nr, int N, int K,
                                               const float* __restrict__ Se = nullptr) {
  constexpr bool F8 = sizeof(WT) == 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kv = K / 8;
  for (int ci = 0; ci < MOE_COLS; ++ci) {
    const int col = (blockIdx.x * MOE_WARPS + warp) * MOE_COLS + ci;
    if (col >= N) break;
    const WT* wa = We + (size_t)col * K;
    const WT* wb = We + (size_t)(col + N) * K;  // the up row (SWIGLU only)
    float acc_a[TM], acc_b[TM];
#pragma unroll
    for (int r = 0; r < TM; ++r) acc_a[r] = acc_b[r] = 0.f;
    constexpr int UNROLL = TM == 1 ? 4 : 2;  // one row: registers to spare for more loads in flight
#pragma unroll UNROLL
    for (int v = lane; v < kv; v += 32) {
      float a[8], b[8];
      load8_w(wa + v * 8, a);
      if (SWIGLU) load8_w(wb + v * 8, b);
#pragma unroll
      for (int r = 0; r < TM; ++r) {
        if (r < nr) {
          float x[8];
          load8(xs + r * K + v * 8, x);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            acc_a[r] += a[i] * x[i];
            if (SWIGLU) acc_b[r] += b[i] * x[i];
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < TM; ++r) {
      if (r < nr) {
        float ya = warp_sum(acc_a[r]);
        if constexpr (F8) ya *= Se[col];
        if (SWIGLU) {
          float yb = warp_sum(acc_b[r]);
          if constexpr (F8) yb *= Se[col + N];
          if (lane == 0) {
            const float g = rbf(ya), u = rbf(yb);  // the gate_up GEMM's bf16 output
            Y[(size_t)(row0 + r) * N + col] = tobf(rbf(g / (1.f + expf(-g))) * u);
          }
        } else if (lane == 0) {
          Y[(size_t)(row0 + r) * N + col] = tobf(ya);
        }
      }
    }
  }
}

// SWIGLU: W is [E, 2N, K] = [gate; up] per expert and the output is swiglu (N columns);
// otherwise W is [E, N, K]. gather: the tile's input row r is X[sorted[row0 + r] / k] (tokens);
// else X[row0 + r] (the rows of the previous expert GEMM).
template <int TM, bool SWIGLU, typename WT = bf16>
__device__ __forceinline__ void moe_expert_impl(const bf16* __restrict__ X, const int* __restrict__ sorted_pair,
                                                const WT* __restrict__ W, bf16* __restrict__ Y,
                                                const int* __restrict__ expert_off,
                                                const int* __restrict__ expert_cnt, int E, int k, int N, int K,
                                                const float* __restrict__ S = nullptr) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* xs = reinterpret_cast<bf16*>(smem_raw);  // [TM, K]
  const int row0 = blockIdx.y * TM;
  if (row0 >= expert_off[E]) return;
  const int e = expert_of_row(expert_off, E, row0);
  const int nr = min(TM, expert_off[e] + expert_cnt[e] - row0);
  if (nr <= 0) return;
  const int kv = K / 8;
  for (int i = threadIdx.x; i < nr * kv; i += blockDim.x) {
    const int r = i / kv, v = i - r * kv;
    const int src = sorted_pair ? sorted_pair[row0 + r] / k : row0 + r;
    reinterpret_cast<bf16x8*>(xs + r * K)[v] = reinterpret_cast<const bf16x8*>(X + (size_t)src * K)[v];
  }
  __syncthreads();
  if constexpr (sizeof(WT) == 1) {
    gemv_tile_body<TM, SWIGLU, WT>(xs, W + (size_t)e * (SWIGLU ? 2 : 1) * N * K, Y, row0, nr, N, K,
                                   S + (size_t)e * (SWIGLU ? 2 : 1) * N);
  } else {
    gemv_tile_body<TM, SWIGLU>(xs, W + (size_t)e * (SWIGLU ? 2 : 1) * N * K, Y, row0, nr, N, K);
  }
}

// Decode fast path (graphs of at most MoeLaunches.pair_max_tokens tokens): no permutation, one block
// row per pair p = t * k + j, so each selected expert is read once per token. moe_pair_gate_up routes
// its token itself (a warp; every block of the token computes the same top-k from the same logits; the
// block at column 0 of slot 0 stores it for the down projection and the combine) and writes act row p;
// moe_pair_down writes y row p; the combine reads row t * k + j (pair_pos null).
//
// The pair GEMV (one input row xs, staged in shared memory before the call): blocks of PAIR_WARPS
// warps, each warp PAIR_COLS consecutive output columns (SWIGLU: their gate and up rows), grid
// (ceil(N / (PAIR_WARPS * PAIR_COLS)), T * k). A lane issues the 16-byte weight loads of all the warp's
// rows for U of its vectors (v = v0 + u * 32 + lane) before it uses any, held as raw uint4 (as bf16x8
// the predicated loads were unpacked at once into 8 registers each, which waited for each load in
// turn). One column at a time in 8-warp blocks left the step latency-bound at ~2 TB/s on the H200 (192
// gate_up blocks on 132 SMs; at most 3 loads in flight per lane of the down projection). Each output
// is gemv_tile_body's FMA chain: the lane's vectors in ascending order, their 8 elements in order,
// then warp_sum, so the pair path stays bit-identical to the tile GEMV path.
#define PAIR_WARPS 4
#define PAIR_COLS 4
// Vectors per lane per round (sm_90, nvcc 13.0): gate_up 2 x (gate, up) x PAIR_COLS = 16 loads in
// flight per lane at 120 registers (batch 1's 384 CTAs fit one wave at 4 CTAs/SM); down 2 x PAIR_COLS
// = 8 at 56 registers (its 1024 CTAs fit one wave at 9 CTAs/SM; 4 vectors: 94 registers, 1.6 waves).
#define PAIR_U_GATE_UP 2
#define PAIR_U_DOWN 2

// Element `hi` (0: low half, the lower address) of two bf16 packed in a 32-bit word, as a float: the
// exact conversion bf() does.
__device__ __forceinline__ float bf_of_pair(uint32_t q, int hi) {
  return __uint_as_float(hi ? q & 0xffff0000u : q << 16);
}

// Router logits of small steps (NT <= MoeLaunches' ROUTER_MAX_TOKENS tokens): Y [NT, N] fp32 = X W^T,
// a warp per router row (2 per block: N = 128 experts are 64 CTAs). A lane issues its loads of U weight
// vectors and their inputs (one token: all 8 of a 2048-wide row) before it uses any, so the whole
// router is read in about one round trip. The GEMV (model_kernels.cu) puts N = 128 rows on 128 warps
// at one token (gemv_f32_t1, 2 weight loads in flight per lane in its SASS) and on 32 warps from 2
// tokens (4 rows per warp): several round trips for the 512 KB of Qwen3-30B-A3B. Each output is gemv_impl's FMA
// chain (the lane's vectors k = lane*8 + 256 i in ascending order, their 8 elements in order, then
// warp_sum): bit-identical to gemv_f32_t1 on each token alone. Rows past *num_tokens are computed from
// the bucket's stale rows and never read, as the GEMV's.
#define ROUTER_WARPS 2

template <int NT>
__device__ __forceinline__ void moe_router_impl(const bf16* __restrict__ W, const bf16* __restrict__ X,
                                                float* __restrict__ Y, int N, int K) {
  constexpr int U = NT == 1 ? 8 : NT == 2 ? 4 : 2;  // vectors per lane per round: U weight, U * NT input loads
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * ROUTER_WARPS + (threadIdx.x >> 5);
  if (n >= N) return;
  const bf16* w = W + (size_t)n * K;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  for (int k0 = lane * 8; k0 < K; k0 += 256 * U) {
    uint4 wv[U], xv[U][NT];  // raw: converted only when used, so every load is in flight at once
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (k0 + u * 256 < K) {
        wv[u] = *reinterpret_cast<const uint4*>(w + k0 + u * 256);
#pragma unroll
        for (int t = 0; t < NT; ++t) xv[u][t] = *reinterpret_cast<const uint4*>(X + (size_t)t * K + k0 + u * 256);
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (k0 + u * 256 < K) {
        const uint32_t q[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const uint32_t xq[4] = {xv[u][t].x, xv[u][t].y, xv[u][t].z, xv[u][t].w};
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[t] += bf_of_pair(q[i / 2], i % 2) * bf_of_pair(xq[i / 2], i % 2);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float v = warp_sum(acc[t]);
    if (lane == 0) Y[(size_t)t * N + n] = v;
  }
}

#define MOE_ROUTER(NT)                                                                                           \
  extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32)                                               \
      moe_router_t##NT(const bf16* W, const bf16* X, float* Y, int N, int K) {                                  \
    moe_router_impl<NT>(W, X, Y, N, K);                                                                          \
  }
MOE_ROUTER(1)
MOE_ROUTER(2)
MOE_ROUTER(3)
MOE_ROUTER(4)

// A lane's vector of 8 weights: 16 bytes of bf16, 8 of e4m3 codes.
template <typename WT>
struct WVec {
  typedef uint4 T;
};
template <>
struct WVec<kv8> {
  typedef uint2 T;
};

// WT: bf16, or kv8 with Se the expert's row scales (FP8 experts).
template <bool SWIGLU, int U, typename WT = bf16>
__device__ __forceinline__ void pair_gemv(const bf16* __restrict__ xs, const WT* __restrict__ We,
                                          bf16* __restrict__ Y, int row, int N, int K,
                                          const float* __restrict__ Se = nullptr) {
  constexpr bool F8 = sizeof(WT) == 1;
  typedef typename WVec<WT>::T Vec;
  constexpr int R = SWIGLU ? 2 : 1;  // weight rows per output column: gate (col) and up (col + N)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int col0 = (blockIdx.x * PAIR_WARPS + warp) * PAIR_COLS;
  const int kv = K / 8;
  // Raw 16-byte vectors (4 registers each, converted only when used: held as bf16x8, the predicated
  // loads were unpacked into 8 registers each at once, which waited for the data and serialized them).
  Vec w[U][R][PAIR_COLS];
  auto issue = [&](int v0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * 32 + lane;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < PAIR_COLS; ++c)
          if (v < kv && col0 + c < N)
            w[u][r][c] = *reinterpret_cast<const Vec*>(We + (size_t)(col0 + c + r * N) * K + (size_t)v * 8);
    }
  };
  if (col0 >= N) return;
  issue(0);
  float acc[R][PAIR_COLS];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < PAIR_COLS; ++c) acc[r][c] = 0.f;
  for (int v0 = 0;;) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * 32 + lane;
      if (v < kv) {
        float x[8];
        load8(xs + v * 8, x);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int c = 0; c < PAIR_COLS; ++c)
            if (col0 + c < N) {
              if constexpr (F8) {
                float f[8];
                kv_f32x8(w[u][r][c], f);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][c] += f[i] * x[i];
              } else {
                const uint32_t q[4] = {w[u][r][c].x, w[u][r][c].y, w[u][r][c].z, w[u][r][c].w};
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][c] += bf_of_pair(q[i / 2], i % 2) * x[i];
              }
            }
      }
    }
    v0 += 32 * U;
    if (v0 >= kv) break;
    issue(v0);
  }
#pragma unroll
  for (int c = 0; c < PAIR_COLS; ++c) {
    if (col0 + c >= N) break;
    float ya = warp_sum(acc[0][c]);
    if constexpr (F8) ya *= Se[col0 + c];
    if (SWIGLU) {
      float yb = warp_sum(acc[R - 1][c]);
      if constexpr (F8) yb *= Se[col0 + c + N];
      if (lane == 0) {
        const float g = rbf(ya), u = rbf(yb);  // the gate_up GEMM's bf16 output
        Y[(size_t)row * N + col0 + c] = tobf(rbf(g / (1.f + expf(-g))) * u);
      }
    } else if (lane == 0) {
      Y[(size_t)row * N + col0 + c] = tobf(ya);
    }
  }
}

template <typename WT>
__device__ __forceinline__ void moe_pair_gate_up_impl(const float* __restrict__ logits, const bf16* __restrict__ X,
                                                      const WT* __restrict__ W, bf16* __restrict__ Y,
                                                      int* __restrict__ topk_ids, float* __restrict__ topk_w,
                                                      const uint32_t* __restrict__ num_tokens, int E, int k,
                                                      int norm_topk, int N, int K, const float* __restrict__ S) {
  extern __shared__ __align__(128) unsigned char pair_smem[];
  bf16* xs = reinterpret_cast<bf16*>(pair_smem);  // [1, K]
  __shared__ int s_ids[32];
  __shared__ float s_w[32];
  const int p = blockIdx.y, t = p / k, j = p - t * k;
  if (t >= (int)*num_tokens) return;
  if (threadIdx.x < 32) route_token(logits + (size_t)t * E, s_ids, s_w, threadIdx.x, E, k, norm_topk);
  for (int v = threadIdx.x; v < K / 8; v += blockDim.x)
    reinterpret_cast<bf16x8*>(xs)[v] = reinterpret_cast<const bf16x8*>(X + (size_t)t * K)[v];
  __syncthreads();  // xs staged, the slot's expert routed
  if (blockIdx.x == 0 && j == 0 && threadIdx.x < k) {
    topk_ids[t * k + threadIdx.x] = s_ids[threadIdx.x];
    topk_w[t * k + threadIdx.x] = s_w[threadIdx.x];
  }
  if constexpr (sizeof(WT) == 1) {
    pair_gemv<true, PAIR_U_GATE_UP, WT>(xs, W + (size_t)s_ids[j] * 2 * N * K, Y, p, N, K, S + (size_t)s_ids[j] * 2 * N);
  } else {
    pair_gemv<true, PAIR_U_GATE_UP>(xs, W + (size_t)s_ids[j] * 2 * N * K, Y, p, N, K);
  }
}

template <typename WT>
__device__ __forceinline__ void moe_pair_down_impl(const bf16* __restrict__ X, const WT* __restrict__ W,
                                                   bf16* __restrict__ Y, const int* __restrict__ topk_ids,
                                                   const uint32_t* __restrict__ num_tokens, int k, int N, int K,
                                                   const float* __restrict__ S) {
  extern __shared__ __align__(128) unsigned char pair_smem[];
  bf16* xs = reinterpret_cast<bf16*>(pair_smem);  // [1, K]
  const int p = blockIdx.y;
  if (p / k >= (int)*num_tokens) return;
  for (int v = threadIdx.x; v < K / 8; v += blockDim.x)
    reinterpret_cast<bf16x8*>(xs)[v] = reinterpret_cast<const bf16x8*>(X + (size_t)p * K)[v];
  __syncthreads();
  if constexpr (sizeof(WT) == 1) {
    pair_gemv<false, PAIR_U_DOWN, WT>(xs, W + (size_t)topk_ids[p] * N * K, Y, p, N, K, S + (size_t)topk_ids[p] * N);
  } else {
    pair_gemv<false, PAIR_U_DOWN>(xs, W + (size_t)topk_ids[p] * N * K, Y, p, N, K);
  }
}

extern "C" __global__ void __launch_bounds__(PAIR_WARPS * 32)
    moe_pair_gate_up(const float* __restrict__ logits, const bf16* __restrict__ X, const bf16* __restrict__ W,
                     bf16* __restrict__ Y, int* __restrict__ topk_ids, float* __restrict__ topk_w,
                     const uint32_t* __restrict__ num_tokens, int E, int k, int norm_topk, int N, int K) {
  moe_pair_gate_up_impl<bf16>(logits, X, W, Y, topk_ids, topk_w, num_tokens, E, k, norm_topk, N, K, nullptr);
}
extern "C" __global__ void __launch_bounds__(PAIR_WARPS * 32)
    moe_pair_gate_up_fp8(const float* __restrict__ logits, const bf16* __restrict__ X, const kv8* __restrict__ W,
                         const float* __restrict__ S, bf16* __restrict__ Y, int* __restrict__ topk_ids,
                         float* __restrict__ topk_w, const uint32_t* __restrict__ num_tokens, int E, int k,
                         int norm_topk, int N, int K) {
  moe_pair_gate_up_impl<kv8>(logits, X, W, Y, topk_ids, topk_w, num_tokens, E, k, norm_topk, N, K, S);
}

extern "C" __global__ void __launch_bounds__(PAIR_WARPS * 32)
    moe_pair_down(const bf16* __restrict__ X, const bf16* __restrict__ W, bf16* __restrict__ Y,
                  const int* __restrict__ topk_ids, const uint32_t* __restrict__ num_tokens, int k, int N, int K) {
  moe_pair_down_impl<bf16>(X, W, Y, topk_ids, num_tokens, k, N, K, nullptr);
}
extern "C" __global__ void __launch_bounds__(PAIR_WARPS * 32)
    moe_pair_down_fp8(const bf16* __restrict__ X, const kv8* __restrict__ W, const float* __restrict__ S,
                      bf16* __restrict__ Y, const int* __restrict__ topk_ids, const uint32_t* __restrict__ num_tokens,
                      int k, int N, int K) {
  moe_pair_down_impl<kv8>(X, W, Y, topk_ids, num_tokens, k, N, K, S);
}

// Tensor-core variant (graphs whose buckets put many rows in a tile: prefill, large decode batches):
// block per (tile, MMA_BN output columns); each warp one 16-column WMMA output slice (SWIGLU: its gate
// and its up columns) for the tile's TM / 16 row fragments, so each weight fragment loaded feeds every
// row fragment of the tile. The tile's rows are staged MMA_KC inputs at a time (row stride MMA_KC + 8:
// no bank conflicts); B comes straight from the expert's weight rows (col-major K x 16 = 16 rows of
// W); fp32 accumulators go through a per-warp shared buffer for the epilogue, one row fragment at a
// time. Row fragments wholly past the tile's count are skipped. Shared memory (MoeLaunches.smem):
// align128(TM * (MMA_KC + 8) * 2) + MOE_WARPS * 2 * 256 * 4 bytes. A row's result depends only on its
// own row (one MMA chain per output element).
#define MMA_BN (MOE_WARPS * 16)
#define MMA_KC 256
// FP8 experts: each warp decodes its 16 x 16 weight fragment (and the up fragment) into bf16 at
// wst [warps, 2, 16, MMA_LDB] behind cs (MoeLaunches.smem adds MOE_WARPS * 2 * 16 * MMA_LDB * 2 bytes),
// then loads it with load_matrix_sync; the row scales multiply the fp32 sums in the epilogue.
#define MMA_LDB 24

template <int TM, bool SWIGLU, typename WT = bf16>
__device__ __forceinline__ void moe_expert_mma_impl(const bf16* __restrict__ X, const int* __restrict__ sorted_pair,
                                                    const WT* __restrict__ W, bf16* __restrict__ Y,
                                                    const int* __restrict__ expert_off,
                                                    const int* __restrict__ expert_cnt, int E, int k, int N, int K,
                                                    const float* __restrict__ S = nullptr) {
  constexpr bool F8 = sizeof(WT) == 1;
  static_assert(TM % 16 == 0 && TM <= 64, "whole WMMA row fragments");
  constexpr int MF = TM / 16;
  constexpr int LDX = MMA_KC + 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* xs = reinterpret_cast<bf16*>(smem_raw);  // [TM, LDX]
  float* cs = reinterpret_cast<float*>(smem_raw + ((TM * LDX * 2 + 127) & ~127));  // [warps, 2, 256]
  __shared__ int src_row[TM];
  const int row0 = blockIdx.y * TM;
  if (row0 >= expert_off[E]) return;
  const int e = expert_of_row(expert_off, E, row0);
  const int nr = min(TM, expert_off[e] + expert_cnt[e] - row0);
  if (nr <= 0) return;
  const int nf = (nr + 15) / 16;  // row fragments holding real rows
  for (int r = threadIdx.x; r < TM; r += blockDim.x)
    src_row[r] = r < nr ? (sorted_pair ? sorted_pair[row0 + r] / k : row0 + r) : -1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int col0 = blockIdx.x * MMA_BN + warp * 16;
  const bool active = col0 < N;  // N % 16 == 0 (checked on the host); idle warps still stage rows
  const WT* We = W + (size_t)e * (SWIGLU ? 2 : 1) * N * K;
  const float* Se = F8 ? S + (size_t)e * (SWIGLU ? 2 : 1) * N : nullptr;
  bf16* wst = reinterpret_cast<bf16*>(cs + MOE_WARPS * 512) + warp * 2 * 16 * MMA_LDB;  // F8: this warp's
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> ca[MF], cb[MF];
#pragma unroll
  for (int f = 0; f < MF; ++f) {
    wmma::fill_fragment(ca[f], 0.f);
    wmma::fill_fragment(cb[f], 0.f);
  }
  wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b, bu;
  for (int kc = 0; kc < K; kc += MMA_KC) {
    const int kw = min(MMA_KC, K - kc), kv = kw / 8;
    __syncthreads();  // src_row written; the previous chunk consumed
    for (int i = threadIdx.x; i < nf * 16 * kv; i += blockDim.x) {
      const int r = i / kv, v = i - r * kv;
      bf16x8 val;
      if (src_row[r] >= 0) {
        val = reinterpret_cast<const bf16x8*>(X + (size_t)src_row[r] * K + kc)[v];
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) val.v[j] = tobf(0.f);  // rows past the tile's count: zeros, never written
      }
      *reinterpret_cast<bf16x8*>(xs + r * LDX + v * 8) = val;
    }
    __syncthreads();
    if (!active) continue;
#pragma unroll 2
    for (int k0 = 0; k0 < kw; k0 += 16) {
      if constexpr (F8) {  // lane: column lane / 2, inputs (lane % 2) * 8.. of the fragment
        const int c = lane >> 1, kh = (lane & 1) * 8;
        const WT* src = We + (size_t)(col0 + c) * K + kc + k0 + kh;
        __syncwarp();  // every lane has loaded the previous fragments
        *reinterpret_cast<bf16x8*>(wst + c * MMA_LDB + kh) = kv_decode8(*reinterpret_cast<const uint2*>(src));
        if (SWIGLU)
          *reinterpret_cast<bf16x8*>(wst + (16 + c) * MMA_LDB + kh) =
              kv_decode8(*reinterpret_cast<const uint2*>(src + (size_t)N * K));
        __syncwarp();
        wmma::load_matrix_sync(b, wst, MMA_LDB);
        if (SWIGLU) wmma::load_matrix_sync(bu, wst + 16 * MMA_LDB, MMA_LDB);
      } else {
        wmma::load_matrix_sync(b, We + (size_t)col0 * K + kc + k0, K);
        if (SWIGLU) wmma::load_matrix_sync(bu, We + (size_t)(col0 + N) * K + kc + k0, K);
      }
#pragma unroll
      for (int f = 0; f < MF; ++f) {
        if (f < nf) {
          wmma::load_matrix_sync(a, xs + f * 16 * LDX + k0, LDX);
          wmma::mma_sync(ca[f], a, b, ca[f]);
          if (SWIGLU) wmma::mma_sync(cb[f], a, bu, cb[f]);
        }
      }
    }
  }
  if (!active) return;
  float* c0 = cs + warp * 512;
#pragma unroll
  for (int f = 0; f < MF; ++f) {
    if (f >= nf) break;
    wmma::store_matrix_sync(c0, ca[f], 16, wmma::mem_row_major);
    if (SWIGLU) wmma::store_matrix_sync(c0 + 256, cb[f], 16, wmma::mem_row_major);
    __syncwarp();
    for (int i = lane; i < 256; i += 32) {
      const int r = f * 16 + (i >> 4), cc = i & 15;
      if (r >= nr) continue;
      float out;
      if constexpr (F8) {
        if (SWIGLU) {
          const float g = rbf(c0[i] * Se[col0 + cc]), u = rbf(c0[256 + i] * Se[N + col0 + cc]);
          out = rbf(g / (1.f + expf(-g))) * u;
        } else {
          out = c0[i] * Se[col0 + cc];
        }
      } else if (SWIGLU) {
        const float g = rbf(c0[i]), u = rbf(c0[256 + i]);
        out = rbf(g / (1.f + expf(-g))) * u;
      } else {
        out = c0[i];
      }
      Y[(size_t)(row0 + r) * N + col0 + cc] = tobf(out);
    }
    __syncwarp();
  }
}

// ------------------------------------------------------------------------------------- combine
// Block per token: out[t] = sum over slots j in order of bf16(y[pos[t*k+j]] * w[t*k+j]) (fp32 sum).
// A thread's loads of MOE_COMBINE_SLOTS slots are issued before any is used (a rolled loop waited for
// each slot's L2 round trip in turn: 8 in a row at top-8); the sum's order is the slot order.
#define MOE_COMBINE_SLOTS 8

// acc[i] = sum over j = 0..k-1 in order of bf16(y[row_j, 8v + i] * w_j), row_j = pos[t*k+j] (pair_pos
// null: the pair path's row t*k+j).
__device__ __forceinline__ void combine_slots(const bf16* __restrict__ y, const int* __restrict__ pair_pos,
                                              const float* __restrict__ topk_w, int t, int k, int H, int v,
                                              float* acc) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
  for (int j0 = 0; j0 < k; j0 += MOE_COMBINE_SLOTS) {
    int row[MOE_COMBINE_SLOTS];
    float w[MOE_COMBINE_SLOTS];
    bf16x8 yv[MOE_COMBINE_SLOTS];
#pragma unroll
    for (int u = 0; u < MOE_COMBINE_SLOTS; ++u)
      if (j0 + u < k) {
        row[u] = pair_pos ? pair_pos[t * k + j0 + u] : t * k + j0 + u;
        w[u] = topk_w[t * k + j0 + u];
      }
#pragma unroll
    for (int u = 0; u < MOE_COMBINE_SLOTS; ++u)
      if (j0 + u < k) yv[u] = reinterpret_cast<const bf16x8*>(y + (size_t)row[u] * H)[v];
#pragma unroll
    for (int u = 0; u < MOE_COMBINE_SLOTS; ++u)
      if (j0 + u < k) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += rbf(bf(yv[u].v[i]) * w[u]);
      }
  }
}
extern "C" __global__ void moe_combine(const bf16* __restrict__ y, const int* __restrict__ pair_pos,
                                       const float* __restrict__ topk_w, bf16* __restrict__ out,
                                       const uint32_t* __restrict__ num_tokens, int k, int H) {
  const int t = blockIdx.x;
  if (t >= (int)*num_tokens) return;
  for (int v = threadIdx.x; v < H / 8; v += blockDim.x) {
    float acc[8];
    combine_slots(y, pair_pos, topk_w, t, k, H, v, acc);
    bf16x8 o;
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = tobf(acc[i]);
    reinterpret_cast<bf16x8*>(out + (size_t)t * H)[v] = o;
  }
}

// The combine fused with the next layer's add_rmsnorm (every MoE layer but the last): residual +=
// bf16(combine), out = rmsnorm(residual) * w, with add_rmsnorm's rounding points (bit-identical to
// moe_combine into delta followed by add_rmsnorm). Block per token; the combined row stays in registers
// of the thread that owns its 8 columns between the two passes (H <= 8 * blockDim.x * MOE_NORM_VPT).
#define MOE_NORM_VPT 4

extern "C" __global__ void moe_combine_norm(const bf16* __restrict__ y, const int* __restrict__ pair_pos,
                                            const float* __restrict__ topk_w, bf16* __restrict__ residual,
                                            const bf16* __restrict__ w, bf16* __restrict__ out,
                                            const uint32_t* __restrict__ num_tokens, int k, int H, float eps) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (t >= (int)*num_tokens) return;
  bf16* r = residual + (size_t)t * H;
  float xs[MOE_NORM_VPT][8];
  float ss = 0.f;
#pragma unroll
  for (int q = 0; q < MOE_NORM_VPT; ++q) {
    const int v = threadIdx.x + q * blockDim.x;
    if (v >= H / 8) break;
    float acc[8];
    combine_slots(y, pair_pos, topk_w, t, k, H, v, acc);
    float x[8];
    load8(r + v * 8, x);
    bf16x8 o;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      xs[q][i] = rbf(x[i] + rbf(acc[i]));  // add_rmsnorm's residual + delta, delta = moe_combine's bf16
      o.v[i] = tobf(xs[q][i]);
      ss += xs[q][i] * xs[q][i];
    }
    *reinterpret_cast<bf16x8*>(r + v * 8) = o;
  }
  const float rs = rsqrtf(block_sum(ss, scratch) / H + eps);
#pragma unroll
  for (int q = 0; q < MOE_NORM_VPT; ++q) {
    const int v = threadIdx.x + q * blockDim.x;
    if (v >= H / 8) break;
    float g[8];
    load8(w + v * 8, g);
    bf16x8 o;
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = tobf(g[i] * rbf(xs[q][i] * rs));
    *reinterpret_cast<bf16x8*>(out + (size_t)t * H + v * 8) = o;
  }
}

// Kernels per tile height (the name carries it: Python launches moe_*_m<TILE_M>): the permutation for
// 16- and 64-row tiles, the tile GEMV for 16, the tensor-core kernels for both.
#define MOE_ALIGN(TM)                                                                                            \
  extern "C" __global__ void __launch_bounds__(1024) moe_align_m##TM(                                           \
      const int* topk_ids, const uint32_t* num_tokens, int k, int E, int* expert_off, int* expert_cnt,          \
      int* sorted_pair, int* pair_pos) {                                                                        \
    moe_align_impl<TM>(topk_ids, num_tokens, k, E, expert_off, expert_cnt, sorted_pair, pair_pos);              \
  }

/* Small steps: route (a warp per token) and align in one block, one launch fewer per layer. */
#define MOE_ROUTE_ALIGN(TM)                                                                                      \
  extern "C" __global__ void __launch_bounds__(1024) moe_route_align_m##TM(                                     \
      const float* logits, int* topk_ids, float* topk_w, const uint32_t* num_tokens, int E, int k,             \
      int norm_topk, int* expert_off, int* expert_cnt, int* sorted_pair, int* pair_pos) {                       \
    const int T = (int)*num_tokens;                                                                              \
    for (int t = threadIdx.x >> 5; t < T; t += blockDim.x >> 5)                                                 \
      route_token(logits + (size_t)t * E, topk_ids + t * k, topk_w + t * k, threadIdx.x & 31, E, k, norm_topk); \
    __syncthreads(); /* the block's global writes are visible to it after the barrier */                        \
    moe_align_impl<TM>(topk_ids, num_tokens, k, E, expert_off, expert_cnt, sorted_pair, pair_pos);              \
  }

#define MOE_GEMV(TM)                                                                                             \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_gate_up_m##TM(                               \
      const bf16* X, const int* sorted_pair, const bf16* W, bf16* Y, const int* expert_off,                     \
      const int* expert_cnt, int E, int k, int N, int K) {                                                      \
    moe_expert_impl<TM, true>(X, sorted_pair, W, Y, expert_off, expert_cnt, E, k, N, K);                        \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_down_m##TM(                                  \
      const bf16* X, const bf16* W, bf16* Y, const int* expert_off, const int* expert_cnt, int E, int N,       \
      int K) {                                                                                                   \
    moe_expert_impl<TM, false>(X, nullptr, W, Y, expert_off, expert_cnt, E, 1, N, K);                           \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_gate_up_m##TM##_fp8(                         \
      const bf16* X, const int* sorted_pair, const kv8* W, const float* S, bf16* Y, const int* expert_off,      \
      const int* expert_cnt, int E, int k, int N, int K) {                                                      \
    moe_expert_impl<TM, true, kv8>(X, sorted_pair, W, Y, expert_off, expert_cnt, E, k, N, K, S);                \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_down_m##TM##_fp8(                            \
      const bf16* X, const kv8* W, const float* S, bf16* Y, const int* expert_off, const int* expert_cnt,      \
      int E, int N, int K) {                                                                                     \
    moe_expert_impl<TM, false, kv8>(X, nullptr, W, Y, expert_off, expert_cnt, E, 1, N, K, S);                   \
  }

#define MOE_MMA(TM)                                                                                              \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_gate_up_mma_m##TM(                           \
      const bf16* X, const int* sorted_pair, const bf16* W, bf16* Y, const int* expert_off,                     \
      const int* expert_cnt, int E, int k, int N, int K) {                                                      \
    moe_expert_mma_impl<TM, true>(X, sorted_pair, W, Y, expert_off, expert_cnt, E, k, N, K);                    \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_down_mma_m##TM(                              \
      const bf16* X, const bf16* W, bf16* Y, const int* expert_off, const int* expert_cnt, int E, int N,       \
      int K) {                                                                                                   \
    moe_expert_mma_impl<TM, false>(X, nullptr, W, Y, expert_off, expert_cnt, E, 1, N, K);                       \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_gate_up_mma_m##TM##_fp8(                     \
      const bf16* X, const int* sorted_pair, const kv8* W, const float* S, bf16* Y, const int* expert_off,      \
      const int* expert_cnt, int E, int k, int N, int K) {                                                      \
    moe_expert_mma_impl<TM, true, kv8>(X, sorted_pair, W, Y, expert_off, expert_cnt, E, k, N, K, S);            \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_down_mma_m##TM##_fp8(                        \
      const bf16* X, const kv8* W, const float* S, bf16* Y, const int* expert_off, const int* expert_cnt,      \
      int E, int N, int K) {                                                                                     \
    moe_expert_mma_impl<TM, false, kv8>(X, nullptr, W, Y, expert_off, expert_cnt, E, 1, N, K, S);               \
  }

MOE_ALIGN(16)
MOE_ALIGN(64)
MOE_ROUTE_ALIGN(16)
MOE_GEMV(16)
MOE_MMA(16)
MOE_MMA(64)
