// Paged attention, prefill: packed varlen queries that also attend to previously cached context,
// FlashAttention-2's structure on tensor cores (mma.sync).
//
// KV cache of one layer: k_cache, v_cache [num_blocks, block_size, nkv, HD] bf16; token p of
// sequence s lives in block block_tables[s][p / block_size], row p % block_size. Causality: the
// query at position p attends keys 0..p, and the queries of a chunk sit at the end of the
// sequence (prefix = seq_len - q_len), so chunked prefill needs no extra metadata.
//
// Grid (T/64 + S, nq), 128 threads = 4 warps, a 64-query tile of one sequence and one head (tile ->
// sequence by a warp scan over cu_q_lens). Scores, softmax and O never leave registers: mma.sync
// m16n8k16 (bf16 -> fp32) with ldmatrix operands; each warp holds its 16 Q rows as A fragments,
// the 16 x 64 score tile as accumulators, turns the probabilities into the A fragments of P V in
// place (bf16), and keeps O (16 x HD) in accumulators; row max / sum over the 4 lanes of a quad by
// shuffles, the sum reduced once at the end. K/V tiles arrive by cp.async, double buffered (the
// next tile's copies in flight during this tile's math), rows past the context zero-filled.
// Shared memory: Q 64 x (HD+8) + 2 stages x (K, V) 64 x (HD+8), bf16 = 85 KiB at HD=128.
#include "common.cuh"
#include "kv_cache.cuh"

// The (sequence, BM-query tile) a prefill block works on: tiles are numbered sequence after
// sequence, so warp 0 scans the tile counts of cu_q_lens (a warp prefix sum per 32 sequences) for
// the one holding blockIdx.x; sh_s = -1 when the block is past the live tiles. One-token rows get no
// tile: the decode kernel, launched before this one in every prefill graph, computes them exactly as
// in a decode step (a decode row's numerics must not depend on what shares its step). Ends in a barrier.
template <int BM>
__device__ __forceinline__ void prefill_tile_of_block(const int* __restrict__ cu_q_lens,
                                                      const uint32_t* __restrict__ num_seqs, int& sh_s,
                                                      int& sh_tile) {
  const int lane = threadIdx.x & 31;
  if ((threadIdx.x >> 5) == 0) {
    if (lane == 0) sh_s = -1;
    __syncwarp();
    const int ns = (int)*num_seqs;
    int base = 0;
    for (int s0 = 0; s0 < ns && base <= (int)blockIdx.x; s0 += 32) {
      const int s = s0 + lane;
      int nt = 0;
      if (s < ns) {
        const int ql = cu_q_lens[s + 1] - cu_q_lens[s];
        nt = ql > 1 ? (ql + BM - 1) / BM : 0;  // one-token rows: the decode kernel (launched first) owns them
      }
      int inc = nt;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += y;
      }
      const int excl = base + inc - nt;
      if (nt > 0 && (int)blockIdx.x >= excl && (int)blockIdx.x < excl + nt) {
        sh_s = s;
        sh_tile = blockIdx.x - excl;
      }
      base += __shfl_sync(FULL_MASK, inc, 31);
    }
  }
  __syncthreads();
}

// ---- the fa2 kernel's building blocks ---------------------------------------------------------
__device__ __forceinline__ uint32_t fa2_smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void fa2_cp16(void* smem, const void* gmem, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fa2_smem(smem)), "l"(gmem), "r"(ok ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void fa2_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void fa2_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// Four 8x8 b16 matrices; lane l addresses row l % 8 of matrix l / 8; r[j] = matrix j's
// (row l / 4, cols 2 (l % 4), +1). `.trans`: matrix j's (rows 2 (l % 4), +1; col l / 4).
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(fa2_smem(p)));
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(fa2_smem(p)));
}

// D (16x8 fp32) += A (16x16 bf16, row) B (16x8 bf16, col). Fragments, g = lane / 4, t = lane % 4:
// A a0 (g, 2t..2t+1) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..); B b0 (2t..2t+1, g) b1 (2t+8.., g);
// D d0 d1 (g, 2t, 2t+1), d2 d3 (g+8, 2t, 2t+1).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = the lower column
  return *reinterpret_cast<uint32_t*>(&v);
}

// KvFp8 (kv_cache.cuh): the same tiles on f16 operands (decoded codes are exact in f16; Q converted once).
template <bool F16>
__device__ __forceinline__ void mma_t(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (F16) {
    kv_mma_f16(d, a, b0, b1);
  } else {
    mma_bf16(d, a, b0, b1);
  }
}
template <bool F16>
__device__ __forceinline__ uint32_t pack_t(float lo, float hi) {
  if constexpr (F16) {
    return kv_pack_f16(lo, hi);
  } else {
    return pack_bf16x2(lo, hi);
  }
}

template <int HD, typename KV>
__device__ __forceinline__ void attn_prefill_fa2_impl(const bf16* __restrict__ q,
                                                      const typename KV::T* __restrict__ k_cache,
                                                      const typename KV::T* __restrict__ v_cache, bf16* __restrict__ out,
                                                      const int* __restrict__ cu_q_lens,
                                                      const int* __restrict__ seq_lens,
                                                      const int* __restrict__ block_tables,
                                                      const uint32_t* __restrict__ num_seqs, int nkv, int bs,
                                                      int mbps, float scale_log2) {
  constexpr int BM = 64, BN = 64, LD = HD + 8;  // row stride: an odd number of 16-byte units
  constexpr int NK = HD / 16, ND = HD / 8, CH = HD / 8, NB = BN / 8;
  static_assert(HD % 16 == 0 && ND % 2 == 0, "head dim: a multiple of 16");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Kst = Qs + BM * LD;       // [2][BN][LD]
  bf16* Vst = Kst + 2 * BN * LD;  // [2][BN][LD]
  // KvFp8: Q, K and V tiles in f16, one stage of K and V ([BN][LD] each, at Kst and Kst + BN * LD), fed
  // from two stages of codes [2][BN][HD] bytes behind them (within the bf16 kernel's shared memory);
  // each thread decodes the 16-byte chunks (and converts the Q vectors) it copied itself.
  constexpr bool F8 = KV::PATH == 2;
  constexpr int CH8 = HD / 16;  // 16-code chunks of a key row
  unsigned char* K8 = reinterpret_cast<unsigned char*>(Kst + 2 * BN * LD);  // [2][BN][HD]
  unsigned char* V8 = K8 + 2 * BN * HD;                                     // [2][BN][HD]
  if constexpr (F8) scale_log2 *= KV_SCALE;  // K's scale, once
  __shared__ int sh_s, sh_tile;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = blockIdx.y, nq = gridDim.y, G = nq / nkv, kvh = h / G;
  prefill_tile_of_block<BM>(cu_q_lens, num_seqs, sh_s, sh_tile);
  const int s = sh_s;
  if (s < 0) return;
  const int q0 = cu_q_lens[s], ql = cu_q_lens[s + 1] - q0;
  const int pre = seq_lens[s] - ql;
  const int r0 = sh_tile * BM, rows = min(BM, ql - r0);
  const int kv_end = pre + r0 + rows;  // keys this tile's last query sees
  const int n_tiles = (kv_end + BN - 1) / BN;
  const int* bt = block_tables + (size_t)s * mbps;
  for (int idx = tid; idx < BM * CH; idx += blockDim.x) {  // Q tile, rows past the chunk zeroed
    const int r = idx / CH, c = (idx % CH) * 8;
    const bool ok = r < rows;
    fa2_cp16(Qs + r * LD + c, q + ((size_t)(q0 + r0 + (ok ? r : 0)) * nq + h) * HD + c, ok);
  }
  auto load_kv = [&](int stage, int kt) {
    if constexpr (F8) {
      for (int idx = tid; idx < BN * CH8; idx += blockDim.x) {
        const int r = idx / CH8, c = (idx % CH8) * 16, key = kt + r;
        const bool ok = key < kv_end;
        const int kk = ok ? key : 0;
        const size_t off = (((size_t)bt[kk / bs] * bs + kk % bs) * nkv + kvh) * HD + c;
        fa2_cp16(K8 + (stage * BN + r) * HD + c, k_cache + off, ok);
        fa2_cp16(V8 + (stage * BN + r) * HD + c, v_cache + off, ok);
      }
      return;
    }
    bf16* Kd = Kst + stage * BN * LD;
    bf16* Vd = Vst + stage * BN * LD;
    for (int idx = tid; idx < BN * CH; idx += blockDim.x) {
      const int r = idx / CH, c = (idx % CH) * 8;
      const int key = kt + r;
      const bool ok = key < kv_end;
      const int kk = ok ? key : 0;
      const size_t off = (((size_t)bt[kk / bs] * bs + kk % bs) * nkv + kvh) * HD + c;
      if constexpr (KV::PATH == 0) {
        fa2_cp16(Kd + r * LD + c, k_cache + off, ok);
        fa2_cp16(Vd + r * LD + c, v_cache + off, ok);
      } else {
        kv_tile8(Kd + r * LD + c, k_cache + off, ok);
        kv_tile8(Vd + r * LD + c, v_cache + off, ok);
      }
    }
  };
  load_kv(0, 0);
  fa2_commit();  // group 0: Q and the first K/V tile

  const int g = lane >> 2, t = lane & 3, wr = warp * 16;
  const int qpos = pre + r0 + wr + g;  // position of the row g query (row g + 8: qpos + 8)
  uint32_t qf[NK][4];
  float o[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  for (int it = 0; it < n_tiles; ++it) {
    const int kt = it * BN, stage = it & 1;
    if (it + 1 < n_tiles) {  // the next tile into the other stage (freed by the last barrier)
      load_kv(stage ^ 1, kt + BN);
      fa2_commit();
      fa2_wait<1>();
    } else {
      fa2_wait<0>();
    }
    if constexpr (F8) {
      if (it == 0) {  // this thread's Q vectors to f16, in place
        for (int idx = tid; idx < BM * CH; idx += blockDim.x) {
          uint4* p = reinterpret_cast<uint4*>(Qs + (idx / CH) * LD + (idx % CH) * 8);
          *p = kv_q_f16x8(*p);
        }
      }
      // this thread's chunks of the tile's codes -> the f16 tiles (free since the last barrier)
      for (int idx = tid; idx < BN * CH8; idx += blockDim.x) {
        const int r = idx / CH8, c = (idx % CH8) * 16, o8 = (stage * BN + r) * HD + c;
        uint4 lo, hi;
        kv_f16x16(*reinterpret_cast<const uint4*>(K8 + o8), lo, hi);
        *reinterpret_cast<uint4*>(Kst + r * LD + c) = lo;
        *reinterpret_cast<uint4*>(Kst + r * LD + c + 8) = hi;
        kv_f16x16(*reinterpret_cast<const uint4*>(V8 + o8), lo, hi);
        *reinterpret_cast<uint4*>(Kst + (BN + r) * LD + c) = lo;
        *reinterpret_cast<uint4*>(Kst + (BN + r) * LD + c + 8) = hi;
      }
    }
    __syncthreads();  // this tile (and Q) copied by every thread
    if (it == 0) {
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) ldsm4(qf[kk], Qs + (wr + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
    }
    const bf16* Ks = Kst + (F8 ? 0 : stage) * BN * LD;
    const bf16* Vs = F8 ? Kst + BN * LD : Vst + stage * BN * LD;
    float sc[NB][4];
#pragma unroll
    for (int n = 0; n < NB; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
#pragma unroll
      for (int n = 0; n < NB; n += 2) {  // keys 8n..8n+15: (keys, dims) b0 b1 of block n, then of n + 1
        uint32_t b[4];
        ldsm4(b, Ks + (n * 8 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
        mma_t<F8>(sc[n], qf[kk], b[0], b[1]);
        mma_t<F8>(sc[n + 1], qf[kk], b[2], b[3]);
      }
    }
    // causal mask and the scale (base 2), then the online softmax of rows g (i = 0) and g + 8 (i = 1)
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NB; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kt + n * 8 + 2 * t + (e & 1);
        const bool ok = key < kv_end && key <= qpos + (e >> 1) * 8;
        sc[n][e] = ok ? sc[n][e] * scale_log2 : -INFINITY;
        mx[e >> 1] = fmaxf(mx[e >> 1], sc[n][e]);
      }
    }
    float mu[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 2));
      const float mn = fmaxf(m[i], mx[i]);
      mu[i] = mn == -INFINITY ? 0.f : mn;  // a row with no key yet: keep every term at exp2(-inf) = 0
      const float alpha = exp2f(m[i] - mu[i]);
      m[i] = mn;
      l[i] *= alpha;
#pragma unroll
      for (int n = 0; n < ND; ++n) {
        o[n][2 * i] *= alpha;
        o[n][2 * i + 1] *= alpha;
      }
    }
    uint32_t pf[BN / 16][4];  // P as the A fragments of P V: keys 16c..16c+15
#pragma unroll
    for (int n = 0; n < NB; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[n][e] = exp2f(sc[n][e] - mu[e >> 1]);
        l[e >> 1] += sc[n][e];
      }
    }
#pragma unroll
    for (int c = 0; c < BN / 16; ++c) {
      pf[c][0] = pack_t<F8>(sc[2 * c][0], sc[2 * c][1]);
      pf[c][1] = pack_t<F8>(sc[2 * c][2], sc[2 * c][3]);
      pf[c][2] = pack_t<F8>(sc[2 * c + 1][0], sc[2 * c + 1][1]);
      pf[c][3] = pack_t<F8>(sc[2 * c + 1][2], sc[2 * c + 1][3]);
    }
#pragma unroll
    for (int c = 0; c < BN / 16; ++c) {
#pragma unroll
      for (int n = 0; n < ND; n += 2) {  // V^T tiles: (keys 0-7, 8-15) x dims 8n.., then dims 8n+8..
        uint32_t b[4];
        ldsm4t(b, Vs + (c * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * LD + n * 8 + (lane >> 4) * 8);
        mma_t<F8>(o[n], pf[c], b[0], b[1]);
        mma_t<F8>(o[n + 1], pf[c], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(FULL_MASK, l[i], 1);
    l[i] += __shfl_xor_sync(FULL_MASK, l[i], 2);
    const int r = wr + g + 8 * i;
    if (r >= rows) continue;
    const float inv = F8 ? KV_SCALE / l[i] : 1.f / l[i];  // KvFp8: V's scale, once
    bf16* orow = out + ((size_t)(q0 + r0 + r) * nq + h) * HD;
#pragma unroll
    for (int n = 0; n < ND; ++n)
      *reinterpret_cast<__nv_bfloat162*>(orow + n * 8 + 2 * t) =
          __floats2bfloat162_rn(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
  }
}

#define PREFILL_KV(HD, T, KV, SUFFIX)                                                                         \
  extern "C" __global__ void __launch_bounds__(128, 2) attn_prefill_fa2_hd##HD##SUFFIX(                       \
      const bf16* q, const T* kc, const T* vc, bf16* out, const int* cu, const int* sl, const int* bt,         \
      const uint32_t* ns, int nkv, int bs, int mbps, float sc) {                                               \
    attn_prefill_fa2_impl<HD, KV>(q, kc, vc, out, cu, sl, bt, ns, nkv, bs, mbps, sc);                          \
  }
// Each over a bf16 cache and, suffixed _fp8kv, over an fp8 one (kv_cache.cuh's KvFp8Engine read policy).
#define PREFILL_PER_HD(HD)      \
  PREFILL_KV(HD, bf16, KvBf16, ) \
  PREFILL_KV(HD, kv8, KvFp8Engine, _fp8kv)
#ifndef KV_ATTENTION_TEMPLATES_ONLY  // bench/kernels/fp8kv_variants.cu instantiates its own
PREFILL_PER_HD(16)
PREFILL_PER_HD(32)
PREFILL_PER_HD(64)
PREFILL_PER_HD(128)
#endif
