// The paged KV cache's element type (EngineConfig.kv_cache_dtype): the writes of the RoPE/KV-write
// kernels and the reads of the attention kernels.
//   "auto": bf16, the model dtype.
//   "fp8":  float8 e4m3fn codes, one byte a value (kv8), per-tensor scale 1 (vLLM's default without
//           calibration): a value x is stored as e4m3(x), round to nearest even, saturating to +-448, and
//           read back as its value, exact in bf16. The definition: blink/models/fp8.py kv_round.
// Kernels that touch the cache are templated on the element type; the bf16 instantiations keep their
// own code (cp.async copies, 16-byte stores), the fp8 ones go through these overloads.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common.cuh"

typedef uint8_t kv8;

// 8 bf16 values into the cache, as the cache's type.
__device__ __forceinline__ void kv_store8(bf16* dst, const bf16x8& v) { *reinterpret_cast<bf16x8*>(dst) = v; }
__device__ __forceinline__ void kv_store8(kv8* dst, const bf16x8& v) {
  uint32_t w[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(bf(v.v[4 * i]), bf(v.v[4 * i + 1])), __NV_SATFINITE,
                                                 __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(bf(v.v[4 * i + 2]), bf(v.v[4 * i + 3])), __NV_SATFINITE,
                                                 __NV_E4M3);
    w[i] = lo | (hi << 16);
  }
  *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
}
__device__ __forceinline__ void kv_store1(bf16* dst, bf16 v) { *dst = v; }
__device__ __forceinline__ void kv_store1(kv8* dst, bf16 v) {
  *dst = __nv_cvt_float_to_fp8(bf(v), __NV_SATFINITE, __NV_E4M3);
}

// 8 fp8 codes (one uint2, lowest byte first) -> 8 bf16 (exact: e4m3 -> fp16 -> fp32 -> bf16).
__device__ __forceinline__ bf16x8 kv_decode8(uint2 w) {
  bf16x8 out;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = i < 2 ? w.x : w.y;
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(word >> (16 * (i & 1))), __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&r));
    out.v[2 * i] = tobf(f.x);
    out.v[2 * i + 1] = tobf(f.y);
  }
  return out;
}
__device__ __forceinline__ bf16x8 kv_load8(const bf16* p) { return *reinterpret_cast<const bf16x8*>(p); }
__device__ __forceinline__ bf16x8 kv_load8(const kv8* p) { return kv_decode8(*reinterpret_cast<const uint2*>(p)); }

// fp8 cache -> a bf16 shared-memory tile: 8 values decoded (zeros when !ok) and stored with one 16-byte
// store. (A bf16 cache is copied by each kernel's cp.async instead.)
__device__ __forceinline__ void kv_tile8(void* smem, const kv8* g, bool ok) {
  bf16x8 v = {};
  if (ok) v = kv_load8(g);
  *reinterpret_cast<bf16x8*>(smem) = v;
}
