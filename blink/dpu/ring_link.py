"""How a frontend reaches a ring: choose its transport (ring.transport), open it, say which and why.

    shm   the ring's /dev/shm file, mapped: the frontend shares the GPU's host
    tcp   through the ring agent on the GPU host (blink.protocol.ring_agent): any network, costs
          that host's CPU per round trip
    rdma  one-sided READ/WRITE into the ring's registered memory (blink.protocol.rdma_transport);
          the agent only bootstraps the queue pair, once
    auto  shm when the frontend sees the ring's own file (same host, same /dev/shm), rdma when both
          ends have an RDMA device and pyverbs, tcp otherwise

A frontend is told where the ring is in one of two ways: a local ring name (it runs beside the
device: `blink serve`, the Ray frontend on the GPU's node) or a ring agent's address (ring.address,
or the address a Ray GPU actor reports). With an address, the agent's welcome names the ring, its
host and its file, which is how `auto` decides. The choice is logged once, at attach time.

Through an agent, the frontend proves the agent's secret and is granted a partition of the ring's
slots (`Link.owner` of `Link.owners`); it serves only those. The connection that holds the grant
is the transport itself over tcp; over rdma the bootstrap connection; over shm (the frontend found
the ring's own file) the probe connection, kept open beside the mapping (`LeasedShm`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from blink.protocol.tcp_transport import TcpTransport
from blink.protocol.transport import ShmTransport, Transport, TransportError, file_id, host_id, shm_path

log = logging.getLogger("blink.ring_link")
KINDS = ("auto", "shm", "tcp", "rdma")


class RingLinkError(RuntimeError):
    """The ring cannot be reached with the transport asked for; the message says why and what to do."""


@dataclass(frozen=True)
class Link:
    transport: Transport
    why: str  # one line: which transport, to where, and why it was chosen
    owner: int = 0  # the slot partition this frontend serves: slots s with s % owners == owner
    owners: int = 1

    @property
    def kind(self) -> str:
        return self.transport.kind


def open_local(name: str, kind: str = "auto") -> Link:
    """A ring this host holds under /dev/shm/<name> (the frontend runs beside the device)."""
    if kind not in ("auto", "shm"):
        raise RingLinkError(
            f"ring.transport = {kind} needs a ring agent to connect to (ring.address, or ring.listen on the "
            "GPU host side); a ring on this host is reached with shm"
        )
    return Link(ShmTransport.open(name), f"shm: /dev/shm/{name} on this host")


class LeasedShm(ShmTransport):
    """The ring's own file, mapped, while a connection to its agent holds this frontend's partition."""

    def __init__(self, path: str, lease: TcpTransport):
        shm = ShmTransport.open(path)
        super().__init__(shm.path, shm._mm, owner=False)
        self.lease = lease

    def close(self) -> None:
        super().close()
        self.lease.close()


def open_remote(
    address: str,
    kind: str = "auto",
    rdma_device: str = "",
    timeout_s: float = 5.0,
    *,
    secret: bytes,
    owner: int = -1,
    owners: int = 0,
) -> Link:
    """The ring behind the ring agent at `address`, over the transport `kind` asks for (see module
    doc), as the frontend of partition `owner` of `owners` (-1 / 0: whichever the agent grants)."""
    if kind not in KINDS:
        raise RingLinkError(f"unknown ring transport {kind!r} (expected one of {', '.join(KINDS)})")
    try:
        probe = TcpTransport(address, secret, timeout_s, owner, owners)
    except TransportError as e:
        raise RingLinkError(str(e)) from e
    w = probe.welcome
    part = dict(owner=w.owner, owners=w.owners)
    mine = f"partition {w.owner} of {w.owners}"
    local = shm_path(w.ring)
    same_file = bool(w.file) and w.host == host_id() and file_id(local) == w.file
    if kind == "shm" or (kind == "auto" and same_file):
        if not same_file:
            probe.close()
            raise RingLinkError(
                f"ring.transport = shm, but the ring {w.ring} behind {address} is not this host's "
                f"{local} (another host, or another /dev/shm); use tcp or rdma"
            )
        return Link(
            LeasedShm(local, probe), f"shm: {local}, the same file the agent at {address} serves; {mine}", **part
        )
    if kind == "tcp":
        return Link(probe, f"tcp: ring {w.ring} through the ring agent at {address} (asked for); {mine}", **part)
    from blink.protocol.rdma_transport import RdmaTransport, RdmaUnavailable, rdma_devices

    if kind == "auto":
        if not (w.rdma and rdma_devices()):
            why = "the GPU host has no RDMA device" if not w.rdma else "this host has no RDMA device or no pyverbs"
            return Link(probe, f"tcp: ring {w.ring} through the ring agent at {address} (auto: {why}); {mine}", **part)
    probe.close()  # the bootstrap connection asks for the same partition (connect retries while it is held)
    try:
        t = RdmaTransport(address, secret, device=rdma_device, timeout_s=timeout_s, **part)
    except RdmaUnavailable as e:
        if kind == "rdma":
            raise RingLinkError(f"ring.transport = rdma: {e}") from e
        log.warning("RDMA to %s unavailable (%s); falling back to tcp", address, e)
        tcp = TcpTransport(address, secret, timeout_s, **part)
        return Link(tcp, f"tcp: ring {w.ring} at {address} (auto: RDMA failed: {e}); {mine}", **part)
    why = f"rdma: ring {w.ring} at {address} via {t.v.device} (bootstrapped through the agent, once); {mine}"
    return Link(t, why, **part)


def open_link(
    name: str | None,
    address: str | None,
    kind: str = "auto",
    rdma_device: str = "",
    timeout_s: float = 5.0,
    *,
    secret: bytes | None = None,
    owner: int = -1,
    owners: int = 0,
) -> Link:
    """The one entry point: a remote ring when `address` is set (then `secret` is the agent's), else
    the local ring `name` (partition `owner` of `owners` as given: nobody grants it there)."""
    if address:
        if secret is None:
            raise RingLinkError(f"the ring agent at {address} needs its secret (ring.secret_file)")
        link = open_remote(address, kind, rdma_device, timeout_s, secret=secret, owner=owner, owners=owners)
    elif name:
        link = open_local(name, kind)
        if owners:
            link = Link(link.transport, link.why, max(owner, 0), owners)
    else:
        raise RingLinkError("neither a ring name nor a ring agent address")
    log.info("ring transport %s", link.why)
    return link


def maps_ring_file(pid: int, name: str) -> bool:
    """Whether process `pid` has /dev/shm/<name> mapped (what a remote frontend must never have)."""
    with open(f"/proc/{pid}/maps") as f:
        return any(line.rstrip().endswith(os.path.join("/dev/shm", name)) for line in f)
