#!/usr/bin/env bash
# All GPU tests and benchmarks of Blink, in one command (the default PARTS run everything, roughly 10-15 min on an H200):
#   BLINK_COMMIT=$(git rev-parse --short HEAD) bash bench/run_gpu.sh
# A shorter call picks parts, e.g. PARTS="engine-tests decode tput8b ablation135m sigstop135m" (~3 min).
# Parts outside the default: tput8b ablation135m sigstop135m smsteal stepprofile kernelvariants
# schedtests (sched's tests and conformance without its 8B benchmark). The check after a refactor
# of the engine (<= 9 min): PARTS="engine-tests schedtests kernelvariants" BUDGET_S=540 bash bench/run_gpu.sh
# Each part logs to $OUT/<part>.log (and JSON to $OUT/<part>.json); a summary table prints last.
# Parts run in separate processes so a CUDA fault in one cannot take down the others.
# Decode attention: the engine's default table (flashq) unless DECODE_ATTENTION is set
# ("basic", "1:flashq,64:basic", ...). engine-tests tests each variant in its own process;
# decode.py then times only the variants that passed (a faulting kernel would lose the whole
# part), and when flashq (the default) or the default-table tests fail, decode and sched run
# with DECODE_ATTENTION=basic, the previous default. After decode, sched uses decode.py's best
# table (its "best table" line) unless DECODE_ATTENTION was given.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_gpu_out}
mkdir -p "$OUT"
COMMIT=${BLINK_COMMIT:-unknown}
PARTS=${PARTS:-"engine-tests decode prefill hf sched"}  # sched: scheduler tests, conformance, benchmarks
source bench/lib.sh
PY=${PY:-python3}
DECODE_ATTENTION=${DECODE_ATTENTION:-}
USER_DECODE_ATTENTION=$DECODE_ATTENTION
ALL_VARIANTS=${TEST_VARIANTS:-basic,flashq}  # engine-tests: variants to test
VARIANTS=${VARIANTS:-$ALL_VARIANTS}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv >"$OUT/env.log" 2>&1
$PY -c "import cupy, torch, transformers; print('cupy', cupy.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >>"$OUT/env.log" 2>&1
$PY -m blink.gpu.toolchain.kernels >>"$OUT/env.log" 2>&1 || echo "kernel build FAILED" | tee -a "$OUT/env.log"

if has engine-tests; then
  # One pytest process per decode attention variant: a kernel fault poisons its CUDA context, so
  # it must not take the other variants' tests with it. Test ids name the variant ("...-flashq-rego",
  # "flashq-long"); graph_table and shuffled run the engine's default table.
  PT="$PY -m pytest -q -p no:cacheprovider --timeout 120 -rA"
  CMDS="$PT tests/gpu/test_engine_sampling.py; $PT tests/gpu/test_engine.py -k 'graph_table or shuffled or fa2_matches or gemm_tuning'"
  for v in ${ALL_VARIANTS//,/ }; do CMDS="$CMDS; $PT -s tests/gpu/test_engine.py -k '$v-'"; done
  part engine-tests 560 bash -c "$CMDS"
  ok=()
  for v in ${ALL_VARIANTS//,/ }; do
    n=$(grep -cE "^PASSED tests/gpu/test_engine.py::.*[[-]$v-" "$OUT/engine-tests.log")
    bad=$(grep -cE "^(FAILED|ERROR) tests/gpu/test_engine.py::.*[[-]$v-" "$OUT/engine-tests.log")
    echo "=== variant $v: $n passed, $bad failed" | tee -a "$OUT/engine-tests.log"
    [ "$n" -ge 4 ] && [ "$bad" -eq 0 ] && ok+=("$v")
  done
  default_bad=$(grep -cE "^(FAILED|ERROR) tests/gpu/test_engine.py::test_(graph_table|shuffled)" "$OUT/engine-tests.log")
  VARIANTS=$(IFS=,; echo "${ok[*]:-basic}")
  if [ -z "$DECODE_ATTENTION" ] && { [[ ",$VARIANTS," != *",flashq,"* ]] || [ "$default_bad" -ne 0 ]; }; then
    echo "=== the default decode attention (flashq) failed: decode and sched use basic" | tee -a "$OUT/engine-tests.log"
    DECODE_ATTENTION=basic
  fi
  echo "=== decode attention variants that passed: $VARIANTS" | tee -a "$OUT/engine-tests.log"
fi
DA_ARGS=()
[ -n "$DECODE_ATTENTION" ] && DA_ARGS=(--decode-attention "$DECODE_ATTENTION")
if has decode; then
  part decode 300 $PY bench/decode.py --commit "$COMMIT" --out "$OUT/decode.json" --variants "$VARIANTS" \
    ${DA_ARGS[@]+"${DA_ARGS[@]}"}
  # later parts (sched) use the measured best table unless DECODE_ATTENTION was given
  best=$(grep -h "^best table: --decode-attention " "$OUT/decode.log" | tail -n 1 | sed 's/^best table: --decode-attention //')
  if [ -z "$USER_DECODE_ATTENTION" ] && [ -n "$best" ]; then
    DECODE_ATTENTION=$best
    echo "=== decode attention from here on (decode.py's best per batch): $DECODE_ATTENTION" | tee -a "$OUT/decode.log"
  fi
fi
if has prefill; then
  part prefill 200 $PY bench/prefill.py --commit "$COMMIT" --out "$OUT/prefill.json"
fi
if has hf; then
  part hf 400 $PY bench/hf_baseline.py --commit "$COMMIT" --batch-requests "${HF_BATCH_REQUESTS:-0}" --out "$OUT/hf.json"
fi
if has sched; then  # the GPU-resident scheduler: tests, conformance, overhead, sigstop, benchmarks
  part sched 1500 env OUT="$OUT/sched" DECODE_ATTENTION="$DECODE_ATTENTION" bash bench/sched_run.sh all
fi
if has schedtests; then  # the scheduler's tests, conformance through the ring, overhead, SIGSTOP, small benchmarks
  part schedtests 420 env OUT="$OUT/sched" DECODE_ATTENTION="$DECODE_ATTENTION" bash bench/sched_run.sh tests
fi
if has kernelvariants; then  # the decode attention variants kept in bench/kernels/, checked and timed against flashq
  part kernelvariants 200 $PY bench/kernels/decode_attention.py --batches 1,8,64,256 --out "$OUT/kernelvariants.json"
fi
# The scheduler benchmarks one by one (each is also part of `sched` above), for a call short on time:
if has tput8b; then  # 256 x (256 -> 128) on Llama-3-8B: GPU scheduler vs host loop, idle and under CPU load
  part tput8b 200 env PYTHONPATH="$PWD:$PWD/tests" $PY bench/sched_bench.py --preset llama3-8b --out "$OUT/tput8b" \
    --skip ablation,sigstop --commit "$COMMIT" ${DA_ARGS[@]+"${DA_ARGS[@]}"}
fi
if has ablation135m; then  # Fig. 3 ablation where the scheduler's share of a step is large (~0.1 ms steps)
  part ablation135m 150 env PYTHONPATH="$PWD:$PWD/tests" $PY bench/sched_bench.py --preset smollm2-135m \
    --kv-blocks 16384 --skip throughput,sigstop --out "$OUT/ablation135m" --commit "$COMMIT"
fi
if has smsteal; then  # step graphs with the GPU scheduler resident vs not, GEMMs sized for 132 vs 131 SMs
  part smsteal 150 env PYTHONPATH="$PWD:$PWD/tests" $PY bench/sm_steal.py --commit "$COMMIT" --out "$OUT/smsteal.json"
fi
if has stepprofile; then  # where the host loop's 256 x (256 -> 128) makespan goes, step by step
  part stepprofile 150 env PYTHONPATH="$PWD:$PWD/tests" $PY bench/step_profile.py --commit "$COMMIT" \
    --out "$OUT/stepprofile.json"
fi
if has sigstop135m; then  # the process owning the CUDA context SIGSTOPped for 30 s while a client streams
  part sigstop135m 200 env PYTHONPATH="$PWD:$PWD/tests" $PY bench/sched_bench.py --preset smollm2-135m \
    --kv-blocks 16384 --skip throughput,ablation --phase 30 --out "$OUT/sigstop135m" --commit "$COMMIT"
fi

echo
echo "=== summary (commit $COMMIT, decode attention: ${DECODE_ATTENTION:-engine default})"
grep -h -E "^[=]* ?[0-9]+ (passed|failed)|^FAILED|^ERROR|^=== (variant|the default|decode attention)" \
  "$OUT/engine-tests.log" 2>/dev/null | tail -n 30
grep -h -E "^best|^batch [0-9]+ |^=== decode attention from" "$OUT/decode.log" 2>/dev/null
for s in "${summary[@]}"; do echo "$s"; done
