"""The HTTP server's edge: what happens to a connection before any handler sees a request.

- A connection limit (server.max_connections): the listening socket's protocol factory counts the
  open connections; one past the limit is answered `503` with `Connection: close` and closed at
  once, so a flood of idle sockets costs one descriptor each only for as long as it takes to refuse
  them, and the process's soft descriptor limit is raised to fit the limit where the hard one allows.
- Idle connections (server.keep_alive_timeout_s): a connection with no request in progress that
  has been idle that long, since it opened or since its last response ended, is closed by the
  server's own reaper (IdleReaper): sockets that never send a request and request heads trickled
  slowly (slowloris) alike, whichever aiohttp release is installed (older ones start their own
  keep-alive timer only after a first response). A request is in progress from the moment its
  head is complete until its handler returns, so a long stream is never cut.
- Sizes and timeouts handed to aiohttp's connection handler: its own keep-alive timer (the same
  timeout), request lines and header fields bounded by server.max_header_bytes. Bodies are
  bounded by client_max_size and read under a timeout (middleware.read_body).
- Compact logs: a malformed request or a connection that fails before its handler is one WARNING
  line naming the peer and the parser's complaint, not an ERROR with a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import time
from collections.abc import Callable, Collection
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from blink.config import ServerConfig

from .middleware import log_safe

log = logging.getLogger("blink.server")
_FD_HEADROOM = 256  # descriptors beyond the connection limit: the ring, logs, tokenizer pipes, ...
_QUIET_S = 10.0  # a flood's warnings and reaps: one log line per this many seconds, not one per socket
_REFUSAL_BODY = (
    b'{"error": {"message": "too many connections; retry later", "type": "server_error", '
    b'"param": null, "code": "too_many_connections"}}'
)
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY
)


class _Refuse(asyncio.Protocol):
    """One connection over the limit: the 503 is written and the socket closed; nothing is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_REFUSAL)
        transport.close()


class IdleReaper:
    """Closes every connection that has no request in progress and has been idle for longer than
    `timeout_s`: since it opened, or since its last response ended. A request head that is not
    complete by then (slowloris) counts as idle: a request is in progress only from the moment its
    head is complete and the app's handler runs (`track`, the outermost middleware) until that
    handler returns (what it answered and is still buffered is sent before the socket closes). One
    task looks at every open connection each `period_s` (half the timeout, within [0.05, 1] s): a
    connection is closed between timeout_s and timeout_s + period_s of idleness, at the cost of a
    dictionary look-up per connection and period, nothing per byte. It runs while the site listens."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.period_s = max(min(timeout_s / 2, 1.0), 0.05)
        self.reaped = 0  # connections closed, in all
        # connection -> when it became idle (time.monotonic()), None while a request is in progress
        self._idle_since: dict[RequestHandler, float | None] = {}
        self._unlogged = 0
        self._logged = -math.inf

    def opened(self, conn: RequestHandler) -> None:
        """A connection accepted by the site (its protocol, just made): idle from now on."""
        self._idle_since[conn] = time.monotonic()

    @web.middleware
    async def track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        conn = request.protocol
        if conn not in self._idle_since:  # a connection no LimitedSite accepted (a test server)
            return await handler(request)
        self._idle_since[conn] = None
        try:
            return await handler(request)
        finally:
            self._idle_since[conn] = time.monotonic()

    def reap(self, live: Collection[RequestHandler]) -> int:
        """Closes the open connections (`live`) idle for too long; returns how many."""
        now = time.monotonic()
        since = self._idle_since
        open_ = set(live)
        n = 0
        for conn in open_:
            t = since.setdefault(conn, now)
            if t is not None and now - t > self.timeout_s:
                conn.force_close()
                del since[conn]
                n += 1
        # forget connections gone a while (not the one whose protocol is made but not yet open)
        gone = [c for c, t in since.items() if t is not None and now - t > self.period_s and c not in open_]
        for conn in gone:
            del since[conn]
        self.reaped += n
        self._unlogged += n
        if self._unlogged and now - self._logged >= _QUIET_S:
            log.info(
                "closed %d idle connection(s): no request in progress for over %g s (--timeout-keep-alive)",
                self._unlogged,
                self.timeout_s,
            )
            self._unlogged, self._logged = 0, now
        return n

    async def run(self, connections: Callable[[], Collection[RequestHandler]]) -> None:
        """Reaps `connections()` every period_s until cancelled."""
        while True:
            await asyncio.sleep(self.period_s)
            try:
                self.reap(connections())
            except Exception:  # a bug here must not end the timeouts of every later connection
                log.exception("the idle connection check failed")


class LimitedSite(web.TCPSite):
    """A TCPSite that serves at most `max_connections` connections at once (the rest get 503) and
    has `reaper` close its idle ones while it listens."""

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, max_connections: int, reaper: IdleReaper, **kw: Any
    ):
        super().__init__(runner, host, port, **kw)
        self.max_connections = max_connections
        self.reaper = reaper
        self._reaping: asyncio.Task | None = None
        self.refused = 0
        self._warned = 0.0

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None
        if len(server.connections) < self.max_connections:
            conn = server()
            self.reaper.opened(conn)
            return conn
        self.refused += 1
        now = time.monotonic()
        if now - self._warned > _QUIET_S:  # one line per 10 s of a flood, not one per socket
            self._warned = now
            log.warning("connection limit %d reached: refusing new connections (503)", self.max_connections)
        return _Refuse()

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]
        server = self._runner.server
        assert server is not None
        self._reaping = asyncio.ensure_future(self.reaper.run(lambda: server.connections))

    async def stop(self) -> None:
        if self._reaping is not None:
            self._reaping.cancel()
            await asyncio.gather(self._reaping, return_exceptions=True)
            self._reaping = None
        await super().stop()


class CompactLogger:
    """aiohttp's connection-handler logger: what it reports with a traceback (a request it could not
    parse, a handler that failed after its response began) becomes one line; debug passes through."""

    def __init__(self, logger: logging.Logger = log):
        self._log = logger

    def debug(self, msg: str, *args: Any, **kw: Any) -> None:
        self._log.debug(msg, *args, **kw)

    def exception(self, msg: str, *args: Any, exc_info: BaseException | None = None, **kw: Any) -> None:
        text = msg % args if args else msg
        if exc_info is None or isinstance(exc_info, bool):
            self._log.warning("%s", log_safe(text))
            return
        what = f"{type(exc_info).__name__}: {exc_info}"
        level = logging.INFO if isinstance(exc_info, ConnectionError) else logging.WARNING
        self._log.log(level, "%s: %s", log_safe(text), log_safe(what))

    error = exception
    warning = exception


def raise_fd_limit(max_connections: int) -> None:
    """Raise the soft descriptor limit so that max_connections fit, as far as the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + _FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if new > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning(
                "file descriptor limit %d is below max_connections %d + %d: lower --max-connections",
                new,
                max_connections,
                _FD_HEADROOM,
            )


def handler_options(config: ServerConfig) -> dict[str, Any]:
    """The keyword arguments of aiohttp's connection handler (through AppRunner). Its keep-alive
    timer is not relied on (IdleReaper is), but where it runs it closes idle connections first."""
    return {
        "keepalive_timeout": config.keep_alive_timeout_s,
        "max_line_size": config.max_header_bytes,
        "max_field_size": config.max_header_bytes,
        "logger": CompactLogger(),
        "lingering_time": 1.0,  # reading the unread rest of a body before closing: not for long
    }
