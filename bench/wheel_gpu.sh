#!/usr/bin/env bash
# A pip-only GPU install, checked on the H200: the wheel built here, installed into a clean target
# with no CUDA toolkit on PATH, compiles its kernels with NVRTC at first use and serves.
#
#   here:   bash bench/wheel_gpu.sh prepare     # .whl/: blink's wheel + what the H200 image lacks
#   there:  bash bench/wheel_gpu.sh run         # (device call, carry [".whl"], about 3-6 min)
#
# Carried (about 62 MiB with the working tree): blink, msgspec and gguf (not in the image), and
# NVRTC + the CUDA headers as blink[cu13] installs them (nvidia-cuda-nvrtc/-runtime/-crt 13.5: the
# image has no nvidia-cuda-crt, and its own NVRTC would otherwise pair with newer headers).
# "run" prints PASS lines; the last line is "wheel_gpu: PASS" or "wheel_gpu: FAIL <why>".
set -u
cd "$(dirname "$0")/.."
mode=${1:-run}

if [ "$mode" = prepare ]; then
  PY=${PY:-.venv/bin/python}
  [ -x "$PY" ] || PY=python3
  ex=$(git rev-parse --git-path info/exclude) && { grep -qx '/.whl/' "$ex" 2>/dev/null || echo /.whl/ >> "$ex"; }
  rm -rf .whl && mkdir .whl
  "$PY" -m pip wheel -q --no-deps --no-build-isolation . -w .whl || exit 1
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl msgspec==0.23.0 gguf==0.19.0 nvidia-cuda-nvrtc==13.5.37 nvidia-cuda-runtime==13.5.37 \
    nvidia-cuda-crt==13.5.37 || exit 1
  ls -la .whl && du -sh .whl
  exit 0
fi

fail() { echo "wheel_gpu: FAIL $*"; exit 1; }
PY=$(command -v python3)
T=/tmp/blink-target
export XDG_CACHE_HOME=/tmp/blink-xdg
rm -rf "$T" "$XDG_CACHE_HOME"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$T" .whl/*.whl || fail "pip install"
# no CUDA toolkit on PATH, and not the checkout: blink comes from the wheel
P=""
for d in $(printf %s "$PATH" | tr : ' '); do
  [ -x "$d/nvcc" ] || [ -x "$d/ptxas" ] || case "$d" in *cuda*) ;; *) P="$P${P:+:}$d" ;; esac
done
export PATH="$P" PYTHONPATH="$T"
command -v nvcc >/dev/null && fail "nvcc is still on PATH"
echo "PASS no nvcc on PATH"
cd /tmp || fail "cd"
"$PY" - <<'EOF' || fail "NVRTC / headers from the wheels"
import os
import blink
import blink.gpu.toolchain.build as B

r = B.nvrtc()
print("blink from", blink.__file__)
print("NVRTC", r.version, r.path)
print("headers", [str(p) for p in r.include_dirs])
print("kernel cache", B.default_cache_dir(os.environ["XDG_CACHE_HOME"]))
assert blink.__file__.startswith("/tmp/blink-target/"), "blink is not the wheel's"
assert "/site-packages/nvidia/" in r.path or "/blink-target/nvidia/" in r.path, "NVRTC is not a wheel's"
assert all("/nvidia/" in str(p) for p in r.include_dirs), "headers are not the wheels'"
print("PASS blink, NVRTC and the CUDA headers come from wheels")
EOF
"$PY" -m blink.cli --version || fail "--version"

LOG=/tmp/blink-serve.log
t0=$(date +%s)
"$PY" -m blink.cli serve --device cuda --model random:tiny-llama --port 8123 --max-batch 8 >"$LOG" 2>&1 &
pid=$!
for _ in $(seq 480); do
  grep -q "serving .* on http" "$LOG" && break
  kill -0 $pid 2>/dev/null || break
  sleep 1
done
grep -q "serving .* on http" "$LOG" || { tail -30 "$LOG"; kill $pid 2>/dev/null; fail "server did not start"; }
echo "PASS serving after $(( $(date +%s) - t0 )) s (first start: NVRTC builds every kernel)"
"$PY" - <<'EOF'
import json, urllib.request
url = "http://127.0.0.1:8123"
m = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"][0]
print("model", m["id"], "max_model_len", m["max_model_len"])
body = {"model": m["id"], "prompt": "hello", "max_tokens": 16, "temperature": 0}
req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
out = json.loads(urllib.request.urlopen(req, timeout=120).read())
print("completion", out["usage"], repr(out["choices"][0]["text"][:40]), out["choices"][0]["finish_reason"])
assert out["usage"]["completion_tokens"] == 16
print("PASS a completion of 16 tokens through the GPU scheduler")
EOF
ok=$?
kill -INT $pid; wait $pid
ls "$XDG_CACHE_HOME/blink/kernels" | sed 's/^/cached: /'
n=$(ls "$XDG_CACHE_HOME/blink/kernels" | grep -c '\.cubin$')
[ $ok -eq 0 ] || { tail -30 "$LOG"; fail "completion"; }
[ "$n" -ge 6 ] || fail "expected 6 cubins (5 engine sources + scheduler) in the XDG cache, found $n"
echo "PASS $n cubins in \$XDG_CACHE_HOME/blink/kernels"
echo "wheel_gpu: PASS"
