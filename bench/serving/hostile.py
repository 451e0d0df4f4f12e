"""Hostile and careless clients for bench/serving/soak.py, and the health prober that measures what they
cost everyone else.

Each hostile loop draws one attack at a time; every attack has an expected answer from a server at
its defaults, and anything else counts as `unexpected` (with an example):

    big_tokenize   POST /tokenize with a prompt of --hostile-prompt-mb     -> 200 (or 413 over the body limit)
    big_chat       the same prompt as a chat message                       -> 400 context_length_exceeded (413)
    slowloris      request headers trickled, a line every 0.5 s            -> closed by the server (keep-alive timeout)
    endless_body   a chunked body that never ends                          -> 408 and closed
    idle_flood     200 idle sockets                                        -> each closed by the server (or refused 503)
    stop_flood     16 stop strings of 1024 characters on a real completion -> 200 (503 while the device is down)
    long_stop      one stop string of 250,000 characters                   -> 400
    bad_template   chat_template_kwargs {"self": 1}                        -> 400
    big_schema     a chat completion under a JSON schema new to the server, of about
                   --hostile-prompt-mb (read and compiled in a grammar thread) -> 200, or 400 when the grammar
                                                                              engine finds it too large (413, 503)

The prober GETs /health every 50 ms for the whole run; its latencies (p50, p99, max) are the
number that says whether anyone could stall the server.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from urllib.parse import urlparse

import aiohttp

KINDS = (
    "big_tokenize",
    "big_chat",
    "slowloris",
    "endless_body",
    "idle_flood",
    "stop_flood",
    "long_stop",
    "bad_template",
    "big_schema",
)
CUT_WAIT_S = 60.0  # a connection the server has not closed after this long is an unexpected answer


class HostileTally:
    def __init__(self) -> None:
        self.kinds: dict[str, dict[str, int]] = {}
        self.examples: list[str] = []
        self.cut_after_s: dict[str, list[float]] = {}

    def add(self, kind: str, expected: bool, why: str = "") -> None:
        k = self.kinds.setdefault(kind, {})
        key = "as_expected" if expected else "unexpected"
        k[key] = k.get(key, 0) + 1
        if not expected and len(self.examples) < 10:
            self.examples.append(f"{kind}: {why}")

    @property
    def unexpected(self) -> int:
        return sum(k.get("unexpected", 0) for k in self.kinds.values())

    def summary(self) -> dict:
        cut = {k: round(max(v), 2) for k, v in self.cut_after_s.items()}
        return {"by_kind": self.kinds, "unexpected": self.unexpected, "examples": self.examples, "cut_after_s_max": cut}


async def _closed_after(reader: asyncio.StreamReader, t0: float) -> tuple[float | None, bytes]:
    """Seconds until the server closed the connection (None: not within CUT_WAIT_S) and what it sent."""
    got = b""
    try:
        async with asyncio.timeout(CUT_WAIT_S):
            while chunk := await reader.read(65536):
                got += chunk
    except TimeoutError:
        return None, got
    except ConnectionError:
        pass
    return time.monotonic() - t0, got


async def _raw(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    u = urlparse(url)
    return await asyncio.open_connection(u.hostname, u.port)


async def _trickled(url: str, head: bytes, piece: bytes, period_s: float) -> tuple[float | None, bytes]:
    """Send `head`, then `piece` (%d: a counter) every period_s until the server closes the
    connection: (seconds until it did, None if not within CUT_WAIT_S; what it sent)."""
    r, w = await _raw(url)
    t0 = time.monotonic()
    w.write(head)

    async def trickle() -> None:
        for i in range(1_000_000):
            w.write(piece % i if b"%d" in piece else piece)
            await w.drain()
            await asyncio.sleep(period_s)

    t = asyncio.ensure_future(trickle())
    took, got = await _closed_after(r, t0)
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)
    w.close()
    return took, got


async def _slowloris(url: str, tally: HostileTally) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    took, _ = await _trickled(url, head, b"X-Slow-%d: y\r\n", 0.5)
    tally.add("slowloris", took is not None, "still open")
    if took is not None:
        tally.cut_after_s.setdefault("slowloris", []).append(took)


async def _endless_body(url: str, tally: HostileTally) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    took, got = await _trickled(url, head, b"1\r\n \r\n", 0.2)
    ok = took is not None and b" 408 " in got[:20]
    tally.add("endless_body", ok, "still open" if took is None else got[:60].decode(errors="replace"))
    if took is not None:
        tally.cut_after_s.setdefault("endless_body", []).append(took)


async def _idle_flood(url: str, tally: HostileTally, n: int = 200) -> None:
    t0 = time.monotonic()
    conns = []
    for _ in range(n):
        try:
            conns.append(await _raw(url))
        except OSError:  # the listen backlog is full: refused before accept, also a refusal
            break
    results = await asyncio.gather(*(_closed_after(r, t0) for r, _ in conns))
    for _, w in conns:
        w.close()
    open_ = sum(took is None for took, _ in results)
    tally.add("idle_flood", open_ == 0, f"{open_} of {len(conns)} idle sockets still open")
    done = [took for took, _ in results if took is not None]
    if done:
        tally.cut_after_s.setdefault("idle_flood", []).append(max(done))


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    async with session.post(url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as r:
        return r.status, await r.read()


async def one_attack(
    session: aiohttp.ClientSession, url: str, model: str, rng: random.Random, big: bytes, tally: HostileTally
) -> None:
    kind = rng.choice(KINDS)
    try:
        if kind == "slowloris":
            return await _slowloris(url, tally)
        if kind == "endless_body":
            return await _endless_body(url, tally)
        if kind == "idle_flood":
            return await _idle_flood(url, tally)
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
        if kind == "big_tokenize":
            body, path, want = (
                b'{"model": %s, "prompt": %s}' % (json.dumps(model).encode(), big),
                "/tokenize",
                (200, 413),
            )
        elif kind == "big_chat":
            msg = b'[{"role": "user", "content": %s}]' % big
            body, path, want = (
                b'{"model": %s, "messages": %s}' % (json.dumps(model).encode(), msg),
                "/v1/chat/completions",
                (400, 413),
            )
        elif kind == "stop_flood":
            stops = ["".join(rng.choices("abcdefgh ", k=1024)) for _ in range(16)]
            body, path = json.dumps({**chat, "stop": stops}).encode(), "/v1/chat/completions"
            want = (200, 503)  # 503: the device is down (soak's kill), not the attack's doing
        elif kind == "big_schema":
            tag = f"{rng.randrange(1 << 30):x}"  # new to the server: it reads and compiles this one
            names = [f"{tag}_{i}_{'n' * 40}" for i in range(max(1, len(big) // 100))]
            schema = {"type": "object", "properties": {k: {"type": "string", "maxLength": 4} for k in names}}
            fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
            body = json.dumps({**chat, "max_tokens": 2, "response_format": fmt}).encode()
            path, want = "/v1/chat/completions", (200, 400, 413, 503)
        elif kind == "long_stop":
            body, path, want = json.dumps({**chat, "stop": ["z" * 250_000]}).encode(), "/v1/chat/completions", (400,)
        else:  # bad_template
            body = json.dumps({**chat, "chat_template_kwargs": {"self": 1}}).encode()
            path, want = "/v1/chat/completions", (400,)
        status, _ = await _post(session, url + path, body)
        tally.add(kind, status in want, f"HTTP {status}")
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        tally.add(kind, False, f"{type(e).__name__}: {e}")


async def hostile_loop(url: str, model: str, seed: int, prompt_mb: float, t_end: float, tally: HostileTally) -> None:
    """Attacks one after another until t_end (the one running then is abandoned)."""
    rng = random.Random(seed)
    big = json.dumps("".join(rng.choices("abcdefghij ", k=1000)) * int(prompt_mb * 1000)).encode()
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < t_end:
            attack = asyncio.ensure_future(one_attack(session, url, model, rng, big, tally))
            done, _ = await asyncio.wait([attack], timeout=max(0.0, t_end - time.monotonic()))
            if not done:
                attack.cancel()
                await asyncio.gather(attack, return_exceptions=True)


async def probe_health(url: str, t_end: float, period_s: float = 0.05) -> list[float]:
    """/health latencies (seconds) every period_s until t_end; a failed probe counts as 60 s."""
    lat = []
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < t_end:
            t0 = time.monotonic()
            try:
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=60)) as r:
                    await r.read()
                lat.append(time.monotonic() - t0)
            except (aiohttp.ClientError, TimeoutError):
                lat.append(60.0)
            await asyncio.sleep(period_s)
    return lat


def percentiles_ms(lat: list[float]) -> dict:
    if not lat:
        return {"n": 0}
    s = sorted(lat)

    def q(p: float) -> float:
        return round(s[min(len(s) - 1, int(p * len(s)))] * 1e3, 2)

    return {"n": len(s), "p50": q(0.5), "p99": q(0.99), "max": round(s[-1] * 1e3, 2)}
