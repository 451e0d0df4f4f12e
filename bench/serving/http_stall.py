"""How long a long prompt, or a large structured output schema, holds `blink serve`'s event loop.

    python -m bench.serving.http_stall --prompt-mb 1            # emulated device (a paced stand-in model)
    python -m bench.serving.http_stall --device cuda --model default --prompt-mb 4
    python -m bench.serving.http_stall --schema-fields 3000     # JSON schemas of 3,000 required fields

For each variant a `blink serve` runs; this process sends /tokenize with a prompt of --prompt-mb
(from a thread, raw bytes) while it GETs /health every 10 ms and reads a stream, and reports the
/health latency and the stream's longest pause while the prompt is encoded. Variants: `thread`
(--tokenizer-pool-size 0: the encode runs in a worker thread of the server, and the tokenizer keeps
the GIL) and `process` (--tokenizer-pool-size 1: a tokenizer process). The JSON holds the date,
host, commit and command (default bench/results/http_stall-<device>-<commit>.json).

With --schema-fields N, the load is instead --schemas completions (one after another, 2 tokens each)
whose `guided_json` is an object of N required string fields: in `schema_new` every schema is new to
the server (it compiles each), in `schema_same` all are one schema (compiled once, then cached). A
schema the grammar engine finds too large (from ~70,000 fields, 3 MB) is a 400, still read first.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
import urllib.error
import urllib.request

from bench.common import add_commit_arg, git_commit, metadata, result_path, smi_gpu_name, write_json
from bench.serving.hostile import percentiles_ms
from blink.testing import ServeProcess

PACED = ["--device-executor", "bench.serving.paced_executor:h200_llama3_8b"]


def _post(url: str, body: bytes) -> tuple[int, float]:
    """(HTTP status, seconds): a 4xx is an answer too (a schema the grammar engine finds too large)."""
    t0 = time.monotonic()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
            return r.status, time.monotonic() - t0
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, time.monotonic() - t0


def _schema_load(url: str, model: str, fields: int, n: int, new: bool) -> tuple[int, float]:
    """n completions under N-field JSON schemas, one after another: (the last status, seconds)."""
    t0, status = time.monotonic(), 0
    for i in range(n):
        tag = f"s{i}_" if new else "s_"
        props = {f"{tag}{j}": {"type": "string", "maxLength": 4} for j in range(fields)}
        schema = {"type": "object", "properties": props, "required": list(props)}
        body = {"model": model, "prompt": "x", "max_tokens": 2, "guided_json": schema}
        status = _post(url + "/v1/completions", json.dumps(body).encode())[0]
    return status, time.monotonic() - t0


async def measure(url: str, model: str, load) -> dict:
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
        status, took = await asyncio.to_thread(load)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "status": status,
        "load_s": round(took, 2),
        "health_ms": percentiles_ms(lat),
        "stream_pause_ms_max": round(max(gaps, default=0.0) * 1e3, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-mb", type=float, default=1.0)
    ap.add_argument("--device", default="emulated", choices=("emulated", "cuda"))
    ap.add_argument("--model", default="random:tiny-llama")
    ap.add_argument("--schema-fields", type=int, default=0, help="load: completions under JSON schemas of N fields")
    ap.add_argument("--schemas", type=int, default=5, help="with --schema-fields: completions per variant")
    ap.add_argument("--out", help="JSON file (default bench/results/http_stall-<device>-<commit>.json)")
    add_commit_arg(ap)
    a = ap.parse_args()
    text = "hello world " * int(a.prompt_mb * (1 << 20) / 12)
    base = ["--device", a.device, "--model", a.model, "--max-model-len", "1024", "--disable-log-requests"]
    if a.device == "emulated":
        base += PACED  # the stream's tokens come at the H200's pace; the device costs no CPU
    variants = {}
    if a.schema_fields:
        with ServeProcess(base, timeout=900) as s:
            for name, new in (("schema_new", True), ("schema_same", False)):
                load = functools.partial(_schema_load, s.url, s.model, a.schema_fields, a.schemas, new)
                variants[name] = asyncio.run(measure(s.url, s.model, load))
                print(name, variants[name], flush=True)
    for name, pool in () if a.schema_fields else (("thread", 0), ("process", 1)):
        with ServeProcess([*base, "--tokenizer-pool-size", str(pool)], timeout=900) as s:
            body = json.dumps({"model": s.model, "prompt": text}).encode()
            variants[name] = asyncio.run(measure(s.url, s.model, functools.partial(_post, s.url + "/tokenize", body)))
        print(name, variants[name], flush=True)
    commit = a.commit or git_commit()
    result = {
        "bench": "http_stall",
        **metadata(commit, [os.path.basename(sys.executable), *sys.argv], gpu=smi_gpu_name()),
        "device": a.device,
        "model": a.model,
        **({"schema_fields": a.schema_fields, "schemas": a.schemas} if a.schema_fields else {"prompt_mb": a.prompt_mb}),
        "variants": variants,
    }
    dev = "h200" if a.device == "cuda" else a.device
    name = "http_stall_schema" if a.schema_fields else "http_stall"
    write_json(a.out or str(result_path(name, dev, commit[:7])), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
