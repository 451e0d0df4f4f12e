"""A model served end to end by `blink serve` (default: random-weight Qwen3-32B at full shape on the
CUDA device, GPU scheduler): start-up time and memory, and the answers of a few requests checked.

    python -m bench.serving.serve_check [--model random:qwen3-32b] [--device cuda] [--scheduler gpu] \\
        [--commit C --out bench/results/serve-qwen3-32b-h200-C.json]

Checks (one line each; exit 1 at the first failure): /v1/models; a greedy completion with logprobs
(max_tokens tokens, finish "length", each chosen token the top of its logprobs); the same request
streamed gives the same text and usage; a chat completion whose prompt count equals /tokenize's for
the same messages; the same chat streamed (role first, the same content); 8 concurrent completions
each of max_tokens tokens; a clean shutdown. Random weights make the text meaningless, so the checks
are on what must hold for any weights: greedy determinism, counts, shapes.
Start-up: seconds until the frontend listens, until /health is 200, until the first completion
returns. Memory: GPU memory per process (nvidia-smi) and the device process's resident set.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from bench.common import add_commit_arg, metadata, write_json
from blink.testing import ServeProcess, rss_mib


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"FAILED POST {url} {body}: HTTP {e.code} {e.read().decode()[:500]}") from None


def stream(url: str, body: dict) -> list[dict]:
    """The chunks of a streamed request, up to `data: [DONE]` (which must come)."""
    req = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    chunks = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks
            chunks.append(json.loads(line[6:]))
    raise AssertionError(f"stream ended without [DONE] after {len(chunks)} chunks")


def gpu_memory_mib() -> dict[str, float]:
    """MiB of GPU memory per process (pid -> MiB) and in all; empty where nvidia-smi is absent."""
    try:
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        used = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split(",")
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return {}
    out = {f"pid {p.strip()}": float(m) for p, m in (ln.split(",") for ln in apps.splitlines() if ln.strip())}
    if len(used) == 2:
        out["used"], out["total"] = float(used[0]), float(used[1])
    return out


class Checks:
    def __init__(self) -> None:
        self.passed: list[str] = []

    def __call__(self, what: str, ok: bool, detail: object = "", note: str = "") -> None:
        """Pass `what` or raise with `detail`; `note` is printed beside a pass."""
        if not ok:
            raise AssertionError(f"FAILED {what}: {detail}")
        self.passed.append(what)
        print(f"ok  {what}" + (f"  ({note})" if note else ""), flush=True)


def check_requests(srv: ServeProcess, n_tokens: int, ok: Checks) -> dict:
    base, name = srv.url, srv.model
    v1 = base + "/v1"
    models = json.loads(srv.get("/v1/models")[1])
    ok("/v1/models lists the model", [m["id"] for m in models["data"]] == [name], models, name)

    prompt = "The capital of France is"
    body = {"model": name, "prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    r = post(v1 + "/completions", {**body, "logprobs": 3})
    first_s = time.monotonic() - t0
    c = r["choices"][0]
    ok(
        "completion: max_tokens tokens, finish length",
        r["usage"]["completion_tokens"] == n_tokens and c["finish_reason"] == "length",
        r,
    )
    lp = c["logprobs"]
    ok("completion: a logprob per token", len(lp["tokens"]) == len(lp["token_logprobs"]) == n_tokens, len(lp["tokens"]))
    # top_logprobs is keyed by token text, and random tokens share texts: the chosen one must be >= any shown
    pairs = zip(lp["token_logprobs"], lp["top_logprobs"], strict=True)
    greedy = all(t <= 0 and t >= max(top.values()) - 1e-3 for t, top in pairs)
    ok("completion: greedy picks the top logprob each step", greedy, lp)

    chunks = stream(v1 + "/completions", {**body, "stream_options": {"include_usage": True}})
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    usage = next((ch["usage"] for ch in chunks if ch.get("usage")), None)
    ok("streamed completion: same text as unstreamed", text == c["text"], (text[:40], c["text"][:40]))
    ok("streamed completion: usage", usage is not None and usage["completion_tokens"] == n_tokens, usage)

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = {"model": name, "messages": msgs, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True}
    r = post(v1 + "/chat/completions", chat)
    count = post(base + "/tokenize", {"model": name, "messages": msgs})["count"]
    m = r["choices"][0]["message"]
    ok("chat: assistant message", m["role"] == "assistant" and r["usage"]["completion_tokens"] == n_tokens, r["usage"])
    ok("chat: prompt tokens = /tokenize of the templated messages", r["usage"]["prompt_tokens"] == count, count)
    chunks = stream(v1 + "/chat/completions", chat)
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    ok("streamed chat: role first, same content", deltas[0].get("role") == "assistant" and content == m["content"])

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda i: post(v1 + "/completions", {**body, "prompt": f"{i} {prompt}"}), range(8)))
    wall = time.monotonic() - t0
    ok("8 concurrent completions", all(x["usage"]["completion_tokens"] == n_tokens for x in rs), rs, f"{wall:.2f} s")
    return {"first_completion_s": first_s, "concurrent_8_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:qwen3-32b")
    ap.add_argument("--device", default="cuda", help="emulated: the same checks without a GPU (a tiny model)")
    ap.add_argument("--scheduler", default="gpu")
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens of each request")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the server to start")
    add_commit_arg(ap)
    ap.add_argument("--out", default="")
    ap.add_argument("serve_args", nargs="*", help="more `blink serve` flags (after --)")
    a = ap.parse_args()
    argv = ["--device", a.device, "--scheduler", a.scheduler, "--model", a.model]
    argv += ["--max-num-seqs", "64", "--max-model-len", "4096", *a.serve_args]
    t0 = time.monotonic()
    srv = ServeProcess(argv, timeout=a.timeout)
    listen_s = time.monotonic() - t0
    proc, log = srv.proc, srv.log
    ok = Checks()
    res: dict = {"bench": "serve_check", **metadata(a.commit), "model": a.model, "device_kind": a.device}
    res["scheduler"], res["server_command"] = a.scheduler, " ".join(srv.command[1:])
    try:
        ok("server listens", True, note=f"{listen_s:.1f} s")
        while srv.get("/health")[0] != 200 and time.monotonic() - t0 < a.timeout and proc.poll() is None:
            time.sleep(0.2)
        health_s = time.monotonic() - t0
        ok("/health 200 (device ready)", srv.get("/health")[0] == 200, "".join(log[-20:]), f"{health_s:.1f} s")
        timing = check_requests(srv, a.tokens, ok)
        res["startup_s"] = {"listening": listen_s, "health_200": health_s, "first_completion": health_s + timing["first_completion_s"]}  # fmt: skip
        res["timing_s"] = timing
        devs = srv.children()
        res["memory_mib"] = {
            "gpu": gpu_memory_mib(),
            "frontend_rss": rss_mib(proc.pid),
            "device_rss": [rss_mib(p) for p in devs],
        }
        res["phases"] = [ln.strip() for ln in log if ln.startswith("blink device:")]
        want = "persistent scheduler kernel launched" if a.scheduler == "gpu" else "serving the ring"
        if a.device == "cuda":
            ok(f"device log says '{want}'", any(want in ln for ln in log), res["phases"])
        ok("clean shutdown (SIGTERM -> rc 0)", srv.stop(timeout=60) == 0, "".join(log[-10:]))
    except BaseException:
        print("".join(log[-40:]), file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
    res["checks"] = ok.passed
    print(
        f"startup: listening {res['startup_s']['listening']:.1f} s, /health 200 {health_s:.1f} s, "
        f"first completion {res['startup_s']['first_completion']:.1f} s; memory: {json.dumps(res['memory_mib'])}"
    )
    if a.out:
        write_json(a.out, res)
    print(f"serve check {a.model}: OK ({len(ok.passed)} checks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
