#!/usr/bin/env bash
# The 2-GPU scale-out run on a lent nvidia-h200-x2: the same ShareGPT-like load through the HTTP
# endpoint on 1 replica, then 2 (bench/scaleout.py), with the pieces placed by Ray (GPU actors one
# per GPU, the frontend actor) and, for comparison, by plain processes (same rings, router, ingress).
#
# The lent GPU machines have no Ray, and Ray's wheel (76 MiB) exceeds what one call carries (64 MiB),
# so it travels in two parts over two calls to the same warm machine:
#   here:   bash bench/scaleout_gpu.sh split      # .carry/ray1 = first 40 MiB of the wheel,
#                                                 # .carry/ray2 = the rest + Ray's dependencies
#   call 1: carry [build/kernels, .whl, .carry/ray1]
#           BLINK_COMMIT=<sha> bash bench/scaleout_gpu.sh part1   # keeps part 1 in /tmp; procs launcher run
#           (or `stash`: keeps part 1 and runs nothing)
#   call 2: (within the 30 s the machine stays warm) carry [build/kernels, .whl, .carry/ray2]
#           BLINK_COMMIT=<sha> bash bench/scaleout_gpu.sh part2   # joins, checks sha256, installs Ray; Ray run
# Results: $OUT/scaleout-{procs,ray}.json and .log. LOAD overrides the load arguments below.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_scaleout_out}
COMMIT=${BLINK_COMMIT:-unknown}
PY=${PY:-python3}
RAY_WHEEL=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
STASH=/tmp/blink-ray-part1
# Per replica: 128 closed-loop streams over 384 requests (capacity), then Poisson arrivals at
# 16 req/s over 480 requests (about 80 % of one replica's closed-loop capacity): N replicas get N times both.
LOAD=${LOAD:-"--device cuda --model random:llama3-8b --max-batch 256 --n-slots 512 --replicas 1,2 --per-replica
  --requests 384 --concurrency 128 --rate 16 --open-requests 480"}

install_wheels() {  # the wheels this call carries (msgspec always; Ray and its dependencies in part 2)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@" || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
}

run_bench() {  # run_bench LAUNCHER
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/scaleout-$1.log"
  $PY -m blink.gpu.toolchain.kernels >>"$OUT/scaleout-$1.log" 2>&1 || echo "kernel build FAILED"
  # shellcheck disable=SC2086
  timeout 540 $PY bench/scaleout.py --launcher "$1" --commit "$COMMIT" $LOAD --out "$OUT/scaleout-$1.json" 2>&1 |
    tee -a "$OUT/scaleout-$1.log" | grep -v -E '^\s*$' | tail -n 40
}

case "${1:-}" in
split)
  mkdir -p .carry/raywhl .carry/ray1 .carry/ray2
  [ -f ".carry/raywhl/$RAY_WHEEL" ] ||
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .carry/raywhl ray==2.60.0 click==8.5.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
      referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 msgpack==1.2.4 protobuf==7.36.2 requests==2.34.2 \
      urllib3==2.8.0 idna==3.20 charset-normalizer==3.5.3 certifi==2026.10.19.post1 filelock==4.3.1 \
      packaging==26.4 pyyaml==6.0.4 typing-extensions==4.16.0 || exit 1
  # build/kernels travels in both calls: rebuild it so that it holds only the current cubins
  # (stale ones pile up, and a call carries 64 MiB at most: ~13 MiB of cubins + ~40 MiB of Ray)
  rm -rf build/kernels && .venv/bin/python -m blink.gpu.toolchain.kernels >/dev/null || exit 1
  rm -f .carry/ray1/* .carry/ray2/*
  head -c 41943040 ".carry/raywhl/$RAY_WHEEL" >.carry/ray1/ray.part1
  tail -c +41943041 ".carry/raywhl/$RAY_WHEEL" >.carry/ray2/ray.part2
  sha256sum ".carry/raywhl/$RAY_WHEEL" | cut -d' ' -f1 >.carry/ray2/ray.sha256
  find .carry/raywhl -name '*.whl' ! -name "$RAY_WHEEL" -exec cp {} .carry/ray2/ \;
  du -sh build/kernels .carry/ray1 .carry/ray2
  ;;
stash)  # part 1 of the wheel only (call 1 then has room for other work)
  mkdir -p "$STASH" && cp .carry/ray1/ray.part1 "$STASH/" && echo "ray part 1 kept in $STASH"
  ;;
part1)
  mkdir -p "$STASH" && cp .carry/ray1/ray.part1 "$STASH/" || exit 1
  install_wheels .whl/*.whl
  run_bench procs
  ;;
part2)
  [ -f "$STASH/ray.part1" ] || { echo "no $STASH/ray.part1: this is not the machine of call 1 (it went back)"; exit 3; }
  cat "$STASH/ray.part1" .carry/ray2/ray.part2 >"/tmp/$RAY_WHEEL"
  [ "$(sha256sum "/tmp/$RAY_WHEEL" | cut -d' ' -f1)" = "$(cat .carry/ray2/ray.sha256)" ] || { echo "sha256 mismatch"; exit 4; }
  install_wheels .whl/*.whl .carry/ray2/*.whl "/tmp/$RAY_WHEEL"
  $PY -c "import ray; print('ray', ray.__version__)" || exit 5
  # A fresh Ray session per run; the lent machine's MemTotal starts small and grows as memory is
  # used (KINDS.md), so Ray's memory monitor would judge usage against too small a total: off.
  export RAY_AUTH_MODE=disabled RAY_memory_monitor_refresh_ms=0
  run_bench ray
  ;;
*)
  echo "usage: $0 split|stash|part1|part2" >&2
  exit 2
  ;;
esac
