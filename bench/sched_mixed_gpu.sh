#!/usr/bin/env bash
# Issue 12 items 1-2 on a lent H200, one call (~9 min): the GPU scheduler's tests, the mixed-step
# engine test, the conformance suite on the GPU scheduler (tests/conformance/test_mixed.py included),
# then bench/ttft_breakdown.py: open-loop 24 req/s, 256 -> 128, random Llama-3-8B, GPU scheduler
# and host loop (ITL p99 <= 1.5 x p50; TTFT gpu <= host; the first token's path stage by stage).
#   the call:  carry [.whl, build/kernels]  (as bench/paper_gpu.sh: msgspec's wheel; cubins built here)
#              BLINK_COMMIT=<sha> bash bench/sched_mixed_gpu.sh
# Results: $OUT/<part>.log per part, $OUT/ttft_breakdown.json. BUDGET_S (default 530) bounds the parts.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sched_mixed_out}
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-530}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
source bench/lib.sh
PART_SHOW="passed|failed|^FAILED|^ERROR|Error|TTFT|ITL|^[a-z_]+ +[0-9.-]+ |target|###|traced|wrote"
PT=($PY -m pytest -q -p no:cacheprovider --timeout 90)
$PY -m blink.gpu.toolchain.kernels >"$OUT/kernels.log" 2>&1 || echo "kernel build FAILED"
part sched-tests 110 "${PT[@]}" -x tests/gpu/test_scheduler.py
part mixed-engine 70 "${PT[@]}" tests/gpu/test_engine.py -k "mixed_steps and tiny"
BLINK_CONFORMANCE_DEVICE='{"kind": "cuda"}' part conformance 150 "${PT[@]}" -m "not slow" tests/conformance
part ttft 260 $PY bench/ttft_breakdown.py --rate 24 --num-prompts 300 --out "$OUT/ttft_breakdown.json"
printf '%s\n' "${summary[@]}"
