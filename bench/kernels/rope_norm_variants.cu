// The engine's RMSNorm and RoPE kernels as they were before the issue-12 rewrite (commit 6822f2b of
// blink/gpu/csrc/model_kernels.cu), kept runnable out of the serving path (llm.c dev/cuda style) so
// that bench/rope_norm.py can time and compare the engine's kernels against them:
//   add_rmsnorm_v0:   block of 256 threads per row, two passes over the row (the second re-reads
//                     the residual it just wrote), loop-carried 16-byte loads.
//   rope_kv_write_v0: grid (token, head group), a warp per head, 2-byte loads and stores, and a
//                     binary search of cu_q_lens per block (log2(num_seqs) dependent loads) before
//                     any KV write: 9.6 us a call at 256 tokens of Llama-3-8B on the H200, 15 % of
//                     its bandwidth ideal (bench/results/decode_breakdown-h200-b76a044.json).
// Launch geometry as the engine used it: add_rmsnorm_v0 (T, 256 threads); rope_kv_write_v0
// (T, ceil(nh / 8)) blocks of 256 threads.
#include "common.cuh"

// residual (+)= delta; out = rmsnorm(residual) * w. delta == nullptr: no add (first layer).
extern "C" __global__ void add_rmsnorm_v0(bf16* __restrict__ residual, const bf16* __restrict__ delta,
                                       const bf16* __restrict__ w, bf16* __restrict__ out,
                                       const uint32_t* __restrict__ num_tokens, int H, float eps) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (t >= (int)*num_tokens) return;
  bf16* r = residual + (size_t)t * H;
  float ss = 0.f;
  for (int v = threadIdx.x; v < H / 8; v += blockDim.x) {
    float x[8];
    load8(r + v * 8, x);
    if (delta != nullptr) {
      float d[8];
      load8(delta + (size_t)t * H + v * 8, d);
      bf16x8 o;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        x[i] = rbf(x[i] + d[i]);
        o.v[i] = tobf(x[i]);
      }
      *reinterpret_cast<bf16x8*>(r + v * 8) = o;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += x[i] * x[i];
  }
  const float rs = rsqrtf(block_sum(ss, scratch) / H + eps);
  for (int v = threadIdx.x; v < H / 8; v += blockDim.x) {
    float x[8], g[8];
    load8(r + v * 8, x);
    load8(w + v * 8, g);
    bf16x8 o;
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = tobf(g[i] * rbf(x[i] * rs));
    *reinterpret_cast<bf16x8*>(out + (size_t)t * H + v * 8) = o;
  }
}

// Grid (token, head group): a warp per head. Q heads: [qk-norm], RoPE -> q_out. K heads:
// [qk-norm], RoPE -> k cache slot. V heads -> v cache slot. The slot of token t of sequence s at
// position p is block_tables[s][p / block_size] * block_size + p % block_size.
extern "C" __global__ void rope_kv_write_v0(const bf16* __restrict__ qkv, bf16* __restrict__ q_out,
                                         bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                         const bf16* __restrict__ q_norm_w, const bf16* __restrict__ k_norm_w,
                                         const float* __restrict__ cos_tab, const float* __restrict__ sin_tab,
                                         const int* __restrict__ positions, const int* __restrict__ cu_q_lens,
                                         const int* __restrict__ block_tables, const uint32_t* __restrict__ num_tokens,
                                         const uint32_t* __restrict__ num_seqs, int nq, int nkv, int hd, int bs,
                                         int mbps, float eps) {
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
      bf16* dst = v_cache + (slot * nkv + (h - nq - nkv)) * hd;
      for (int i = lane; i < hd; i += 32) dst[i] = src[i];
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
  }
}

