"""TcpTransport: the one-sided ring interface over TCP, to a ring agent on the GPU host.

For clusters without RDMA (and for CI, which has none): the frontend's reads and writes travel
as msgspec frames to `blink.protocol.ring_agent`, a small process (or thread) on the GPU host that
maps the ring and applies them. One `transact` is one frame each way, whatever number of regions
it reads or writes, so a token-reader cycle is one round trip.

This is not free the way RDMA is: every round trip costs the GPU host's CPU (the agent decodes
the frame, copies the bytes and answers; tens of microseconds of one core per round trip), and
the frontend's event loop blocks for the round trip (the interface is synchronous, as it is for
shared memory and RDMA, where an access takes nanoseconds to a few microseconds). The transport
benchmark measures both.

Ordering: the agent applies a batch's writes in order and then its reads in order, with plain
x86-64 stores and loads on the shared mapping, so the rules of `transport.py` hold as they do for
`ShmTransport`; a 4- or 8-byte aligned write is one machine store (a state word is never torn).

Authentication: a connection opens with agent_auth.py's handshake over the secret the transport
is given (both ends prove they hold it), and is granted a partition of the ring's slots
(`owner` of `owners`, in `welcome`): the frontend serves only those slots, and the agent refuses
any other write and hides any other slot's bytes (ring_access.py).

Failure: every socket operation has a deadline (`timeout_s`); a closed connection, a reset or a
deadline raises TransportError, and the transport stays broken until `reconnect()`. The frontend
then fails its in-flight requests with an error event (health 503) rather than hanging.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Sequence

import msgspec
import numpy as np

from . import agent_auth
from .transport import (
    BatchOfOne,
    RangeError,
    Read,
    TransportError,
    Write,
    as_bytes,
    check_range,
    out_bytes,
)
from .wire import AGENT_PROTOCOL, AgentAuth, AgentChallenge, AgentFrame, AgentHello, AgentWelcome, RingBatch, RingReply

_LEN = struct.Struct("<I")
MAX_FRAME = 1 << 28  # a reply larger than this is a protocol error, not a ring access
BUSY_RETRY_S = 0.05  # a partition held by a connection the agent has not seen close yet: ask again


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' (an IPv6 host in brackets: '[::1]:7000') -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad ring agent address {address!r}; expected host:port")
    return host.strip("[]"), int(port)


def send_frame(sock: socket.socket, frame: msgspec.Struct) -> None:
    body = msgspec.msgpack.encode(frame)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError("the ring agent closed the connection")
        got += k
    return buf


_decoder = msgspec.msgpack.Decoder(AgentFrame)


def recv_frame(sock: socket.socket) -> AgentFrame:
    (n,) = _LEN.unpack(recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes from the ring agent")
    return _decoder.decode(recv_exact(sock, n))


def connect(
    address: str, timeout_s: float, secret: bytes, owner: int = -1, owners: int = 0
) -> tuple[socket.socket, AgentWelcome]:
    """An authenticated connection to the agent at `address`, granted partition `owner` of `owners`
    (-1 / 0: any, the agent's count); raises TransportError. A partition that is held is asked for
    again until `timeout_s` (its holder may be this frontend's own connection, closing)."""
    t_end = time.monotonic() + timeout_s
    while True:
        sock, w = _attach(address, timeout_s, secret, owner, owners)
        if isinstance(w, AgentWelcome):
            return sock, w
        if not w.busy or time.monotonic() > t_end:
            raise TransportError(f"ring agent at {address} refused the attach: {w.error}")
        time.sleep(BUSY_RETRY_S)


def _attach(address: str, timeout_s: float, secret: bytes, owner: int, owners: int):
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise TransportError(f"cannot reach the ring agent at {address}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = agent_auth.new_nonce()
        send_frame(sock, AgentHello(AGENT_PROTOCOL, nonce))
        ch = recv_frame(sock)
        if not isinstance(ch, AgentChallenge):
            raise TransportError(
                f"ring agent at {address} answered {type(ch).__name__}; expected protocol {AGENT_PROTOCOL}"
            )
        if not agent_auth.proofs_equal(ch.proof, agent_auth.agent_proof(secret, nonce, ch.nonce)):
            raise TransportError(f"ring agent at {address} does not hold this frontend's secret (wrong secret file?)")
        send_frame(sock, AgentAuth(agent_auth.client_proof(secret, nonce, ch.nonce), owner, owners))
        w = recv_frame(sock)
    except (OSError, msgspec.DecodeError) as e:
        sock.close()
        raise TransportError(
            f"ring agent at {address}: attach failed ({type(e).__name__}: {e}); a wrong secret?"
        ) from e
    except TransportError:
        sock.close()
        raise
    if isinstance(w, AgentWelcome) and w.version == AGENT_PROTOCOL:
        return sock, w
    sock.close()
    if isinstance(w, RingReply):
        return None, w
    raise TransportError(f"ring agent at {address} answered {w!r}; expected protocol {AGENT_PROTOCOL}")


class TcpTransport(BatchOfOne):
    """A ring reached through the ring agent at `address` ('host:port'), with the agent's `secret`, as
    the frontend of slot partition `owner` of `owners` (-1 / 0: whichever the agent grants)."""

    kind = "tcp"

    def __init__(self, address: str, secret: bytes, timeout_s: float = 5.0, owner: int = -1, owners: int = 0):
        self.address = address
        self.secret = secret
        self.timeout_s = timeout_s
        self.owner, self.owners = owner, owners
        self._lock = threading.Lock()  # one frame in flight (Ray's status calls come from other threads)
        self._sock: socket.socket | None = None
        self.round_trips = 0  # batches that waited for an answer
        self.posts = 0  # batches sent without waiting
        self._open()

    def _open(self) -> None:
        self._sock, w = connect(self.address, self.timeout_s, self.secret, self.owner, self.owners)
        self.owner, self.owners = w.owner, w.owners  # a reconnect asks for the same partition again
        self.size = w.size
        self.identity = w.identity
        self.ring = w.ring
        self.welcome = w

    def reconnect(self) -> int:
        """Close and connect again (the agent may have been restarted). Returns the ring identity,
        which differs from the old one when the agent reopened the ring."""
        self.close()
        self._open()
        return self.identity

    @property
    def connected(self) -> bool:
        return self._sock is not None

    # -- the batch: one round trip ------------------------------------------------------
    def transact(self, writes: Sequence[Write], reads: Sequence[Read] = ()) -> None:
        ws = []
        for off, data in writes:
            b = as_bytes(data)
            check_range(self.size, off, b.nbytes)
            ws.append((off, b.tobytes()))
        targets = [out_bytes(o) for _, o in reads]
        rs = [(off, t.size) for (off, _), t in zip(reads, targets, strict=True)]
        for off, n in rs:
            check_range(self.size, off, n)
        reply = self._call(RingBatch(ws, rs))
        if reply.error:
            raise (RangeError if reply.range_error else TransportError)(f"ring agent: {reply.error}")
        data = reply.data
        if len(data) != sum(n for _, n in rs):
            raise TransportError(f"ring agent returned {len(data)} bytes for reads of {sum(n for _, n in rs)}")
        pos = 0
        for t in targets:
            t[:] = np.frombuffer(data, np.uint8, t.size, pos)
            pos += t.size

    def post(self, writes: Sequence[Write]) -> None:
        """Send the writes without waiting: the agent applies frames in order, so every later batch
        sees them; a failure closes the connection and shows at the next call."""
        ws = []
        for off, data in writes:
            b = as_bytes(data)
            check_range(self.size, off, b.nbytes)
            ws.append((off, b.tobytes()))
        if ws:
            self._call(RingBatch(ws, reply=False))

    def _call(self, frame: RingBatch) -> RingReply | None:
        with self._lock:
            sock = self._sock
            if sock is None:
                raise TransportError(f"not connected to the ring agent at {self.address}")
            try:
                send_frame(sock, frame)
                if not frame.reply:
                    self.posts += 1
                    return None
                reply = recv_frame(sock)
            except (OSError, msgspec.DecodeError) as e:  # timeouts are OSErrors too
                self._drop()
                raise TransportError(f"ring agent at {self.address}: {type(e).__name__}: {e}") from e
            self.round_trips += 1
        if not isinstance(reply, RingReply):
            self._drop()
            raise TransportError(f"ring agent at {self.address} answered {type(reply).__name__}")
        return reply

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()
