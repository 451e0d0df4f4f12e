#!/usr/bin/env bash
# FP8 weights on the H200 in one call (about 9 min with the default PARTS; each part under its timeout):
#   here, once:  python -m blink.gpu.toolchain.kernels --arch 90 --cache-dir build/kernels   (fp8.cu: ~5 s)
#   the call:    carry [.whl, build/kernels];  BLINK_COMMIT=<sha> bash bench/fp8_gpu.sh
# Parts (PARTS="..." picks; the order is the priority):
#   tests   tests/gpu/test_fp8_kernels.py: the kernels against the numpy definition, the engine on quantized and
#           on FP8-checkpoint weights against the numpy model, serving on both schedulers (~2-3 min)
#   gemm    bench/fp8_gemm.py: each projection's FP8 and bf16 paths at Llama-3-8B / Qwen3-32B shapes (~1 min)
#   models  bench/throughput.py --quantization fp8 --presets llama3-8b,qwen3-32b: batch-1 decode step and its
#           share of copy bandwidth (FP8 bytes), 256 x (256 -> 128) output tok/s, KV blocks (~4 min)
# Logs in $OUT/<part>.log, JSON in $OUT; a summary prints last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_fp8_out}
COMMIT=${BLINK_COMMIT:-unknown}
PARTS=${PARTS:-"tests gemm models"}
PY=${PY:-python3}
mkdir -p "$OUT"
source bench/lib.sh
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
env_log
has tests && part tests 240 $PY -m pytest -q -p no:cacheprovider -rA -s tests/gpu/test_fp8_kernels.py
has gemm && part gemm 150 $PY bench/fp8_gemm.py "$OUT" --commit "$COMMIT"
has models && part models 330 $PY bench/throughput.py --presets llama3-8b,qwen3-32b --schedulers gpu \
  --quantization fp8 --timeout 160 --commit "$COMMIT" --out "$OUT/models_fp8-h200-$COMMIT.json"
printf '%s\n' "${summary[@]}"
