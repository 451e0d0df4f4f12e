#pragma once
// Fused decode GEMVs (Forward's gemv_fusion; GEMV buckets only), for bf16 weights (model_kernels.cu) and
// FP8 weights (fp8.cu): the weight type is a traits class WT (Bf16W below, Fp8W in fp8.cu) giving the
// 16-byte vector, its load, the per-vector arithmetic and the weight loop; FP8 weights also scale each
// output row (WT::SCALED: acc * scale[n] once per output, before any rounding).
//
// The same weight stream as gemv_impl (one warp per R rows, 16-byte loads, the same per-row
// summation order), with the small kernels around the projections folded in:
//   F_NORM_IN:    X is the residual stream [NT, K] and nw the RMSNorm weight: each CTA first writes
//                 rmsnorm(X[t]) * nw to shared memory with add_rmsnorm's loop order and reduction
//                 (the same bf16 values), then streams W against it. The first weight vectors of its
//                 rows are loaded before that prologue, so the weight stream starts at once.
//   F_RESID_OUT:  Y is the residual stream: Y[t, n] = bf16(Y[t, n] + bf16(acc)), add_rmsnorm's add.
//                 Each element is read and written by one warp only: no race with other CTAs.
//   F_SWIGLU_OUT: W is [gate; up] (N = 2I rows). Warps 0-3 of a CTA take gate rows, warps 4-7 the
//                 matching up rows, and Y[t, j] = bf16(bf16(silu(bf16 g)) * bf16 u) ([NT, I], as swiglu).
//   F_ROPE_OUT:   W is the fused qkv projection (heads of hd rows). Warps 0-3 take rows j of a head,
//                 warps 4-7 rows j + hd/2, and the pair is finished as rope_kv_write does it without
//                 qk-norm: RoPE'd q -> q_out, RoPE'd k and plain v -> the KV cache slot of the token.
//                 Tokens past *num_tokens write nothing (their block table rows may be stale).
// Other bucket rows past the live token count are computed on stale data and never read.
// The weight loop (WT): U == 0 one vector of each row at a time (the compiler's schedule); U > 0 U stretches
// of each row loaded into registers, then used; PIPE > 0 a ring of PIPE stretches of each row in shared
// memory filled by cp.async (a lane reads back only what it loaded itself: no barrier), refilled as each is
// used, so the loads run on while the warp computes. The same per-lane order of k either way.
#include "common.cuh"

//   F_F32_OUT:    Y holds fp32 values (the LM head's logits): Y[t, n] = acc, no rounding (a float* passed
//                 as Y; plain kernels only).
enum { F_NORM_IN = 1, F_RESID_OUT = 2, F_SWIGLU_OUT = 4, F_ROPE_OUT = 8, F_F32_OUT = 16 };
// bf16 weight vectors per lane and row loaded before the norm prologue: 1 keeps the one-token kernels at
// 32 registers (8 CTAs/SM, as gemv_impl); 2 or more spill there. (WT::PREFETCH: FP8 loads U.)
constexpr int GEMV_PREFETCH = 1;

// F_ROPE_OUT's destinations and token data (a by-value kernel parameter; RopeArgs in forward.py).
struct RopeArgs {
  bf16* q_out;
  bf16* k_cache;
  bf16* v_cache;
  const float* cos_tab;
  const float* sin_tab;
  const int* positions;
  const int* cu_q_lens;
  const int* block_tables;
  const uint32_t* num_tokens;
  const uint32_t* num_seqs;
  int nq, nkv, hd, bs, mbps;
};

// cp.async of 16 bytes, global -> shared, bypassing L1 (WT::PIPE's weight ring); per-thread groups.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// bf16 weights: 8 values a vector; the weight loop of gemv_impl (unrolled 4, the compiler's schedule).
struct Bf16W {
  using T = bf16;
  using Vec = bf16x8;
  static constexpr int VALS = 8, U = 0, PREFETCH = GEMV_PREFETCH, PIPE = 0;
  static constexpr bool SCALED = false;
  static __device__ __forceinline__ Vec load(const T* __restrict__ W, size_t off) {
    return *reinterpret_cast<const bf16x8*>(W + off);
  }
  // acc[t][r] += the vector of row r against x[t, k:k+8] (xl(t, k, x) loads 8 values of token t)
  template <int NT, int R, typename XL>
  static __device__ __forceinline__ void step(const Vec (&wv)[R], int k, const XL& xl, float (&acc)[NT][R]) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float x[8];
      xl(t, k, x);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[t][r] += bf(wv[r].v[i]) * x[i];
    }
  }
};

template <int NT, int R, int F, typename WT>
__device__ __forceinline__ void gemv_fused_impl(const typename WT::T* __restrict__ W, const float* __restrict__ scales,
                                                const bf16* __restrict__ X, const bf16* __restrict__ nw,
                                                bf16* __restrict__ Y, int N, int K, float eps, const RopeArgs& ra) {
  using Vec = typename WT::Vec;
  constexpr int VALS = WT::VALS, STRIDE = 32 * VALS;  // a warp's stretch of one row: 512 bytes
  constexpr bool NORM = F & F_NORM_IN, SWIGLU = F & F_SWIGLU_OUT, ROPE = F & F_ROPE_OUT, PAIRS = SWIGLU || ROPE;
  constexpr int PF = NORM ? WT::PREFETCH : 0;
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  __shared__ float red[NT][32];
  __shared__ float hi_s[NT][4 * R];
  __shared__ long long tok_slot[NT];  // F_ROPE_OUT: KV slot of each bucket token, -1 past the live count
  __shared__ int tok_pos[NT];
  bf16* sx = reinterpret_cast<bf16*>(gemv_smem);  // F_NORM_IN: normalised x [NT, K]
  pdl_launch_dependents();  // the next GEMV may start its weight loads under this one (common.cuh)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // PAIRS: pair p (of N / 2) is rows lo(p), hi(p); this warp takes R consecutive pairs from p0.
  const int p0 = (blockIdx.x * 4 + (warp & 3)) * R;
  int n0, row_end;
  if constexpr (SWIGLU) {
    n0 = (warp >> 2) * (N / 2) + p0;
    row_end = (warp >> 2) * (N / 2) + N / 2;
  } else if constexpr (ROPE) {  // hd / 2 is a multiple of R: the R pairs share one head
    const int half = ra.hd / 2;
    n0 = (p0 / half) * ra.hd + p0 % half + (warp >> 2) * half;
    row_end = p0 < N / 2 ? N : 0;
  } else {
    n0 = (blockIdx.x * (blockDim.x >> 5) + warp) * R;
    row_end = N;
  }
  const bool live = n0 < row_end;
  float sc[R];  // WT::SCALED: the rows' scales, loaded with the first weights
  if constexpr (WT::SCALED) {
#pragma unroll
    for (int r = 0; r < R; ++r) sc[r] = live && n0 + r < row_end ? scales[n0 + r] : 0.f;
  }
  // WT::PIPE: the lane's slot of stage j for row r in the CTA's ring [PIPE][8 warps][R][32 lanes]
  auto pipe_slot = [&](int j, int r) { return ((j * 8 + warp) * R + r) * 32 + lane; };
  if constexpr (WT::PIPE > 0) {  // the first PIPE stretches of the rows start loading before the prologue
    if (live) {
      typename WT::Vec* ring = WT::template ring<R>();
#pragma unroll
      for (int j = 0; j < WT::PIPE; ++j) {
        const int k = lane * VALS + j * STRIDE;
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (k < K && n0 + r < row_end) cp_async16(&ring[pipe_slot(j, r)], W + (size_t)(n0 + r) * K + k);
        cp_async_commit();
      }
    }
  }
  Vec wpre[PF > 0 ? PF : 1][R];
  if constexpr (NORM) {
#pragma unroll
    for (int p = 0; p < PF; ++p)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int k = lane * VALS + p * STRIDE;
        if (live && k < K && n0 + r < row_end) wpre[p][r] = WT::load(W, (size_t)(n0 + r) * K + k);
      }
  }
  // Up to here only weights were read: under programmatic dependent launch all of the above overlaps
  // the kernel before, and everything below waits for it.
  pdl_wait();
  if constexpr (ROPE) {
    if (threadIdx.x < NT) {
      const int t = threadIdx.x;
      long long slot = -1;
      int pos = 0;
      if (t < (int)*ra.num_tokens) {
        pos = ra.positions[t];
        const int s = seq_of_token(ra.cu_q_lens, (int)*ra.num_seqs, t);
        slot = (long long)ra.block_tables[(size_t)s * ra.mbps + pos / ra.bs] * ra.bs + pos % ra.bs;
      }
      tok_slot[t] = slot;
      tok_pos[t] = pos;
    }
  }
  if constexpr (NORM) {
    float ss[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) ss[t] = 0.f;
    for (int v = threadIdx.x; v < K / 8; v += blockDim.x)
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        float x[8];
        load8(X + (size_t)t * K + v * 8, x);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss[t] += x[i] * x[i];
      }
    // block_sum for NT values at once (same order: warp_sum, then over warps)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float s = warp_sum(ss[t]);
      if (lane == 0) red[t][warp] = s;
    }
    __syncthreads();
    float rs[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) rs[t] = rsqrtf(warp_sum(lane < (int)(blockDim.x >> 5) ? red[t][lane] : 0.f) / K + eps);
    for (int v = threadIdx.x; v < K / 8; v += blockDim.x) {
      float g[8];
      load8(nw + v * 8, g);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        float x[8];
        load8(X + (size_t)t * K + v * 8, x);
        bf16x8 o;
#pragma unroll
        for (int i = 0; i < 8; ++i) o.v[i] = tobf(g[i] * rbf(x[i] * rs[t]));
        *reinterpret_cast<bf16x8*>(sx + t * K + v * 8) = o;
      }
    }
    __syncthreads();
  }
  float acc[NT][R];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
  auto xl = [&](int t, int k, float* x) {
    if constexpr (NORM) load8(sx + t * K + k, x);
    else load8(X + (size_t)t * K + k, x);
  };
  if (live) {
    int k = lane * VALS;
    if constexpr (PF > 0) {
#pragma unroll
      for (int p = 0; p < PF; ++p, k += STRIDE)
        if (k < K) WT::template step<NT, R>(wpre[p], k, xl, acc);
    }
    if constexpr (WT::PIPE > 0) {  // the ring: stretch j + PIPE is loading while stretch j is used
      typename WT::Vec* ring = WT::template ring<R>();
      for (int j = 0; k < K; ++j, k += STRIDE) {
        cp_async_wait<WT::PIPE - 1>();  // this lane's group j (stretch j of its rows) has landed
        Vec wv[R];
#pragma unroll
        for (int r = 0; r < R; ++r) wv[r] = n0 + r < row_end ? ring[pipe_slot(j % WT::PIPE, r)] : Vec{};
        WT::template step<NT, R>(wv, k, xl, acc);  // uses the values: the slot may be refilled
        const int kn = k + WT::PIPE * STRIDE;
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (kn < K && n0 + r < row_end)
            cp_async16(&ring[pipe_slot(j % WT::PIPE, r)], W + (size_t)(n0 + r) * K + kn);
        cp_async_commit();  // one group a stretch, empty ones too: the wait counts groups
      }
    } else if constexpr (WT::U == 0) {
#pragma unroll 4
      for (; k < K; k += STRIDE) {
        Vec wv[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (n0 + r < row_end) wv[r] = WT::load(W, (size_t)(n0 + r) * K + k);
        WT::template step<NT, R>(wv, k, xl, acc);
      }
    } else {  // WT::U stretches of each row loaded before the first is used: U * R vectors in flight a lane
      for (; k < K; k += WT::U * STRIDE) {
        Vec wv[WT::U][R];
#pragma unroll
        for (int u = 0; u < WT::U; ++u)
#pragma unroll
          for (int r = 0; r < R; ++r)
            wv[u][r] = k + u * STRIDE < K && n0 + r < row_end ? WT::load(W, (size_t)(n0 + r) * K + k + u * STRIDE)
                                                              : Vec{};
#pragma unroll
        for (int u = 0; u < WT::U; ++u)
          if (k + u * STRIDE < K) WT::template step<NT, R>(wv[u], k + u * STRIDE, xl, acc);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[t][r] = warp_sum(acc[t][r]);
      if constexpr (WT::SCALED) acc[t][r] *= sc[r];
    }
  if constexpr (PAIRS) {
    if (warp >= 4 && lane == 0)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int r = 0; r < R; ++r) hi_s[t][(warp & 3) * R + r] = acc[t][r];
    __syncthreads();
    if (warp < 4 && lane == 0 && live) {
      if constexpr (SWIGLU) {
        const int I = N / 2;
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int r = 0; r < R; ++r)
            if (n0 + r < I) {
              const float g = rbf(acc[t][r]), u = rbf(hi_s[t][(warp & 3) * R + r]);
              const float sg = rbf(g / (1.f + expf(-g)));
              Y[(size_t)t * I + n0 + r] = tobf(sg * u);
            }
      } else {
        const int hd = ra.hd, half = hd / 2, head = n0 / hd, f0 = n0 % hd;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const long long slot = tok_slot[t];
          if (slot < 0) continue;
          bf16* dst;
          if (head < ra.nq) dst = ra.q_out + ((size_t)t * ra.nq + head) * hd;
          else if (head < ra.nq + ra.nkv) dst = ra.k_cache + ((size_t)slot * ra.nkv + head - ra.nq) * hd;
          else dst = ra.v_cache + ((size_t)slot * ra.nkv + head - ra.nq - ra.nkv) * hd;
          const float* ct = ra.cos_tab + (size_t)tok_pos[t] * half;
          const float* st = ra.sin_tab + (size_t)tok_pos[t] * half;
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const int f = f0 + r;
            const float a = rbf(acc[t][r]), b = rbf(hi_s[t][(warp & 3) * R + r]);
            if (head >= ra.nq + ra.nkv) {
              dst[f] = tobf(a);
              dst[f + half] = tobf(b);
            } else {
              const float c = rbf(ct[f]), sn = rbf(st[f]);
              dst[f] = tobf(rbf(a * c) + rbf(-b * sn));
              dst[f + half] = tobf(rbf(b * c) + rbf(a * sn));
            }
          }
        }
      }
    }
  } else if (lane == 0 && live) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (n0 + r < N) {
          bf16* y = Y + (size_t)t * N + n0 + r;
          if constexpr (F & F_RESID_OUT) *y = tobf(bf(*y) + rbf(acc[t][r]));
          else if constexpr (F & F_F32_OUT) reinterpret_cast<float*>(Y)[(size_t)t * N + n0 + r] = acc[t][r];
          else *y = tobf(acc[t][r]);
        }
  }
}
