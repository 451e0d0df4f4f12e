#!/usr/bin/env bash
# The cuBLASLt GEMM tuner (EngineConfig.gemm_candidates, blink/gpu/engine/cublaslt.py) on the H200: its
# correctness and what it buys, in one device call per PART group.
#   BLINK_COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/gt PARTS="tests sched decode" bash bench/gemm_tuning_gpu.sh
#   BLINK_COMMIT=... OUT=/tmp/gt PARTS="tput prefill" bash bench/gemm_tuning_gpu.sh
# Parts (each in its own process, logs in $OUT/<part>.log, all logs also in $OUT/0_all_logs.tar.gz):
#   tests    engine GPU tests (tuning is off by default; the forced-cuBLASLt test turns it on), vs transformers
#            (flashq), vs the numpy reference, shuffled tables bitwise, graph table, sampling
#   sched    bench/sched_run.sh tests: GPU scheduler tests, conformance through the ring, overhead, SIGSTOP
#   decode   bench/decode.py at context 1024 (batches 1-256) and 320 (64-256), each step also timed
#            with every GEMM on cublasGemmEx (row "gemmex")
#   tput     256 x (256 -> 128) on Llama-3-8B (bench/sched_bench.py), --gemm-candidates 8, then 0
#   prefill  bench/prefill.py 16x256, 1k, 4k with a per-category breakdown and GEMM shapes at 4096 rows
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_gemm_tuning_out}
mkdir -p "$OUT"
COMMIT=${BLINK_COMMIT:-unknown}
PY=${PY:-python3}
PARTS=${PARTS:-"tests sched decode"}
PART_SHOW="passed|failed|^FAILED|^ERROR|tok/s|gemmex|engine  |by kernel|^gemm rows|shapes on cuBLASLt|rc="
PART_TAIL=40
source bench/lib.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
env_log
PT="$PY -m pytest -q -p no:cacheprovider --timeout 150 -rA -s"
has tests && part tests 300 $PT tests/gpu/test_engine.py tests/gpu/test_engine_sampling.py -k \
  "gemm_tuning or graph_table or shuffled or llama3-8b-flashq-rego or qwen3-8b-flashq-rego or numpy_executor and flashq- or sampling"
has sched && part sched 300 env OUT="$OUT/sched" bash bench/sched_run.sh tests
DEC="$PY bench/decode.py --commit $COMMIT --variants flashq --gemm-candidates 8 --compare-gemm-tuning --iters 20"
has decode && part decode 200 bash -c "$DEC --batches 1,8,32,64,128,256 --breakdown 1,256 --out $OUT/decode1024.json &&
  $DEC --batches 64,128,256 --context 320 --breakdown 256 --compare-cublas= --out $OUT/decode320.json"
SB="$PY bench/sched_bench.py --preset llama3-8b --skip ablation,sigstop --commit $COMMIT"
has tput && part tput 400 env PYTHONPATH="$PWD:$PWD/tests" bash -c "$SB --gemm-candidates 8 --out $OUT/tput_tuned &&
  $SB --gemm-candidates 0 --out $OUT/tput_gemmex"
has prefill && part prefill 150 $PY bench/prefill.py --commit "$COMMIT" --gemm-candidates 8 --lengths 16x256,1024,4096 --breakdown \
  --gemm-rows 4096 --out "$OUT/prefill.json"
echo "=== summary (commit $COMMIT)"
for s in "${summary[@]}"; do echo "$s"; done
tar -czf "$OUT/0_all_logs.tar.gz" -C "$OUT" $(cd "$OUT" && find . -name '*.log' -o -name '*.json' -o -name '*.txt' | sed 's|^\./||')
