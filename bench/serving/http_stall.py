"""How long a long prompt holds `blink serve`'s event loop, by how it is tokenized.

    python -m bench.serving.http_stall --prompt-mb 1            # emulated device (a paced stand-in model)
    python -m bench.serving.http_stall --device cuda --model default --prompt-mb 4

For each variant a `blink serve` runs; this process sends /tokenize with a prompt of --prompt-mb
(from a thread, raw bytes) while it GETs /health every 10 ms and reads a stream, and reports the
/health latency and the stream's longest pause while the prompt is encoded. Variants: `thread`
(--tokenizer-pool-size 0: the encode runs in a worker thread of the server, and the tokenizer keeps
the GIL) and `process` (--tokenizer-pool-size 1: a tokenizer process). The JSON holds the date,
host, commit and command (default bench/results/http_stall-<device>-<commit>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import time
import urllib.request

from bench.common import RESULTS, add_commit_arg, git_commit, metadata, smi_gpu_name
from bench.serving.hostile import percentiles_ms
from blink.testing import ServeProcess

PACED = ["--device-executor", "bench.serving.paced_executor:h200_llama3_8b"]


def _post(url: str, body: bytes) -> tuple[int, float]:
    t0 = time.monotonic()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
        return r.status, time.monotonic() - t0


async def measure(url: str, model: str, body: bytes) -> dict:
    import aiohttp

    stop = asyncio.Event()
    lat: list[float] = []
    gaps: list[float] = []

    async def probe(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            async with s.get(url + "/health") as r:
                await r.read()
            lat.append(time.monotonic() - t0)
            await asyncio.sleep(0.01)

    async def stream(s: aiohttp.ClientSession) -> None:
        last = None
        req = {"model": model, "prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        async with s.post(url + "/v1/completions", json=req) as r:
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                now = time.monotonic()
                if last is not None and not stop.is_set():
                    gaps.append(now - last)
                last = now

    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.ensure_future(probe(s)), asyncio.ensure_future(stream(s))]
        await asyncio.sleep(1.0)
        status, took = await asyncio.to_thread(_post, url + "/tokenize", body)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "status": status,
        "tokenize_s": round(took, 2),
        "health_ms": percentiles_ms(lat),
        "stream_pause_ms_max": round(max(gaps, default=0.0) * 1e3, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-mb", type=float, default=1.0)
    ap.add_argument("--device", default="emulated", choices=("emulated", "cuda"))
    ap.add_argument("--model", default="random:tiny-llama")
    ap.add_argument("--out", help="JSON file (default bench/results/http_stall-<device>-<commit>.json)")
    add_commit_arg(ap)
    a = ap.parse_args()
    text = "hello world " * int(a.prompt_mb * (1 << 20) / 12)
    base = ["--device", a.device, "--model", a.model, "--max-model-len", "1024", "--disable-log-requests"]
    if a.device == "emulated":
        base += PACED  # the stream's tokens come at the H200's pace; the device costs no CPU
    variants = {}
    for name, pool in (("thread", 0), ("process", 1)):
        with ServeProcess([*base, "--tokenizer-pool-size", str(pool)], timeout=900) as s:
            body = json.dumps({"model": s.model, "prompt": text}).encode()
            variants[name] = asyncio.run(measure(s.url, s.model, body))
        print(name, variants[name], flush=True)
    commit = a.commit or git_commit()
    result = {
        "bench": "http_stall",
        **metadata(commit, [os.path.basename(sys.executable), *sys.argv], gpu=smi_gpu_name()),
        "device": a.device,
        "model": a.model,
        "prompt_mb": a.prompt_mb,
        "variants": variants,
    }
    dev = "h200" if a.device == "cuda" else a.device
    out = pathlib.Path(a.out) if a.out else RESULTS / f"http_stall-{dev}-{commit[:7]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
