"""The scale-out benchmark's load generator: ShareGPT-like requests, arrival times, and client
processes that drive an OpenAI endpoint with streamed completions (bench/scaleout.py).

Clients are separate processes (one per 32 streams in scaleout.py), so the client is never the
bottleneck. Each warms up (session, connection, one request), reports ready, and all start on
one signal; every request's TTFT, end-to-end time, send time and send lag are recorded.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np

# log-normal (mu, sigma) of token counts, fitted to ShareGPT-V3 first turns (approximate).
PROMPT_LN = (5.2, 1.0)
OUTPUT_LN = (5.3, 0.8)


def sharegpt_like(
    n: int, vocab: int, max_context: int, scale: float, seed: int, copies: int = 1
) -> list[tuple[list[int], int]]:
    """n requests (prompt ids, output length), then `copies` - 1 more sets with the same lengths
    and fresh prompt ids, interleaved: with one copy per replica, every point of a scale-out run
    carries exactly the same work per replica (independent draws would differ in their tails)."""
    rng = np.random.default_rng(seed)
    p_len = np.clip((rng.lognormal(*PROMPT_LN, n) * scale).astype(int), 4, max_context // 2)
    o_len = np.clip((rng.lognormal(*OUTPUT_LN, n) * scale).astype(int), 4, max_context // 2 - 1)
    sets = [[(rng.integers(3, vocab, int(p)).tolist(), int(o)) for p, o in zip(p_len, o_len, strict=True)]]
    for j in range(1, copies):
        ids = np.random.default_rng([seed, j])
        sets.append([(ids.integers(3, vocab, len(pr)).tolist(), o) for pr, o in sets[0]])
    return [sets[j][i] for i in range(n) for j in range(copies)]


def poisson_offsets(n: int, rate: float, seed: int, copies: int = 1) -> np.ndarray:
    """Arrival times (s from the start) of the interleaved requests of sharegpt_like(n, copies=...):
    copy j arrives as its own Poisson stream at `rate`, copy 0 exactly as a single replica's."""
    out = np.empty(n * copies)
    for j in range(copies):
        gaps = np.random.default_rng(seed + 1 if j == 0 else [seed + 1, j]).exponential(1.0 / rate, n)
        out[j::copies] = np.cumsum(gaps) - gaps[0]
    return out


async def _one(session, url: str, model: str, prompt: list[int], n_out: int) -> dict:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True}
    # continuous_usage_stats: every token batch comes as a chunk with the count so far, so tokens are
    # timed even when they decode to no text (random-weight models emit many such tokens).
    body.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    t0 = time.monotonic()  # CLOCK_MONOTONIC: one clock for every client process of the machine
    t_first = None
    n_tok = 0
    async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=3600)) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {await r.text()}"}
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return {"error": ev["error"]["message"]}
            if ev.get("usage"):
                n_tok = ev["usage"]["completion_tokens"]
                if t_first is None and n_tok > 0:
                    t_first = time.monotonic()
    t1 = time.monotonic()
    ttft = (t_first or t1) - t0
    tpot = (t1 - t0 - ttft) / max(n_tok - 1, 1)
    return {"t_start": t0, "t_end": t1, "ttft": ttft, "e2e": t1 - t0, "tokens": n_tok, "tpot": tpot}


async def _drive_part(session, url: str, model: str, part: list, streams: int, t0: float) -> list:
    """One client process's share. streams > 0: closed loop, that many streams pulling from `part`
    in order; streams == 0: open loop, each request sent at t0 + its arrival offset (monotonic s)."""
    results: list[dict] = []

    async def send(i: int, prompt: list[int], n_out: int, first_wave: bool, due: float) -> None:
        r = await _one(session, url, model, prompt, n_out)
        lag = r["t_start"] - due if "t_start" in r else 0.0  # sent this late (event loop busy)
        results.append({**r, "i": i, "first_wave": first_wave, "lag": lag})

    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    if streams:
        queue = list(reversed(part))

        async def worker() -> None:
            first = True
            while queue:
                i, prompt, n_out, _ = queue.pop()
                await send(i, prompt, n_out, first, time.monotonic())
                first = False

        await asyncio.gather(*(worker() for _ in range(streams)))
    else:
        tasks = []
        for i, prompt, n_out, off in part:
            delay = t0 + off - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(send(i, prompt, n_out, False, t0 + off)))
        await asyncio.gather(*tasks)
    return results


async def _client(conn, url: str, model: str, part: list, streams: int) -> list:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams)) as session:
        # Warm up before the start signal: imports, the session, a connection and one request and
        # response, so that no client process is still starting while the others already send
        # (a late process would send its first requests in a burst and read their tokens late).
        async with session.get(url + "/v1/models") as r:
            await r.read()
        conn.send_bytes(b"ready")
        t0 = float(conn.recv_bytes())  # every client waits here; nothing else runs on this loop yet
        return await _drive_part(session, url, model, part, streams, t0)


def _client_main(conn, url: str, model: str, part: list, streams: int) -> None:
    """Entry point of a client process: warm up, wait for the common start, drive its share, send
    back the per-request records."""
    import resource

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    res = asyncio.run(_client(conn, url, model, part, streams))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    conn.send_bytes(json.dumps({"results": res, "cpu_s": ru.ru_utime + ru.ru_stime}).encode())
    conn.close()


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a live process (Linux /proc), seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(
    url: str,
    model: str,
    reqs: list[tuple[list[int], int]],
    concurrency: int,
    procs: int,
    arrivals: np.ndarray | None = None,
    watch: dict[str, list[int]] | None = None,
    rate: float = 0.0,
) -> dict:
    """Send `reqs` from `procs` client processes. arrivals None: closed loop with `concurrency`
    streams in all; else open loop, request i sent at arrivals[i] s (concurrency unbounded).
    `watch` maps a role to pids whose CPU use over the phase is reported (frontend, engines)."""
    import multiprocessing as mp

    procs = max(1, min(procs, len(reqs), concurrency if arrivals is None else len(reqs)))
    ctx = mp.get_context("spawn")  # no forked event loops or Ray state in the clients
    offsets = arrivals if arrivals is not None else np.zeros(len(reqs))
    streams = (
        [0] * procs
        if arrivals is not None
        else [concurrency // procs + (k < concurrency % procs) for k in range(procs)]
    )
    tagged = [(i, p, n, float(off)) for i, ((p, n), off) in enumerate(zip(reqs, offsets, strict=True))]
    # open loop: each process sends its share in arrival order (the copies' streams interleave)
    parts = [sorted(tagged[k::procs], key=lambda x: x[3]) for k in range(procs)]
    pipes, children = [], []
    for k in range(procs):
        ours, theirs = ctx.Pipe(duplex=True)
        c = ctx.Process(target=_client_main, args=(theirs, url, model, parts[k], streams[k]), daemon=True)
        c.start()
        theirs.close()
        pipes.append(ours)
        children.append(c)
    for rx in pipes:  # every client warmed up and waiting: start them together
        if rx.recv_bytes() != b"ready":
            raise RuntimeError("client process did not report ready")
    t0 = time.monotonic() + 0.05
    for rx in pipes:
        rx.send_bytes(repr(t0).encode())
    watch = watch or {}
    cpu0 = {role: [_proc_cpu_s(p) for p in pids] for role, pids in watch.items()}
    w0 = time.monotonic()
    records, client_cpu = [], 0.0
    for rx, c in zip(pipes, children, strict=True):
        got = json.loads(rx.recv_bytes())
        records += got["results"]
        client_cpu += got["cpu_s"]
        c.join(30)
    w1 = time.monotonic()
    cpu_use = {}
    for role, pids in watch.items():
        used = [
            None if a is None or b is None else round((b - a) / (w1 - w0), 3)
            for a, b in zip(cpu0[role], [_proc_cpu_s(p) for p in pids], strict=True)
        ]
        cpu_use[role] = used
    ok = [r for r in records if "error" not in r]
    errors = [r["error"] for r in records if "error" in r]
    tok = sum(r["tokens"] for r in ok)
    t_first = min((r["t_start"] for r in ok), default=t0)
    wall = max((r["t_end"] for r in ok), default=t0) - (t_first if arrivals is None else t0)
    steady = [r for r in ok if not r["first_wave"]]

    def pct(rs: list[dict], key: str, q: float) -> float:
        return float(np.percentile([r[key] for r in rs], q)) if rs else float("nan")

    by_i = sorted(ok, key=lambda r: r["i"])
    return {
        "mode": f"closed loop, {concurrency} streams" if arrivals is None else f"poisson {rate:g} req/s",
        "client_procs": procs,
        "requests": len(records),
        "errors": len(errors),
        "first_errors": errors[:3],
        "output_tokens": tok,
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "wall_s": wall,
        "output_tok_per_s": tok / wall if wall > 0 else float("nan"),
        "requests_per_s": len(ok) / wall if wall > 0 else float("nan"),
        "ttft_p50_s": pct(ok, "ttft", 50),
        "ttft_p90_s": pct(ok, "ttft", 90),
        "ttft_p99_s": pct(ok, "ttft", 99),
        # closed loop: every stream's first request is sent at t=0, all at once; the p99 over all
        # requests is then the time to prefill that burst. "steady" leaves the first wave out.
        "ttft_p99_steady_s": pct(steady, "ttft", 99) if arrivals is None else pct(ok, "ttft", 99),
        # how late the clients sent (open loop: after the arrival time; should stay ~0)
        "send_lag_p99_ms": pct(ok, "lag", 99) * 1e3,
        "send_lag_max_ms": max((r["lag"] for r in ok), default=0.0) * 1e3,
        "tpot_p50_s": pct(ok, "tpot", 50),
        "tpot_p99_s": pct(ok, "tpot", 99),
        "e2e_p50_s": pct(ok, "e2e", 50),
        "cpu_cores_used": {**cpu_use, "clients_total": round(client_cpu / (w1 - w0), 3)},
        # per request, in request order: [prompt tokens, output tokens, TTFT ms, end-to-end s,
        # sent at (s after the start), client process]
        "per_request": [
            [
                len(reqs[r["i"]][0]),
                r["tokens"],
                round(r["ttft"] * 1e3, 2),
                round(r["e2e"], 3),
                round(r["t_start"] - t0, 4),
                r["i"] % procs,
            ]
            for r in by_i
        ],
    }
