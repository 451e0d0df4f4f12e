// The fp8 KV cache's first attention kernels, kept out of the engine to time against its own
// (bench/kernels/fp8kv_attention.py builds, checks and times them; llm.c dev/cuda style).
//
// "fp8tile" (kv_cache.cuh KvFp8Tile): the engine's templates reading an fp8 cache with synchronous
// 8-byte loads, each 8 codes decoded to bf16 and stored into the bf16 tile/ring the bf16 kernels fill by
// cp.async; the bf16 math after that. The engine's _fp8kv kernels (KvFp8) copy the codes by cp.async
// and decode them once (flashq: in registers; flashmma, fa2: into an f16 tile for f16 mma).
// Llama-3-8B's shape only: head dim 128, 4 query heads per KV head.
#define KV_ATTENTION_TEMPLATES_ONLY
#include "flash_decode.cu"
#include "prefill_attention.cu"

FLASH_KV(flashq, 128, 4, 4, 4, 3, kv8, KvFp8Tile, _fp8tile)
FLASHMMA_KV(128, 4, kv8, KvFp8Tile, _fp8tile)
PREFILL_KV(128, kv8, KvFp8Tile, _fp8tile)
