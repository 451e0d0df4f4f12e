"""The frontend's transports compared: per-operation latency, then serving over shm vs tcp.

    python -m bench.serving.transport                                     # emulated device, tiny model (a harness check)
    python -m bench.serving.transport --device cuda --model default       # the H200: SmolLM2-135M, the real numbers

Part 1, per-op latency (`--ops`): a ring of the serving geometry (256 slots), reached over shm (the
mapping) and over tcp (a ring agent in its own process on this host, loopback). Timed, each
`--iters` times: one word load; one token-reader cycle (the transact of every slot record, the
header and a 16-token window for each of `--streams` slots); one `post` of `--streams` consumed
counters; one submission (a 512-token prompt, the record, the state word, the doorbell, posted,
then a one-word read so that the post is known to have landed). Over rdma too where a device exists.

Part 2, serving (`--serve`): `blink serve` twice on the same device settings, once with the
frontend on the mapping (`--transport shm`) and once through the ring agent (`--transport tcp`: the
frontend process never touches the ring; the agent, its own process, does every access), and
`blink bench serve` against each: `--streams` concurrent streams, random `--input-len` ->
`--output-len` prompts. Reported per transport: output tok/s, TTFT and ITL (mean, p50, p99), and
for tcp the agent's CPU (cores busy on the GPU host, and CPU-microseconds per output token): how
many tokens/s one frontend carries over tcp, and what that costs the GPU host.

Writes bench/results/transport-<device>-<commit>.json (--commit names the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.common import RESULTS, add_commit_arg, cpu_seconds, metadata, write_json
from blink.protocol.agent_auth import new_secret
from blink.protocol.layout import HEADER_DTYPE, SLOT_DTYPE
from blink.protocol.ring_agent import start_agent_process
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.tcp_transport import TcpTransport
from blink.protocol.transport import ShmTransport
from blink.testing import ServeProcess, cmdline


# -- part 1: per-op latency ----------------------------------------------------------------------
def _us(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples) * 1e6
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def time_ops(t, geo: RingGeometry, streams: int, iters: int) -> dict[str, dict[str, float]]:
    slots = np.zeros(geo.n_slots, SLOT_DTYPE)
    hdr = np.zeros(1, HEADER_DTYPE)
    windows = np.zeros((streams, 16), np.int32)
    cycle_reads = [(geo.slots_offset, slots), (0, hdr)]
    cycle_reads += [(geo.output_offset(s, 0), windows[s]) for s in range(streams)]
    consumed = [(geo.slot_offset(s) + SLOT_DTYPE.fields["consumed"][1], np.array([1], "<u4")) for s in range(streams)]
    prompt = np.arange(512, dtype=np.int32)
    rec = np.zeros(1, SLOT_DTYPE)
    submit = [
        (geo.prompt_arena_offset, prompt),
        (geo.slot_offset(0), rec),
        (geo.slot_offset(0), np.array([0], "<u4")),
        (HEADER_DTYPE.fields["submit_seq"][1], np.array([1], "<u8")),
    ]
    ops = {
        "load_u32": lambda: t.load_u32(0),
        f"reader_cycle_{streams}": lambda: t.transact((), cycle_reads),
        f"post_consumed_{streams}": lambda: t.post(consumed),
        "submit_512": lambda: (t.post(submit), t.load_u32(0)),
    }
    out = {}
    for name, fn in ops.items():
        for _ in range(max(10, iters // 20)):
            fn()
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        out[name] = _us(samples)
    t.load_u32(0)  # every post landed before the next transport's turn
    return out


def ops_part(streams: int, iters: int) -> dict:
    geo = RingGeometry(256, 256 * 8192, 1024)
    name = f"blink-bench-transport-{os.getpid()}"
    ring = ShmTransport.create(name, geo)
    secret = new_secret()
    agent, addr = start_agent_process(name, secret=secret)
    agent_cpu0 = cpu_seconds(agent.pid)
    res: dict = {"geometry": {"n_slots": geo.n_slots, "bytes": geo.total_bytes}}
    try:
        res["shm"] = time_ops(ShmTransport.open(name), geo, streams, iters)
        tcp = TcpTransport(addr, secret)
        res["tcp"] = time_ops(tcp, geo, streams, iters)
        res["tcp_agent_cpu_s"] = cpu_seconds(agent.pid) - agent_cpu0
        res["tcp_round_trips"] = tcp.round_trips
        tcp.close()
        from blink.protocol.rdma_transport import RdmaTransport, rdma_devices

        if rdma_devices():
            res["rdma"] = time_ops(RdmaTransport(addr, secret), geo, streams, iters)
        else:
            res["rdma"] = "not run: no RDMA device on this host"
    finally:
        agent.terminate()
        agent.wait(10)
        ring.close()
        ring.unlink()
    return res


# -- part 2: serving over shm vs tcp -------------------------------------------------------------
def serve_part(a: argparse.Namespace) -> dict:
    common = ["--device", a.device, "--model", a.model, "--n-slots", str(max(a.streams * 2, 64))]
    common += ["--max-batch", str(a.max_batch)] + (["--num-kv-blocks", str(a.kv_blocks)] if a.kv_blocks else [])
    out = {}
    for kind in a.transports:
        s = ServeProcess(["--disable-log-requests", *common, "--transport", kind], timeout=900)
        try:
            agent = next((p for p in s.children() if "blink.protocol.ring_agent" in cmdline(p)), None)
            link = next((ln.strip() for ln in s.log if "ring transport" in ln), "")
            fe_cpu0 = cpu_seconds(s.proc.pid)
            agent_cpu0 = cpu_seconds(agent) if agent else 0.0
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, "-m", "blink.cli", "bench", "serve", "--base-url", s.url]
                cmd += ["--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.streams)]
                cmd += ["--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len)]
                cmd += ["--metric-percentiles", "50,99", "--result-file", f.name]
                t0 = time.monotonic()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                wall = time.monotonic() - t0
                r = json.load(open(f.name))
            res = {k: r[k] for k in ("output_throughput", "ttft_ms", "itl_ms", "completed") if k in r}
            res["link"] = link
            res["frontend_cores"] = (cpu_seconds(s.proc.pid) - fe_cpu0) / wall
            if agent:
                busy = cpu_seconds(agent) - agent_cpu0
                res["agent_cores"] = busy / wall  # the GPU host's CPU the tcp path costs
                out_tokens = r.get("total_output_tokens") or r["output_throughput"] * r.get("duration", wall)
                res["agent_cpu_us_per_token"] = busy / max(out_tokens, 1) * 1e6
            out[kind] = res
        finally:
            s.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="emulated", choices=("emulated", "cuda"))
    ap.add_argument("--model", default="random:tiny-llama")
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams (and active slots per reader cycle)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--kv-blocks", type=int, default=0, help="KV blocks (0: the device sizes the pool)")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--transports", nargs="+", default=["shm", "tcp"], choices=("shm", "tcp", "rdma"))
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    add_commit_arg(ap)
    ap.add_argument("--out", help="result JSON (default bench/results/transport-<device>-<commit>.json)")
    a = ap.parse_args(argv)
    res = metadata(a.commit, [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    res["settings"] = {k: v for k, v in vars(a).items() if k not in ("out", "commit")}
    if not a.skip_ops:
        res["ops_us"] = ops_part(a.streams, a.iters)
        for kind in ("shm", "tcp", "rdma"):
            v = res["ops_us"].get(kind)
            if isinstance(v, dict):
                print(
                    f"{kind:5s} " + "  ".join(f"{op} p50 {s['p50']:.1f} us p99 {s['p99']:.1f}" for op, s in v.items())
                )
    if not a.skip_serve:
        res["serve"] = serve_part(a)
        for kind, r in res["serve"].items():
            ttft, itl = r["ttft_ms"], r["itl_ms"]
            extra = f"  agent {r['agent_cores']:.2f} cores" if "agent_cores" in r else ""
            print(
                f"{kind:5s} {r['output_throughput']:8.0f} tok/s  TTFT mean {ttft['mean']:.1f} ms  "
                f"ITL mean {itl['mean']:.2f} ms  frontend {r['frontend_cores']:.2f} cores{extra}"
            )
    dev = "h200" if "H200" in res.get("gpu", "") else a.device
    path = a.out or os.path.join(RESULTS, f"transport-{dev}-{res['commit']}.json")
    write_json(path, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
