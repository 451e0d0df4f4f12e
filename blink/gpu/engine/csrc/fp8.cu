// FP8 weights: per-channel quantization at load, the small-batch FP8-weight GEMV, and the
// dequantization that feeds the bf16 GEMM of larger steps.
//
// The definition is blink/models/fp8.py: a linear layer's weight W [N, K] (HF (out, in)) is held as
//   codes [N, K]  uint8, float8 e4m3fn bit patterns (max 448, no infinities, 0x7F NaN)
//   scales [N]    fp32, scale[n] = amax(|W[n, :]|) / 448 (1 for an all-zero row)
// with W[n, k] ~ scale[n] * e4m3(codes[n, k]); y[t, n] = scale[n] * sum_k x[t, k] * e4m3(codes[n, k]).
// Activations stay bf16 (weight-only FP8): the GEMV decodes 16 codes per 16-byte load into registers
// (cvt.rn.f16x2.e4m3x2, exact: every e4m3 value is an fp16) and accumulates in fp32, so a decode step
// reads one byte per weight instead of two.
#include "common.cuh"
#include <cuda_fp8.h>

// ---- Quantization at load: W (bf16 rows, a staging buffer) -> codes + scales -------------------
// A block of 256 threads per row; K a multiple of 8. The scale is an fp32 division (amax / 448) and
// each code the e4m3 of the fp32 quotient W / scale, rounded to nearest even and saturated to +-448
// (__NV_SATFINITE): the same arithmetic as the numpy definition, so the same bits.
extern "C" __global__ void __launch_bounds__(256) fp8_quantize_rows(const bf16* __restrict__ W,
                                                                    uint8_t* __restrict__ codes,
                                                                    float* __restrict__ scales, int N, int K) {
  __shared__ float red[32];
  const int n = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (n >= N) return;
  const bf16* w = W + (size_t)n * K;
  float m = 0.f;
  for (int v = threadIdx.x; v < K / 8; v += blockDim.x) {
    float x[8];
    load8(w + (size_t)v * 8, x);
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(x[i]));
  }
  m = warp_max(m);
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = warp_max(lane < (int)(blockDim.x >> 5) ? red[lane] : 0.f);
  const float s = m > 0.f ? __fdiv_rn(m, 448.f) : 1.f;
  if (threadIdx.x == 0) scales[n] = s;
  for (int v = threadIdx.x; v < K / 8; v += blockDim.x) {
    float x[8];
    load8(w + (size_t)v * 8, x);
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo |= (uint32_t)__nv_cvt_float_to_fp8(__fdiv_rn(x[i], s), __NV_SATFINITE, __NV_E4M3) << (8 * i);
      hi |= (uint32_t)__nv_cvt_float_to_fp8(__fdiv_rn(x[i + 4], s), __NV_SATFINITE, __NV_E4M3) << (8 * i);
    }
    *reinterpret_cast<uint2*>(codes + (size_t)n * K + (size_t)v * 8) = make_uint2(lo, hi);
  }
}

// 16 codes of one 16-byte load -> 16 floats (byte i -> f[i]; the low byte of a pair is .x).
__device__ __forceinline__ void decode16(const uint4& q, float* f) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[j] >> (16 * h)), __NV_E4M3);
      const float2 v = __half22float2(__half2(r));
      f[4 * j + 2 * h] = v.x;
      f[4 * j + 2 * h + 1] = v.y;
    }
  }
}

// ---- Small-batch GEMV: Y[t, n] = bf16(scale[n] * sum_k X[t, k] e4m3(W[n, k])), NT tokens ----------
// gemv_impl's structure (model_kernels.cu): a warp streams R weight rows, lane l taking bytes
// [16 l, 16 l + 16) of each 512-byte stretch, so the matrix is read once, coalesced; the R rows share
// each load of x. Loads of U stretches are issued before the first is used (U 16-byte loads per row
// in flight per lane). K a multiple of 16.
template <int NT, int R, int U>
__device__ __forceinline__ void gemv_fp8_impl(const uint8_t* __restrict__ W, const float* __restrict__ scales,
                                              const bf16* __restrict__ X, bf16* __restrict__ Y, int N, int K) {
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
  if (n0 >= N) return;
  float acc[NT][R];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
  for (int k0 = lane * 16; k0 < K; k0 += 512 * U) {
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int k = k0 + u * 512;
        wv[u][r] = (k < K && n0 + r < N) ? __ldg(reinterpret_cast<const uint4*>(W + (size_t)(n0 + r) * K + k))
                                         : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + u * 512;
      if (k >= K) break;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float wf[16];
        decode16(wv[u][r], wf);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          float x[16];
          load8(X + (size_t)t * K + k, x);
          load8(X + (size_t)t * K + k + 8, x + 8);
#pragma unroll
          for (int i = 0; i < 16; ++i) acc[t][r] += wf[i] * x[i];
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[t][r]);
      if (lane == 0 && n0 + r < N) Y[(size_t)t * N + n0 + r] = tobf(v * scales[n0 + r]);
    }
}

// Grid: ceil(N / (8 R)) CTAs of 256 threads (forward.FP8_GEMV_ROWS_PER_WARP). One token: a row a warp
// and 4 stretches in flight (most warps and bytes in flight); more tokens: 4 rows share x, 2 stretches.
#define GEMV_FP8(NT, R, U)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256)                                                         \
      gemv_fp8_t##NT(const uint8_t* W, const float* scales, const bf16* X, bf16* Y, int N, int K) {         \
    gemv_fp8_impl<NT, R, U>(W, scales, X, Y, N, K);                                                         \
  }
GEMV_FP8(1, 1, 4)
GEMV_FP8(2, 4, 2)
GEMV_FP8(4, 4, 2)
GEMV_FP8(8, 4, 2)

// ---- Larger steps: out [N, K] = bf16(scale[n] * e4m3(codes[n, k])), the bf16 GEMM's weight ---------
// Grid (ceil(K / 4096), N), 256 threads of 16 values; K a multiple of 16.
extern "C" __global__ void fp8_dequant_rows(const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                                            bf16* __restrict__ out, int N, int K) {
  const int n = blockIdx.y, k = (blockIdx.x * blockDim.x + threadIdx.x) * 16;
  if (n >= N || k >= K) return;
  float f[16];
  decode16(*reinterpret_cast<const uint4*>(codes + (size_t)n * K + k), f);
  const float s = scales[n];
  bf16x8 o[2];
#pragma unroll
  for (int i = 0; i < 16; ++i) o[i / 8].v[i % 8] = tobf(f[i] * s);
  *reinterpret_cast<bf16x8*>(out + (size_t)n * K + k) = o[0];
  *reinterpret_cast<bf16x8*>(out + (size_t)n * K + k + 8) = o[1];
}

// ---- Larger steps, W8A8: activations quantized per token by fp8_quantize_rows (X [T, K] bf16 ->
// codes [T, K] + scales [T]; the weights' arithmetic), the GEMM on FP8 tensor cores (cuBLASLt,
// blink/gpu/engine/fp8_gemm.py). Where cuBLASLt cannot apply the per-token x per-channel scales
// itself (outer-vector scaling), it writes the unscaled fp32 sums D [T, N] and this kernel scales and
// rounds them: Y[t, n] = bf16((D[t, n] * xs[t]) * ws[n]). Grid (ceil(N / 2048), T), 256 threads of 8.
extern "C" __global__ void fp8_scale_rows(const float* __restrict__ D, const float* __restrict__ xs,
                                          const float* __restrict__ ws, bf16* __restrict__ Y, int T, int N) {
  const int t = blockIdx.y, n = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (t >= T || n >= N) return;
  const float s = xs[t];
  const float* d = D + (size_t)t * N + n;
  bf16x8 o;
  if ((N & 7) == 0) {  // rows of whole 16-byte vectors
    const float4 a = *reinterpret_cast<const float4*>(d), b = *reinterpret_cast<const float4*>(d + 4);
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = tobf((v[i] * s) * ws[n + i]);
    *reinterpret_cast<bf16x8*>(Y + (size_t)t * N + n) = o;
  } else {
    for (int i = 0; n + i < N; ++i) Y[(size_t)t * N + n + i] = tobf((d[i] * s) * ws[n + i]);
  }
}
