"""Structured output on a served model: the frontend's mask work per token, and what constrained
streams cost on the device (default: random-weight Llama-3-8B on the CUDA device, GPU-resident
scheduler; `--scheduler host` for the host loop: both apply token masks).

    python -m bench.serving.structured RESULTS_DIR [--model random:llama3-8b] [--device cuda]
        [--scheduler gpu|host] [--streams 32] [--tokens 128] [--commit C]
        [--device emulated --device-executor bench.serving.paced_executor:h200_llama3_8b]  (H200 step times)

Writes RESULTS_DIR/structured_output_<scheduler>-<h200|emulated>-<commit>.json with:
- mask: per JSON schema of growing size (2 to 64 properties), the frontend's work per generated token
  (advance the matcher by the token, fill the next position's bitmask, copy it for the ring write:
  blink.dpu.token_masks.Constraint.advance) over a valid document, p50/p99 in microseconds, with the
  served model's tokenizer;
- tpot: TPOT p50/mean (ms) of `--streams` concurrent streams of `--tokens` tokens, unconstrained
  (ignore_eos) vs constrained (a guided_regex of exactly `--tokens` letters: a mask every token);
- beside: TPOT of the unconstrained streams alone, beside as many constrained streams, and of twice as
  many unconstrained streams (the same batch without constraints: what "beside" compares to);
- served_masks: per run with constrained streams, from the server's /metrics before and after it: the
  frontend's latency per constrained token from the reader cycle that read it to its next mask posted
  (blink_mask_latency_seconds: masks, p50/p90/p99 in microseconds) and the device's rows that sat out
  a step for lack of their mask (header.mask_late_rows), also per constrained token generated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import numpy as np

from bench.common import add_commit_arg, git_commit, metadata, short_device, smi_gpu_name, write_json
from blink.dpu.mask_timing import summary
from blink.dpu.structured import json_schema_grammar
from blink.dpu.token_masks import Constraint
from blink.dpu.tokenizer import load_tokenizer
from blink.protocol.ring_geometry import RingGeometry
from blink.testing import ServeProcess


def schema_and_doc(n: int) -> tuple[dict, str]:
    kinds = [
        ({"type": "string", "maxLength": 12}, "text value"),
        ({"type": "integer"}, 1234),
        ({"type": "boolean"}, True),
    ]
    props = {f"field_{i}": kinds[i % 3][0] for i in range(n)}
    doc = {f"field_{i}": kinds[i % 3][1] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}, json.dumps(doc, separators=(",", ":"))


def mask_times(model: str, reps: int) -> dict:
    tok = load_tokenizer(model)
    grammars = tok.grammars
    geo = RingGeometry(1, 1, 1, 1, 32 * grammars.words)
    out = {}
    for n in (2, 8, 32, 64):
        schema, doc = schema_and_doc(n)
        g = json_schema_grammar(schema, "bench")
        t0 = time.perf_counter()
        assert grammars.check(g) == "", grammars.check(g)
        compile_ms = (time.perf_counter() - t0) * 1e3
        ids = tok.tok.encode(doc, add_bos=False)
        times = []
        for _ in range(reps):
            c = Constraint(grammars.matcher(g), 0, geo)
            c.writes(0, 0)
            for k, t in enumerate(ids):
                t0 = time.perf_counter_ns()
                c.advance(0, [t], k + 1)
                times.append((time.perf_counter_ns() - t0) / 1e3)
            assert not c.failed, f"the document of {n} fields does not follow its schema's tokens"
        a = np.array(times)
        out[f"json_{n}_fields"] = {
            "tokens": len(ids),
            "compile_ms": round(compile_ms, 2),
            "us_p50": round(float(np.percentile(a, 50)), 1),
            "us_p99": round(float(np.percentile(a, 99)), 1),
        }
        print(f"mask json_{n}: {out[f'json_{n}_fields']}", flush=True)
    return {"model": tok.name, "vocab": tok.info.vocab_size, "schemas": out}


async def _stream(session, url: str, body: dict) -> list[tuple[float, int]]:
    """(arrival time, completion tokens so far) of each chunk (continuous usage stats)."""
    out = []
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                u = json.loads(line[6:]).get("usage")
                if u:
                    out.append((time.perf_counter(), int(u["completion_tokens"])))
    return out


def _tpot(runs: list[list[tuple[float, int]]]) -> dict:
    """Per stream: (last chunk - first chunk) / (tokens between them)."""
    per = [(r[-1][0] - r[0][0]) / (r[-1][1] - r[0][1]) * 1e3 for r in runs if len(r) > 1 and r[-1][1] > r[0][1]]
    return {
        "streams": len(per),
        "tpot_ms_p50": round(float(np.median(per)), 3),
        "tpot_ms_mean": round(float(np.mean(per)), 3),
    }


async def run_streams(url: str, model: str, n_free: int, n_masked: int, tokens: int) -> tuple[dict, dict]:
    import aiohttp

    free = {"model": model, "prompt": "hello", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    free["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    masked = dict(free, guided_regex=f"[a-z]{{{tokens}}}")
    async with aiohttp.ClientSession() as s:
        jobs = [_stream(s, url, free) for _ in range(n_free)] + [_stream(s, url, masked) for _ in range(n_masked)]
        res = await asyncio.gather(*jobs)
    return _tpot(res[:n_free]) if n_free else {}, _tpot(res[n_free:]) if n_masked else {}


def scrape(url: str, key: str | None = None) -> tuple[list[int], int]:
    """From a server's /metrics: the mask latency histogram (counts per bucket, as MaskLatency keeps
    them) and the device's mask_late_rows."""
    import urllib.request

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    cum, late = [], 0
    for line in text.splitlines():
        if line.startswith("blink_mask_latency_seconds_bucket"):
            cum.append(int(float(line.rsplit(" ", 1)[1])))
        elif line.startswith("blink_device_mask_late_rows_total"):
            late = int(float(line.rsplit(" ", 1)[1]))
    return [b - a for a, b in zip([0, *cum[:-1]], cum, strict=True)], late


def masks_between(before: tuple[list[int], int], after: tuple[list[int], int], tokens: int) -> dict:
    """What one run added: mask latency percentiles, rows that sat out, and those per constrained token."""
    (c0, l0), (c1, l1) = before, after
    counts = [b - a for a, b in zip(c0 or [0] * len(c1), c1, strict=True)]
    late = l1 - l0
    return {"frontend": summary(counts), "sat_out_rows": late, "sat_out_per_token": round(late / max(tokens, 1), 4)}


def device_runs(a: argparse.Namespace) -> dict:
    argv = ["--device", a.device, "--scheduler", a.scheduler, "--model", a.model, "--max-batch", str(2 * a.streams)]
    if a.device_executor:
        argv += ["--device-executor", a.device_executor]
    srv = ServeProcess(argv, timeout=a.timeout)
    try:
        url, n, t = srv.url + "/v1/completions", a.streams, a.tokens
        asyncio.run(run_streams(url, srv.model, 4, 4, 8))  # warm-up
        free, _ = asyncio.run(run_streams(url, srv.model, n, 0, t))
        m0 = scrape(srv.url)
        _, masked = asyncio.run(run_streams(url, srv.model, 0, n, t))
        m1 = scrape(srv.url)
        beside, with_masked = asyncio.run(run_streams(url, srv.model, n, n, t))
        m2 = scrape(srv.url)
        # the same batch (2n streams) with no constraint at all: what the n beside n constrained compare to
        same_batch, _ = asyncio.run(run_streams(url, srv.model, 2 * n, 0, t))
    finally:
        srv.stop()
    out = {
        "tpot": {"unconstrained": free, "constrained": masked},
        "beside": {
            "unconstrained_alone": free,
            "unconstrained_same_batch": same_batch,
            "unconstrained_beside_constrained": beside,
            "constrained": with_masked,
        },
        "served_masks": {"constrained": masks_between(m0, m1, n * t), "beside": masks_between(m1, m2, n * t)},
    }
    print(json.dumps(out), flush=True)
    return out


def device_result(a: argparse.Namespace, argv: list[str] | None) -> tuple[dict, str, str]:
    """A device run's result metadata, the device part of its file name, and its short commit."""
    commit = a.commit or git_commit()
    gpu = "cpu" if a.device == "emulated" else smi_gpu_name()
    result = metadata(commit, argv, gpu=gpu) | {"model": a.model, "device": a.device, "scheduler": a.scheduler}
    return result, "emulated" if a.device == "emulated" else short_device(gpu), commit[:7]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="folder for the JSON result")
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--mask-model", default="", help="tokenizer of the mask timing (default: --model's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scheduler", default="gpu", choices=("gpu", "host"))
    ap.add_argument("--device-executor", default="", help="emulated device: an executor factory (module:function)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=600)
    add_commit_arg(ap)
    a = ap.parse_args(argv)
    result, where, commit = device_result(a, argv)
    result["mask"] = mask_times(a.mask_model or a.model, a.reps)
    result |= device_runs(a)
    name = f"structured_output_{a.scheduler}-{where}-{commit}.json"  # one file per scheduler
    write_json(os.path.join(a.results, name), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
