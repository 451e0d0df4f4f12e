// FP8 weights: per-channel quantization at load, the small-batch FP8-weight GEMV, and the
// dequantization that feeds the bf16 GEMM of larger steps.
//
// The definition is blink/models/fp8.py: a linear layer's weight W [N, K] (HF (out, in)) is held as
//   codes [N, K]  uint8, float8 e4m3fn bit patterns (max 448, no infinities, 0x7F NaN)
//   scales [N]    fp32, scale[n] = amax(|W[n, :]|) / 448 (1 for an all-zero row)
// with W[n, k] ~ scale[n] * e4m3(codes[n, k]); y[t, n] = scale[n] * sum_k x[t, k] * e4m3(codes[n, k]).
// Activations stay bf16 (weight-only FP8): the GEMV decodes 16 codes per 16-byte load into registers
// (cvt.rn.f16x2.e4m3x2, exact: every e4m3 value is an fp16) and accumulates in fp32, so a decode step
// reads one byte per weight instead of two; it takes the bf16 GEMV's fusions (norm, swiglu, rope, resid).
#include "common.cuh"
#include "fp8_codes.cuh"  // decode16
#include "gemv_fused.cuh"
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

// ---- Small-batch GEMV: Y[t, n] = bf16(scale[n] * sum_k X[t, k] e4m3(W[n, k])), NT tokens ----------
// gemv_fused_impl (gemv_fused.cuh) with FP8 weights: a warp streams R weight rows, lane l taking bytes
// [16 l, 16 l + 16) of each 512-byte stretch, so the matrix is read once, coalesced; U stretches of
// each row are loaded before the first is used (U * R 16-byte loads in flight a lane). Per vector:
// 16 codes decoded (decode16) against 16 values of each token's x (from L1, or shared memory where the
// norm is fused), fp32 sums in the order of k, the row's scale applied once to the warp's sum. Every
// (R, U) sums in the same order: all configurations and fusions give the same bits.
template <int U_>
struct Fp8W {
  using T = uint8_t;
  using Vec = uint4;
  static constexpr int VALS = 16, U = U_, PREFETCH = U_, PIPE = 0;  // the norm prologue runs under U loads a row
  static constexpr bool SCALED = true;
  static __device__ __forceinline__ Vec load(const T* __restrict__ W, size_t off) {
    return __ldg(reinterpret_cast<const uint4*>(W + off));
  }
  // Up to 2 rows: both decoded first, each token's x loaded once for them; more rows: a row at a time
  // (registers), x loaded again per row. The same sums in the same order either way.
  template <int NT, int R, typename XL>
  static __device__ __forceinline__ void step(const Vec (&wv)[R], int k, const XL& xl, float (&acc)[NT][R]) {
    if constexpr (R <= 2) {
      float wf[R][16];
#pragma unroll
      for (int r = 0; r < R; ++r) decode16(wv[r], wf[r]);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        float x[16];
        xl(t, k, x);
        xl(t, k + 8, x + 8);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int i = 0; i < 16; ++i) acc[t][r] += wf[r][i] * x[i];
      }
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float wf[16];
        decode16(wv[r], wf);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          float x[16];
          xl(t, k, x);
          xl(t, k + 8, x + 8);
#pragma unroll
          for (int i = 0; i < 16; ++i) acc[t][r] += wf[i] * x[i];
        }
      }
    }
  }
};

// The pipelined weight loop (gemv_fused_impl's WT::PIPE): S stretches of each row in flight in a shared-memory
// ring (S * 8 * R * 512 bytes a CTA, static), loaded by cp.async and refilled as used, the first S issued
// before the norm prologue; the same vectors, arithmetic and order as Fp8W (the same bits).
template <int S>
struct Fp8WPipe : Fp8W<1> {
  static constexpr int U = 0, PREFETCH = 0, PIPE = S;
  template <int R>
  static __device__ __forceinline__ uint4* ring() {
    __shared__ uint4 buf[S * 8 * R * 32];
    return buf;
  }
};

// Kernels gemv_fp8[_<fusion>]_t<NT>_r<R>u<U>: the plain GEMV and the fusions of model_kernels.cu's
// gemv_<fusion>_t<NT> (norm, norm_swiglu, swiglu, resid, rope, norm_rope; same parameters plus the
// scales). Grids: ceil(N / (8 R)) CTAs of 256 threads; the pair kernels (swiglu, rope)
// ceil(N / 2 / (4 R)); the norm kernels take NT * K * 2 bytes of dynamic shared memory. The engine
// launches the configuration FP8_GEMV_CONFIG[NT] (blink/gpu/engine/fp8_weights.py) of the compiled
// ones below (bench.kernels.fp8_gemv times them all).
#define FP8_BOUNDS(NT) __launch_bounds__(256, NT == 1 ? 2 : 1)
// The pipelined kernels hold no weights in registers: more CTAs an SM (one wave over qkv's 6144 rows at
// R = 2, over 4096 rows at R = 1).
#define FP8P_BOUNDS(NT, R) __launch_bounds__(256, NT > 1 ? 1 : R == 1 ? 4 : 3)
// One configuration's kernels: NAME_t<NT>_r<R><TAG><U> over weight traits WT with launch bounds BOUNDS.
#define GEMV_FP8_PLAIN(NT, R, TAG, U, WT, BOUNDS)                                                               \
  extern "C" __global__ void BOUNDS gemv_fp8_t##NT##_r##R##TAG##U(const uint8_t* W, const float* scales,        \
                                                                   const bf16* X, bf16* Y, int N, int K) {      \
    gemv_fused_impl<NT, R, 0, WT>(W, scales, X, nullptr, Y, N, K, 0.f, RopeArgs{});                             \
  }
// gemv_fp8_f32_*: the plain kernel writing fp32 sums times the scale (the FP8 LM head's logits).
#define GEMV_FP8_F32(NT, R, TAG, U, WT, BOUNDS)                                                                 \
  extern "C" __global__ void BOUNDS gemv_fp8_f32_t##NT##_r##R##TAG##U(const uint8_t* W, const float* scales,    \
                                                                       const bf16* X, float* Y, int N, int K) { \
    gemv_fused_impl<NT, R, F_F32_OUT, WT>(W, scales, X, nullptr, reinterpret_cast<bf16*>(Y), N, K, 0.f,        \
                                          RopeArgs{});                                                          \
  }
#define GEMV_FP8_FUSED(NAME, NT, R, TAG, U, WT, BOUNDS, FLAGS)                                                  \
  extern "C" __global__ void BOUNDS gemv_fp8_##NAME##_t##NT##_r##R##TAG##U(                                     \
      const uint8_t* W, const float* scales, const bf16* X, const bf16* nw, bf16* Y, int N, int K, float eps) { \
    gemv_fused_impl<NT, R, FLAGS, WT>(W, scales, X, nw, Y, N, K, eps, RopeArgs{});                              \
  }
#define GEMV_FP8_ROPE(NAME, NT, R, TAG, U, WT, BOUNDS, FLAGS)                                                   \
  extern "C" __global__ void BOUNDS gemv_fp8_##NAME##_t##NT##_r##R##TAG##U(                                     \
      const uint8_t* W, const float* scales, const bf16* X, const bf16* nw, RopeArgs ra, int N, int K,         \
      float eps) {                                                                                              \
    gemv_fused_impl<NT, R, FLAGS, WT>(W, scales, X, nw, nullptr, N, K, eps, ra);                                \
  }
#define GEMV_FP8_ALL(NT, R, TAG, U, WT, BOUNDS)                                        \
  GEMV_FP8_PLAIN(NT, R, TAG, U, WT, BOUNDS)                                            \
  GEMV_FP8_F32(NT, R, TAG, U, WT, BOUNDS)                                              \
  GEMV_FP8_FUSED(norm, NT, R, TAG, U, WT, BOUNDS, F_NORM_IN)                           \
  GEMV_FP8_FUSED(norm_swiglu, NT, R, TAG, U, WT, BOUNDS, F_NORM_IN | F_SWIGLU_OUT)     \
  GEMV_FP8_FUSED(swiglu, NT, R, TAG, U, WT, BOUNDS, F_SWIGLU_OUT)                      \
  GEMV_FP8_FUSED(resid, NT, R, TAG, U, WT, BOUNDS, F_RESID_OUT)                        \
  GEMV_FP8_ROPE(rope, NT, R, TAG, U, WT, BOUNDS, F_ROPE_OUT)                           \
  GEMV_FP8_ROPE(norm_rope, NT, R, TAG, U, WT, BOUNDS, F_NORM_IN | F_ROPE_OUT)
// _r<R>u<U>: U stretches a row in registers; _r<R>p<S>: the pipelined ring of S stretches a row.
#define GEMV_FP8(NT, R, U) GEMV_FP8_ALL(NT, R, u, U, Fp8W<U>, FP8_BOUNDS(NT))
#define GEMV_FP8_PIPE(NT, R, S) GEMV_FP8_ALL(NT, R, p, S, Fp8WPipe<S>, FP8P_BOUNDS(NT, R))
// The compiled configurations (FP8_GEMV_CONFIGS in fp8_weights.py lists the same).
GEMV_FP8(1, 1, 8)
GEMV_FP8(1, 1, 4)
GEMV_FP8(1, 2, 4)
GEMV_FP8_PIPE(1, 2, 4)
GEMV_FP8_PIPE(1, 1, 8)
GEMV_FP8(2, 2, 4)
GEMV_FP8(2, 4, 2)
GEMV_FP8_PIPE(2, 2, 4)
GEMV_FP8(4, 2, 4)
GEMV_FP8(4, 4, 2)
GEMV_FP8(8, 2, 2)
GEMV_FP8(8, 4, 2)

// ---- Weight-only FP8 on tensor cores: decode steps of up to 32 tokens --------------------------------
// Y[t, n] = bf16(scale[n] * sum_k X[t, k] e4m3(W[n, k])) as gemv_fp8, the products on mma.sync
// m16n8k16 (bf16 x bf16 -> fp32): A = 16 weight rows, B = 8 tokens (8 NT8 tokens a warp, T of them
// live: the other columns are zeros and never written). A CTA of 8 warps takes 16 MT rows; its warps
// split K in 128-value chunks (warp w: chunks w, w + 8, ...), each lane loading 32 contiguous bytes of
// rows g and g + 8 of each 16-row tile (g = lane / 4; the 4 lanes of a group cover a row's 128 bytes)
// and 32 contiguous bf16 of token g's x. Any k order serves if A and B share it: chunk-relative k =
// 32 t + 16 q + 4 j + i (t = lane % 4) sits in mma slot 2t + (0, 8, 1, 9)[i] of step (q, j), which is
// where e4m3x4_bf16 puts byte i of the 4 (odd bytes, even bytes) and where the PRMTs put x's values.
// The 8 warps' fp32 partial sums meet in shared memory, summed in warp order (deterministic).
// e4m3 -> bf16: byte s.eeee.mmm as the bf16 s.0000eeee.mmm0000 is the value times 2**-120 (exact, also
// for the subnormal e = 0), then times 2**120 (bf16 0x7B80: exact).
__device__ __forceinline__ void e4m3x4_bf16(uint32_t w, uint32_t& even, uint32_t& odd) {
  const uint32_t w8 = w << 8;
  const uint32_t e = (w8 & 0x80008000u) | ((w8 & 0x7F007F00u) >> 4);  // bytes 0, 2
  const uint32_t o = (w & 0x80008000u) | ((w & 0x7F007F00u) >> 4);    // bytes 1, 3
  const __nv_bfloat162 k = __halves2bfloat162(__ushort_as_bfloat16(0x7B80), __ushort_as_bfloat16(0x7B80));
  const __nv_bfloat162 re = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&e), k);
  const __nv_bfloat162 ro = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&o), k);
  even = *reinterpret_cast<const uint32_t*>(&re);
  odd = *reinterpret_cast<const uint32_t*>(&ro);
}

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int MT, int NT8, typename OutT = bf16>
__device__ __forceinline__ void gemv_fp8_mma_impl(const uint8_t* __restrict__ W, const float* __restrict__ scales,
                                                  const bf16* __restrict__ X, OutT* __restrict__ Y, int N, int K,
                                                  int T) {
  constexpr int ACC = MT * NT8 * 4;  // accumulators a lane
  __shared__ float part[8][ACC][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * 16 * MT;
  float acc[MT][NT8][4] = {};
  for (int kc = warp * 128; kc < K; kc += 8 * 128) {
    uint4 wq[MT][2][2], xq[NT8][4];  // weights: 16 codes a q; x: 8 values a p (k = 8 p, chunk- and lane-relative)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int row = m0 + 16 * m + g + 8 * h, k = kc + 32 * t + 16 * q;
          wq[m][h][q] = row < N && k < K ? __ldg(reinterpret_cast<const uint4*>(W + (size_t)row * K + k))
                                         : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
    for (int n = 0; n < NT8; ++n)
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int tok = 8 * n + g, k = kc + 32 * t + 8 * p;
        xq[n][p] = tok < T && k < K ? *reinterpret_cast<const uint4*>(X + (size_t)tok * K + k) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t b[NT8][2];
#pragma unroll
        for (int n = 0; n < NT8; ++n) {
          const uint32_t* xw = reinterpret_cast<const uint32_t*>(&xq[n][2 * q + (j >> 1)]) + 2 * (j & 1);
          b[n][0] = __byte_perm(xw[0], xw[1], 0x5410);  // x at 16 q + 4 j + 0, + 2
          b[n][1] = __byte_perm(xw[0], xw[1], 0x7632);  // x at 16 q + 4 j + 1, + 3
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          uint32_t a[4];
          e4m3x4_bf16(reinterpret_cast<const uint32_t*>(&wq[m][0][q])[j], a[0], a[2]);  // row g
          e4m3x4_bf16(reinterpret_cast<const uint32_t*>(&wq[m][1][q])[j], a[1], a[3]);  // row g + 8
#pragma unroll
          for (int n = 0; n < NT8; ++n) mma_bf16_16816(acc[m][n], a[0], a[1], a[2], a[3], b[n][0], b[n][1]);
        }
      }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) part[warp][(m * NT8 + n) * 4 + c][lane] = acc[m][n][c];
  __syncthreads();
  for (int v = threadIdx.x; v < ACC * 32; v += blockDim.x) {
    const int i = v >> 5, l = v & 31, c = i & 3, n = (i >> 2) % NT8, m = (i >> 2) / NT8;
    const int row = m0 + 16 * m + (l >> 2) + 8 * (c >> 1), tok = 8 * n + 2 * (l & 3) + (c & 1);
    if (row >= N || tok >= T) continue;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) s += part[w][i][l];
    if constexpr (sizeof(OutT) == 4) Y[(size_t)tok * N + row] = s * scales[row];  // fp32 logits
    else Y[(size_t)tok * N + row] = tobf(s * scales[row]);
  }
}

// gemv_fp8_mma_m<MT>_n<NT8>: grid ceil(N / (16 MT)) CTAs of 256 threads; T <= 8 NT8 tokens. The engine
// launches FP8_MMA_ROWS (fp8_weights.py) of the MT compiled here, with the smallest NT8 that holds T.
// gemv_fp8_mma_f32_*: the same writing fp32 (the FP8 LM head's logits).
#define GEMV_FP8_MMA(MT, NT8)                                                                               \
  extern "C" __global__ void __launch_bounds__(256) gemv_fp8_mma_m##MT##_n##NT8(                            \
      const uint8_t* W, const float* scales, const bf16* X, bf16* Y, int N, int K, int T) {                 \
    gemv_fp8_mma_impl<MT, NT8>(W, scales, X, Y, N, K, T);                                                   \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(256) gemv_fp8_mma_f32_m##MT##_n##NT8(                        \
      const uint8_t* W, const float* scales, const bf16* X, float* Y, int N, int K, int T) {                \
    gemv_fp8_mma_impl<MT, NT8, float>(W, scales, X, Y, N, K, T);                                            \
  }
GEMV_FP8_MMA(1, 1)
GEMV_FP8_MMA(2, 1)
GEMV_FP8_MMA(4, 1)
GEMV_FP8_MMA(1, 2)
GEMV_FP8_MMA(2, 2)
GEMV_FP8_MMA(1, 4)
GEMV_FP8_MMA(2, 4)

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
