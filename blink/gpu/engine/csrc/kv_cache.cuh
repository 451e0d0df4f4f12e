// The paged KV cache's element type (EngineConfig.kv_cache_dtype): the writes of the RoPE/KV-write
// kernels and the reads of the attention kernels.
//   "auto": bf16, the model dtype.
//   "fp8":  float8 e4m3fn codes, one byte a value (kv8), per-tensor scale 1 (vLLM's default without
//           calibration): a value x is stored as e4m3(x), round to nearest even, saturating to +-448, and
//           read back as its value, exact in bf16. The definition: blink/models/fp8.py kv_round.
// Kernels that touch the cache are templated on the element type; the bf16 instantiations keep their
// own code (cp.async copies, 16-byte stores), the fp8 ones go through these overloads.
//
// The attention kernels (flash_decode.cu, prefill_attention.cu) take a read policy instead (KvBf16,
// KvFp8, KvFp8Tile below): the same tiling, and for an fp8 cache the codes travel by the same 16-byte
// cp.async copies as a bf16 cache's values (half the bytes a key), two codes are decoded by one
// instruction (cvt.rn.f16x2.e4m3x2, exact), and the scale is applied once (to the scores and the output).
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

// ---- read policies of the attention kernels ---------------------------------------------------------
// KvBf16: a bf16 cache, copied by cp.async (the kernels' own code).
// KvFp8: an fp8 cache, its codes copied by cp.async 16 at a time into a ring/stage of bytes; flashq
//   decodes each lane's 8 codes in registers (the fp32 math of KvBf16 on the same values), the tensor-core
//   kernels decode each 16-code chunk into an f16 tile (e4m3 is exact in f16) read by ldmatrix and f16 mma.
// KvFp8Tile: an fp8 cache loaded synchronously (8 codes a lane) and decoded into the bf16 tile
//   (kv_tile8); slower, kept for the benchmark (bench/kernels/fp8kv_attention.py).
struct KvBf16 {
  typedef bf16 T;
  static constexpr int PATH = 0;
};
struct KvFp8Tile {
  typedef kv8 T;
  static constexpr int PATH = 1;
};
struct KvFp8 {
  typedef kv8 T;
  static constexpr int PATH = 2;
};
// The policy of the engine's _fp8kv attention kernels (the switch between the two fp8 paths).
typedef KvFp8 KvFp8Engine;
// The fp8 cache's per-tensor scale (blink.models.fp8.KV_SCALE): a stored code c means KV_SCALE * value(c).
constexpr float KV_SCALE = 1.f;

// Two codes (lowest byte first) -> two halves, lowest first: one cvt.rn.f16x2.e4m3x2 on sm_89+.
__device__ __forceinline__ uint32_t kv_f16x2(uint32_t two) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xffffu), __NV_E4M3);
  return (uint32_t)r.x | ((uint32_t)r.y << 16);
}
// 8 codes (a uint2, lowest byte first) -> 8 floats.
__device__ __forceinline__ void kv_f32x8(uint2 w, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t h = kv_f16x2((i < 2 ? w.x : w.y) >> (16 * (i & 1)));
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&h));
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}
// 16 codes (a uint4) -> 16 halves in two 16-byte vectors (values 0-7, 8-15).
__device__ __forceinline__ void kv_f16x16(uint4 w, uint4& lo, uint4& hi) {
  lo = make_uint4(kv_f16x2(w.x), kv_f16x2(w.x >> 16), kv_f16x2(w.y), kv_f16x2(w.y >> 16));
  hi = make_uint4(kv_f16x2(w.z), kv_f16x2(w.z >> 16), kv_f16x2(w.w), kv_f16x2(w.w >> 16));
}
// The tensor-core kernels' f16 operands (KvFp8): D (16x8 fp32) += A (16x16 f16, row) B (16x8 f16, col),
// the fragments as the kernels' bf16 mma.sync takes them; two floats packed as halves (.x the lower).
__device__ __forceinline__ void kv_mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t kv_pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
// 8 bf16 values -> 8 halves in place (a query row for the f16 mma; |q| past 65504 saturates).
__device__ __forceinline__ uint4 kv_q_f16x8(uint4 w) {
  const uint32_t* b = &w.x;
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&b[i]));
    const __half2 h = __floats2half2_rn(fminf(fmaxf(f.x, -65504.f), 65504.f), fminf(fmaxf(f.y, -65504.f), 65504.f));
    o[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}
