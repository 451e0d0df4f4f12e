"""The HTTP server against hostile and careless clients (in-process, 127.0.0.1 only, bounded in
time): a long prompt must not stall /health or other streams, slow or endless requests are cut,
a connection flood is refused without using up descriptors, --api-key covers every endpoint but
/health, stop strings are bounded and matched in linear time, and what a client sends cannot
forge log lines or fill the log with tracebacks."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.web_protocol import RequestHandler
from test_dpu_server_ops import CHAT, COMPLETION, MODEL, ScriptedBackend

from blink.config import ServerConfig
from blink.dpu.server import OpenAIServer, start_http
from blink.dpu.tokenizer import load_tokenizer
from blink.protocol.gc_freeze import freeze_startup_heap

# Characters of the long prompts: seconds of encoding with the test model's tokenizer on a small
# host, far beyond the 100 ms a health check may wait (bench/soak.py's hostile mix sends 4 MB).
BIG = 512 << 10


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("random:tiny-llama")


@pytest.fixture
def served_heap():
    """This process's heap frozen as a serving frontend's is once it has started (blink.protocol.gc_freeze).
    Otherwise a full collection walks the test runner's own heap, which no server holds (45 ms a
    collection here, 370 ms seen on a loaded 2-core host), and a latency bound measures the runner."""
    freeze_startup_heap()
    yield
    gc.unfreeze()


class Served:
    """start_http (the production edge: connection limit, timeouts) on 127.0.0.1, a free port."""

    def __init__(self, server: OpenAIServer):
        self.server = server

    async def __aenter__(self) -> Served:
        self.runner, self.port = await start_http(self.server, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


async def _probe_health(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[float]:
    lat = []
    while not stop.is_set():
        t0 = time.perf_counter()
        async with session.get(url + "/health") as r:
            assert r.status == 200
        lat.append(time.perf_counter() - t0)
        await asyncio.sleep(0.01)
    return lat


async def _stream_gaps(session: aiohttp.ClientSession, url: str, gaps: list[float]) -> None:
    """Reads one stream (a token every 10 ms) until cancelled; the gaps between its chunks go to `gaps`."""
    last = None
    body = {**COMPLETION, "max_tokens": 4000, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        async for _ in r.content:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


def _post_raw(url: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.asyncio
async def test_health_and_streams_run_while_long_prompts_are_tokenized(tok, served_heap):
    """/tokenize, /v1/completions and chat with a long prompt: /health answers within 100 ms and a
    stream's tokens keep coming (the tokenizer holds the GIL: a thread did not help)."""
    be = ScriptedBackend(n_tokens=100_000, delay=0.01)
    text = "x" * BIG
    big = [
        (path, json.dumps(body).encode())
        for path, body in (
            ("/tokenize", {"model": MODEL, "prompt": text}),
            ("/v1/completions", {**COMPLETION, "prompt": text, "max_tokens": 1}),
            ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": text}], "max_tokens": 1}),
        )
    ]
    gaps: list[float] = []
    t_enc = time.perf_counter()
    tok.completion_prompt(text)  # what one of these prompts costs the tokenizer on this machine
    t_enc = time.perf_counter() - t_enc
    async with Served(OpenAIServer(be, tok, ServerConfig())) as s, aiohttp.ClientSession() as session:
        stop = asyncio.Event()
        probe = asyncio.ensure_future(_probe_health(session, s.url, stop))
        stream = asyncio.ensure_future(_stream_gaps(session, s.url, gaps))
        await asyncio.sleep(0.2)  # the stream is running
        t0 = time.perf_counter()
        answers = []
        for path, body in big:  # from a thread, bytes in and out: the client's own work is not this loop's
            answers.append((path, *await asyncio.to_thread(_post_raw, s.url + path, body)))
        took = time.perf_counter() - t0
        stop.set()
        lat = await probe
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
        for path, status, raw in answers:
            js, r = json.loads(raw), SimpleNamespace(status=status)
            if path == "/tokenize":
                assert r.status == 200 and js["count"] == BIG  # one token per byte
            else:  # far over the context: a 400 once the prompt's length is known
                assert r.status == 400 and js["error"]["code"] == "context_length_exceeded", js
    # Three prompts, each as long as the one timed alone: the server did at least that work (a bound in
    # seconds held on one machine and not on a faster one: 0.92 s for a 1 s bound).
    assert took > t_enc, (took, t_enc, "the prompts were not tokenized at all")
    # The 99th percentile within 100 ms, and no stall of a second: a CI host of 2 cores, which the
    # tokenizer process shares with this one, may deschedule the server for a moment now and then.
    assert len(lat) > 50 and _p99(lat) < 0.1 and max(lat) < 1, (
        f"/health p99 {_p99(lat) * 1e3:.0f} ms, max {max(lat) * 1e3:.0f}"
    )
    assert len(gaps) > 100 and _p99(gaps) < 0.1 and max(gaps) < 1, (
        f"stream pauses p99 {_p99(gaps) * 1e3:.0f} ms, max {max(gaps) * 1e3:.0f}"
    )


def _large_schema(fields: int, tag: str) -> dict:
    """A JSON schema of about 160 bytes a field (its names distinct per `tag`)."""
    names = [f"{tag}_{i:06d}_{'n' * 40}" for i in range(fields)]
    props = {k: {"type": "string", "maxLength": 8, "description": "d" * 20} for k in names}
    return {"type": "object", "properties": props, "required": names[::2]}


@pytest.mark.asyncio
async def test_health_and_streams_run_while_large_schemas_are_read(tok, served_heap):
    """Chat requests under 3 MB JSON schemas, two distinct and one repeated: reading a schema (its
    checks, its text, its grammar: 0.2 s of Python and engine work each, which the engine then
    refuses as too large) must not stall /health or a stream, whether the schema is new or cached."""
    be = ScriptedBackend(n_tokens=100_000, delay=0.01)
    schemas = [_large_schema(20_000, tag) for tag in ("a", "b")]
    bodies = [
        json.dumps(
            {
                **CHAT,
                "max_tokens": 1,
                "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}},
            }
        ).encode()
        for schema in (*schemas, schemas[0])
    ]
    gaps: list[float] = []
    async with Served(OpenAIServer(be, tok, ServerConfig())) as s, aiohttp.ClientSession() as session:
        stop = asyncio.Event()
        probe = asyncio.ensure_future(_probe_health(session, s.url, stop))
        stream = asyncio.ensure_future(_stream_gaps(session, s.url, gaps))
        await asyncio.sleep(0.2)  # the stream is running
        answers = [await asyncio.to_thread(_post_raw, s.url + "/v1/chat/completions", b) for b in bodies]
        stop.set()
        lat = await probe
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
    for status, raw in answers:
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "response_format", err
        assert "too large" in err["message"], err
    # Read on the loop, each request paused both for 0.5 s or more; now the loop decodes the body (~30 ms)
    # and waits while the engine holds the GIL (up to ~60 ms): 300 ms leaves room for a loaded 2-core host.
    assert len(lat) > 20 and _p99(lat) < 0.3 and max(lat) < 1, (
        f"/health p99 {_p99(lat) * 1e3:.0f} ms, max {max(lat) * 1e3:.0f}"
    )
    assert len(gaps) > 40 and _p99(gaps) < 0.3 and max(gaps) < 1, (
        f"stream pauses p99 {_p99(gaps) * 1e3:.0f} ms, max {max(gaps) * 1e3:.0f}"
    )


@pytest.mark.asyncio
async def test_a_chat_of_many_messages_is_templated_off_the_event_loop(tok, monkeypatch):
    """Checking each message and rendering the chat template is Python work that grows with the
    chat: 70,000 short messages (a 2.5 MB body) took 0.22 s on the event loop, a pause of /health and
    of every stream per request. A chat beyond a few dozen messages, with tools, or with long
    contents is templated in a worker thread (the loop gets the GIL back every switch interval); a
    short one stays on the loop. Which thread ran the template is asserted, not a latency."""
    from blink.dpu import tokenizer as tokenizer_mod

    threads: list[bool] = []  # templated on the loop's thread?
    real = tokenizer_mod.FrontendTokenizer.chat_text

    def spy(self, *a, **kw):
        threads.append(threading.current_thread() is threading.main_thread())
        return real(self, *a, **kw)

    monkeypatch.setattr(tokenizer_mod.FrontendTokenizer, "chat_text", spy)
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(70_000)]
    long_one = [{"role": "user", "content": "x " * BIG}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "p"}] * 50_000}]
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(3)]
    cases = [
        ({**CHAT, "messages": many, "max_tokens": 1}, 400, False),
        ({**CHAT, "messages": long_one, "max_tokens": 1}, 400, False),
        ({**CHAT, "messages": parts, "max_tokens": 1}, 400, False),
        ({**CHAT, "tools": tools, "max_tokens": 1}, 200, False),
        ({**CHAT, "max_tokens": 1}, 200, True),
    ]
    be = ScriptedBackend(n_tokens=1)
    async with Served(OpenAIServer(be, tok, ServerConfig())) as s:
        for body, status, on_loop in cases:
            threads.clear()
            got, raw = await asyncio.to_thread(_post_raw, s.url + "/v1/chat/completions", json.dumps(body).encode())
            assert got == status, raw[:300]
            if status == 400:
                assert json.loads(raw)["error"]["code"] == "context_length_exceeded", raw[:300]
            assert threads == [on_loop], (len(body["messages"]), threads)


def _p99(xs: list[float]) -> float:
    return sorted(xs)[int(0.99 * len(xs))]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.asyncio
async def test_connection_flood_is_refused_and_uses_no_descriptors(tok):
    """More idle sockets than max_connections: the extra ones get 503 and are closed at once (the
    server holds at most max_connections descriptors for them); once the idle ones time out, a
    real client is served."""
    cfg = ServerConfig(max_connections=20, keep_alive_timeout_s=1.0)
    async with Served(OpenAIServer(ScriptedBackend(), tok, cfg)) as s:
        base = _fds()
        conns = [await asyncio.open_connection("127.0.0.1", s.port) for _ in range(200)]
        await asyncio.sleep(0.3)
        held = _fds() - base - 200  # the server's side of the connections (the clients' are 200)
        assert held <= 20 + 2, held
        refused = 0
        for reader, _ in conns[20:]:
            head = await asyncio.wait_for(reader.read(4096), 2)
            refused += head.startswith(b"HTTP/1.1 503") and b"too many connections" in head
        assert refused == 180
        for _, w in conns:
            w.close()
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as session, session.get(s.url + "/health") as r:
            assert r.status == 200


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection; fails if it is still open after `seconds`."""
    out = b""
    async with asyncio.timeout(seconds):
        try:
            while chunk := await reader.read(4096):
                out += chunk
        except ConnectionResetError:  # closed with our unread bytes in its buffer: an RST, after its answer
            pass
    return out


@pytest.fixture(params=["aiohttp-timer", "no-timer-before-first-response"])
def aiohttp_timer(request, monkeypatch):
    """aiohttp's own keep-alive timer as installed, or as older aiohttp releases had it: started
    only once a connection's first response has ended, so that a connection that never completes
    a first request head is never timed out by aiohttp (the server must do it itself)."""
    if request.param == "no-timer-before-first-response":
        made = RequestHandler.connection_made

        def connection_made(self: RequestHandler, transport: asyncio.BaseTransport) -> None:
            made(self, transport)
            if self._keepalive_handle is not None:  # what newer releases schedule here
                self._keepalive_handle.cancel()
                self._keepalive_handle = None

        monkeypatch.setattr(RequestHandler, "connection_made", connection_made)
    return request.param


async def _exchange(r: asyncio.StreamReader, w: asyncio.StreamWriter, path: str = "/health") -> bytes:
    """One GET on an open connection, kept alive; the response's head and body."""
    w.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    async with asyncio.timeout(3):
        head = await r.readuntil(b"\r\n\r\n")
        n = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
        return head + await r.readexactly(n)


@pytest.mark.asyncio
async def test_idle_and_slow_header_connections_are_closed(tok, aiohttp_timer, caplog):
    """Idle sockets that never send a request, a request head trickled a line every 50 ms
    (slowloris), and the same after a first response on the connection: each is closed within
    the keep-alive timeout (plus the server's check period), whatever aiohttp's own timer does."""
    caplog.set_level(logging.INFO, logger="blink.server")
    cfg = ServerConfig(keep_alive_timeout_s=0.5)
    async with Served(OpenAIServer(ScriptedBackend(), tok, cfg)) as s:
        idle = [await asyncio.open_connection("127.0.0.1", s.port) for _ in range(20)]
        slow_r, slow_w = await asyncio.open_connection("127.0.0.1", s.port)
        after_r, after_w = await asyncio.open_connection("127.0.0.1", s.port)
        assert (await _exchange(after_r, after_w)).startswith(b"HTTP/1.1 200")
        for w in (slow_w, after_w):
            w.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")

        async def trickle() -> None:
            for i in range(100):  # a header line every 50 ms: slowloris
                for r, w in ((slow_r, slow_w), (after_r, after_w)):
                    if not r.at_eof():
                        w.write(b"X-%d: y\r\n" % i)
                await asyncio.sleep(0.05)

        t = asyncio.ensure_future(trickle())
        t0 = time.perf_counter()
        for r, _ in idle:
            assert await _closed_within(r, 3) == b""
        assert await _closed_within(slow_r, 3) == b""
        assert await _closed_within(after_r, 3) == b""
        assert time.perf_counter() - t0 < 2
        t.cancel()
        for w in (*(w for _, w in idle), slow_w, after_w):
            w.close()
    if aiohttp_timer == "no-timer-before-first-response":  # closed by the server's reaper: one line
        reaped = [rec.getMessage() for rec in caplog.records if "idle connection" in rec.getMessage()]
        assert len(reaped) == 1, reaped


@pytest.mark.asyncio
async def test_slow_stream_is_not_cut_and_kept_alive_connections_are_reused(tok, aiohttp_timer):
    """A stream whose tokens come further apart than the keep-alive timeout, for several timeouts,
    is a request in progress: it is not cut. Asked again within the timeout, a kept-alive
    connection serves request after request for longer than the timeout; left idle, it is closed."""
    cfg = ServerConfig(keep_alive_timeout_s=0.3)
    async with Served(OpenAIServer(ScriptedBackend(n_tokens=3, delay=0.4), tok, cfg)) as s:
        r, w = await asyncio.open_connection("127.0.0.1", s.port)
        body = json.dumps({**COMPLETION, "max_tokens": 3, "stream": True}).encode()
        w.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        t0 = time.perf_counter()
        async with asyncio.timeout(5):
            head = await r.readuntil(b"\r\n\r\n")
            events = await r.readuntil(b"data: [DONE]")
            await r.readuntil(b"\r\n0\r\n\r\n")  # the chunked body's end: the connection stays open
        assert head.startswith(b"HTTP/1.1 200") and events.count(b"data: ") == 3 + 1
        assert time.perf_counter() - t0 > 1.0  # three timeouts and more
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:  # a request every 0.2 s, on the same connection
            assert (await _exchange(r, w)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.2)
        assert await _closed_within(r, 2) == b""
        w.close()


@pytest.mark.asyncio
async def test_endless_chunked_body_gets_408_and_close(tok):
    cfg = ServerConfig(body_read_timeout_s=0.5)
    async with Served(OpenAIServer(ScriptedBackend(), tok, cfg)) as s:
        for path in ("/v1/completions", "/tokenize"):
            r, w = await asyncio.open_connection("127.0.0.1", s.port)
            w.write(
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\n\r\n".encode()
            )

            async def trickle(w: asyncio.StreamWriter = w) -> None:
                with pytest.raises(ConnectionError):
                    while True:  # a chunk every 50 ms, never the last one
                        w.write(b"1\r\n \r\n")
                        await w.drain()
                        await asyncio.sleep(0.05)

            t = asyncio.ensure_future(trickle())
            out = await _closed_within(r, 3)
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
            w.close()
            assert out.startswith(b"HTTP/1.1 408") and b"request_timeout" in out, out[:200]


@pytest.mark.asyncio
async def test_malformed_http_is_one_log_line(tok, caplog):
    caplog.set_level(logging.DEBUG)
    async with Served(OpenAIServer(ScriptedBackend(), tok, ServerConfig(max_header_bytes=1024))) as s:
        for raw in (
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 2000 + b"\r\n\r\n",
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n",
        ):
            r, w = await asyncio.open_connection("127.0.0.1", s.port)
            w.write(raw)
            out = await _closed_within(r, 3)
            w.close()
            assert out.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400")), out[:100]
    noisy = [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]
    assert not noisy, [rec.getMessage() for rec in noisy]
    lines = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(lines) == 2 and all("\n" not in rec.getMessage() for rec in lines)


@pytest.mark.asyncio
async def test_client_gone_mid_stream_is_one_info_line(tok, caplog):
    """Writing to a client that went away ("Cannot write to closing transport") is the request's
    own log line, outcome disconnected; no ERROR, no traceback. Without handler cancellation the
    write is what notices, every time."""
    caplog.set_level(logging.INFO)
    be = ScriptedBackend(n_tokens=100_000, delay=0.002)
    app = OpenAIServer(be, tok, ServerConfig()).app()
    async with TestClient(TestServer(app, handler_cancellation=False)) as c:
        for _ in range(3):
            r, w = await asyncio.open_connection("127.0.0.1", c.port)
            body = b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 4000, "stream": true}'
            w.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            async with asyncio.timeout(5):
                await r.readuntil(b"data: ")
            w.transport.abort()
        for _ in range(200):
            if be.active == 0:
                break
            await asyncio.sleep(0.01)
    assert be.active == 0
    noisy = [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]
    assert not noisy, [rec.getMessage() for rec in noisy]
    gone = [rec.getMessage() for rec in caplog.records if " disconnected:" in rec.getMessage()]
    assert len(gone) == 3


@pytest.mark.asyncio
async def test_api_key_covers_every_endpoint_but_health(tok):
    key = "s3cret"
    good = {"Authorization": f"Bearer {key}"}
    bad_keys = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {key}x"}, {"Authorization": key}]
    for public_metrics in (False, True):
        cfg = ServerConfig(api_key=key, public_metrics=public_metrics)
        app = OpenAIServer(ScriptedBackend(), tok, cfg).app()
        async with TestClient(TestServer(app)) as c:
            calls = [
                ("GET", "/v1/models", None),
                ("POST", "/v1/completions", COMPLETION),
                ("POST", "/v1/chat/completions", CHAT),
                ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}),
                ("POST", "/detokenize", {"model": MODEL, "tokens": [72]}),
                ("GET", "/version", None),
                ("GET", "/metrics", None),
                ("GET", "/no-such-path", None),
            ]
            for method, path, body in calls:
                for h in bad_keys:
                    r = await c.request(method, path, json=body, headers=h)
                    open_ = path == "/metrics" and public_metrics
                    assert (r.status == 401) != open_, (path, h, r.status)
                r = await c.request(method, path, json=body, headers=good)
                assert r.status == (404 if path == "/no-such-path" else 200), (path, r.status)
            assert (await c.get("/health")).status == 200


@pytest.mark.asyncio
async def test_request_ids_cannot_forge_log_lines(tok, caplog):
    caplog.set_level(logging.INFO)
    app = OpenAIServer(ScriptedBackend(), tok, ServerConfig()).app()
    forged = "x\nINFO 12-02 00:00:00 blink.server: admin logged in\x1b[2J\x1b[31m"
    async with TestClient(TestServer(app)) as c:
        r = await c.post("/v1/completions", json={**COMPLETION, "request_id": forged})
        assert r.status == 200 and (await r.json())["id"] == f"cmpl-{forged}"
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "a\tb"})
        assert r.status == 200
    msgs = [rec.getMessage() for rec in caplog.records if rec.name == "blink.server"]
    assert any("admin logged in" in m for m in msgs)
    for m in msgs:
        assert m.isprintable(), repr(m)


@pytest.mark.asyncio
async def test_chat_template_kwargs_self_is_a_400(tok):
    app = OpenAIServer(ScriptedBackend(), tok, ServerConfig()).app()
    async with TestClient(TestServer(app)) as c:
        for path, body in (
            ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"self": 1}}),
            ("/tokenize", {"model": MODEL, "messages": CHAT["messages"], "chat_template_kwargs": {"self": 1}}),
        ):
            r = await c.post(path, json=body)
            js = await r.json()
            assert r.status == 400 and js["error"]["param"] == "chat_template_kwargs", js
        # a variable the template uses wrongly is the request's fault too
        tok.tok.set_chat_template("{% for m in messages %}{{ m.content }}{{ extra + 1 }}{% endfor %}")
        try:
            r = await c.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"extra": "s"}})
            assert r.status == 400 and "chat template error" in (await r.json())["error"]["message"]
        finally:
            tok.tok.set_chat_template(load_tokenizer("random:tiny-llama").tok.chat_template)


@pytest.mark.asyncio
async def test_stop_strings_are_bounded(tok):
    cfg = ServerConfig(max_stop_strings=4, max_stop_string_chars=100)
    app = OpenAIServer(ScriptedBackend(), tok, cfg).app()
    async with TestClient(TestServer(app)) as c:
        for stop in (["a"] * 5, ["b" * 101], "c" * 101):
            r = await c.post("/v1/completions", json={**COMPLETION, "stop": stop})
            js = await r.json()
            assert r.status == 400 and js["error"]["param"] == "stop", js
        r = await c.post("/v1/completions", json={**COMPLETION, "stop": ["a" * 100] * 4})
        assert r.status == 200
