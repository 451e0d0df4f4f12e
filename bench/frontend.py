"""Frontend benchmark: how many requests/s the frontend can submit and how much latency it adds.

    python bench/frontend.py [--requests 2000] [--concurrency 1,16,64] [--out bench/results]

Runs `blink serve` (emulated device, tiny random model, max_tokens=1: a device that answers
almost at once) in a subprocess and drives it over HTTP with aiohttp from this process.
Reports, per concurrency: requests/s and client-side latency percentiles (time to the first
response byte of a streaming request); and the first token's path split into stages from the
server's /metrics histograms (frontend and device stamp one wall clock):

    submit  HTTP request received -> slot published in the ring (parse, tokenize, claim)
    admit   slot published -> device admitted it         (device polling)
    device  admitted -> first token in the ring            (the tiny model's prefill)
    read    first token in the ring -> token reader has it (reader polling)
    write   token reader -> first response byte written    (SSE)

Also a micro-benchmark of the slot tracker alone: claim + release on a ring without HTTP.
Results: a short table on stdout and JSON in bench/results/frontend-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("submit", "admit", "device", "read", "write")


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--port", "0", "--device", "emulated", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    found: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in proc.stderr:
            if m := re.search(r"serving .* on (http://\S+)/v1", line):
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(180) or not found:
        proc.kill()
        raise RuntimeError("server did not start")
    return proc, found[0]


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of one process (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and ln[0] != "#")}


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean seconds per stage over the requests between two scrapes."""
    out = {}
    for s in STAGES:
        k = f"blink_first_token_{s}_seconds"
        n = after[k + "_count"] - before[k + "_count"]
        out[s] = (after[k + "_sum"] - before[k + "_sum"]) / n if n else float("nan")
    return out


async def run_load(url: str, model: str, n: int, concurrency: int) -> dict[str, float]:
    body = {"model": model, "prompt": "hi", "max_tokens": 1, "temperature": 0, "ignore_eos": True, "stream": True}
    lat: list[float] = []
    errors = 0
    it = iter(range(n))

    async def worker(sess: aiohttp.ClientSession) -> None:
        nonlocal errors
        for _ in it:
            t0 = time.perf_counter()
            async with sess.post(url + "/v1/completions", json=body) as r:
                first = await r.content.readany()  # the first bytes after the headers
                lat.append(time.perf_counter() - t0)
                rest = await r.read()
                if r.status != 200 or not (first + rest).rstrip().endswith(b"[DONE]"):
                    errors += 1

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as sess:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(sess) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {
        "concurrency": concurrency,
        "requests": n,
        "errors": errors,
        "req_per_s": n / wall,
        "ttfb_p50_ms": 1e3 * statistics.median(lat),
        "ttfb_p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "ttfb_mean_ms": 1e3 * statistics.fmean(lat),
    }


def slot_tracker_micro(n: int = 20000) -> dict[str, float]:
    """Claim + release of a 16-token prompt on a 256-slot ring (no device, no HTTP)."""
    from blink.dpu.slot_tracker import SlotTracker
    from blink.protocol.layout import RingGeometry
    from blink.protocol.transport import ShmTransport
    from blink.protocol.wire import SubmitRequest

    name = f"blink-bench-{uuid.uuid4().hex[:8]}"
    t = ShmTransport.create(name, RingGeometry(256, 256 * 1024, 256))
    try:
        st = SlotTracker(t, RingGeometry(256, 256 * 1024, 256))
        req = SubmitRequest(1, list(range(16)), 8, stop_ids=[2])
        t0 = time.perf_counter()
        for _ in range(n):
            s = st.claim(req)
            st.release(s)
        claim_release = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(2000):
            st.refresh()
        refresh = (time.perf_counter() - t0) / 2000
    finally:
        t.close()
        t.unlink()
    return {"claim_release_us": 1e6 * claim_release, "bulk_refresh_256_slots_us": 1e6 * refresh}


def machine() -> dict[str, str | int]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count() or 0,
        "python": platform.python_version(),
        # other work on the machine skews every number here; recorded so a reader can judge
        "loadavg_1m_at_start": os.getloadavg()[0],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per concurrency level")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--model", default="random:tiny-llama")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]

    mach = machine()
    micro = slot_tracker_micro()
    server_flags = ["--model", args.model, "--n-slots", "256", "--max-batch", "64", "--num-kv-blocks", "2048"]
    server_flags += ["--max-queue", "4096"]
    proc, url = start_server(server_flags)
    rows = []
    try:
        model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
        asyncio.run(run_load(url, model, 100, 4))  # warm-up
        for c in levels:
            before, cpu0 = scrape(url), cpu_seconds(proc.pid)
            row = asyncio.run(run_load(url, model, args.requests, c))
            # CPU the frontend process (HTTP, tokenizer, slot tracker, token reader) spent per request
            row["frontend_cpu_us_per_req"] = 1e6 * (cpu_seconds(proc.pid) - cpu0) / args.requests
            row["stages_ms"] = {k: 1e3 * v for k, v in stage_means(before, scrape(url)).items()}
            rows.append(row)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)

    print(f"slot tracker alone: claim+release {micro['claim_release_us']:.1f} us, "
          f"bulk read of 256 slot records {micro['bulk_refresh_256_slots_us']:.1f} us")  # fmt: skip
    head = f"{'conc':>5} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'fe cpu us':>9}"
    print(head + " | first-token stages, mean ms: " + " ".join(STAGES))
    for r in rows:
        st = " ".join(f"{r['stages_ms'][s]:.3f}" for s in STAGES)
        print(f"{r['concurrency']:>5} {r['req_per_s']:>8.0f} {r['ttfb_p50_ms']:>8.2f} {r['ttfb_p99_ms']:>8.2f} "
              f"{r['frontend_cpu_us_per_req']:>9.0f} | {st}"
              f"{'  ERRORS ' + str(r['errors']) if r['errors'] else ''}")  # fmt: skip

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    today = datetime.datetime.now(datetime.UTC)
    out = {
        "date": today.isoformat(timespec="seconds"),
        "machine": mach,
        "git_commit": commit,
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "setup": {
            "server": "blink serve --device emulated " + " ".join(server_flags),
            "load": "streaming /v1/completions, prompt 'hi', max_tokens=1, client in the benchmark process",
            "note": "client, frontend and emulated device share this machine's cores",
        },
        "slot_tracker": micro,
        "http": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"frontend-{today:%Y-%m-%d}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {os.path.relpath(path, ROOT)}")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
