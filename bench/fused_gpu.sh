#!/usr/bin/env bash
# GEMV fusions (EngineConfig.gemv_fusion) on the GPU: build, correctness of the fused AND the unfused
# path, decode step times of both. About 4 minutes on an H200; every part has its own timeout and
# the sum stays under BUDGET_S (parts past the budget are skipped and say so).
#   BLINK_COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/fused bash bench/fused_gpu.sh
# Parts run in separate processes (a kernel fault poisons its CUDA context): the fused tests and
# timings cannot take the unfused results down. Logs: $OUT/<part>.log; JSON: $OUT/decode_*.json;
# all of them also in $OUT/0_all_logs.tar.gz.
#   tests_on / tests_off   tests/gpu/test_engine.py -k fusion_on / fusion_off: vs transformers at batch
#                          1, 2, 3, 8 (GEMV path, prefill+decode mix), vs the numpy reference (small
#                          shapes); tests_on also compares fused and unfused graphs on one KV cache
#   decode_on              bench/decode.py, engine fused ("all"), batches 1, 8, 64; the same process
#                          also times "none", "norm,swiglu", "norm", "swiglu", "rope" (rows fusion_<spec>)
#   decode_off             the same with the engine unfused (a fallback if decode_on faults)
#   decode_gemv8           GEMV path for batches 1-8 (gemv_max_tokens 8), fused vs none vs cuBLAS
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_fused_out}
mkdir -p "$OUT"
COMMIT=${BLINK_COMMIT:-unknown}
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-285}
PARTS=${PARTS:-"tests_on decode_on tests_off decode_off decode_gemv8"}
PART_TAIL=25
source bench/lib.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
T0=$SECONDS

{
  date -u +%FT%TZ
  echo "commit $COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  $PY -c "import cupy, torch, transformers; print('cupy', cupy.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.log" 2>&1
if timeout 120 $PY -m blink.gpu.toolchain.kernels >>"$OUT/env.log" 2>&1; then
  summary+=("build         ok")
else
  summary+=("build         FAILED (see env.log)")
fi

PT="$PY -m pytest -q -p no:cacheprovider --timeout 100 -rA -s tests/gpu/test_engine.py"
DEC="$PY bench/decode.py --commit $COMMIT --variants flashq --compare-cublas= --iters 50"
has tests_on && part tests_on 110 $PT -k fusion_on
has decode_on && part decode_on 60 $DEC --batches 1,8,64 --breakdown 1 --gemv-fusion all \
  --compare-fusion "none;norm,swiglu;norm;swiglu;rope" --out "$OUT/decode_on.json"
has tests_off && part tests_off 90 $PT -k fusion_off
has decode_off && part decode_off 45 $DEC --batches 1,8,64 --breakdown 1 --gemv-fusion none --out "$OUT/decode_off.json"
has decode_gemv8 && part decode_gemv8 45 $DEC --batches 1,2,4,8 --breakdown= --gemv-max-tokens 8 --gemv-fusion all \
  --compare-fusion none --compare-cublas 2,4,8 --out "$OUT/decode_gemv8.json"

echo
echo "=== summary (commit $COMMIT, $((SECONDS - T0)) s)"
for t in tests_on tests_off; do
  [ -f "$OUT/$t.log" ] || continue
  grep -h -E "^(PASSED|FAILED|ERROR) " "$OUT/$t.log" | sed 's/^/  /'
  grep -h -E "^[=]* ?[0-9]+ (passed|failed)" "$OUT/$t.log" | tail -n 1 | sed "s/^/  $t: /"
done
for d in decode_on decode_off decode_gemv8; do
  [ -f "$OUT/$d.log" ] || continue
  echo "  $d (ms/step):"
  grep -h -E "^ +[0-9]+ +(engine|fusion_|cublas_only|gemv|attn_) " "$OUT/$d.log" | awk '{printf "    batch %-4s %-16s %s\n", $1, $2, $3}'
  grep -h -E "^engine gemv fusion|^batch 1 by kernel" "$OUT/$d.log" | sed 's/^/    /'
done
for s in "${summary[@]}"; do echo "  $s"; done
# A device call may return only a few files: every log and JSON in one tarball, named to sort first.
tar -czf "$OUT/0_all_logs.tar.gz" -C "$OUT" $(cd "$OUT" && ls | grep -E '\.(log|json)$')
