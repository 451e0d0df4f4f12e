"""The ring agent: serves one shared-memory ring to frontends on other hosts (TCP; RDMA bootstrap).

    python -m blink.protocol.ring_agent --ring NAME [--listen 0.0.0.0:0] [--rdma-device mlx5_0]

It runs on the GPU host, maps /dev/shm/NAME and answers, on one asyncio loop:

- `RingBatch` frames from TcpTransport clients: writes in order, then reads in order, one reply
  (the TCP path's whole data plane; see tcp_transport.py);
- one `RdmaHello` per RDMA frontend, at start-up only: it registers the ring as a memory region
  (once), connects a fresh RC queue pair to the frontend's and answers with its QPN, GID, rkey and
  address (rdma_transport.py). After that the frontend's reads and writes never reach this process.
  Its queue pair lives as long as that bootstrap connection, which the frontend keeps open.

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
import struct
import sys
import threading
from typing import Any

import msgspec
import numpy as np

from .tcp_transport import MAX_FRAME, parse_address
from .transport import RangeError, ShmTransport, file_id, host_id
from .wire import AGENT_PROTOCOL, AgentFrame, AgentHello, AgentWelcome, RdmaHello, RingBatch, RingReply

log = logging.getLogger("blink.ring_agent")
_LEN = struct.Struct("<I")


class RingAgent:
    """Serves the ring `ring` (a /dev/shm name or path) on `listen` ('host:port', port 0: any)."""

    def __init__(self, ring: str, listen: str = "127.0.0.1:0", rdma_device: str = ""):
        self.ring = ring
        self.listen = listen
        from .rdma_transport import rdma_devices  # [] without pyverbs or without a device

        devs = rdma_devices()
        if rdma_device and rdma_device not in devs:
            raise ValueError(f"RDMA device {rdma_device!r} not found (this host has: {', '.join(devs) or 'none'})")
        self.rdma_device = rdma_device or (devs[0] if devs else "")  # offered to frontends in the welcome
        self.t = ShmTransport.open(ring)
        self.identity = secrets.randbits(63)  # new per opening: a restarted agent is a new ring to clients
        self.address = ""
        self.batches = 0
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._rdma: Any = None  # rdma_transport.RdmaRing, created at the first RdmaHello
        self._conns: set[asyncio.StreamWriter] = set()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> str:
        host, port = parse_address(self.listen)
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._serve, host, port, limit=1 << 20)
        h, p = self._server.sockets[0].getsockname()[:2]
        self.address = f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
        log.info("ring agent for %s listening on %s", self.ring, self.address)
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._conns):
                w.close()
            await self._server.wait_closed()
            self._server = None
        if self._rdma is not None:
            self._rdma.close()
            self._rdma = None
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

    # -- one connection ------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        decoder = msgspec.msgpack.Decoder(AgentFrame)
        qp = None  # this connection's RDMA queue pair, if it asked for one
        peer = writer.get_extra_info("peername")
        try:
            while True:
                try:
                    (n,) = _LEN.unpack(await reader.readexactly(4))
                    if n > MAX_FRAME:
                        raise ValueError(f"frame of {n} bytes")
                    frame = decoder.decode(await reader.readexactly(n))
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                    return  # the client went away, or the agent is closing
                if isinstance(frame, RingBatch):
                    reply = self._batch(frame)
                    if not frame.reply:
                        if reply.error:
                            log.warning("posted batch from %s failed: %s; closing", peer, reply.error)
                            return
                        continue
                elif isinstance(frame, AgentHello):
                    if frame.version != AGENT_PROTOCOL:
                        log.warning("client %s speaks protocol %d, not %d", peer, frame.version, AGENT_PROTOCOL)
                        return
                    reply = AgentWelcome(
                        AGENT_PROTOCOL,
                        self.t.size,
                        self.identity,
                        self.ring,
                        self.rdma_device,
                        host_id(),
                        file_id(self.t.path),
                    )
                elif isinstance(frame, RdmaHello):
                    if qp is not None:
                        reply = RingReply(error="this connection already has a queue pair")
                    else:
                        try:
                            qp, reply = self._rdma_connect(frame)
                        except Exception as e:  # no device, pyverbs missing, QP refused: say why
                            log.warning("RDMA bootstrap from %s failed: %s", peer, e)
                            reply = RingReply(error=f"RDMA bootstrap failed on the GPU host: {e}")
                else:
                    log.warning("unexpected %s from %s; closing", type(frame).__name__, peer)
                    return
                body = msgspec.msgpack.encode(reply)
                writer.write(_LEN.pack(len(body)) + body)
                await writer.drain()
        except (ValueError, msgspec.DecodeError) as e:
            log.warning("bad frame from %s: %s; closing", peer, e)
        finally:
            self._conns.discard(writer)
            if qp is not None:
                qp.close()  # the frontend's bootstrap connection is gone: so is its QP
            writer.close()

    def _batch(self, b: RingBatch) -> RingReply:
        self.batches += 1
        t = self.t
        try:
            t.transact(b.writes)
            if not b.reads:
                return RingReply()
            total = sum(n for _, n in b.reads)
            out = np.empty(total, np.uint8)
            pos = 0
            for off, n in b.reads:
                t.read_into(off, out[pos : pos + n])
                pos += n
            return RingReply(out.tobytes())
        except RangeError as e:
            return RingReply(error=str(e), range_error=True)

    def _rdma_connect(self, hello: RdmaHello):
        from .rdma_transport import RdmaRing  # pyverbs only where RDMA is asked for

        if self._rdma is None:
            self._rdma = RdmaRing(self.t, self.rdma_device)
        return self._rdma.accept(hello)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blink.protocol.ring_agent", description=__doc__.split("\n")[0])
    ap.add_argument("--ring", required=True, help="ring name in /dev/shm (or a path)")
    ap.add_argument("--listen", default="127.0.0.1:0", help="host:port to bind (port 0: any free port)")
    ap.add_argument("--rdma-device", default="", help="RDMA device to register the ring with (e.g. mlx5_0)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def run() -> None:
        agent = RingAgent(a.ring, a.listen, a.rdma_device)
        addr = await agent.start()
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
    ring: str, listen: str = "127.0.0.1:0", timeout_s: float = 30.0, extra_args: list[str] | None = None, **popen_kw
):
    """The agent as a child process; returns (Popen, address) once it listens."""
    import selectors
    import subprocess
    import time

    cmd = [sys.executable, "-m", "blink.protocol.ring_agent", "--ring", ring, "--listen", listen, *(extra_args or [])]
    cmd = popen_kw.pop("prefix", []) + cmd  # e.g. ["nsenter", ...] to run it in another namespace
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **popen_kw)
    assert proc.stdout is not None
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
