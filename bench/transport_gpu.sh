#!/usr/bin/env bash
# bench/transport.py on a lent GPU machine in one call (issue 11, item 7): per-op latency of the
# shm and tcp transports, then `blink serve --device cuda` with the frontend on the mapping (shm) and
# through the ring agent (tcp), 64 concurrent streams each, TTFT / ITL / output tok/s and the agent's CPU.
#   here, once:  the wheels and kernels of bench/results/README.md ("The paper's figures: one command")
#   the call:    carry [.whl, build/kernels];  BLINK_COMMIT=<sha> bash bench/transport_gpu.sh [bench/transport.py args]
# Results: $OUT/transport.log and $OUT/transport-h200-<commit>.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_transport_out}
PY=${PY:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
$PY -m blink.gpu.toolchain.kernels >"$OUT/kernels.log" 2>&1 || echo "kernel build FAILED"
# random weights of SmolLM2-135M's shape: no download, and fast steps, so the frontend is what is tested
timeout 540 $PY bench/transport.py --device cuda --model random:smollm2-135m --streams 64 --num-prompts 512 \
  --input-len 128 --output-len 256 --max-batch 64 --commit "${BLINK_COMMIT:-unknown}" \
  --out "$OUT/transport-h200-${BLINK_COMMIT:-unknown}.json" "$@" 2>&1 | tee "$OUT/transport.log" | tail -n 20
exit "${PIPESTATUS[0]}"
