"""Data-parallel routing inside the frontend process: N rings (one per GPU actor), one HTTP ingress.

`Router` has the request tracker's interface (submit / health / stats / check_prompt / ...), so
the HTTP server serves N replicas exactly as it serves one. Each request goes to the live replica
with the fewest requests: slots in use on its ring, by every frontend sharing it (deploy.frontends
> 1), plus this frontend's queue for it. Ties rotate. It is read from the slot records that the
token reader bulk-reads every cycle anyway: no Ray, no extra ring read.

Replica liveness comes from the ring alone. A replica whose token reader declared its device
down (status FAILED/STOPPED or a heartbeat silent for server.heartbeat_timeout_s) is dropped
from routing; its in-flight requests have already ended with an error event. A watcher checks
each ring file every `watch_interval_s`: when the GPU actor is restarted it creates a fresh ring
under the same name (a new inode); the old ring is then failed at once (without waiting for the
heartbeat timeout), and once the new ring says READY the replica is attached again.

A ring on another host (the frontend on a `dpu` node of another machine): `locate(i)` asks the
replica's GPU actor, once per attach, for its ring agent's address (a Ray call: control plane,
never per request or token), and blink.dpu.ring_link opens the transport ring.transport asks for
(auto: shm when this host holds that very file, rdma where both ends have a device, else tcp). A
remote ring has no file to watch: a GPU actor that dies takes its agent (and, over RDMA, its queue
pair) with it, the next round trip fails, the token reader fails the replica's requests with an
error event, and the watcher attaches again to whatever the restarted actor reports.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from blink.dpu.request_tracker import DeviceDownError, RequestHandle, RequestTracker
from blink.dpu.ring_link import RingLinkError, open_link
from blink.dpu.slot_tracker import read_header
from blink.protocol.layout import RING_MAGIC, DeviceStatus
from blink.protocol.transport import ShmTransport, Transport, TransportError, shm_path
from blink.protocol.wire import DeviceHealth, RingStats, SubmitRequest

log = logging.getLogger(__name__)

MakeTracker = Callable[[Transport], RequestTracker]
Locate = Callable[[int], dict]  # replica -> its GPU actor's ring_info() ("agent": host:port when served)


@dataclass
class Replica:
    index: int
    ring: str  # shm name
    tracker: RequestTracker | None = None
    transport: Transport | None = None
    inode: int = 0  # identity of the ring file attached (0: none; a remote ring: its agent's incarnation)
    link: str = ""  # which transport, and why (ring_link)
    down_reason: str = "not attached yet"
    attaches: int = 0  # times a ring was attached (1 = never restarted)
    requests: int = 0  # requests routed here
    history: list[str] = field(default_factory=list)  # up/down transitions, for status()

    @property
    def up(self) -> bool:
        return self.tracker is not None and not self.tracker.reader.failed


def _inode(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return 0


def _ring_ready(path: str) -> tuple[int, bool]:
    """(inode, READY) of the ring file at `path` ((0, False) when absent or not a ring yet)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return 0, False
    if st.st_size < 512:
        return st.st_ino, False
    t = ShmTransport.open(path)
    try:
        hdr = t.view().header
        ready = int(hdr["magic"]) == RING_MAGIC and int(hdr["device_status"]) == DeviceStatus.READY
        del hdr
    finally:
        t.close()
    return st.st_ino, ready


class Router:
    def __init__(
        self,
        rings: list[str],
        make_tracker: MakeTracker,
        watch_interval_s: float = 0.25,
        locate: Locate | None = None,
        transport: str = "auto",
        rdma_device: str = "",
        secret: bytes | None = None,
        partition: tuple[int, int] = (0, 1),
    ):
        """locate: where each replica's ring is (None: every ring is a /dev/shm file on this host);
        transport / rdma_device: ring.transport and ring.rdma_device (blink.dpu.ring_link); secret: the
        ring agents'; partition: (owner, owners), this frontend's slots of every ring."""
        if not rings:
            raise ValueError("a router needs at least one ring")
        self.replicas = [Replica(i, name) for i, name in enumerate(rings)]
        self._make_tracker = make_tracker
        self._locate = locate
        self._kind = transport
        self._rdma_device = rdma_device
        self._secret = secret
        self._partition = partition
        self.watch_interval_s = watch_interval_s
        self._watch: asyncio.Task[None] | None = None
        self._last = -1
        self._closing = False

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        for r in self.replicas:
            await self._try_attach(r)
        self._watch = asyncio.get_running_loop().create_task(self._watcher(), name="replica-watcher")

    async def close(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except asyncio.CancelledError:
                pass  # the watcher was cancelled by us just above
        for r in self.replicas:
            await self._detach(r, "frontend closed")

    async def _try_attach(self, r: Replica) -> bool:
        if self._locate is not None:
            return await self._try_attach_located(r)
        path = shm_path(r.ring)
        inode, ready = _ring_ready(path)
        if not ready or inode == r.inode:
            return False  # no ring, not serving yet, or the same (dead) ring we already dropped
        transport = ShmTransport.open(path)
        tracker = self._make_tracker(transport)
        await tracker.start()
        r.tracker, r.transport, r.inode = tracker, transport, inode
        r.link = f"shm: {path}"
        r.attaches += 1
        r.down_reason = ""
        r.history.append("up")
        log.info("replica %d attached to ring %s (inode %d)", r.index, r.ring, inode)
        return True

    async def _try_attach_located(self, r: Replica) -> bool:
        """Ask the replica's GPU actor where its ring is, open the transport ring.transport asks for,
        attach once the device says READY. Blocking work (a Ray call, a connect) runs off the loop."""
        loop = asyncio.get_running_loop()

        def connect():
            info = self._locate(r.index)
            owner, owners = self._partition
            agent = info.get("agent")
            link = open_link(
                r.ring, agent, self._kind, self._rdma_device, secret=self._secret, owner=owner, owners=owners
            )
            try:
                hdr = read_header(link.transport)
                ready = int(hdr["magic"]) == RING_MAGIC and int(hdr["device_status"]) == DeviceStatus.READY
            except TransportError:
                ready = False
            if not ready:
                link.transport.close()
                return None, info
            return link, info

        try:
            link, info = await loop.run_in_executor(None, connect)
        except (RingLinkError, TransportError, TimeoutError, OSError) as e:
            r.down_reason = f"cannot reach the ring: {e}"
            return False
        except Exception as e:  # the Ray call failed (the GPU actor is restarting, or gone)
            r.down_reason = f"ring location unknown: {type(e).__name__}: {e}"
            return False
        if link is None:
            r.down_reason = "the ring's device is not READY yet"
            return False
        tracker = self._make_tracker(link.transport)
        await tracker.start()
        # A ring mapped here is watched by its file, as without `locate`; a remote one by its link.
        ident = _inode(shm_path(r.ring)) if link.kind == "shm" else int(info.get("incarnation", 0))
        r.tracker, r.transport, r.inode, r.link = tracker, link.transport, ident, link.why
        r.attaches += 1
        r.down_reason = ""
        r.history.append("up")
        log.info("replica %d attached: %s", r.index, link.why)
        return True

    async def _detach(self, r: Replica, why: str) -> None:
        if r.tracker is not None:
            await r.tracker.close()
            r.history.append(f"down: {why}")
            (log.info if self._closing else log.warning)("replica %d down: %s", r.index, why)
        r.tracker = None
        if r.transport is not None:
            r.transport.close()
        r.transport = None
        r.down_reason = why

    async def _watcher(self) -> None:
        while not self._closing:
            for r in self.replicas:
                local = self._locate is None or r.link.startswith("shm")
                if (
                    local
                    and r.tracker is not None
                    and not r.tracker.reader.failed
                    and _inode(shm_path(r.ring)) != r.inode
                ):
                    # The GPU actor restarted and replaced the ring: the old one is dead even if
                    # its heartbeat has not timed out yet. Fail its requests now (error events),
                    # rather than after server.heartbeat_timeout_s.
                    r.tracker.fail(f"ring {r.ring} was replaced or removed (its GPU actor restarted or stopped)")
                if r.tracker is not None and r.tracker.reader.failed:
                    await self._detach(r, r.tracker.reader.failed)
                if r.tracker is None:
                    await self._try_attach(r)
            await asyncio.sleep(self.watch_interval_s)

    # -- routing -------------------------------------------------------------------------
    def pick(self) -> Replica:
        """The live replica with the least load (RequestTracker.load: requests on its ring from every
        frontend, plus this frontend's queue for it)."""
        best, best_load = None, None
        n = len(self.replicas)
        # Ties rotate (start after the last pick), so sequential requests spread too.
        for k in range(n):
            r = self.replicas[(self._last + 1 + k) % n]
            if not r.up:
                continue
            load = r.tracker.load()
            if best_load is None or load < best_load:
                best, best_load = r, load
        if best is None:
            raise DeviceDownError(
                "no replica is serving: " + "; ".join(f"{r.index}: {r.down_reason}" for r in self.replicas)
            )
        self._last = best.index
        return best

    async def submit(self, req: SubmitRequest) -> RequestHandle:
        r = self.pick()
        r.requests += 1
        return await r.tracker.submit(req)

    # -- the tracker interface the server reads -------------------------------------------
    def _any(self) -> RequestTracker:
        return self.pick().tracker

    def health(self) -> DeviceHealth:
        up = [r for r in self.replicas if r.up]
        if up:
            return up[0].tracker.health()
        why = "; ".join(f"replica {r.index}: {r.down_reason}" for r in self.replicas)
        return DeviceHealth(False, int(DeviceStatus.FAILED), 0, why)

    def stats(self) -> RingStats:
        parts = [r.tracker.stats() for r in self.replicas if r.up]
        return RingStats(
            sum(p.n_slots for p in parts),
            sum(p.busy_slots for p in parts),
            sum(p.queued for p in parts),
            sum(p.free_slots for p in parts),
        )

    def reset_prefix_cache(self) -> bool:
        """Every live replica forgets its cached prefixes; True when any caches them."""
        return any([r.tracker.reset_prefix_cache() for r in self.replicas if r.up])

    def mask_latency(self) -> list[int]:
        """The replicas' frontend mask latency histograms, summed (blink.dpu.mask_timing)."""
        out: list[int] = []
        for r in self.replicas:
            if r.up:
                h = r.tracker.mask_latency()
                out = [a + b for a, b in zip(out, h, strict=True)] if out else list(h)
        return out

    def device_counters(self) -> dict[str, int]:
        """Device counters summed over the live replicas (they are all monotonic counts or gauges)."""
        return self._summed(lambda t: t.device_counters())

    def frontend_counters(self) -> dict[str, int]:
        """The token readers' counts (RequestTracker.frontend_counters), summed over the live replicas."""
        return self._summed(lambda t: t.frontend_counters())

    def _summed(self, counters) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.replicas:
            if r.up:
                for k, v in counters(r.tracker).items():
                    out[k] = out.get(k, 0) + v
        return out

    @property
    def max_context(self) -> int:
        return self._any().max_context

    @property
    def vocab_size(self) -> int:
        return self._any().vocab_size

    def new_request_id(self) -> int:
        return self._any().new_request_id()

    def check_prompt(self, n_prompt: int, words: int | None = None) -> str | None:
        return self._any().check_prompt(n_prompt, words)

    @property
    def features(self) -> int:
        """DeviceFeatures every replica implements (their devices may differ)."""
        f = 0xFFFFFFFF
        for r in self.replicas:
            if r.up:
                f &= r.tracker.features
        return f

    def replica_status(self) -> list[dict]:
        out = []
        for r in self.replicas:
            d = {"replica": r.index, "ring": r.ring, "up": r.up, "down_reason": r.down_reason, "link": r.link}
            d.update(attaches=r.attaches, requests=r.requests, history=list(r.history[-8:]))
            if r.up:
                s = r.tracker.stats()
                d.update(free_slots=s.free_slots, busy_slots=s.busy_slots, queued=s.queued)
            out.append(d)
        return out
