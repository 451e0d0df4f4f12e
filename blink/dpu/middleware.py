"""Every request's way through the HTTP server, before and after its handler: browser safety,
the API key, and errors answered in OpenAI's shape.

Browser safety: a POST body must be declared application/json (otherwise 415: a page may send
text/plain cross-origin without a preflight), and a server bound to loopback answers only Host
headers naming loopback or server.allowed_hosts (DNS rebinding). CORS headers go only to the
origins server.allowed_origins names. Every error a handler raises becomes an OpenAI-shaped
response with a 4xx/5xx status; the server keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from typing import Any

import msgspec
from aiohttp import web

from blink.config import ServerConfig

from . import openai_api as api
from .generation import GenerationError
from .request_tracker import DeviceDownError, QueueFullError

log = logging.getLogger("blink.server")
_json = msgspec.json.Encoder()
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancers' probes)
_LOG_CHARS = 128  # a client's string in a log line is cut to this many characters


def log_safe(text: str) -> str:
    """A client's string (request id, path) fit for one log line: control characters (newlines,
    ESC, ...) and other unprintables escaped, so it cannot forge lines or drive a terminal."""
    cut = text[:_LOG_CHARS]
    if not cut.isprintable():
        cut = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in cut)
    return cut + ("..." if len(text) > _LOG_CHARS else "")


def is_loopback(host: str) -> bool:
    """A bind address or Host name that only this machine reaches."""
    h = host.strip("[]").lower()
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The name of a Host header without its port: "a:80" -> "a", "[::1]:80" -> "::1"."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class Middleware:
    """The server's aiohttp middlewares (`middlewares`, in order) and response hooks (`on_response_prepare`)."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self._origins = config.origins  # CORS (parsed once)
        self._key = None if config.api_key is None else f"Bearer {config.api_key}".encode()
        self.draining = False  # set by OpenAIServer.drain
        self._open = _OPEN_PATHS | ({"/metrics"} if config.public_metrics else set())
        # Host names accepted (None: any); loopback binds accept loopback names by default
        hosts = config.hosts
        self._hosts: frozenset[str] | None = None
        if "*" not in hosts and (hosts or is_loopback(config.host)):
            self._hosts = _LOOPBACK_NAMES | hosts

    @property
    def middlewares(self) -> list[Any]:
        return [self.drain_check, self.host_check, self.preflight, self.errors, self.auth, self.json_only]

    @property
    def on_response_prepare(self) -> list[Any]:
        return ([self.cors_headers] if self.config.allowed_origins else []) + [echo_request_id]

    @web.middleware
    async def errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except api.APIError as e:
            return error_response(e)
        except GenerationError as e:
            return error_response(api.APIError(e.status, str(e)))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(e.status)
            msg = e.text if e.status != 413 else f"request body exceeds {self.config.max_body_bytes} bytes"
            return error_response(api.APIError(e.status, msg or e.reason, code=code))
        except BodyTimeoutError as e:  # the connection holds the rest of a body nobody will read
            resp = error_response(api.APIError(408, str(e), code="request_timeout"))
            resp.force_close()
            return resp
        except DeviceDownError as e:  # raised by the backend outside a submit (e.g. no replica up)
            return error_response(api.APIError(503, f"device unavailable: {e}"))
        except QueueFullError as e:
            return error_response(api.APIError(429, f"server busy: {e}", code="rate_limit_exceeded"))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # a bug: answer in the API's shape, keep serving, keep the traceback
            log.exception("%s %s failed", request.method, log_safe(request.path))
            return error_response(api.APIError(500, f"internal error: {e!r}"))

    @web.middleware
    async def drain_check(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Shutting down (OpenAIServer.drain): a request on a connection kept alive gets 503 and close."""
        if self.draining:
            resp = error_response(api.APIError(503, "the server is shutting down", code="shutting_down"))
            resp.force_close()
            return resp
        return await handler(request)

    @web.middleware
    async def host_check(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 sends
        `Host: evil.example`; a loopback server answers only its own names."""
        host = request.headers.get("Host")
        if self._hosts is not None and host is not None and _host_name(host) not in self._hosts:
            err = api.APIError(403, f"Host {host!r} is not allowed (see --allowed-hosts)", code="host_not_allowed")
            return error_response(err)
        return await handler(request)

    @web.middleware
    async def json_only(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """POST bodies are JSON and must say so: a browser sends text/plain (or form) bodies
        cross-origin without a preflight, so accepting them would let any page run generations."""
        if request.method == "POST" and request.content_type != "application/json":
            raise api.APIError(
                415,
                f"Content-Type must be application/json, got {request.headers.get('Content-Type', 'none')!r}",
                code="unsupported_media_type",
            )
        return await handler(request)

    def origin_allowed(self, request: web.Request) -> str | None:
        """The Access-Control-Allow-Origin value for this request, or None (no CORS headers)."""
        origin = request.headers.get("Origin")
        allowed = self._origins
        if not origin or not allowed:
            return None
        return "*" if "*" in allowed else origin if origin in allowed else None

    @web.middleware
    async def preflight(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """A browser's CORS preflight (OPTIONS, before any auth): 204 with what may follow."""
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            if self.origin_allowed(request) is None:
                return web.Response(status=403, text="origin not allowed")
            return web.Response(status=204)  # the allow-* headers come from cors_headers
        return await handler(request)

    async def cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        allow = self.origin_allowed(request)
        if allow is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allow
        response.headers["Vary"] = "Origin"
        if request.method == "OPTIONS":
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            want = request.headers.get("Access-Control-Request-Headers")
            response.headers["Access-Control-Allow-Headers"] = want or "Authorization, Content-Type"
            response.headers["Access-Control-Max-Age"] = "600"

    @web.middleware
    async def auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """--api-key: every path but the open ones; compared in constant time (a timing side
        channel would give the key away byte by byte)."""
        if self._key is not None and request.path not in self._open:
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, self._key):
                raise api.APIError(401, "invalid or missing API key", code="invalid_api_key")
        return await handler(request)


class BodyTimeoutError(Exception):
    """A request body did not arrive in time (408; the connection is closed)."""


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request's body, whole, within `timeout_s` (its size is bounded by client_max_size:
    413 past it); a body trickled slower than that, or a chunked one that never ends, is a 408."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise BodyTimeoutError(f"the request body did not arrive within {timeout_s:g} s") from None


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """A client's X-Request-Id comes back on the response (every endpoint, errors and streams too)."""
    rid = request.headers.get("X-Request-Id")
    if rid:
        response.headers["X-Request-Id"] = rid


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(obj), status=status, content_type="application/json")


def error_response(e: api.APIError) -> web.Response:
    return json_response(e.body(), status=e.status)
