// Shared helpers for the Blink model kernels (bf16 storage, fp32 math).
//
// Every kernel reads its live sizes (*num_tokens, *num_seqs, cu_q_lens, seq_lens) from device
// buffers at run time, so a captured graph never bakes in a length: the grid is sized for the
// graph's bucket and blocks past the live count return at once.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float bf(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 tobf(float x) { return __float2bfloat16_rn(x); }
// Round a float through bf16 (what a bf16 tensor op in PyTorch does to its result).
__device__ __forceinline__ float rbf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// 8 bf16 in one 16-byte vector.
struct __align__(16) bf16x8 {
  bf16 v[8];
};

__device__ __forceinline__ void load8(const bf16* p, float* out) {
  bf16x8 t = *reinterpret_cast<const bf16x8*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = bf(t.v[i]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < nw ? scratch[lane] : 0.f;
  return warp_sum(r);
}

// One row's out = bf16(w * bf16(bf16(r + d) * rsqrt(mean(bf16(r + d)^2) + eps))), the residual left as it
// is (d: null for no add); all threads of the block, `scratch` as block_sum's. The final norm of each
// sequence's last token and the prompt-logprob rows share it.
__device__ __forceinline__ void sum_rmsnorm_row(const bf16* __restrict__ r, const bf16* __restrict__ d,
                                                const bf16* __restrict__ w, bf16* __restrict__ out, int H,
                                                float eps, float* scratch) {
  float ss = 0.f;
  for (int v = threadIdx.x; v < H / 8; v += blockDim.x) {
    float x[8], dd[8] = {};
    load8(r + v * 8, x);
    if (d != nullptr) load8(d + v * 8, dd);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[i] = rbf(x[i] + dd[i]);
      ss += x[i] * x[i];
    }
  }
  const float rs = rsqrtf(block_sum(ss, scratch) / H + eps);
  for (int v = threadIdx.x; v < H / 8; v += blockDim.x) {
    float x[8], dd[8] = {}, g[8];
    load8(r + v * 8, x);
    if (d != nullptr) load8(d + v * 8, dd);
    load8(w + v * 8, g);
    bf16x8 o;
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = tobf(g[i] * rbf(rbf(x[i] + dd[i]) * rs));
    *reinterpret_cast<bf16x8*>(out + v * 8) = o;
  }
}

// Sequence that owns packed token t: the s with cu[s] <= t < cu[s+1] (binary search).
__device__ __forceinline__ int seq_of_token(const int* cu, int num_seqs, int t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Programmatic dependent launch (sm_90 and later). A kernel the engine launches with it (the GEMVs of
// gemv_fused.cuh: forward.pdl_kernel) may start while the kernel before it in its graph is finishing:
// pdl_wait() returns once that kernel has completed and its writes are visible, so a kernel calls it
// before it touches any memory another kernel writes or reads (only the weights come before it).
// pdl_launch_dependents() lets such a next kernel start now, once every CTA of this one has called it.
// Both are no-ops in a kernel launched without it, and compile to nothing before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
