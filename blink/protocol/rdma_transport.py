"""RdmaTransport: one-sided RDMA (pyverbs, RC queue pairs) from the frontend host to the ring.

The design's steady state: the frontend (on a DPU or another host) reads and writes the ring with
RDMA READ and WRITE; no CPU on the GPU host touches a request or a token. Two halves:

- GPU host, `RdmaRing` (run by the ring agent, blink/protocol/ring_agent.py): registers the ring's
  memory (the /dev/shm mapping, which the CUDA engine maps as host-pinned memory) as one memory
  region with LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE and without relaxed ordering (see below),
  and for each frontend creates an RC queue pair connected to the frontend's. Optionally a second
  region over GPU memory exported as a dma-buf (`register_dmabuf`: `cuMemGetHandleForAddressRange`
  gives the fd, pyverbs `DmaBufMR` registers it), for rings whose slot states live on the GPU as
  in the paper. Today's CUDA scheduler keeps the whole ring in host-pinned memory, so the frontend
  uses the host region; the dma-buf region is there for that layout.
- Frontend, `RdmaTransport`: PD, CQ, RC QP, a registered staging buffer. `transact(writes, reads)`
  posts one chain of work requests with one doorbell (a single `post_send` of linked WRs): an RDMA
  WRITE per write (prompts, slot records, state words, doorbells, `consumed`), then an RDMA READ per
  read (header, slot records with the `generated` counters of every slot, token arenas). Only the
  last WR is signaled; the transport busy-polls the CQ for it. On RC, completions arrive in order,
  so the last one means every earlier WR completed. Small writes go inline (no staging DMA).

The bootstrap happens once, at start-up: the frontend connects to the ring agent over TCP, passes
the agent's handshake (agent_auth.py: both prove the shared secret; the frontend is granted its
slot partition) and only then sends
its QPN, PSN, GID and LID (`RdmaHello`), and receives the GPU host's QPN, PSN, GID, LID, the rkey,
the region's address and the ring size (`RdmaWelcome`). Nothing is exchanged per request. The TCP
connection stays open: the GPU host's queue pair lives exactly as long as it (a frontend that dies
releases its QP), and a frontend that restarts runs the bootstrap again (`reconnect`). The queue
pair reaches the whole region: the agent's per-word allow-list (ring_access.py) cannot apply to
one-sided accesses, so an RDMA frontend is trusted with the ring once it has proved the secret.

Ordering (why a state word published after its data is never seen before it):

- WRITE after WRITE, same RC QP: the responder executes requests in the order the requester
  posted them (InfiniBand Architecture Specification vol. 1, 9.5 "Transaction ordering" and the
  ordering rules of 10.8.3: RDMA WRITE and SEND requests are not reordered with respect to each
  other on a reliable connection), and the HCA places each WRITE's data with PCIe posted writes,
  which PCIe keeps in order when the region is registered *without* IBV_ACCESS_RELAXED_ORDERING.
  So the slot record, written as earlier WRs, reaches host memory before the WR that stores
  `state = PREFILL_PENDING`, which reaches it before the doorbell WR. No fence is needed. Within
  one WRITE the placement order of its bytes is not defined, which is why every state word and
  doorbell is a WRITE of its own: 4 or 8 naturally aligned bytes, one PCIe transaction, never torn.
  (GPU memory over a dma-buf region is different: the GPU may observe peer writes out of order
  until it fences or flushes them; see `register_dmabuf`.)
- READ after WRITE, same QP: a READ request is executed after the WRITEs posted before it
  (same in-order execution at the responder), and its PCIe read cannot pass the earlier posted
  writes (PCIe ordering: a read request does not pass a posted write), so a batch's reads see its
  writes. No fence is needed.
- The fence flag (IBV_SEND_FENCE) is what the other direction needs: a WRITE posted after a READ
  may start before the READ's data has been fetched. The frontend never depends on that inside
  one batch (writes come first); a write that must follow a read (store `consumed`, release a slot
  after reading its tokens) goes in a later batch, posted after the READ's completion was polled.
- READ after READ: READs may execute, and their PCIe reads complete, in any order. A batch's
  first READ is its acquire (the slot records with every `generated` counter; the token windows
  after it must not be fetched before it), so the second READ of a chain carries IBV_SEND_FENCE,
  which holds it, and with it every later WR, until the first READ has completed. The READs after
  it (token windows of different slots) are independent of each other and run in parallel.
- Within one READ, bytes are fetched in no defined order, so a record's `state` and `generated`
  read together are not ordered with each other. The token reader takes the `generated` of a slot
  it saw DECODE_COMPLETED from a READ issued after the one that saw the state (a second batch,
  blink/dpu/token_reader.py), which is ordered by completion.

pyverbs is optional: it is imported only when an RDMA transport is built, and a missing module
or a missing device raises `RdmaUnavailable` saying how to get it (rdma-core's `python3-pyverbs`;
the PyPI sdist does not build against older rdma-core). It is the one import in blink/protocol
outside the stdlib, numpy and msgspec, and it is never imported unless RDMA is asked for.

What ran where: no machine this was written on has an RDMA device (no NIC, no rxe/siw), so this
module has run only up to its import and the "no device" error; tests/test_transport.py runs the
transport conformance suite over it when a device exists (marker `rdma`).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .tcp_transport import connect, recv_frame, send_frame
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
from .wire import RdmaHello, RdmaWelcome, RingReply

INSTALL_HINT = (
    "pyverbs is not installed: it comes with rdma-core. On Debian/Ubuntu: `apt-get install python3-pyverbs` "
    "and make it visible to this Python (e.g. symlink /usr/lib/python3/dist-packages/pyverbs into the venv's "
    "site-packages); the PyPI sdist does not build against older rdma-core"
)


class RdmaUnavailable(RuntimeError):
    """RDMA was asked for, but pyverbs or an RDMA device is missing."""


def load_pyverbs() -> Any:
    try:
        import pyverbs.device
        import pyverbs.enums  # noqa: F401
    except ImportError as e:
        raise RdmaUnavailable(f"{INSTALL_HINT} ({e})") from e
    return pyverbs


def rdma_devices() -> list[str]:
    """Names of this host's RDMA devices ([] without pyverbs or without devices)."""
    try:
        load_pyverbs()
    except RdmaUnavailable:
        return []
    import pyverbs.device as d
    from pyverbs.pyverbs_error import PyverbsError

    try:
        return [dev.name.decode() for dev in d.get_device_list()]
    except PyverbsError:  # raised when the host has no RDMA device class at all
        return []


def pick_device(name: str = "") -> str:
    """`name`, or this host's first RDMA device; RdmaUnavailable when there is none."""
    load_pyverbs()
    devs = rdma_devices()
    if name:
        if name not in devs:
            raise RdmaUnavailable(f"RDMA device {name!r} not found (this host has: {', '.join(devs) or 'none'})")
        return name
    if not devs:
        raise RdmaUnavailable("no RDMA device on this host (ibv_devices lists none); use --transport tcp")
    return devs[0]


@dataclass(frozen=True)
class PortInfo:
    gid: str  # "" when the port has no usable GID (InfiniBand without GRH: lid only)
    gid_index: int
    lid: int
    mtu: int  # ibv_mtu enum


# Connection attributes of both halves (the values of rdma-core's ibv_rc_pingpong and pyverbs tests).
MAX_RD_ATOMIC = 16  # outstanding RDMA READs per QP (capped by the device's max_qp_rd_atom)
MIN_RNR_TIMER = 12
TIMEOUT = 14  # 4.096 us * 2^14 = 67 ms per retry
RETRY_CNT = 7
RNR_RETRY = 7


class _Verbs:
    """One device context with a PD and a CQ: the resources both halves build the same way."""

    def __init__(self, device: str, port: int, gid_index: int | None, cqe: int = 256):
        load_pyverbs()
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.pd import PD

        self.device = pick_device(device)
        self.port = port
        self.ctx = Context(name=self.device)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, cqe, None, None, 0)
        self.attr = self.ctx.query_device()
        self.port_info = self._port_info(gid_index)

    def _port_info(self, gid_index: int | None) -> PortInfo:
        import pyverbs.enums as e

        pa = self.ctx.query_port(self.port)
        if pa.state != e.IBV_PORT_ACTIVE:
            raise RdmaUnavailable(f"{self.device} port {self.port} is not active")
        candidates = [gid_index] if gid_index is not None else range(pa.gid_tbl_len)
        for idx in candidates:
            gid = self.ctx.query_gid(self.port, idx).gid
            if gid.replace("0", "").replace(":", ""):
                return PortInfo(gid, idx, pa.lid, pa.active_mtu)
        if pa.link_layer == e.IBV_LINK_LAYER_ETHERNET:
            raise RdmaUnavailable(f"{self.device} port {self.port}: RoCE needs a GID and the table has none")
        return PortInfo("", 0, pa.lid, pa.active_mtu)

    def create_qp(self, max_send_wr: int, max_inline: int, remote_access: bool):
        import pyverbs.enums as e
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1, max_inline_data=max_inline)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = (
            e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE if remote_access else 0
        )
        return QP(self.pd, init, attr)  # returned in INIT (RC needs the peer's QPN for RTR)

    def connect_qp(self, qp, psn: int, peer_qpn: int, peer_psn: int, peer_gid: str, peer_lid: int, mtu: int) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self.port)
        attr.path_mtu = min(mtu, self.port_info.mtu)
        attr.dest_qp_num = peer_qpn
        attr.rq_psn = peer_psn
        attr.sq_psn = psn
        rd = min(MAX_RD_ATOMIC, self.attr.max_qp_rd_atom, self.attr.max_qp_init_rd_atom)
        attr.max_dest_rd_atomic = rd
        attr.max_rd_atomic = rd
        attr.min_rnr_timer = MIN_RNR_TIMER
        attr.timeout = TIMEOUT
        attr.retry_cnt = RETRY_CNT
        attr.rnr_retry = RNR_RETRY
        if peer_gid and self.port_info.gid:
            gr = GlobalRoute(dgid=GID(peer_gid), sgid_index=self.port_info.gid_index)
            attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=peer_lid)
        else:
            attr.ah_attr = AHAttr(port_num=self.port, is_global=0, dlid=peer_lid)
        qp.to_rts(attr)  # INIT -> RTR -> RTS

    def close(self) -> None:
        for r in ("cq", "pd", "ctx"):
            obj = getattr(self, r, None)
            if obj is not None:
                obj.close()
                setattr(self, r, None)


def _random_psn() -> int:
    return int.from_bytes(np.random.default_rng().bytes(3), "little")  # 24-bit packet sequence number


class _PeerQP:
    """A GPU-host queue pair connected to one frontend; closed when its bootstrap connection ends."""

    def __init__(self, qp):
        self.qp = qp

    def close(self) -> None:
        if self.qp is not None:
            self.qp.close()
            self.qp = None


class RdmaRing:
    """GPU-host half: the ring's memory region, and one RC QP per connected frontend."""

    def __init__(self, shm, device: str = "", port: int = 1, gid_index: int | None = None):
        load_pyverbs()
        import pyverbs.enums as e
        from pyverbs.mr import MR

        self.v = _Verbs(device, port, gid_index)
        self.size = shm.size
        self.addr = shm.address()
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE  # no RELAXED_ORDERING
        self.mr = MR(self.v.pd, self.size, access, address=self.addr)
        self._shm = shm  # keeps the mapping alive as long as the region
        self.dmabuf_mr = None

    def register_dmabuf(self, fd: int, length: int, offset: int = 0) -> tuple[int, int]:
        """Register GPU memory exported as a dma-buf (fd from cuMemGetHandleForAddressRange with
        CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD) so frontends can reach slot states kept on the GPU. Writes
        into GPU memory by the NIC are not ordered for GPU threads until the GPU observes them through
        a fence/flush (cudaDeviceFlushGPUDirectRDMAWrites or a volatile/acquire poll of the state word
        after a __threadfence_system), which a scheduler keeping its slots there must do.
        Returns (rkey, remote address): pyverbs registers the region with iova = offset."""
        import pyverbs.enums as e
        from pyverbs.mr import DmaBufMR

        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        self.dmabuf_mr = DmaBufMR(self.v.pd, length, access, dmabuf=fd, offset=offset)
        return self.dmabuf_mr.rkey, offset

    def accept(self, hello: RdmaHello) -> tuple[_PeerQP, RdmaWelcome]:
        qp = self.v.create_qp(max_send_wr=1, max_inline=0, remote_access=True)
        psn = _random_psn()
        try:
            self.v.connect_qp(qp, psn, hello.qpn, hello.psn, hello.gid, hello.lid, hello.mtu)
        except Exception:
            qp.close()
            raise
        p = self.v.port_info
        return _PeerQP(qp), RdmaWelcome(qp.qp_num, psn, p.gid, p.lid, p.mtu, self.mr.rkey, self.addr, self.size)

    def close(self) -> None:
        for mr in (self.dmabuf_mr, self.mr):
            if mr is not None:
                mr.close()
        self.mr = self.dmabuf_mr = None
        self.v.close()


class RdmaTransport(BatchOfOne):
    """Frontend half: the ring reached with RDMA READ/WRITE; bootstrap through the ring agent at
    `address` ('host:port'), once."""

    kind = "rdma"

    def __init__(
        self,
        address: str,
        secret: bytes,
        device: str = "",
        port: int = 1,
        gid_index: int | None = None,
        timeout_s: float = 5.0,
        staging_bytes: int = 8 << 20,
        max_wr: int = 256,
        max_inline: int = 64,
        owner: int = -1,
        owners: int = 0,
    ):
        load_pyverbs()  # a clear RdmaUnavailable before anything else
        import pyverbs.enums as e
        from pyverbs.mr import MR

        self.address = address
        self.secret = secret
        self.owner, self.owners = owner, owners
        self.timeout_s = timeout_s
        self._e = e
        self.v = _Verbs(device, port, gid_index, cqe=max_wr)
        self.staging = MR(self.v.pd, staging_bytes, e.IBV_ACCESS_LOCAL_WRITE)
        self.staging_bytes = staging_bytes
        self.max_wr = max_wr
        self.max_inline = max_inline
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.qp = None
        self.round_trips = 0
        self._wr_id = 0
        self._unwaited = 0  # WRs posted by post() whose completion nobody waited for yet
        self._connect()

    def _connect(self) -> None:
        self._sock, welcome = connect(self.address, self.timeout_s, self.secret, self.owner, self.owners)
        self.owner, self.owners = welcome.owner, welcome.owners
        self.identity = welcome.identity
        self.ring = welcome.ring
        qp = self.v.create_qp(self.max_wr, self.max_inline, remote_access=False)
        psn = _random_psn()
        p = self.v.port_info
        try:
            send_frame(self._sock, RdmaHello(qp.qp_num, psn, p.gid, p.lid, p.mtu))
            w = recv_frame(self._sock)
        except OSError as e:
            qp.close()
            self._sock.close()
            raise TransportError(f"RDMA bootstrap with {self.address}: {e}") from e
        if isinstance(w, RingReply):
            qp.close()
            self._sock.close()
            raise RdmaUnavailable(w.error)
        if not isinstance(w, RdmaWelcome):
            qp.close()
            self._sock.close()
            raise TransportError(f"RDMA bootstrap with {self.address}: unexpected {type(w).__name__}")
        self.v.connect_qp(qp, psn, w.qpn, w.psn, w.gid, w.lid, w.mtu)
        self.qp = qp
        self.rkey, self.raddr, self.size = w.rkey, w.addr, w.size
        self._broken = ""

    def reconnect(self) -> int:
        self.close_qp()
        self._connect()
        return self.identity

    # -- the batch: one doorbell, one completion -------------------------------------------
    def post(self, writes: Sequence[Write]) -> None:
        """Writes that all fit inline (state words, `consumed`, doorbells) are posted without waiting
        for their completion: the HCA copied them at post time, and the next batch's completion,
        which arrives after theirs (RC completes in order), reports any failure. Larger writes go
        through the staging buffer, which a later batch reuses, so they wait like a transact."""
        ws = [(off, as_bytes(d)) for off, d in writes]
        if not ws:
            return
        if len(ws) >= self.max_wr or any(b.nbytes > self.max_inline for _, b in ws):
            self.transact(ws)
            return
        for off, b in ws:
            check_range(self.size, off, b.nbytes)
        with self._lock:
            if self.qp is None or self._broken:
                raise TransportError(f"RDMA connection to {self.address} is down: {self._broken or 'closed'}")
            if self._unwaited + len(ws) > self.max_wr // 2:
                # Send-queue entries (and CQ entries) come back only when a completion is polled:
                # reap the posted chains before the queues could fill.
                self._wait(self._wr_id)
            self._post_chain([(self._e.IBV_WR_RDMA_WRITE, off, 0, b) for off, b in ws], inline_only=True)
            self._unwaited += len(ws)

    def transact(self, writes: Sequence[Write], reads: Sequence[Read] = ()) -> None:
        ws = []
        for off, data in writes:
            b = as_bytes(data)
            check_range(self.size, off, b.nbytes)
            ws.append((off, b))
        rs = []
        for off, out in reads:
            t = out_bytes(out)
            check_range(self.size, off, t.size)
            rs.append((off, t))
        with self._lock:
            if self.qp is None or self._broken:
                raise TransportError(f"RDMA connection to {self.address} is down: {self._broken or 'closed'}")
            # Split into chains that fit the send queue and the staging buffer; each chain is one
            # post_send (one doorbell) and one signaled completion. Order is kept across chains.
            chain: list[tuple[int, int, int, Any]] = []  # (opcode, remote off, staging off, data or target)
            used = 0
            for off, b in ws:
                n = b.nbytes
                if n > self.staging_bytes:
                    raise RangeError(f"a write of {n} bytes exceeds the {self.staging_bytes}-byte staging buffer")
                if len(chain) == self.max_wr // 2 or used + n > self.staging_bytes:
                    self._run(chain)
                    chain, used = [], 0
                chain.append((self._e.IBV_WR_RDMA_WRITE, off, used, b))
                used += -(-n // 8) * 8
            for off, t in rs:
                n = t.size
                if n > self.staging_bytes:
                    raise RangeError(f"a read of {n} bytes exceeds the {self.staging_bytes}-byte staging buffer")
                if len(chain) == self.max_wr // 2 or used + n > self.staging_bytes:
                    self._run(chain)
                    chain, used = [], 0
                chain.append((self._e.IBV_WR_RDMA_READ, off, used, t))
                used += -(-n // 8) * 8
            if chain:
                self._run(chain)

    def _run(self, chain: list) -> None:
        self._post_chain(chain)
        self._wait(self._wr_id)
        self.round_trips += 1
        for op, _off, soff, obj in chain:
            if op == self._e.IBV_WR_RDMA_READ:
                obj[:] = np.frombuffer(self.staging.read(obj.size, soff), np.uint8)

    def _post_chain(self, chain: list, inline_only: bool = False) -> None:
        """One linked list of WRs, one post_send (one doorbell); only the last WR is signaled.
        The second READ of a chain carries IBV_SEND_FENCE: it starts once the first READ (the
        batch's acquire: slot records, a counter) has completed, so the data it covers is read
        after it; the READs after the second are not ordered among themselves (transport.py)."""
        from pyverbs.wr import SGE, SendWR

        e = self._e
        base = self.staging.buf
        lkey = self.staging.lkey
        first = prev = None
        n_reads = 0
        inline_data = []  # kept alive until post_send has copied them
        for i, (op, off, soff, obj) in enumerate(chain):
            flags = 0
            if op == e.IBV_WR_RDMA_WRITE:
                n = obj.nbytes
                if n <= self.max_inline:
                    flags |= e.IBV_SEND_INLINE
                else:
                    assert not inline_only
                    self.staging.write(obj.tobytes(), n, soff)
            else:
                n = obj.size
                n_reads += 1
                if n_reads == 2:
                    flags |= e.IBV_SEND_FENCE
            if i == len(chain) - 1:
                flags |= e.IBV_SEND_SIGNALED
            self._wr_id += 1
            if flags & e.IBV_SEND_INLINE:  # the provider copies inline data from the SGE at post time
                inline_data.append(np.frombuffer(obj.tobytes(), np.uint8))
                sge = SGE(int(inline_data[-1].ctypes.data), n, lkey)
            else:
                sge = SGE(base + soff, n, lkey)
            wr = SendWR(wr_id=self._wr_id, opcode=op, num_sge=1, sg=[sge], send_flags=flags)
            wr.set_wr_rdma(self.rkey, self.raddr + off)
            if prev is None:
                first = wr
            else:
                prev.next_wr = wr
            prev = wr
        if first is not None:
            self.qp.post_send(first)  # one doorbell for the chain

    def _wait(self, wr_id: int) -> None:
        t_end = time.monotonic() + self.timeout_s
        cq = self.v.cq
        while True:
            n, wcs = cq.poll(1)
            if n:
                wc = wcs[0]
                if wc.status != self._e.IBV_WC_SUCCESS:
                    self._broken = f"work completion status {wc.status} (vendor error {wc.vendor_err})"
                    raise TransportError(f"RDMA to {self.address}: {self._broken}")
                if wc.wr_id == wr_id:
                    self._unwaited = 0  # RC completes in order: everything posted before is done
                    return
            elif time.monotonic() > t_end:
                self._broken = f"no completion within {self.timeout_s:g} s"
                raise TransportError(f"RDMA to {self.address}: {self._broken}")

    def close_qp(self) -> None:
        with self._lock:
            if self.qp is not None:
                self.qp.close()
                self.qp = None
            if self._sock is not None:
                self._sock.close()  # the GPU host closes its QP with the bootstrap connection
                self._sock = None

    def close(self) -> None:
        self.close_qp()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        self.v.close()
