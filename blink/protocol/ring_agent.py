"""The ring agent: serves one shared-memory ring to frontends on other hosts (TCP; RDMA bootstrap).

    python -m blink.protocol.ring_agent --ring NAME --secret-file PATH [--listen 0.0.0.0:0]
        [--partitions P] [--reserve K ...] [--rdma-device mlx5_0]

It runs on the GPU host, maps /dev/shm/NAME and answers, on one asyncio loop:

- the handshake (agent_auth.py): both ends prove they hold the shared secret before anything else,
  and the client is granted a slot partition (below);
- `RingBatch` frames from TcpTransport clients: writes in order, then reads in order, one reply
  (the TCP path's whole data plane; see tcp_transport.py), each write checked against the
  ownership table and each read masked to what the client may see (ring_access.py);
- one `RdmaHello` per RDMA frontend, at start-up only: it registers the ring as a memory region
  (once), connects a fresh RC queue pair to the frontend's and answers with its QPN, GID, rkey and
  address (rdma_transport.py). After that the frontend's reads and writes never reach this process
  (so the agent cannot check them: an RDMA frontend can reach the whole ring, and the secret is
  what keeps others from getting a queue pair). Its queue pair lives as long as that bootstrap
  connection, which the frontend keeps open.

Partitions: the ring's slots are split into `partitions` disjoint sets (slot s is in partition
s % partitions), one per frontend, so that every slot word keeps one host writer. A client asks
for a partition at attach (a given one, or any free one) and holds it as long as its connection;
`reserved` partitions belong to frontends that map the ring directly (the one beside the device).
A frontend therefore only ever sees, cancels and releases its own slots: attaching a second
frontend leaves the first one's requests alone.

Limits: at most `max_pending` connections in the handshake and `max_clients` after it (more are
closed at once); the handshake must finish within `handshake_timeout_s`; a frame's bytes must
arrive within `frame_timeout_s` of its first byte and be at most `max_frame_bytes` (checked before
anything is allocated); one batch reads at most `max_reply_bytes`. An authenticated connection may
be idle (a frontend with no requests, an RDMA queue pair's bootstrap connection): TCP keepalive
closes it when its peer is gone.

Cost: on TCP every round trip of every frontend runs here, on the GPU host's CPU (decode a frame,
copy the bytes, answer: tens of microseconds of one core each). Over RDMA the agent is idle after
start-up. The GPU itself never waits for the agent: the scheduler polls the ring as it always does.

On start it prints one line, `blink ring agent: listening on HOST:PORT`, which is how a parent
learns the port it bound (`--listen HOST:0`). `RingAgent.start_thread` runs the same agent on a
thread of the calling process (the GPU actor does that).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from . import agent_auth
from .gc_freeze import freeze_startup_heap
from .ring_access import AccessDenied, RingAccess
from .tcp_transport import parse_address
from .transport import RangeError, ShmTransport, check_range, file_id, host_id
from .wire import (
    AGENT_PROTOCOL,
    AgentAuth,
    AgentChallenge,
    AgentFrame,
    AgentHello,
    AgentWelcome,
    RdmaHello,
    RingBatch,
    RingReply,
)

log = logging.getLogger("blink.ring_agent")
_LEN = struct.Struct("<I")
HANDSHAKE_FRAME = 1024  # bytes of a hello or an auth frame at most: a peer not yet authenticated holds no more


@dataclass(frozen=True)
class AgentLimits:
    max_clients: int = 64  # authenticated connections
    max_pending: int = 16  # connections still in the handshake
    handshake_timeout_s: float = 5.0
    frame_timeout_s: float = 10.0  # from a frame's first byte to its last
    max_frame_bytes: int = 8 << 20  # one frame from a client (a request's prompt is far less)
    max_reply_bytes: int = 64 << 20  # the reads of one batch
    buffer_bytes: int = 64 << 10  # what the agent reads ahead of a frame it is decoding


class _Refused(Exception):
    """The handshake failed; the message goes to the log (and to the client when it proved itself)."""

    def __init__(self, why: str, tell: bool = False, busy: bool = False):
        super().__init__(why)
        self.tell, self.busy = tell, busy


class RingAgent:
    """Serves the ring `ring` (a /dev/shm name or path) on `listen` ('host:port', port 0: any) to the
    clients that hold `secret`; its slots split into `partitions`, of which `reserved` are not granted."""

    def __init__(
        self,
        ring: str,
        listen: str = "127.0.0.1:0",
        rdma_device: str = "",
        *,
        secret: bytes,
        partitions: int = 1,
        reserved: tuple[int, ...] = (),
        limits: AgentLimits = AgentLimits(),
    ):
        self.ring = ring
        self.listen = listen
        self.secret = agent_auth.check_secret(secret)
        from .rdma_transport import rdma_devices  # [] without pyverbs or without a device

        devs = rdma_devices()
        if rdma_device and rdma_device not in devs:
            raise ValueError(f"RDMA device {rdma_device!r} not found (this host has: {', '.join(devs) or 'none'})")
        self.rdma_device = rdma_device or (devs[0] if devs else "")  # offered to frontends in the welcome
        self.t = ShmTransport.open(ring)
        self.view = self.t.view()
        if not 1 <= partitions <= self.view.geo.n_slots or not set(reserved) <= set(range(partitions)):
            raise ValueError(
                f"partitions {partitions} (reserved {reserved}) on a ring of {self.view.geo.n_slots} slots"
            )
        self.partitions, self.reserved = partitions, frozenset(reserved)
        self.limits = limits
        self.identity = secrets.randbits(63)  # new per opening: a restarted agent is a new ring to clients
        self.address = ""
        self.batches = 0
        self.refused = 0  # connections closed before or at the handshake, or for a denied access
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._rdma: Any = None  # rdma_transport.RdmaRing, created at the first RdmaHello
        self._pending: set[asyncio.StreamWriter] = set()
        self._clients: dict[asyncio.StreamWriter, int] = {}  # authenticated connection -> its partition

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> str:
        host, port = parse_address(self.listen)
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._serve, host, port, limit=self.limits.buffer_bytes)
        h, p = self._server.sockets[0].getsockname()[:2]
        self.address = f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
        log.info("ring agent for %s listening on %s (%d partitions)", self.ring, self.address, self.partitions)
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in [*self._pending, *self._clients]:
                w.close()
            await self._server.wait_closed()
            self._server = None
        if self._rdma is not None:
            self._rdma.close()
            self._rdma = None
        self.view = None
        self.t.close()

    def start_thread(self) -> str:
        """Serve on a daemon thread of this process; returns the bound address."""
        ready = threading.Event()
        err: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(self.start())
            except BaseException as e:  # reported to the caller below
                err.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self.close())
                loop.close()

        self._thread = threading.Thread(target=run, name="ring-agent", daemon=True)
        self._thread.start()
        ready.wait()
        if err:
            raise err[0]
        return self.address

    def stop_thread(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def connections(self) -> int:
        return len(self._pending) + len(self._clients)

    # -- one connection ------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lim = self.limits
        peer = writer.get_extra_info("peername")
        if len(self._pending) >= lim.max_pending or len(self._clients) >= lim.max_clients:
            self.refused += 1
            writer.transport.abort()  # at capacity: no buffer, no task kept for this one
            return
        self._pending.add(writer)
        part = None
        qp = None  # this connection's RDMA queue pair, if it asked for one
        try:
            try:
                async with asyncio.timeout(lim.handshake_timeout_s):
                    part = await self._handshake(reader, writer)
            except _Refused as e:
                self.refused += 1
                log.warning("ring agent client %s refused: %s", peer, e)
                if e.tell:
                    await self._send(writer, RingReply(error=str(e), range_error=False, busy=e.busy))
                return
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError, msgspec.DecodeError) as e:
                self.refused += 1
                log.info("ring agent client %s dropped in the handshake: %s", peer, type(e).__name__)
                return
            finally:
                self._pending.discard(writer)
            self._clients[writer] = part
            _keepalive(writer.get_extra_info("socket"))
            access = RingAccess(self.view, part, self.partitions)
            qp = await self._session(reader, writer, access, peer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError, TimeoutError):
            pass  # the client went away (or stalled mid-frame), or the agent is closing
        except (ValueError, msgspec.DecodeError) as e:
            log.warning("bad frame from %s: %s; closing", peer, e)
        finally:
            self._clients.pop(writer, None)
            if qp is not None:
                qp.close()  # the frontend's bootstrap connection is gone: so is its QP
            writer.close()

    async def _read_frame(self, reader: asyncio.StreamReader, decoder, limit: int = 0) -> AgentFrame:
        """One frame: its first byte whenever it comes, the rest within frame_timeout_s; the length
        is checked (against `limit`, default max_frame_bytes) before its body is read."""
        limit = limit or self.limits.max_frame_bytes
        first = await reader.readexactly(1)
        async with asyncio.timeout(self.limits.frame_timeout_s):
            (n,) = _LEN.unpack(first + await reader.readexactly(3))
            if n > limit:
                raise ValueError(f"frame of {n} bytes (at most {limit})")
            return decoder.decode(await reader.readexactly(n))

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, frame: msgspec.Struct) -> None:
        body = msgspec.msgpack.encode(frame)
        writer.write(_LEN.pack(len(body)) + body)
        await writer.drain()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        """agent_auth.py's exchange; returns the partition granted."""
        decoder = msgspec.msgpack.Decoder(AgentFrame)
        hello = await self._read_frame(reader, decoder, HANDSHAKE_FRAME)
        if not isinstance(hello, AgentHello):
            raise _Refused(f"{type(hello).__name__} before the hello")
        if hello.version != AGENT_PROTOCOL:
            raise _Refused(f"protocol {hello.version}, not {AGENT_PROTOCOL}")
        nonce = agent_auth.new_nonce()
        await self._send(writer, AgentChallenge(nonce, agent_auth.agent_proof(self.secret, hello.nonce, nonce)))
        auth = await self._read_frame(reader, decoder, HANDSHAKE_FRAME)
        if not isinstance(auth, AgentAuth):
            raise _Refused(f"{type(auth).__name__} instead of the proof")
        want = agent_auth.client_proof(self.secret, hello.nonce, nonce)
        if not agent_auth.proofs_equal(auth.proof, want):
            raise _Refused("wrong proof (not the ring's secret)")
        part = self._grant(auth.owner, auth.owners)
        self._clients[writer] = part  # held from here: a concurrent handshake cannot take it
        w = AgentWelcome(
            AGENT_PROTOCOL,
            self.t.size,
            self.identity,
            self.ring,
            self.rdma_device,
            host_id(),
            file_id(self.t.path),
            part,
            self.partitions,
        )
        await self._send(writer, w)
        return part

    def _grant(self, owner: int, owners: int) -> int:
        p = self.partitions
        if owners not in (0, p):
            raise _Refused(f"the ring's slots are split into {p} partitions, not {owners}", tell=True)
        held = set(self._clients.values())
        if owner == -1:
            free = [k for k in range(p) if k not in self.reserved and k not in held]
            if not free:
                raise _Refused(f"all {p - len(self.reserved)} frontend partitions of this ring are taken", tell=True)
            return free[0]
        if not 0 <= owner < p or owner in self.reserved:
            raise _Refused(f"partition {owner} of {p} is not one a frontend can attach to", tell=True)
        if owner in held:
            raise _Refused(f"partition {owner} of {p} is held by another frontend", tell=True, busy=True)
        return owner

    async def _session(self, reader, writer, access: RingAccess, peer) -> Any:
        """Batches (and one RDMA bootstrap) until the client goes; returns its queue pair, if any."""
        decoder = msgspec.msgpack.Decoder(AgentFrame)
        qp = None
        while True:
            try:
                frame = await self._read_frame(reader, decoder)
            except asyncio.IncompleteReadError:
                return qp
            if isinstance(frame, RingBatch):
                reply = self._batch(frame, access)
                if reply.error and not reply.range_error:
                    self.refused += 1
                    log.warning("ring agent client %s (partition %d): %s; closing", peer, access.owner, reply.error)
                    if frame.reply:
                        await self._send(writer, reply)
                    return qp
                if not frame.reply:
                    continue
            elif isinstance(frame, RdmaHello) and qp is None:
                try:
                    qp, reply = self._rdma_connect(frame)
                except Exception as e:  # no device, pyverbs missing, QP refused: say why
                    log.warning("RDMA bootstrap from %s failed: %s", peer, e)
                    reply = RingReply(error=f"RDMA bootstrap failed on the GPU host: {e}")
            else:
                log.warning("unexpected %s from %s; closing", type(frame).__name__, peer)
                return qp
            await self._send(writer, reply)

    def _batch(self, b: RingBatch, access: RingAccess) -> RingReply:
        self.batches += 1
        t = self.t
        try:
            for off, data in b.writes:  # each checked in the state the writes before it left
                check_range(t.size, off, len(data))
                access.check_write(off, data)
                t.transact([(off, data)])
            if not b.reads:
                return RingReply()
            total = 0
            for off, n in b.reads:
                check_range(t.size, off, n)
                total += n
            if total > self.limits.max_reply_bytes:
                return RingReply(error=f"reads of {total} bytes in one batch (at most {self.limits.max_reply_bytes})")
            out = np.empty(total, np.uint8)
            pos = 0
            for off, n in b.reads:
                t.read_into(off, out[pos : pos + n])
                access.mask_read(off, out[pos : pos + n])
                pos += n
            return RingReply(out.tobytes())
        except RangeError as e:
            return RingReply(error=str(e), range_error=True)
        except AccessDenied as e:
            return RingReply(error=f"refused: {e}")

    def _rdma_connect(self, hello: RdmaHello):
        from .rdma_transport import RdmaRing  # pyverbs only where RDMA is asked for

        if self._rdma is None:
            self._rdma = RdmaRing(self.t, self.rdma_device)
        return self._rdma.accept(hello)


def _keepalive(sock: socket.socket | None, idle_s: int = 30, interval_s: int = 10, count: int = 3) -> None:
    """Close an idle connection whose peer vanished (about idle_s + interval_s * count)."""
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, v in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", count)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blink.protocol.ring_agent", description=__doc__.split("\n")[0])
    ap.add_argument("--ring", required=True, help="ring name in /dev/shm (or a path)")
    ap.add_argument("--listen", default="127.0.0.1:0", help="host:port to bind (port 0: any free port)")
    ap.add_argument("--rdma-device", default="", help="RDMA device to register the ring with (e.g. mlx5_0)")
    key = ap.add_mutually_exclusive_group(required=True)
    key.add_argument("--secret-file", help="the shared secret's file (64 hex digits, mode 0600)")
    key.add_argument("--secret-stdin", action="store_true", help="read the secret (hex) from the first line of stdin")
    ap.add_argument("--partitions", type=int, default=1, help="frontend partitions of the ring's slots")
    ap.add_argument("--reserve", type=int, action="append", default=[], help="a partition not to grant (repeatable)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if a.secret_file:
            secret = agent_auth.read_secret_file(a.secret_file)
        else:
            secret = agent_auth.check_secret(bytes.fromhex(sys.stdin.readline().strip()))
    except ValueError as e:
        print(f"blink ring agent: {e}", file=sys.stderr)
        return 2

    async def run() -> None:
        agent = RingAgent(
            a.ring, a.listen, a.rdma_device, secret=secret, partitions=a.partitions, reserved=tuple(a.reserve)
        )
        addr = await agent.start()
        log.info("%s", freeze_startup_heap().describe())
        print(f"blink ring agent: listening on {addr}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await agent.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


def start_agent_process(
    ring: str,
    listen: str = "127.0.0.1:0",
    timeout_s: float = 30.0,
    extra_args: list[str] | None = None,
    *,
    secret: bytes,
    partitions: int = 1,
    reserved: tuple[int, ...] = (),
    **popen_kw,
):
    """The agent as a child process; returns (Popen, address) once it listens. The secret goes to it
    on its stdin (never on a command line, which every local user can read)."""
    import selectors
    import subprocess
    import time

    cmd = [sys.executable, "-m", "blink.protocol.ring_agent", "--ring", ring, "--listen", listen, "--secret-stdin"]
    cmd += ["--partitions", str(partitions), *(f"--reserve={k}" for k in reserved), *(extra_args or [])]
    cmd = popen_kw.pop("prefix", []) + cmd  # e.g. ["nsenter", ...] to run it in another namespace
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen_kw)
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdin.write(agent_auth.check_secret(secret).hex() + "\n")
    proc.stdin.close()
    t_end = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < t_end:  # the first line names the address (or the process died)
            if not sel.select(max(0.0, t_end - time.monotonic())):
                break
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("blink ring agent: listening on "):
                return proc, line.rsplit(" ", 1)[1].strip()
    proc.kill()
    proc.wait()
    raise RuntimeError(f"ring agent for {ring} did not start (exit code {proc.returncode})")


if __name__ == "__main__":
    raise SystemExit(main())
