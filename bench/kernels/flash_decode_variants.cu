// Decode attention variants retired from the engine (llm.c dev/cuda style: kept and runnable, out
// of the serving path; bench/kernels/decode_attention.py builds, checks and times them).
//
// Both are the engine's flash-decoding template (blink/gpu/engine/csrc/flash_decode.cu, included here)
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
