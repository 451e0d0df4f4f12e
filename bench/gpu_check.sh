#!/usr/bin/env bash
# The GPU check of a commit in one device call (~2.5 min on an H200): every GPU test in parallel lanes (engine, sampling,
# prompt logprobs, MoE, scheduler, conformance through the ring on the GPU scheduler, blink serve ops) beside Qwen3-32B
# served end to end, then alone on the GPU the four models' speed (bench/throughput.py --presets) and the decode-step
# breakdown (bench/decode.py --role-breakdown). Results and logs under $OUT (gpu_check.tgz: every step's log).
#   here:      mkdir -p .carry/whl && pip download msgspec gguf prometheus_client wheels into it (bench/results/README.md);
#              python -m blink.gpu.toolchain.kernels   (fills build/kernels, carried)
#   the call:  carry [.carry/whl, build/kernels]    bash bench/gpu_check.sh $(git rev-parse --short HEAD)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_gpu_check_out}; mkdir -p "$OUT"
C=${1:?commit}
L=/tmp/gpu_check; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=$PWD:$PWD/tests:/tmp/site PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
T0=$SECONDS
python3 -m blink.gpu.toolchain.kernels > $L/kernels.log 2>&1; echo "### kernels rc=$? $((SECONDS-T0))s"
PT="python3 -m pytest -q -p no:cacheprovider -rfE"
step() { local n=$1 t=$2; shift 2; local t1=$SECONDS; timeout -k 5 $t "$@" > $L/$n.log 2>&1; local r=$?; echo "### $n rc=$r $((SECONDS-t1))s"; grep -E "passed|failed|^FAILED|^ERROR|Error|OK|MISMATCH|startup|tok/s|of copy|qwen3-30b|excused" $L/$n.log | tail -16; }
CONF_GPU='{"kind": "cuda"}'
l1() {
  step moe_tests 200 $PT -s tests/gpu/test_moe.py
  BLINK_CONFORMANCE_DEVICE=$CONF_GPU step moe_conf 60 $PT tests/conformance -k "tiny-qwen3-moe"
}
l2() {
  BLINK_CONFORMANCE_DEVICE=$CONF_GPU step conf_gpu 120 $PT -m "not slow" tests/conformance -k "not tiny-qwen3-moe"
  step sched 40 $PT tests/gpu/test_scheduler.py
}
l3() {
  step engine 110 $PT tests/gpu/test_engine.py tests/gpu/test_engine_sampling.py tests/gpu/test_engine_prompt_logprobs.py tests/gpu/test_ring_sampling.py -m gpu
  step serve_ops 80 $PT tests/gpu/test_serve_ops.py -m gpu
}
l4() {
  step serve32b 190 python3 bench/serve_check.py --commit $C --out $OUT/serve-qwen3-32b-h200-$C.json -- --num-kv-blocks 2048
}
for l in l1 l2 l3 l4; do $l > $L/$l.out 2>&1 & done
wait
cat $L/l1.out $L/l2.out $L/l3.out $L/l4.out
echo "### correctness done at $((SECONDS-T0))s"
step models 215 python3 bench/throughput.py --presets llama3-8b,phi-4,qwen3-30b-a3b,qwen3-32b --schedulers gpu --timeout 110 --budget-s 195 --commit $C --out $OUT/models-h200-$C.json
grep -v INFO $L/models.log | tail -14
step decode_bd 130 python3 bench/decode.py --role-breakdown --batches 128,256 --contexts 320,1024 --commit $C --out $OUT/decode_breakdown-h200-$C.json
tail -75 $L/decode_bd.log
echo "total $((SECONDS-T0)) s"
tar czf $OUT/gpu_check.tgz -C /tmp gpu_check
