"""The serving stack of one server (blink serve, blink generate): ring + device + frontend roles in
one process besides the device, and the supervisor that heals it when the device dies.

The pieces come from the launch layer (blink.launch: the spec, the ring, the device process); this
module composes them with the frontend (blink.dpu) and keeps them serving: restarts of a dead device
on a fresh ring (with backoff and a limit), the ring agent that serves the ring to other hosts, and
a frontend-only stack's reconnects to a remote ring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable

import msgspec

from blink.config import BlinkConfig
from blink.launch import (
    DeviceProcess,
    Progress,
    create_ring,
    device_spec,
    die_with,
    new_ring_name,
    remove_stale_rings,
    start_device,
    wait_for_ready,
)
from blink.protocol.layout import DEVICE_COUNTERS, DeviceStatus
from blink.protocol.transport import ShmTransport
from blink.protocol.wire import DeviceSpec

log = logging.getLogger(__name__)


# -- the ring agent and a remote ring ----------------------------------------------------------
def start_ring_agent(
    ring: str, listen: str, rdma_device: str = "", *, secret: bytes, partitions: int = 1, reserved: tuple[int, ...] = ()
) -> tuple[subprocess.Popen, str]:
    """The ring agent (blink.protocol.ring_agent) for a local ring, as a child process that dies with
    this one; returns (process, bound address). Its own process: its CPU cost per round trip is
    visible as such, and it never holds the frontend's GIL."""
    from blink.protocol.ring_agent import start_agent_process

    extra = ["--rdma-device", rdma_device] if rdma_device else []
    return start_agent_process(
        ring,
        listen,
        extra_args=extra,
        secret=secret,
        partitions=partitions,
        reserved=reserved,
        preexec_fn=die_with(os.getpid()),
    )


def agent_secret(rc, remote: bool) -> tuple[bytes | None, str]:
    """The ring agent's secret for this server (read once, here) and where it came from: a frontend of a
    remote ring reads ring.secret_file; a server whose agent other hosts reach (ring.listen) reads or
    creates it; an agent only this server's frontend reaches gets a fresh one in memory."""
    from blink.config import ConfigError
    from blink.protocol import agent_auth

    path = rc.secret_file or agent_auth.default_secret_file()
    try:
        if remote:
            return agent_auth.read_secret_file(path), path
        if rc.listen is not None:
            return agent_auth.ensure_secret_file(path), path
        if rc.transport in ("tcp", "rdma"):
            if rc.secret_file:
                return agent_auth.read_secret_file(path), path
            return agent_auth.new_secret(), "in memory"
    except agent_auth.SecretError as e:
        raise ConfigError(str(e)) from None
    return None, ""


def stop_ring_agent(agent: subprocess.Popen) -> None:
    agent.terminate()
    try:
        agent.wait(5)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()


def wait_ready_remote(transport, timeout: float, progress: Progress | None = None) -> None:
    """Block until the remote ring's device says READY (a frontend only: no device process here)."""
    from blink.dpu.slot_tracker import read_header

    def check(status: int) -> None:
        if status in (DeviceStatus.FAILED, DeviceStatus.STOPPED):
            raise RuntimeError(f"the remote device is {DeviceStatus(status).name}")

    def status() -> int:  # the remote ring's header, read anew on every poll
        return int(read_header(transport)["device_status"])

    wait_for_ready(status, check, timeout, progress, "remote device", poll_s=0.02)


SUPERVISE_POLL_S = 0.1  # how often the supervisor looks at the device process
RESTART_BACKOFF_S = (0.5, 30.0)  # wait before the first restart in a row (doubling), and at most
HEALTHY_AFTER_S = 60.0  # a device that served this long starts the count of restarts in a row over
RECONNECT_S = 1.0  # a frontend only: how often it tries to reach a ring it lost


class Stack:
    """Ring + device + frontend roles of one server (one process besides the device).

    It is the server's Backend (blink.dpu.generation): it stands in front of the request tracker
    of the current ring and heals the server when the device process dies. The tracker notices
    the death within 0.1 s (liveness) and ends the in-flight requests with an error event (/health:
    503); the supervisor then waits (backoff), starts a new device on a fresh ring, swaps in a new
    tracker (busy/running gauges start from zero, /health turns 200) and removes the old ring.
    Device counters continue across rings; `restarts` counts the new devices started. After
    `device.max_restarts` restarts in a row it gives up: `gave_up` says why and `on_give_up` runs.

    The frontend reads the ring through `link` (blink.dpu.ring_link, ring.transport): the ring itself
    (shm), or the ring agent. ring.listen serves the ring to frontends on other hosts through a ring
    agent (restarted on the same address with each new ring); ring.transport tcp/rdma makes this
    frontend go through that agent too (how the transport benchmark measures the remote path on one
    host). ring.address set: a frontend only, of the ring behind that agent; no ring or device
    here (the remote device is not this server's to restart): when the ring becomes unreachable (the
    agent, the link or the GPU host went away) the in-flight requests end with an error event and
    /health says 503, and the supervisor connects again, every RECONNECT_S, until the ring answers
    READY; then it swaps in a new tracker and /health turns 200.
    """

    def __init__(self, cfg: BlinkConfig, progress: Progress | None = None):
        self.cfg = cfg
        self.progress = progress
        self.remote = cfg.ring.address is not None
        self.spec = None if self.remote else device_spec(cfg, new_ring_name())
        self.kind = "remote" if self.spec is None else self.spec.kind
        rc = cfg.ring
        self.secret, self.secret_source = agent_secret(rc, self.remote)
        # This frontend's slot partition (owner of owners): a remote ring's agent grants one at the
        # first attach; beside the device it is partition 0 of 1 + the remote frontends that may attach.
        self.owner, self.owners = (-1, 0) if self.remote else (0, 1 + (rc.remote_frontends if rc.listen else 0))
        self.transport: ShmTransport | None = None  # the ring this process created (not when remote)
        self.link = None  # what the frontend reads the ring through (the ring itself, or via an agent)
        self.link_why = ""
        self.agent: subprocess.Popen | None = None
        self.agent_address = ""
        self.device: DeviceProcess | None = None
        self.tokenizer = None
        self.tracker = None
        self.restarts = 0
        self.gave_up: str | None = None
        self._counters_before: dict[str, int] = {}  # device counters of the rings already replaced
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def ring_name(self) -> str:
        return self.spec.ring if self.spec is not None else ""

    def _say(self, msg: str) -> None:
        if self.progress:
            self.progress(msg)
        else:
            log.warning("%s", msg)

    def _launch(self, spec: DeviceSpec) -> tuple[ShmTransport, DeviceProcess]:
        transport = create_ring(spec.ring, self.cfg.ring)
        if self.progress:
            self.progress(f"ring /dev/shm/{spec.ring}: {self.cfg.ring.n_slots} slots; starting the {spec.kind} device")
        try:
            return transport, start_device(spec)
        except BaseException:
            transport.unlink()
            transport.close()
            raise

    def start_device(self) -> None:
        """Remove rings of dead servers, create the ring, start the device (and the ring agent if
        asked), load the tokenizer meanwhile, wait for READY, open the frontend's link. A frontend
        only: load the tokenizer, attach to the remote ring, wait for its READY."""
        from blink.dpu.tokenizer import load_tokenizer

        if not self.remote:
            for name in remove_stale_rings():
                self._say(f"removed stale ring /dev/shm/{name} (the server that made it is gone)")
            self.transport, self.device = self._launch(self.spec)
        m = self.cfg.model
        self.tokenizer = load_tokenizer(m.spec, m.name, m.chat_template)
        if self.remote:
            self._open_link()
            wait_ready_remote(self.link, self.cfg.device.ready_timeout_s, self.progress)
            return
        self.device.wait_ready(self.transport, self.cfg.device.ready_timeout_s, self.progress)
        self._start_agent()
        self._open_link()

    def _start_agent(self) -> None:
        rc = self.cfg.ring
        listen = rc.listen or ("127.0.0.1:0" if rc.transport in ("tcp", "rdma") else None)
        if listen is None:
            return
        # a restarted device's ring is served on the address the frontends already know
        self.agent, self.agent_address = start_ring_agent(
            self.ring_name,
            self.agent_address or listen,
            rc.rdma_device,
            secret=self.secret,
            partitions=self.owners,
            reserved=() if rc.transport in ("tcp", "rdma") else (0,),  # (0,): this frontend maps the ring
        )
        self._say(
            f"ring agent for /dev/shm/{self.ring_name} listening on {self.agent_address} (secret: "
            f"{self.secret_source}; {self.owners - 1} remote frontend partition(s))"
        )

    def _open_link(self) -> None:
        from blink.dpu.ring_link import open_link

        rc = self.cfg.ring
        address = rc.address or (self.agent_address if rc.transport in ("tcp", "rdma") else None)
        if address is None:
            self.link, self.link_why = self.transport, f"shm: /dev/shm/{self.ring_name} on this host"
        else:
            link = open_link(
                None, address, rc.transport, rc.rdma_device, secret=self.secret, owner=self.owner, owners=self.owners
            )
            self.link, self.link_why = link.transport, link.why
            self.owner, self.owners = link.owner, link.owners
        self._say(f"ring transport {self.link_why}")

    def _close_link(self) -> None:
        if self.link is not None and self.link is not self.transport:
            self.link.close()
        self.link = None

    async def _new_tracker(self, transport, device: DeviceProcess | None):
        from blink.dpu.request_tracker import RequestTracker

        def liveness() -> str | None:
            return None if device.alive() else f"device process exited with code {device.returncode}"

        kw = {"liveness": liveness} if device is not None else {}
        tracker = RequestTracker.for_server(transport, self.cfg.server, self.tokenizer, self.owner, self.owners, kw)
        await tracker.start()
        return tracker

    async def start_frontend(self, on_give_up: Callable[[], None] | None = None) -> Stack:
        assert self.link is not None
        self.tracker = await self._new_tracker(self.link, self.device)
        task = self._supervise_remote() if self.remote else self._supervise(on_give_up)
        self._supervisor = asyncio.get_running_loop().create_task(task, name="supervisor")
        return self

    async def _supervise_remote(self) -> None:
        """A frontend only: reconnect to the remote ring after it became unreachable."""
        while True:
            await asyncio.sleep(SUPERVISE_POLL_S)
            why = self.tracker.reader.failed
            if self._stopping or not why or "unreachable" not in why:
                continue  # serving, or a device-side failure the remote host heals (heartbeat resumes)
            old_tracker, old_link = self.tracker, self.link
            while not self._stopping:
                try:
                    await asyncio.to_thread(self._reconnect)
                    break
                except (RuntimeError, TimeoutError, OSError) as e:
                    log.info("ring still unreachable: %s", e)
                    await asyncio.sleep(RECONNECT_S)
            if self._stopping:
                return
            self.tracker = await self._new_tracker(self.link, None)
            await old_tracker.close()
            old_link.close()
            self._say(f"ring reachable again ({self.link_why}); serving again")

    def _reconnect(self) -> None:
        from blink.dpu.ring_link import open_link

        rc = self.cfg.ring
        link = open_link(
            None,
            rc.address,
            rc.transport,
            rc.rdma_device,
            timeout_s=5.0,
            secret=self.secret,
            owner=self.owner,
            owners=self.owners,
        )
        try:
            wait_ready_remote(link.transport, RECONNECT_S * 5)
        except BaseException:
            link.transport.close()
            raise
        self.link, self.link_why = link.transport, link.why
        self.owner, self.owners = link.owner, link.owners

    async def _supervise(self, on_give_up: Callable[[], None] | None) -> None:
        limit = self.cfg.device.max_restarts
        in_a_row, up_since = 0, time.monotonic()
        while True:
            await asyncio.sleep(SUPERVISE_POLL_S)
            if self._stopping or self.device is None or self.device.alive():
                continue
            why = f"device process exited with code {self.device.returncode}"
            self.tracker.fail(why)  # (the tracker's liveness check has most likely done so already)
            if time.monotonic() - up_since >= HEALTHY_AFTER_S:
                in_a_row = 0
            while True:
                if in_a_row >= limit:
                    self.gave_up = f"{why}; giving up after {in_a_row} restarts in a row"
                    self._say(self.gave_up)
                    if on_give_up is not None:
                        on_give_up()
                    return
                in_a_row += 1
                delay = min(RESTART_BACKOFF_S[0] * 2 ** (in_a_row - 1), RESTART_BACKOFF_S[1])
                self._say(f"{why}; restarting the device in {delay:.1f} s (restart {in_a_row} of {limit} in a row)")
                await asyncio.sleep(delay)
                self.restarts += 1
                try:
                    await self._restart()
                    break
                except (RuntimeError, TimeoutError, OSError) as e:
                    why = f"the restarted device failed: {e}"
            up_since = time.monotonic()
            self._say(f"device restarted on /dev/shm/{self.ring_name}; serving again")

    async def _restart(self) -> None:
        """A new device on a fresh ring, then a new tracker on it; the old ring is removed."""
        spec = msgspec.structs.replace(self.spec, ring=new_ring_name())
        transport, device = self._launch(spec)
        try:
            await asyncio.to_thread(device.wait_ready, transport, self.cfg.device.ready_timeout_s, self.progress)
        except BaseException:  # failed, or the server is shutting down meanwhile
            device.stop(transport, drain=False, timeout=2.0)
            transport.unlink()
            transport.close()
            raise
        old_tracker, old_transport, old_link = self.tracker, self.transport, self.link
        if self.agent is not None:  # the agent served the old ring: the new one gets a new agent
            stop_ring_agent(self.agent)
            self.agent = None
        self.spec, self.transport, self.device = spec, transport, device
        self._start_agent()
        self._open_link()
        self.tracker = await self._new_tracker(self.link, device)
        last = old_tracker.device_counters()
        for k in DEVICE_COUNTERS:
            self._counters_before[k] = self._counters_before.get(k, 0) + last.get(k, 0)
        await old_tracker.close()
        if old_link is not old_transport:
            old_link.close()
        old_transport.unlink()
        old_transport.close()

    # -- Backend (blink.dpu.generation): the current ring's tracker --------------------------------
    def device_counters(self) -> dict[str, int]:
        out = self.tracker.device_counters()
        for k, v in self._counters_before.items():
            out[k] = out.get(k, 0) + v
        out["restarts"] = self.restarts  # -> blink_device_restarts_total
        return out

    def __getattr__(self, name: str):
        # submit, health, stats, check_prompt, new_request_id, max_context, features, ...: whatever
        # the Backend protocol holds is the current tracker's (looked up per call: it is swapped)
        if name.startswith("_") or name == "tracker":
            raise AttributeError(name)
        return getattr(self.tracker, name)

    # -- shutdown ---------------------------------------------------------------------------------
    async def stop_frontend(self) -> None:
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        if self.tracker is not None:
            await self.tracker.close()
            self.tracker = None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the device to stop (drain), wait, then remove the ring. Safe to call twice. A frontend
        only closes its link: the remote device is not its to stop."""
        self._stopping = True
        self._close_link()
        if self.transport is not None and self.device is not None:
            self.device.stop(self.transport, drain=True, timeout=timeout)
        if self.agent is not None:
            stop_ring_agent(self.agent)
            self.agent = None
        if self.transport is not None:
            self.transport.unlink()
            self.transport.close()
            self.transport = None


def stderr_progress(msg: str) -> None:
    print(f"blink: {msg}", file=sys.stderr, flush=True)
