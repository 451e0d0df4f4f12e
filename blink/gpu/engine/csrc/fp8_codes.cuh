// FP8 e4m3 codes decoded in registers, shared by the FP8 GEMV kernels (fp8.cu) and the FP8 LM head's
// prompt-logprob GEMM (sampling.cu).
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// The 4 * NW codes of NW 32-bit words -> 4 * NW floats (byte i -> f[i]; the low byte of a pair is .x).
template <int NW>
__device__ __forceinline__ void decode_e4m3(const uint32_t* w, float* f) {
#pragma unroll
  for (int j = 0; j < NW; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[j] >> (16 * h)), __NV_E4M3);
      const float2 v = __half22float2(__half2(r));
      f[4 * j + 2 * h] = v.x;
      f[4 * j + 2 * h + 1] = v.y;
    }
  }
}

// 16 codes of one 16-byte load -> 16 floats.
__device__ __forceinline__ void decode16(const uint4& q, float* f) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  decode_e4m3<4>(w, f);
}
