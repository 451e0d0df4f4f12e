"""Soak test: `blink serve` under mixed load for a long time, with a device kill in the middle.

    python -m bench.serving.soak --duration-s 1800                        # emulated device, 30 min
    python -m bench.serving.soak --device cuda --duration-s 600 --model default

Load: `--concurrency` client loops, each drawing its next request from a mix: short chats
(streamed or not), completions with n = 2, long prompts (up to 90 % of the context), streams
the client aborts after a few chunks, and prompts that share one of three system prefixes (prefix
caching: blocks shared by running requests, some of them aborted mid-stream), and chats under one of a few
small JSON schemas (structured output: token masks in the ring). At `--kill-at` (a fraction of the duration) the device
process is sent SIGKILL; the server should end the requests then in flight with an error and
(with self-healing) restart its device and come back to /health 200. Beside them, `--hostile`
loops of hostile clients (bench/serving/hostile.py: 4 MB prompts, slowloris, endless bodies, idle-socket
floods, stop-string floods, bad template variables, large JSON schemas new to the server), each attack
with its expected answer, and a
prober that GETs /health every 50 ms.

Reported (and written as JSON to bench/results/soak-<device>-<commit>.json, with the command):
- requests by outcome: ok, aborted (by the client, on purpose), rejected (4xx), unavailable (503),
  failed (another 5xx or an error event), failed_at_kill (in flight when the device was killed), and lost: no answer at all
  (connection dropped, timeout, a stream without [DONE]). Lost must be 0.
- leaks once the load stops and the server is idle: slots still busy and KV blocks still in
  use (both must be 0), from /metrics; not measurable when the device is down at the end.
- the server process's RSS after warm-up and at the end; the device's, before the kill and at the end.
- the kill: when, which pid, how long until /health answered 200 again (null: it did not).
- /health latency (p50, p99, max) over the whole run, hostile clients included; the hostile
  attacks by kind, as expected or not, and how long the server took to cut the slow ones.
Exit status 1 when anything was lost or leaked, an attack was not answered as expected, or the
device was not serving at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import signal
import sys
import time

from bench.common import RESULTS, add_commit_arg, git_commit, metadata, smi_gpu_name
from bench.serving import hostile
from blink.testing import ServeProcess, rss_mib

# -- the load ---------------------------------------------------------------------------------
SHARED = [random.Random(k).choices(range(10, 250), k=n) for k, n in ((1, 96), (2, 200), (3, 320))]


class Tally:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.kinds: dict[str, dict[str, int]] = {}
        self.lost_examples: list[str] = []
        self.failed_examples: list[str] = []
        self.t_kill: float | None = None
        self.t_noticed: float | None = None  # when /health first said the device was down
        self.hostile = hostile.HostileTally()
        self.health: list[float] = []  # /health latencies (s), the whole run

    def at_kill(self, t0: float, t1: float) -> bool:
        """In flight when the device was killed, or sent after the kill but before the server could
        know of it (until /health first answered non-200; until the request ended if not yet)."""
        if self.t_kill is None:
            return False
        return t0 <= self.t_kill <= t1 or self.t_kill <= t0 <= (self.t_noticed or t1)

    def add(self, kind: str, outcome: str, t0: float, t1: float, why: str = "") -> None:
        if outcome in ("failed", "lost") and self.at_kill(t0, t1):
            outcome = "failed_at_kill"
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        k = self.kinds.setdefault(kind, {})
        k[outcome] = k.get(outcome, 0) + 1
        examples = {"lost": self.lost_examples, "failed": self.failed_examples}.get(outcome)
        if examples is not None and len(examples) < 10:
            since = f", {t0 - self.t_kill:+.2f} s from the kill" if self.t_kill is not None else ""
            examples.append(f"{kind}: {why}{since}")


async def one_request(session, url: str, model: str, max_context: int, rng: random.Random) -> tuple[str, str, str]:
    """Send one request of a random kind; (kind, outcome, why)."""
    import aiohttp

    kinds = ["chat", "chat_stream", "n2", "long", "abort", "prefix", "prefix_abort", "structured"]
    kind = rng.choices(kinds, weights=[3, 4, 1, 1, 2, 3, 1, 1])[0]
    if kind == "structured":  # one of a few schemas: compiled once, then a copy of the matcher per request
        path = "/v1/chat/completions"
        props = {f"f{i}": {"type": rng.choice(["integer", "boolean", "string"])} for i in range(rng.randint(1, 3))}
        schema = {"type": "object", "properties": props, "required": list(props)}
        body = {"model": model, "messages": [{"role": "user", "content": "json"}], "max_tokens": 48}
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    elif kind in ("chat", "chat_stream"):
        path = "/v1/chat/completions"
        # within a small context too (the CI test's 128 tokens: a byte-level tokenizer, the template's ~30)
        n_words, n_out = min(30, max_context // 16), min(64, max_context // 4)
        words = " ".join(
            rng.choice(["tell", "me", "about", "the", "sea", "and", "sky"]) for _ in range(rng.randint(1, n_words))
        )
        body = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": rng.randint(1, n_out)}
        body["stream"] = kind == "chat_stream"
    else:
        path = "/v1/completions"
        n_prompt = int(max_context * rng.uniform(0.5, 0.9)) if kind == "long" else rng.randint(4, 64)
        prompt = [rng.randint(10, 250) for _ in range(n_prompt)]
        if kind.startswith("prefix"):  # a shared system prompt of up to half the context, a turn of its own
            prompt = SHARED[rng.randrange(len(SHARED))][: max_context // 2] + prompt[: rng.randint(1, 24)]
        body = {"model": model, "prompt": prompt, "max_tokens": 16}
        body.update(n=2 if kind == "n2" else 1, stream=kind.endswith("abort"), ignore_eos=True)
        if kind.endswith("abort"):  # long enough to be cut, and within the context
            body["max_tokens"] = min(400, max_context - len(prompt))
    body["temperature"] = rng.choice([0.0, 0.7, 1.0])
    timeout = aiohttp.ClientTimeout(total=600)
    try:
        async with session.post(url + path, json=body, timeout=timeout) as r:
            if r.status != 200:
                await r.read()
                outcome = "rejected" if r.status < 500 else "unavailable" if r.status == 503 else "failed"
                return kind, outcome, f"HTTP {r.status}"
            if not body.get("stream"):
                js = await r.json()
                return kind, "ok" if js.get("choices") else "lost", "no choices"
            chunks, error = 0, b""
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    return kind, "failed" if error else "ok", error.decode(errors="replace")[:200]
                if not error and b'"error"' in line[:20]:
                    error = line.strip()
                chunks += 1
                if kind.endswith("abort") and chunks >= 3 and not error:
                    return kind, "aborted", ""  # leaving the block closes the connection mid-stream
            return kind, "lost", "stream ended without [DONE]"
    except (TimeoutError, aiohttp.ClientError) as e:
        return kind, "lost", f"{type(e).__name__}: {e}"


async def drive(served: ServeProcess, a: argparse.Namespace, tally: Tally, model: str, max_context: int) -> dict:
    import aiohttp

    t_end = time.monotonic() + a.duration_s
    t_kill = time.monotonic() + a.duration_s * a.kill_at if a.kill_at > 0 else None
    kill: dict = {"done": False}

    async def worker(i: int) -> None:
        rng = random.Random(a.seed * 1000 + i)
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                kind, outcome, why = await one_request(session, served.url, model, max_context, rng)
                tally.add(kind, outcome, t0, time.monotonic(), why)
                if outcome not in ("ok", "aborted"):
                    await asyncio.sleep(0.05)  # a down device answers at once: do not spin

    async def killer() -> None:
        if t_kill is None:
            return
        await asyncio.sleep(max(0.0, t_kill - time.monotonic()))
        pid = served.device_pid()
        kill.update(pid=pid, t_s=round(a.duration_s * a.kill_at, 1), device_rss_mb_before=rss_mib(pid))
        if pid is None:
            kill["error"] = "no device process found"
            return
        tally.t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        kill["done"] = True
        # how long until the server notices (/health 503), and until it serves again (200); a restart
        # that ends after the load is still timed (up to RECOVERY_WAIT_S past the end)
        kill["noticed_after_s"] = kill["recovered_after_s"] = None
        while time.monotonic() < t_end + RECOVERY_WAIT_S:
            status, _ = await asyncio.to_thread(served.get, "/health")
            el = round(time.monotonic() - tally.t_kill, 2)
            if status != 200 and kill["noticed_after_s"] is None:
                kill["noticed_after_s"] = el
                tally.t_noticed = time.monotonic()
            if status == 200 and kill["noticed_after_s"] is not None:
                kill["recovered_after_s"] = el
                return
            await asyncio.sleep(0.1)

    attackers = (
        hostile.hostile_loop(served.url, model, a.seed * 1000 + 500 + i, a.hostile_prompt_mb, t_end, tally.hostile)
        for i in range(a.hostile)
    )
    results = await asyncio.gather(
        hostile.probe_health(served.url, t_end), killer(), *(worker(i) for i in range(a.concurrency)), *attackers
    )
    tally.health = results[0]
    return kill


RECOVERY_WAIT_S = 60.0


def prefix_hit_rate(served: ServeProcess) -> float | None:
    """Prompt tokens the device took from its prefix cache over all it was asked for."""
    m = served.metrics()
    q = m.get("blink_device_prefix_cache_queries_total", 0.0)
    return m.get("blink_device_prefix_cache_hits_total", 0.0) / q if q else None


def idle_leaks(served: ServeProcess, wait_s: float) -> dict:
    """After the load: slots and KV blocks still in use once everything had time to settle."""
    t_end = time.monotonic() + wait_s
    m: dict[str, float] = {}
    while time.monotonic() < t_end:
        m = served.metrics()
        busy = m.get("blink_ring_busy_slots", -1)
        used = m.get("blink_device_kv_blocks_total", 0) - m.get("blink_device_kv_blocks_free", 0)
        if busy == 0 and used == 0:
            break
        time.sleep(0.2)
    if m.get("blink_device_up") != 1:  # a dead device's counters are frozen: nothing to measure
        return {"slots_leaked": None, "kv_blocks_leaked": None, "device_up": m.get("blink_device_up")}
    return {
        "slots_leaked": m.get("blink_ring_busy_slots"),
        "kv_blocks_leaked": m["blink_device_kv_blocks_total"] - m["blink_device_kv_blocks_free"],
        "queued": m.get("blink_ring_queued"),
        "device_up": 1,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=1800)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of the duration (0: no kill)")
    ap.add_argument("--device", default="emulated", choices=("emulated", "cuda"))
    ap.add_argument("--model", default="random:tiny-llama")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hostile", type=int, default=1, help="hostile client loops (bench/serving/hostile.py)")
    ap.add_argument("--hostile-prompt-mb", type=float, default=4.0, help="the hostile long prompts' size")
    ap.add_argument("--warmup-s", type=float, default=10.0, help="load before the first RSS sample")
    add_commit_arg(ap)
    ap.add_argument("--out", help="JSON file (default bench/results/soak-<device>-<date>.json)")
    ap.add_argument("serve_args", nargs="*", help="more `blink serve` flags (after --)")
    a = ap.parse_args(argv)

    served = ServeProcess(
        ["--disable-log-requests", "--device", a.device, "--model", a.model, "--max-context", str(a.max_context)]
        + a.serve_args,
        timeout=900,
    )
    try:
        model = json.loads(served.get("/v1/models")[1])["data"][0]["id"]
        tally = Tally()
        rss: dict[str, float | None] = {}

        async def run() -> dict:
            async def sample() -> None:
                await asyncio.sleep(min(a.warmup_s, a.duration_s / 4))
                rss["server_mb_after_warmup"] = rss_mib(served.proc.pid)

            kill, _ = await asyncio.gather(drive(served, a, tally, model, a.max_context), sample())
            return kill

        t0 = time.monotonic()
        kill = asyncio.run(run())
        wall = time.monotonic() - t0
        leaks = idle_leaks(served, 30.0)
        hit_rate = prefix_hit_rate(served)
        rss["server_mb_end"] = rss_mib(served.proc.pid)
        rss["device_mb_end"] = rss_mib(served.device_pid())
        if rss.get("server_mb_after_warmup") and rss["server_mb_end"]:
            rss["server_growth_mb"] = round(rss["server_mb_end"] - rss["server_mb_after_warmup"], 1)
    finally:
        rc = served.stop(timeout=30)
    lost = tally.counts.get("lost", 0)
    measured = leaks["slots_leaked"] is not None
    leaked = (leaks["slots_leaked"] or 0) + (leaks["kv_blocks_leaked"] or 0)
    result = {
        "bench": "soak",
        # the server owns the GPU: its name from nvidia-smi, not CUDA in this process
        **metadata(a.commit or git_commit(), [os.path.basename(sys.executable), *sys.argv], gpu=smi_gpu_name()),
        "device": a.device,
        "model": a.model,
        "duration_s": round(wall, 1),
        "concurrency": a.concurrency,
        "requests": sum(tally.counts.values()),
        "outcomes": tally.counts,
        "by_kind": tally.kinds,
        "lost": lost,
        "lost_examples": tally.lost_examples,
        "failed_examples": tally.failed_examples,
        "leaks": leaks,
        "prefix_cache_hit_rate": hit_rate,
        "rss": rss,
        "kill": kill,
        "server_exit": rc,
        "health_ms": hostile.percentiles_ms(tally.health),
        "hostile_loops": a.hostile,
        "hostile": tally.hostile.summary(),
        # the device must be serving at the end (after a kill: restarted) for leaks to be measured
        "ok": lost == 0 and measured and leaked == 0 and tally.hostile.unexpected == 0,
    }
    dev = "h200" if a.device == "cuda" else a.device
    out = pathlib.Path(a.out) if a.out else RESULTS / f"soak-{dev}-{result['commit'][:7] or 'nocommit'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"soak {a.device} {wall:.0f} s, {result['requests']} requests: {tally.counts}")
    print(f"lost {lost}, slots leaked {leaks['slots_leaked']}, KV blocks leaked {leaks['kv_blocks_leaked']}")
    if not measured:
        print("leaks not measured: the device was not serving at the end (killed and not restarted)")
    print(f"RSS {rss}; kill {kill}")
    print(f"/health ms {result['health_ms']}; hostile {result['hostile']}")
    print(f"-> {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
