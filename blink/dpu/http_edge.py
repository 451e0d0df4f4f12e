"""The HTTP server's edge: what happens to a connection before any handler sees a request.

- A connection limit (server.max_connections): the listening socket's protocol factory counts the
  open connections; one past the limit is answered `503` with `Connection: close` and closed at
  once, so a flood of idle sockets costs one descriptor each only for as long as it takes to refuse
  them, and the process's soft descriptor limit is raised to fit the limit where the hard one allows.
- Timeouts and sizes handed to aiohttp's connection handler: a connection with no complete request
  head within server.keep_alive_timeout_s of opening (or of its previous response) is closed, which
  cuts idle sockets and slowly trickled headers alike; request lines and header fields are bounded
  by server.max_header_bytes. Bodies are bounded by client_max_size and read under a timeout
  (middleware.read_body).
- Compact logs: a malformed request or a connection that fails before its handler is one WARNING
  line naming the peer and the parser's complaint, not an ERROR with a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from aiohttp import web

from blink.config import ServerConfig

from .middleware import log_safe

log = logging.getLogger("blink.server")
_FD_HEADROOM = 256  # descriptors beyond the connection limit: the ring, logs, tokenizer pipes, ...
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


class LimitedSite(web.TCPSite):
    """A TCPSite that serves at most `max_connections` connections at once; the rest get 503."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int, **kw: Any):
        super().__init__(runner, host, port, **kw)
        self.max_connections = max_connections
        self.refused = 0
        self._warned = 0.0

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None
        if len(server.connections) < self.max_connections:
            return server()
        self.refused += 1
        now = time.monotonic()
        if now - self._warned > 10:  # one line per 10 s of a flood, not one per socket
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
    """The keyword arguments of aiohttp's connection handler (through AppRunner)."""
    return {
        "keepalive_timeout": config.keep_alive_timeout_s,
        "max_line_size": config.max_header_bytes,
        "max_field_size": config.max_header_bytes,
        "logger": CompactLogger(),
        "lingering_time": 1.0,  # reading the unread rest of a body before closing: not for long
    }
