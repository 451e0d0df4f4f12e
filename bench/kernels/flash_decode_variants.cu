// Decode attention variants retired from the engine (llm.c dev/cuda style: kept and runnable, out
// of the serving path; bench/kernels/decode_attention.py builds, checks and times them).
//
// Both are the engine's flash-decoding template (blink/gpu/csrc/flash_decode.cu, included here)
// with 8 K + 8 V vectors per lane per tile instead of flashq's 4 + 4: more bytes in flight per
// warp, more registers, fewer CTAs per SM.
//   "flash8":  loads straight into registers (STAGES = 0);
//   "flashq8": through a 3-tile cp.async ring in dynamic shared memory (96 KiB per CTA).
// Their combine kernels differ from flashq's only in the split quantum (N = 8).
// Never timed against flashq on a GPU before they left the engine (bench/results holds no run).
#include "flash_decode.cu"

#define FLASH8_VARIANTS(HD, G)                  \
  FLASH(flash8, HD, G, 8, 0, (G == 1 ? 3 : 2)) \
  FLASH(flashq8, HD, G, 8, 3, 2)
#define FLASH8_PER_HD(HD)       \
  FLASH8_VARIANTS(HD, 1)        \
  FLASH8_VARIANTS(HD, 2)        \
  FLASH8_VARIANTS(HD, 4)        \
  FLASH8_VARIANTS(HD, 8)        \
  FLASH_COMBINE(flash8, HD, 8)  \
  FLASH_COMBINE(flashq8, HD, 8)
FLASH8_PER_HD(64)
FLASH8_PER_HD(128)

// ---- "flashmma": GQA decode attention on tensor cores (issue 12, item 3) -------------------------
// flashq does the G x keys dot products and the P V sums on CUDA cores in fp32 (per 8 keys per warp:
// 32 FMAs per lane each way, a reduce-scatter and two warp-wide softmax reductions), which costs
// about as many issue slots as the K/V bytes take to arrive at batch >= 128. Here the G query heads
// of a KV head are the rows of one m16n8k16 tile (rows >= G zero), as FlashAttention-2 does for
// prefill (prefill_attention.cu "fa2": same fragment layouts and ldmatrix addressing): per 64-key
// tile, loaded by the whole CTA with cp.async into a 2-stage ring, each of the 4 warps takes 16
// keys: S = Q K^T (8 mma), online softmax over a quad of lanes per row, O += P V (16 mma). Same
// grid, splits (flash_chunk with flashq's quantum) and partial-output layout as flashq, so flashq's
// combine kernel merges the splits. Dynamic shared memory: Q 16 x (HD+8) + 2 x (K, V) 64 x (HD+8)
// bf16 (74 KiB at HD=128: 3 CTAs per SM).
__device__ __forceinline__ uint32_t mm_smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mm_ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(mm_smem(p)));
}
__device__ __forceinline__ void mm_ldsm4t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(mm_smem(p)));
}
__device__ __forceinline__ void mm_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t mm_pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

constexpr int MMA_BN = 64;  // keys per CTA tile (16 per warp)

__host__ __device__ constexpr int flashmma_smem(int hd) { return (16 + 4 * MMA_BN) * (hd + 8) * 2; }

template <int HD, int G>
__device__ __forceinline__ void attn_flashmma_impl(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                                                   const bf16* __restrict__ v_cache, float* __restrict__ part_o,
                                                   float* __restrict__ part_lse, bf16* __restrict__ out,
                                                   const int* __restrict__ cu_q_lens, const int* __restrict__ seq_lens,
                                                   const int* __restrict__ block_tables,
                                                   const uint32_t* __restrict__ num_seqs, int nkv, int bs, int mbps,
                                                   float scale_log2, int target) {
  constexpr int LD = HD + 8, NK = HD / 16, ND = HD / 8, CH = HD / 8, NW = FLASH_WARPS;
  static_assert(G <= 8 && HD % 16 == 0, "rows g + 8 are padding: G <= 8");
  extern __shared__ __align__(128) unsigned char mm_smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(mm_smem_raw);  // [16][LD]
  bf16* Kst = Qs + 16 * LD;                        // [2][BN][LD]
  bf16* Vst = Kst + 2 * MMA_BN * LD;               // [2][BN][LD]
  __shared__ float wm[NW][G], wl[NW][G];
  const int s = blockIdx.z;
  const int ns = (int)*num_seqs, L = seq_lens[s], tok = cu_q_lens[s + 1] - 1;
  if (s >= ns) return;
  const int split = blockIdx.x, kvh = blockIdx.y, nq = nkv * G, NS = gridDim.x;
  const int chunk = flash_chunk(L, ns, NS, nkv, target, flash_quantum(HD, 4));  // flashq's: its combine merges
  const int start = split * chunk;
  if (start >= L) return;
  const int end = min(L, start + chunk), nused = (L + chunk - 1) / chunk;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int* bt = block_tables + (size_t)s * mbps;
  for (int idx = tid; idx < 16 * CH; idx += NW * 32) {  // Q: rows G.. zero
    const int r = idx / CH, c = (idx % CH) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < G) v = *reinterpret_cast<const uint4*>(q + ((size_t)tok * nq + kvh * G + r) * HD + c);
    *reinterpret_cast<uint4*>(Qs + r * LD + c) = v;
  }
  auto load_kv = [&](int stage, int kt) {
    bf16* Kd = Kst + stage * MMA_BN * LD;
    bf16* Vd = Vst + stage * MMA_BN * LD;
    for (int idx = tid; idx < MMA_BN * CH; idx += NW * 32) {
      const int r = idx / CH, c = (idx % CH) * 8, key = kt + r;
      const bool ok = key < end;
      const int kk = ok ? key : start;
      const size_t off = (((size_t)bt[kk / bs] * bs + kk % bs) * nkv + kvh) * HD + c;
      cp_async16(Kd + r * LD + c, k_cache + off, ok);
      cp_async16(Vd + r * LD + c, v_cache + off, ok);
    }
  };
  const int n_tiles = (end - start + MMA_BN - 1) / MMA_BN;
  load_kv(0, start);
  cp_async_commit();
  uint32_t qf[NK][4];
  float o[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m = -INFINITY, l = 0.f;  // row g (rows g + 8 are padding)
  const int kw = warp * 16;      // this warp's keys in a tile
  for (int it = 0; it < n_tiles; ++it) {
    const int kt = start + it * MMA_BN, stage = it & 1;
    if (it + 1 < n_tiles) {
      load_kv(stage ^ 1, kt + MMA_BN);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this tile (and Q) in shared memory
    if (it == 0) {
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) mm_ldsm4(qf[kk], Qs + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);
    }
    const bf16* Ks = Kst + stage * MMA_BN * LD;
    const bf16* Vs = Vst + stage * MMA_BN * LD;
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {  // keys kw..kw+7 (sc[0]) and kw+8..kw+15 (sc[1])
      uint32_t b[4];
      mm_ldsm4(b, Ks + (kw + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
      mm_mma(sc[0], qf[kk], b[0], b[1]);
      mm_mma(sc[1], qf[kk], b[2], b[3]);
    }
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // row g: elements 0, 1 (2, 3 are row g + 8: padding)
        const int key = kt + kw + n * 8 + 2 * t + e;
        sc[n][e] = key < end ? sc[n][e] * scale_log2 : -INFINITY;
        mx = fmaxf(mx, sc[n][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
    const float mn = fmaxf(m, mx), mu = mn == -INFINITY ? 0.f : mn;
    const float alpha = exp2f(m - mu);
    m = mn;
    l *= alpha;
#pragma unroll
    for (int n = 0; n < ND; ++n) {
      o[n][0] *= alpha;
      o[n][1] *= alpha;
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[n][e] = exp2f(sc[n][e] - mu);
        l += sc[n][e];
      }
    uint32_t pf[4];  // P (rows g, g + 8 = 0) as the A fragment of P V over the warp's 16 keys
    pf[0] = mm_pack(sc[0][0], sc[0][1]);
    pf[1] = 0u;
    pf[2] = mm_pack(sc[1][0], sc[1][1]);
    pf[3] = 0u;
#pragma unroll
    for (int n = 0; n < ND; n += 2) {
      uint32_t b[4];
      mm_ldsm4t(b, Vs + (kw + (lane & 7) + (((lane >> 3) & 1) << 3)) * LD + n * 8 + (lane >> 4) * 8);
      mm_mma(o[n], pf, b[0], b[1]);
      mm_mma(o[n + 1], pf, b[2], b[3]);
    }
    __syncthreads();  // every warp done with this stage before it is refilled
  }
  l += __shfl_xor_sync(FULL_MASK, l, 1);
  l += __shfl_xor_sync(FULL_MASK, l, 2);
  // merge the 4 warps' (m, l, O) of each row through shared memory (the K/V ring is free now)
  float* wo = reinterpret_cast<float*>(Kst);  // [NW][G][HD]
  if (g < G) {
#pragma unroll
    for (int n = 0; n < ND; ++n) {
      wo[(warp * G + g) * HD + n * 8 + 2 * t] = o[n][0];
      wo[(warp * G + g) * HD + n * 8 + 2 * t + 1] = o[n][1];
    }
    if (t == 0) {
      wm[warp][g] = m;
      wl[warp][g] = l;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < G * HD; idx += NW * 32) {
    const int r = idx / HD, d = idx % HD;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, wm[w][r]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      if (wl[w][r] > 0.f) {
        const float f = exp2f(wm[w][r] - M);
        num += f * wo[(w * G + r) * HD + d];
        den += f * wl[w][r];
      }
    }
    const float ov = num / den;  // den > 0: warp 0 holds key `start`
    if (nused == 1) {
      out[((size_t)tok * nq + kvh * G + r) * HD + d] = tobf(ov);
    } else {
      const size_t row = ((size_t)s * nq + kvh * G + r) * NS + split;
      part_o[row * HD + d] = ov;
      if (d == 0) part_lse[row] = M + log2f(den);
    }
  }
}

#define FLASHMMA(HD, G)                                                                                         \
  extern "C" __global__ void __launch_bounds__(128, 3) attn_flashmma_hd##HD##_g##G(                            \
      const bf16* q, const bf16* kc, const bf16* vc, float* po, float* plse, bf16* out, const int* cu,          \
      const int* sl, const int* bt, const uint32_t* ns, int nkv, int bs, int mbps, float sc, int target) {      \
    attn_flashmma_impl<HD, G>(q, kc, vc, po, plse, out, cu, sl, bt, ns, nkv, bs, mbps, sc, target);           \
  }
FLASHMMA(128, 4)
FLASHMMA(64, 4)
