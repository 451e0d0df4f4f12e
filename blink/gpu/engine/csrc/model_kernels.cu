// Pointwise and row kernels of the Llama/Qwen3 forward pass, plus the small-batch GEMV.
//
// Rounding follows transformers' bf16 forward op by op (each torch op on bf16 tensors rounds
// its result to bf16), so the engine matches a bf16 HF model to bf16 noise, not just "close":
//   rmsnorm:  out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))      (x upcast to fp32)
//   residual: r = bf16(r + delta)
//   swiglu:   out = bf16(bf16(silu(g)) * u)
//   rope:     q' = bf16(bf16(q*cos) + bf16(rot(q)*sin)) with cos/sin rounded to bf16
// Layouts (row-major, T = packed tokens of the graph's bucket):
//   hidden   [T, H]                       bf16
//   qkv      [T, (nq + 2*nkv) * hd]       bf16 (fused projection output: q heads, k heads, v heads)
//   q_out    [T, nq, hd]                  bf16
//   k/v cache of one layer [num_blocks, block_size, nkv, hd] bf16
//   rope tables [max_pos, hd/2] fp32
#include "common.cuh"
#include "kv_cache.cuh"
#include "gemv_fused.cuh"

extern "C" __global__ void embed_tokens(const int* __restrict__ ids, const bf16* __restrict__ table,
                                        bf16* __restrict__ out, const uint32_t* __restrict__ num_tokens, int H) {
  const int t = blockIdx.x;
  if (t >= (int)*num_tokens) return;
  const bf16x8* src = reinterpret_cast<const bf16x8*>(table + (size_t)ids[t] * H);
  bf16x8* dst = reinterpret_cast<bf16x8*>(out + (size_t)t * H);
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) dst[i] = src[i];
}

// residual (+)= delta; out = rmsnorm(residual) * w. delta == nullptr: no add (first layer).
// Block of 256 threads per token row; thread i owns the 8-value vectors i, i + 256, ... (its sum of
// squares runs over them in that order, then block_sum: the reduction order every engine path and
// moe_combine_norm share, kept so that all of them stay bit-identical). Up to ADD_RMSNORM_VPT
// vectors a thread (H <= 6144 at 256 threads) the row stays in registers: every load of the row
// (residual, delta, w) is issued before the first use, one memory latency instead of two serial
// passes that re-read the residual; longer rows loop as before. VPT 3 costs 86 registers (2 blocks
// an SM: the whole grid of a decode step of <= 264 tokens is resident at once anyway); 4 took 120.
constexpr int ADD_RMSNORM_VPT = 3;

template <int VPT>
__device__ __forceinline__ void add_rmsnorm_regs(bf16* __restrict__ r, const bf16* __restrict__ d,
                                                 const bf16* __restrict__ w, bf16* __restrict__ o, int H,
                                                 float eps, float* scratch) {
  const int nv = H / 8;
  bf16x8 xv[VPT], dv[VPT], wv[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v < nv) {
      xv[j] = *reinterpret_cast<const bf16x8*>(r + v * 8);
      if (d != nullptr) dv[j] = *reinterpret_cast<const bf16x8*>(d + v * 8);
      wv[j] = *reinterpret_cast<const bf16x8*>(w + v * 8);
    }
  }
  float ss = 0.f;  // the row stays in bf16 (xv): every value it takes is bf16 already
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v >= nv) continue;
    if (d != nullptr) {
#pragma unroll
      for (int i = 0; i < 8; ++i) xv[j].v[i] = tobf(bf(xv[j].v[i]) + bf(dv[j].v[i]));
      *reinterpret_cast<bf16x8*>(r + v * 8) = xv[j];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x = bf(xv[j].v[i]);
      ss += x * x;
    }
  }
  const float rs = rsqrtf(block_sum(ss, scratch) / H + eps);
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v >= nv) continue;
    bf16x8 out;
#pragma unroll
    for (int i = 0; i < 8; ++i) out.v[i] = tobf(bf(wv[j].v[i]) * rbf(bf(xv[j].v[i]) * rs));
    *reinterpret_cast<bf16x8*>(o + v * 8) = out;
  }
}

// add_rmsnorm's row loop (rows whose vectors do not fit add_rmsnorm_regs; all of add_rmsnorm_rows): two passes
// over the row, the second re-reading the residual it wrote.
__device__ __forceinline__ void add_rmsnorm_loop(bf16* __restrict__ r, const bf16* __restrict__ d,
                                                 const bf16* __restrict__ w, bf16* __restrict__ o, int H, float eps,
                                                 float* scratch) {
  float ss = 0.f;
  for (int v = threadIdx.x; v < H / 8; v += blockDim.x) {
    float x[8];
    load8(r + v * 8, x);
    if (d != nullptr) {
      float dd[8];
      load8(d + v * 8, dd);
      bf16x8 s;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        x[i] = rbf(x[i] + dd[i]);
        s.v[i] = tobf(x[i]);
      }
      *reinterpret_cast<bf16x8*>(r + v * 8) = s;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += x[i] * x[i];
  }
  const float rs = rsqrtf(block_sum(ss, scratch) / H + eps);
  for (int v = threadIdx.x; v < H / 8; v += blockDim.x) {
    float x[8], g[8];
    load8(r + v * 8, x);
    load8(w + v * 8, g);
    bf16x8 s;
#pragma unroll
    for (int i = 0; i < 8; ++i) s.v[i] = tobf(g[i] * rbf(x[i] * rs));
    *reinterpret_cast<bf16x8*>(o + v * 8) = s;
  }
}

extern "C" __global__ void __launch_bounds__(256) add_rmsnorm(bf16* __restrict__ residual,
                                                              const bf16* __restrict__ delta,
                                                              const bf16* __restrict__ w, bf16* __restrict__ out,
                                                              const uint32_t* __restrict__ num_tokens, int H,
                                                              float eps) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (t >= (int)*num_tokens) return;
  bf16* r = residual + (size_t)t * H;
  const bf16* d = delta != nullptr ? delta + (size_t)t * H : nullptr;
  bf16* o = out + (size_t)t * H;
  const int vpt = (H / 8 + blockDim.x - 1) / blockDim.x;
  switch (vpt) {  // uniform over the grid: H and blockDim are launch constants
    case 1: add_rmsnorm_regs<1>(r, d, w, o, H, eps, scratch); return;
    case 2: add_rmsnorm_regs<2>(r, d, w, o, H, eps, scratch); return;
    case ADD_RMSNORM_VPT: add_rmsnorm_regs<ADD_RMSNORM_VPT>(r, d, w, o, H, eps, scratch); return;
    default: break;
  }
  add_rmsnorm_loop(r, d, w, o, H, eps, scratch);
}

// Final norm of the last token of each sequence: out[s] = rmsnorm(residual[row] + delta[row]) * w,
// row = cu_q_lens[s+1]-1. Only these rows feed the LM head. delta == nullptr: residual is complete
// (the fused decode path adds each projection into it in the GEMV).
extern "C" __global__ void final_norm_gather(const bf16* __restrict__ residual, const bf16* __restrict__ delta,
                                             const bf16* __restrict__ w, bf16* __restrict__ out,
                                             const int* __restrict__ cu_q_lens, const uint32_t* __restrict__ num_seqs,
                                             int H, float eps) {
  __shared__ float scratch[32];
  const int s = blockIdx.x;
  if (s >= (int)*num_seqs) return;
  const size_t row = (size_t)(cu_q_lens[s + 1] - 1) * H;
  sum_rmsnorm_row(residual + row, delta != nullptr ? delta + row : nullptr, w, out + (size_t)s * H, H, eps, scratch);
}

// Sequence that owns packed token t, found by the whole warp (every lane gets it): the largest s
// in [0, num_seqs) with cu[s] <= t, as seq_of_token, in 32-way steps (one load round per factor of
// 32 sequences instead of one per factor of 2: 2 dependent loads at 1024 sequences, not 10).
__device__ __forceinline__ int warp_seq_of_token(const int* __restrict__ cu, int num_seqs, int t) {
  const int lane = threadIdx.x & 31;
  int lo = 0, hi = num_seqs - 1;  // the answer lies in [lo, hi]; cu[lo] <= t
  while (lo < hi) {
    const int stride = (hi - lo + 32) >> 5;  // ceil((hi - lo + 1) / 32)
    const int p = lo + lane * stride;
    const unsigned below = __ballot_sync(FULL_MASK, p <= hi && cu[p] <= t);  // a prefix of the lanes
    lo += (31 - __clz(below)) * stride;
    hi = min(hi, lo + stride - 1);
  }
  return lo;
}

// rope_kv_write: thread per (token, head, 8-pair unit): a head of hd values is hd / 16 threads,
// each holding 8 values of its first half and the 8 they rotate with (16-byte loads and stores).
// A block takes HPB consecutive (token, head) pairs of the packed [T, nh] order (HPB = blockDim.x /
// (hd / 16), set by the launch; blockDim.x a multiple of 32). Q heads: [qk-norm], RoPE -> q_out;
// K heads: [qk-norm], RoPE -> the token's k cache slot; V heads -> its v cache slot. The slot of
// token t of sequence s at position p is block_tables[s][p / block_size] * block_size + p % bs.
// The loads of the row and of the cos/sin at the token's position are issued first; meanwhile warp
// w finds the sequence and slot of the block's w-th token (warp_seq_of_token) into shared memory.
// qk-norm: the block's rows are staged in shared memory and a warp per head sums the squares in
// the lane order of the per-head warp it replaced (lane l: values l, l + 32, ...; then warp_sum),
// so rs, and every value, is bit-identical to it. Per value, the rounding sequence is
//   [a = bf16(w * bf16(a * rs))], q' = bf16(bf16(a*cos) + bf16(-b*sin)), with cos/sin rounded to bf16.
constexpr int ROPE_THREADS = 256;               // most threads of a block (the launch may use fewer)
constexpr int ROPE_MAX_TOKENS = ROPE_THREADS / 3 + 2;  // tokens one block can touch (nh >= 3)

template <typename KV>
__device__ __forceinline__ void rope_kv_write_impl(
    const bf16* __restrict__ qkv, bf16* __restrict__ q_out, KV* __restrict__ k_cache, KV* __restrict__ v_cache,
    const bf16* __restrict__ q_norm_w, const bf16* __restrict__ k_norm_w, const float* __restrict__ cos_tab,
    const float* __restrict__ sin_tab, const int* __restrict__ positions, const int* __restrict__ cu_q_lens,
    const int* __restrict__ block_tables, const uint32_t* __restrict__ num_tokens, const uint32_t* __restrict__ num_seqs,
    int nq, int nkv, int hd, int bs, int mbps, float eps) {
  __shared__ long long tok_slot[ROPE_MAX_TOKENS];  // KV slot of the block's tokens, from its first
  __shared__ float head_rs[ROPE_THREADS];          // qk-norm: 1 / rms of each head of the block
  __shared__ __align__(16) bf16 rows[ROPE_THREADS * 16];  // qk-norm: the block's heads [HPB, hd]
  const int nh = nq + 2 * nkv, half = hd / 2, upc = hd / 16, hpb = blockDim.x / upc;
  const int ntok = (int)*num_tokens;
  const int g0 = blockIdx.x * hpb;  // first (token, head) of the block
  const int t0 = g0 / nh;
  if (t0 >= ntok) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int hl = threadIdx.x / upc, f = (threadIdx.x % upc) * 8;  // head of the block, first value
  const int t = (g0 + hl) / nh, h = (g0 + hl) % nh;
  const bool live = t < ntok;
  const bool is_v = h >= nq + nkv, is_q = h < nq;
  const bf16* nwt = is_q ? q_norm_w : k_norm_w;
  const bool norm = !is_v && nwt != nullptr;
  bf16x8 lo, hi, nlo, nhi;
  float c[8], sn[8];
  if (live) {
    const bf16* src = qkv + ((size_t)t * nh + h) * hd;
    lo = *reinterpret_cast<const bf16x8*>(src + f);
    hi = *reinterpret_cast<const bf16x8*>(src + f + half);
    if (!is_v) {
      const int pos = positions[t];
      const float4* ct = reinterpret_cast<const float4*>(cos_tab + (size_t)pos * half + f);
      const float4* st = reinterpret_cast<const float4*>(sin_tab + (size_t)pos * half + f);
      const float4 c0 = ct[0], c1 = ct[1], s0 = st[0], s1 = st[1];
      c[0] = c0.x, c[1] = c0.y, c[2] = c0.z, c[3] = c0.w, c[4] = c1.x, c[5] = c1.y, c[6] = c1.z, c[7] = c1.w;
      sn[0] = s0.x, sn[1] = s0.y, sn[2] = s0.z, sn[3] = s0.w, sn[4] = s1.x, sn[5] = s1.y, sn[6] = s1.z, sn[7] = s1.w;
    }
  }
  const int t_end = min((g0 + hpb - 1) / nh + 1, ntok);  // the block's tokens: [t0, t_end)
  const int ns = (int)*num_seqs;
  for (int i = warp; t0 + i < t_end; i += nw) {
    const int pos = positions[t0 + i];  // loaded beside the search, not after it
    const int s = warp_seq_of_token(cu_q_lens, ns, t0 + i);
    if (lane == 0) tok_slot[i] = (long long)block_tables[(size_t)s * mbps + pos / bs] * bs + pos % bs;
  }
  if (q_norm_w != nullptr || k_norm_w != nullptr) {
    if (live) {
      *reinterpret_cast<bf16x8*>(rows + hl * hd + f) = lo;
      *reinterpret_cast<bf16x8*>(rows + hl * hd + f + half) = hi;
    }
    __syncthreads();
    for (int j = warp; j < hpb; j += nw) {  // the per-head warp's sum, in its order
      const int hj = (g0 + j) % nh;
      if ((g0 + j) / nh >= ntok || hj >= nq + nkv || (hj < nq ? q_norm_w : k_norm_w) == nullptr) continue;
      float ss = 0.f;
      for (int i = lane; i < hd; i += 32) {
        const float v = bf(rows[j * hd + i]);
        ss += v * v;
      }
      const float rs = rsqrtf(warp_sum(ss) / hd + eps);
      if (lane == 0) head_rs[j] = rs;
    }
  }
  __syncthreads();
  if (!live) return;
  const size_t slot = is_q ? 0 : (size_t)tok_slot[t - t0];
  if (is_v) {
    KV* dst = v_cache + (slot * nkv + (h - nq - nkv)) * hd;
    kv_store8(dst + f, lo);
    kv_store8(dst + f + half, hi);
    return;
  }
  const float rs = norm ? head_rs[hl] : 0.f;
  if (norm) {  // loaded late: holding them across the search costs registers (64 a thread: 4 blocks an SM)
    nlo = *reinterpret_cast<const bf16x8*>(nwt + f);
    nhi = *reinterpret_cast<const bf16x8*>(nwt + f + half);
  }
  bf16x8 olo, ohi;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float a = bf(lo.v[i]), b = bf(hi.v[i]);
    if (norm) {
      a = rbf(bf(nlo.v[i]) * rbf(a * rs));
      b = rbf(bf(nhi.v[i]) * rbf(b * rs));
    }
    const float cr = rbf(c[i]), sr = rbf(sn[i]);
    olo.v[i] = tobf(rbf(a * cr) + rbf(-b * sr));
    ohi.v[i] = tobf(rbf(b * cr) + rbf(a * sr));
  }
  if constexpr (sizeof(KV) == 2) {  // the bf16 cache: q and k through one pointer, as before the template
    bf16* dst = is_q ? q_out + ((size_t)t * nq + h) * hd : k_cache + (slot * nkv + (h - nq)) * hd;
    *reinterpret_cast<bf16x8*>(dst + f) = olo;
    *reinterpret_cast<bf16x8*>(dst + f + half) = ohi;
  } else if (is_q) {
    bf16* dst = q_out + ((size_t)t * nq + h) * hd;
    *reinterpret_cast<bf16x8*>(dst + f) = olo;
    *reinterpret_cast<bf16x8*>(dst + f + half) = ohi;
  } else {
    KV* dst = k_cache + (slot * nkv + (h - nq)) * hd;
    kv_store8(dst + f, olo);
    kv_store8(dst + f + half, ohi);
  }
}

#define ROPE_KV_WRITE(NAME, KV)                                                                                   \
  extern "C" __global__ void __launch_bounds__(ROPE_THREADS, 4)                                                   \
      NAME(const bf16* __restrict__ qkv, bf16* __restrict__ q_out, KV* __restrict__ k_cache,                     \
           KV* __restrict__ v_cache, const bf16* __restrict__ q_norm_w, const bf16* __restrict__ k_norm_w,        \
           const float* __restrict__ cos_tab, const float* __restrict__ sin_tab, const int* __restrict__ positions, \
           const int* __restrict__ cu_q_lens, const int* __restrict__ block_tables,                                \
           const uint32_t* __restrict__ num_tokens, const uint32_t* __restrict__ num_seqs, int nq, int nkv, int hd, \
           int bs, int mbps, float eps) {                                                                          \
    rope_kv_write_impl<KV>(qkv, q_out, k_cache, v_cache, q_norm_w, k_norm_w, cos_tab, sin_tab, positions,         \
                           cu_q_lens, block_tables, num_tokens, num_seqs, nq, nkv, hd, bs, mbps, eps);            \
  }
ROPE_KV_WRITE(rope_kv_write, bf16)
ROPE_KV_WRITE(rope_kv_write_fp8kv, kv8)  // --kv-cache-dtype fp8

// add_rmsnorm for steps of many tokens (forward.norm_kernel): the same sums in the same order as
// add_rmsnorm (bit-identical), a row per block in a loop of 16-byte loads with few registers, so more
// blocks stay resident than add_rmsnorm's register-held rows allow (the faster one from 1024 tokens).
extern "C" __global__ void add_rmsnorm_rows(bf16* __restrict__ residual, const bf16* __restrict__ delta,
                                       const bf16* __restrict__ w, bf16* __restrict__ out,
                                       const uint32_t* __restrict__ num_tokens, int H, float eps) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (t >= (int)*num_tokens) return;
  add_rmsnorm_loop(residual + (size_t)t * H, delta != nullptr ? delta + (size_t)t * H : nullptr, w,
                   out + (size_t)t * H, H, eps, scratch);
}

// rope_kv_write for steps of few tokens (forward.rope_kernel): bit-identical to it, a warp per head, no
// shared-memory staging (the faster one for few tokens). Grid (token, head group). Q heads: [qk-norm], RoPE -> q_out. K heads:
// [qk-norm], RoPE -> k cache slot. V heads -> v cache slot. The slot of token t of sequence s at
// position p is block_tables[s][p / block_size] * block_size + p % block_size.
template <typename KV>
__device__ __forceinline__ void rope_kv_write_warp_impl(
    const bf16* __restrict__ qkv, bf16* __restrict__ q_out, KV* __restrict__ k_cache, KV* __restrict__ v_cache,
    const bf16* __restrict__ q_norm_w, const bf16* __restrict__ k_norm_w, const float* __restrict__ cos_tab,
    const float* __restrict__ sin_tab, const int* __restrict__ positions, const int* __restrict__ cu_q_lens,
    const int* __restrict__ block_tables, const uint32_t* __restrict__ num_tokens, const uint32_t* __restrict__ num_seqs,
    int nq, int nkv, int hd, int bs, int mbps, float eps) {
  const int t = blockIdx.x;
  if (t >= (int)*num_tokens) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int pos = positions[t];
  const int s = seq_of_token(cu_q_lens, (int)*num_seqs, t);
  const int blk = block_tables[(size_t)s * mbps + pos / bs];
  const size_t slot = (size_t)blk * bs + pos % bs;
  const int nh = nq + 2 * nkv, half = hd / 2;
  const bf16* row = qkv + (size_t)t * nh * hd;
  const float* ct = cos_tab + (size_t)pos * half;
  const float* st = sin_tab + (size_t)pos * half;
  for (int h = blockIdx.y * nw + warp; h < nh; h += nw * gridDim.y) {
    const bf16* src = row + (size_t)h * hd;
    if (h >= nq + nkv) {  // V head: plain copy into the cache
      KV* dst = v_cache + (slot * nkv + (h - nq - nkv)) * hd;
      for (int i = lane; i < hd; i += 32) kv_store1(dst + i, src[i]);
      continue;
    }
    const bool is_q = h < nq;
    const bf16* nwt = is_q ? q_norm_w : k_norm_w;
    float rs = 0.f;
    if (nwt != nullptr) {
      float ss = 0.f;
      for (int i = lane; i < hd; i += 32) {
        const float v = bf(src[i]);
        ss += v * v;
      }
      rs = rsqrtf(warp_sum(ss) / hd + eps);
    }
    if constexpr (sizeof(KV) == 2) {  // the bf16 cache: q and k through one pointer, as before the template
      bf16* dst = is_q ? q_out + ((size_t)t * nq + h) * hd : k_cache + (slot * nkv + (h - nq)) * hd;
      for (int f = lane; f < half; f += 32) {
        float a = bf(src[f]), b = bf(src[f + half]);
        if (nwt != nullptr) {
          a = rbf(bf(nwt[f]) * rbf(a * rs));
          b = rbf(bf(nwt[f + half]) * rbf(b * rs));
        }
        const float c = rbf(ct[f]), sn = rbf(st[f]);
        dst[f] = tobf(rbf(a * c) + rbf(-b * sn));
        dst[f + half] = tobf(rbf(b * c) + rbf(a * sn));
      }
      continue;
    }
    bf16* qdst = q_out + ((size_t)t * nq + h) * hd;
    KV* kdst = k_cache + (slot * nkv + (h - nq)) * hd;
    for (int f = lane; f < half; f += 32) {
      float a = bf(src[f]), b = bf(src[f + half]);
      if (nwt != nullptr) {
        a = rbf(bf(nwt[f]) * rbf(a * rs));
        b = rbf(bf(nwt[f + half]) * rbf(b * rs));
      }
      const float c = rbf(ct[f]), sn = rbf(st[f]);
      const bf16 lo = tobf(rbf(a * c) + rbf(-b * sn)), hi = tobf(rbf(b * c) + rbf(a * sn));
      if (is_q) {
        qdst[f] = lo;
        qdst[f + half] = hi;
      } else {
        kv_store1(kdst + f, lo);
        kv_store1(kdst + f + half, hi);
      }
    }
  }
}

#define ROPE_KV_WRITE_WARP(NAME, KV)                                                                               \
  extern "C" __global__ void NAME(                                                                                 \
      const bf16* __restrict__ qkv, bf16* __restrict__ q_out, KV* __restrict__ k_cache, KV* __restrict__ v_cache,  \
      const bf16* __restrict__ q_norm_w, const bf16* __restrict__ k_norm_w, const float* __restrict__ cos_tab,     \
      const float* __restrict__ sin_tab, const int* __restrict__ positions, const int* __restrict__ cu_q_lens,     \
      const int* __restrict__ block_tables, const uint32_t* __restrict__ num_tokens,                              \
      const uint32_t* __restrict__ num_seqs, int nq, int nkv, int hd, int bs, int mbps, float eps) {               \
    rope_kv_write_warp_impl<KV>(qkv, q_out, k_cache, v_cache, q_norm_w, k_norm_w, cos_tab, sin_tab, positions,    \
                                cu_q_lens, block_tables, num_tokens, num_seqs, nq, nkv, hd, bs, mbps, eps);       \
  }
ROPE_KV_WRITE_WARP(rope_kv_write_warp, bf16)
ROPE_KV_WRITE_WARP(rope_kv_write_warp_fp8kv, kv8)  // --kv-cache-dtype fp8

// gu [T, 2I] = [gate | up] -> out [T, I].
extern "C" __global__ void swiglu(const bf16* __restrict__ gu, bf16* __restrict__ out,
                                  const uint32_t* __restrict__ num_tokens, int I) {
  const int t = blockIdx.y;
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (int)*num_tokens || v * 8 >= I) return;
  float g[8], u[8];
  load8(gu + (size_t)t * 2 * I + v * 8, g);
  load8(gu + (size_t)t * 2 * I + I + v * 8, u);
  bf16x8 o;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float sg = rbf(g[i] / (1.f + expf(-g[i])));
    o.v[i] = tobf(sg * u[i]);
  }
  *reinterpret_cast<bf16x8*>(out + (size_t)t * I + v * 8) = o;
}

// y[t, :] += bias (Qwen2's q/k/v projection biases, after the qkv GEMM or GEMV): grid
// (ceil(n / 2048), T), 256 threads x 8 values; n a multiple of 8. The sum is rounded to bf16 once
// more (the GEMM already rounded its product: transformers adds the bias before that rounding).
extern "C" __global__ void add_bias(bf16* __restrict__ y, const bf16* __restrict__ bias,
                                    const uint32_t* __restrict__ num_tokens, int n) {
  const int t = blockIdx.y;
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (int)*num_tokens || v * 8 >= n) return;
  float a[8], b[8];
  load8(y + (size_t)t * n + v * 8, a);
  load8(bias + v * 8, b);
  bf16x8 o;
#pragma unroll
  for (int i = 0; i < 8; ++i) o.v[i] = tobf(a[i] + b[i]);
  *reinterpret_cast<bf16x8*>(y + (size_t)t * n + v * 8) = o;
}

// The graph's last kernel: publish completion of step *step_seq. The release orders every
// earlier write of the graph (out_tokens, KV) before the token that the scheduler acquires.
extern "C" __global__ void signal_done(const uint64_t* __restrict__ step_seq, uint64_t* done_seq) {
  const uint64_t v = *step_seq;
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(done_seq), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Random bf16 weights on the GPU: bias + scale * U[-1, 1), counter-based (element i of stream seed).
extern "C" __global__ void fill_random_bf16(bf16* __restrict__ out, uint64_t n, uint64_t seed, float scale,
                                            float bias) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    const uint64_t r = splitmix64(seed ^ (i * 0xD1B54A32D192ED03ull));
    const float u = (float)(r >> 40) * (1.f / 16777216.f);
    out[i] = tobf(bias + scale * (2.f * u - 1.f));
  }
}

// Small-batch GEMM Y[t, n] = sum_k X[t, k] W[n, k] for NT tokens (decode buckets <= 8): a warp
// streams R weight rows with 16-byte loads, so the weight matrix is read exactly once, coalesced.
// The R rows share each load of x (from L1): with one row per warp, 8 tokens made the x reads
// (8 x the weight bytes) L1-bound. cuBLAS's tensor-core kernels are tuned for larger N; at 1-8
// tokens the step is a pure weight stream and this reaches more of the copy bandwidth.
template <int NT, int R, typename OutT>
__device__ __forceinline__ void gemv_impl(const bf16* __restrict__ W, const bf16* __restrict__ X, OutT* __restrict__ Y,
                                          int N, int K) {
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
  if (n0 >= N) return;
  float acc[NT][R];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
#pragma unroll 4
  for (int k = lane * 8; k < K; k += 256) {
    bf16x8 wv[R];
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (n0 + r < N) wv[r] = *reinterpret_cast<const bf16x8*>(W + (size_t)(n0 + r) * K + k);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float x[8];
      load8(X + (size_t)t * K + k, x);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[t][r] += bf(wv[r].v[i]) * x[i];
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[t][r]);
      if (lane == 0 && n0 + r < N) {
        if constexpr (sizeof(OutT) == 4) Y[(size_t)t * N + n0 + r] = v;
        else Y[(size_t)t * N + n0 + r] = tobf(v);
      }
    }
}

// Rows per warp: 1 for one token (most warps in flight: measured faster than 2), 4 above (x reuse).
#define GEMV(NT, R)                                                                                          \
  extern "C" __global__ void gemv_bf16_t##NT(const bf16* W, const bf16* X, bf16* Y, int N, int K) {          \
    gemv_impl<NT, R, bf16>(W, X, Y, N, K);                                                                   \
  }                                                                                                          \
  extern "C" __global__ void gemv_f32_t##NT(const bf16* W, const bf16* X, float* Y, int N, int K) {          \
    gemv_impl<NT, R, float>(W, X, Y, N, K);                                                                  \
  }
GEMV(1, 1)
GEMV(2, 4)
GEMV(4, 4)
GEMV(8, 4)

// Grids: ceil(N / (8 R)) CTAs of 256 threads; the pair kernels (swiglu, rope) ceil(N / 2 / (4 R)).
// The norm kernels take NT * K * 2 bytes of dynamic shared memory.
#define GEMV_FUSED_KERNEL(NAME, NT, R, FLAGS)                                                                  \
  extern "C" __global__ void __launch_bounds__(256, NT == 1 ? 8 : 1)                                         \
      gemv_##NAME##_t##NT(const bf16* W, const bf16* X, const bf16* nw, bf16* Y, int N, int K, float eps) {   \
    gemv_fused_impl<NT, R, FLAGS, Bf16W>(W, nullptr, X, nw, Y, N, K, eps, RopeArgs{});                                   \
  }
#define GEMV_ROPE_KERNEL(NAME, NT, R, FLAGS)                                                                   \
  extern "C" __global__ void __launch_bounds__(256, NT == 1 ? 8 : 1)                                         \
      gemv_##NAME##_t##NT(const bf16* W, const bf16* X, const bf16* nw, RopeArgs ra, int N, int K, float eps) { \
    gemv_fused_impl<NT, R, FLAGS, Bf16W>(W, nullptr, X, nw, nullptr, N, K, eps, ra);                                     \
  }
#define GEMV_FUSED(NT, R)                                         \
  GEMV_FUSED_KERNEL(norm, NT, R, F_NORM_IN)                       \
  GEMV_FUSED_KERNEL(norm_swiglu, NT, R, F_NORM_IN | F_SWIGLU_OUT) \
  GEMV_FUSED_KERNEL(swiglu, NT, R, F_SWIGLU_OUT)                  \
  GEMV_FUSED_KERNEL(resid, NT, R, F_RESID_OUT)                    \
  GEMV_ROPE_KERNEL(rope, NT, R, F_ROPE_OUT)                       \
  GEMV_ROPE_KERNEL(norm_rope, NT, R, F_NORM_IN | F_ROPE_OUT)
GEMV_FUSED(1, 1)
GEMV_FUSED(2, 4)
GEMV_FUSED(4, 4)
GEMV_FUSED(8, 4)
