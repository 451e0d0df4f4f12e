#!/usr/bin/env bash
# One device call (about 8 min on an H200) for what was written after session 3's last GPU call:
#   BLINK_COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/nc bash bench/next_gpu_check.sh
# Parts (own processes; logs $OUT/<part>.log, all in $OUT/0_all_logs.tar.gz):
#   tests    tests/gpu/test_engine.py: "fa2" prefill (vs transformers, vs the numpy engine, vs "rego"
#            on long chunked prefills), Qwen2 (qwen2.5-7b vs transformers, tiny-qwen2 vs numpy),
#            the default table and shuffled tables; GPU sampling
#   prefill  bench/prefill.py: every prefill kernel (rego, fa2) on 16x256, 1k, 4k
#   decode   bench/decode.py (refactored step setup): batches 1-256, default table
#   tput     256 x (256 -> 128) on Llama-3-8B, prefill "rego" (the default) and then "fa2"
#   qwen     Qwen2.5-7B shape (GQA 7, q/k/v biases): decode batches 1-64 and 256 x (256 -> 128)
# If fa2 passes its tests and is faster, make it EngineConfig.prefill_attention's default.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_next_check}
mkdir -p "$OUT"
COMMIT=${BLINK_COMMIT:-unknown}
PY=${PY:-python3}
PARTS=${PARTS:-"tests prefill decode tput qwen"}
PART_SHOW="passed|failed|^FAILED|^ERROR|tok/s|TFLOP|ms/step|rel err|^ +[0-9]+ "
source bench/lib.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
env_log
PT="$PY -m pytest -q -p no:cacheprovider --timeout 150 -rA -s"
has tests && part tests 300 $PT tests/gpu/test_engine.py tests/gpu/test_engine_sampling.py -k \
  "fa2 or qwen2 or graph_table or shuffled or sampling"
has prefill && part prefill 150 $PY bench/prefill.py --commit "$COMMIT" --lengths 16x256,1024,4096 \
  --out "$OUT/prefill.json"
has decode && part decode 150 $PY bench/decode.py --commit "$COMMIT" --variants flashq --batches 1,8,64,256 \
  --out "$OUT/decode.json"
SB="$PY bench/sched_bench.py --skip ablation,sigstop --commit $COMMIT"
has tput && part tput 300 env PYTHONPATH="$PWD:$PWD/tests" bash -c "$SB --preset llama3-8b --out $OUT/tput_rego &&
  $SB --preset llama3-8b --prefill-attention fa2 --out $OUT/tput_fa2"
has qwen && part qwen 300 env PYTHONPATH="$PWD:$PWD/tests" bash -c "$PY bench/decode.py --commit $COMMIT \
  --model qwen2.5-7b --variants flashq --batches 1,8,64 --breakdown= --compare-cublas= --out $OUT/decode_qwen.json &&
  $SB --preset qwen2.5-7b --out $OUT/tput_qwen"
echo "=== summary (commit $COMMIT)"
for s in "${summary[@]}"; do echo "$s"; done
tar -czf "$OUT/0_all_logs.tar.gz" -C "$OUT" $(cd "$OUT" && find . -name '*.log' -o -name '*.json' | sed 's|^\./||')
