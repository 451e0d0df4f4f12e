# Shared by the GPU scripts (run_gpu.sh, fused_gpu.sh, gemm_tuning_gpu.sh, next_gpu_check.sh); source
# it from the repository root once OUT and PARTS are set.
#   part NAME TIMEOUT_S CMD...  CMD in its own process (a CUDA fault cannot take the other parts
#                               down) under a timeout, cut to what is left of BUDGET_S when that is
#                               set; output appended to $OUT/NAME.log; one line in `summary`; then
#                               the log's lines matching $PART_SHOW (an extended regex), or its
#                               last $PART_TAIL (30) lines
#   has PART                    PART is listed in $PARTS
#   env_log                     $OUT/env.log: the date, $COMMIT, the GPU (nvidia-smi), then the output of
#                               building every kernel with $PY ("kernel build FAILED" also printed)
summary=()
LIB_T0=$SECONDS

part() {
  local name=$1 limit=$2
  shift 2
  if [ -n "${BUDGET_S:-}" ]; then
    local left=$((BUDGET_S - (SECONDS - LIB_T0)))
    if [ "$left" -lt 20 ]; then
      summary+=("$(printf '%-14s SKIPPED (budget of %ss spent)' "$name" "$BUDGET_S")")
      return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
  fi
  local t0=$SECONDS
  echo "=== $name (timeout ${limit}s): $*" | tee -a "$OUT/$name.log"
  timeout -k 5 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-14s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  if [ -n "${PART_SHOW:-}" ]; then
    grep -E "$PART_SHOW" "$OUT/$name.log" | tail -n "${PART_TAIL:-30}"
  else
    tail -n "${PART_TAIL:-30}" "$OUT/$name.log"
  fi
}

has() { [[ " $PARTS " == *" $1 "* ]]; }

env_log() {
  {
    date -u +%FT%TZ
    echo "commit $COMMIT"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  } >"$OUT/env.log" 2>&1
  $PY -m blink.gpu.toolchain.kernels >>"$OUT/env.log" 2>&1 || echo "kernel build FAILED" | tee -a "$OUT/env.log"
}
