#!/usr/bin/env bash
# The GPU-resident scheduler on the H200, one device call: build, tests, conformance, benchmarks.
#   bash bench/sched_run.sh [tests|bench|all]      (results and logs under $OUT, default /tmp/sched_out)
# bench/run_gpu.sh calls this. Needs nothing beyond the H200 image (no msgspec on the GPU path).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sched_out}
MODE=${1:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
$PY -m blink.gpu.scheduler --check || exit 1
$PY -c "from blink.gpu import scheduler as s; print('scheduler cubin', s.build_cubin())" || exit 1
rc=0
if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
  timeout 120 $PY -m pytest -x -q -p no:cacheprovider --timeout 60 tests/gpu/test_scheduler.py >"$OUT/sched_tests.log" 2>&1
  rc=$?
  tail -40 "$OUT/sched_tests.log"
  if [ $rc -ne 0 ] && [ -d build/sched_fallback ]; then
    # SCHED_FALLBACK: a copy of the last kernel sources that passed on the H200 (carried in build/)
    echo "=== new kernel failed: falling back to build/sched_fallback" | tee -a "$OUT/sched_tests.log"
    cp build/sched_fallback/* blink/gpu/csrc/
    timeout 120 $PY -m pytest -x -q -p no:cacheprovider --timeout 60 tests/gpu/test_scheduler.py >>"$OUT/sched_tests.log" 2>&1
    rc=$?
    tail -5 "$OUT/sched_tests.log"
  fi
  [ $rc -eq 0 ] || exit $rc  # the mechanics are broken: the rest would only time out
  BLINK_DEVICE_FACTORY=blink.gpu.serve:conformance_factory timeout 150 $PY -m pytest -q -p no:cacheprovider \
    --timeout 60 -m "not slow" tests/conformance >"$OUT/sched_conformance.log" 2>&1
  rc=$((rc | $?))
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/sched_conformance.log" | tail -30
  timeout 60 $PY bench/sched_overhead.py --out "$OUT/sched_overhead.json" 2>&1 | tail -8
  rc=$((rc | PIPESTATUS[0]))
fi
if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
  timeout 60 $PY -m pytest -x -q -p no:cacheprovider -s tests/gpu/test_sigstop.py >"$OUT/sched_sigstop_test.log" 2>&1
  rc=$((rc | $?))
  grep -E "tok/s|passed|failed" "$OUT/sched_sigstop_test.log"
fi
if [ "$MODE" = tests ]; then  # the benchmarks themselves, at small sizes (tiny model)
  timeout 100 $PY bench/sched_bench.py --preset tiny-llama --small --phase 3 --out "$OUT/small" >"$OUT/sched_bench_small.log" 2>&1
  rc=$((rc | $?))
  tail -20 "$OUT/sched_bench_small.log"
fi
if [ "$MODE" = bench ] || [ "$MODE" = all ]; then
  timeout 400 $PY bench/sched_bench.py --preset llama3-8b --out "$OUT/sched_bench" --skip "${SCHED_SKIP:-}" \
    2>&1 | tee "$OUT/sched_bench.log" | tail -30
  rc=$((rc | PIPESTATUS[0]))
  # the same ablation where the scheduler's share of a step is large (135M model: ~0.1 ms steps)
  timeout 150 $PY bench/sched_bench.py --preset smollm2-135m --kv-blocks 16384 --skip throughput,sigstop \
    --out "$OUT/sched_bench_135m" 2>&1 | tail -9
  rc=$((rc | PIPESTATUS[0]))
fi
exit $rc
