#!/usr/bin/env bash
# The GPU-resident scheduler on the H200, one device call: build, tests, conformance, benchmarks.
#   bash bench/sched_run.sh [tests|bench|all]     (OUT=dir for results, default /tmp/sched_out)
# Writes at most 6 files: sched_log.txt (every log), sched_overhead.json, sched_bench/*.json,
# sched_bench_135m/ablation.json. bench/run_gpu.sh calls this (part "sched"). SCHED_SKIP=sigstop,...
# skips parts of the 8B benchmark. Needs the H200 image plus msgspec (the device process's spec is
# msgspec JSON): carry .whl (msgspec's wheel), installed here when the image lacks it.
# DECODE_ATTENTION=basic: engines use that decode attention (bench/run_gpu.sh's fallback when the
# default one fails the engine tests); conformance then runs its device with it too.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sched_out}
MODE=${1:-all}
mkdir -p "$OUT"
LOG="$OUT/sched_log.txt"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
DA=${DECODE_ATTENTION:-}
DA_ARGS=()
DEVICE='{"kind": "cuda"}'
if [ -n "$DA" ]; then
  DA_ARGS=(--decode-attention "$DA")
  DEVICE="{\"kind\": \"cuda\", \"decode_attention\": \"$DA\"}"
fi
if ! $PY -c "import msgspec" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/blink-site .whl/msgspec-*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/blink-site"
fi
step() {  # step NAME TIMEOUT CMD... : full output into $LOG, its summary lines to stdout
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*" >>"$LOG"
  timeout "$limit" "$@" >>"$LOG.part" 2>&1
  local r=$?
  cat "$LOG.part" >>"$LOG"
  grep -E "passed|failed|^FAILED|^ERROR|tok/s|ratio|host/gpu|us \(|^ *[0-9]+ +[0-9.]+ " "$LOG.part" | tail -25
  rm -f "$LOG.part"
  echo "=== $name rc=$r" | tee -a "$LOG"
  return $r
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$LOG"
$PY -m blink.gpu.scheduler.scheduler --check || exit 1
$PY -c "from blink.gpu.scheduler import scheduler as s; print('scheduler cubin', s.build_cubin())" || exit 1
rc=0
PT=($PY -m pytest -q -p no:cacheprovider --timeout 60)
if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
  step scheduler-tests 120 "${PT[@]}" -x tests/gpu/test_scheduler.py
  rc=$?
  if [ $rc -ne 0 ] && [ -d build/sched_fallback ]; then
    # a copy of the last kernel sources that passed on the H200 (carried in build/)
    echo "=== new kernel failed: falling back to build/sched_fallback" | tee -a "$LOG"
    cp build/sched_fallback/* blink/gpu/scheduler/csrc/
    step scheduler-tests-fallback 120 "${PT[@]}" -x tests/gpu/test_scheduler.py
    rc=$?
  fi
  [ $rc -eq 0 ] || exit $rc  # the mechanics are broken: the rest would only time out
  BLINK_CONFORMANCE_DEVICE=$DEVICE step conformance 150 "${PT[@]}" -m "not slow" tests/conformance
  rc=$((rc | $?))
  step overhead 60 $PY bench/sched_overhead.py --out "$OUT/sched_overhead.json" ${DA_ARGS[@]+"${DA_ARGS[@]}"}
  rc=$((rc | $?))
  step sigstop-test 60 "${PT[@]}" -x -s tests/gpu/test_sigstop.py
  rc=$((rc | $?))
fi
if [ "$MODE" = tests ]; then  # the benchmarks themselves, at small sizes (tiny model)
  step bench-small 100 $PY bench/sched_bench.py --preset tiny-llama --small --phase 3 --out "$OUT/small" ${DA_ARGS[@]+"${DA_ARGS[@]}"}
  rc=$((rc | $?))
fi
if [ "$MODE" = bench ] || [ "$MODE" = all ]; then
  step bench-8b 400 $PY bench/sched_bench.py --preset llama3-8b --out "$OUT/sched_bench" --skip "${SCHED_SKIP:-}" ${DA_ARGS[@]+"${DA_ARGS[@]}"}
  rc=$((rc | $?))
  # the same ablation where the scheduler's share of a step is large (135M model: ~0.1 ms steps)
  step ablation-135m 150 $PY bench/sched_bench.py --preset smollm2-135m --kv-blocks 16384 --skip throughput,sigstop \
    --out "$OUT/sched_bench_135m" ${DA_ARGS[@]+"${DA_ARGS[@]}"}
  rc=$((rc | $?))
fi
exit $rc
