"""Frontend actor: the "DPU" roles of a deployment in one process, serving every replica's ring.

One process holds the HTTP/SSE server (blink.dpu.server), the tokenizer and detokenizer, and,
per replica, a request tracker (slot tracker + token reader) over that replica's ring; the
Router picks a replica per request. Each role stays its own module; they share one event loop
because the hand-offs between them (tokenize -> claim a slot -> stream tokens) are per request
and per token, and a process boundary there would cost a copy and a wake-up per token.

When one core is not enough for HTTP + detokenization (deploy.frontends > 1, like vLLM's
api-server-count), F such processes serve one port: each listens with SO_REUSEPORT, so the kernel
spreads connections over them, and each attaches every replica's ring but owns only the slots
s % F == its index (blink.dpu.slot_tracker), so every ring word keeps a single host writer.
Frontend 0 binds the configured port; the others get the port it bound.

The event loop runs on a thread of its own; Ray calls (start / status / stop) arrive on Ray's
threads and never touch the token path. When Ray restarts a killed frontend, the constructor
starts it again: it opens the existing rings by name (no GPU actor restarts) and the request
trackers reclaim the slots the dead frontend left behind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from typing import Any

from blink.dpu import metrics as dpu_metrics
from blink.protocol.gc_freeze import freeze_startup_heap

from . import raycount
from .config import DeployConfig
from .lifecycle import reconstructed, start_in_background

log = logging.getLogger(__name__)


class FrontendActor:
    def __init__(
        self,
        cfg_json: str,
        replicas: int,
        index: int = 0,
        count: int = 1,
        port: int | None = None,
        secret: bytes | None = None,
    ):
        """index / count: this frontend among `count` sharing the replicas (its slot partition of every
        ring); port: the port to bind (frontends 1.. take the one frontend 0 bound; None: the
        configured server.port); secret: the GPU actors' ring agents' (blink deploy makes it)."""
        raycount.install()
        raycount.note_incoming("__init__")
        self.cfg = DeployConfig.from_json(cfg_json)
        self.replicas = replicas
        if not 0 <= index < count:
            raise ValueError(f"frontend index {index} out of range for {count} frontends")
        self.index, self.count, self.port = index, count, port
        self._secret = secret
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._error = ""
        self._info: dict[str, Any] = {}
        self._router = None
        self._server = None
        self._stop_event: asyncio.Event | None = None
        self._restarted = reconstructed()
        if self._restarted:
            start_in_background(self.start, "frontend", self._set_error)

    def _set_error(self, why: str) -> None:
        self._error = why

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Load the tokenizer, attach the rings, bind HTTP; idempotent. Returns {url, ...}."""
        raycount.note_incoming("start")
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run_loop, name="frontend-loop", daemon=True)
                self._thread.start()
        self._started.wait()
        if self._error:
            raise RuntimeError(f"frontend failed to start: {self._error}")
        return dict(self._info)

    def _run_loop(self) -> None:
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:  # uvloop is a dependency; the stdlib loop still works without it
            loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except Exception as e:
            log.exception("frontend loop failed")
            self._error = self._error or f"{type(e).__name__}: {e}"
        finally:
            self._started.set()
            self._stopped.set()
            loop.close()

    async def _serve(self) -> None:
        from blink.dpu.request_tracker import RequestTracker
        from blink.dpu.tokenizer import load_tokenizer
        from blink.protocol.transport import Transport

        from .http import start_http
        from .router import Router

        srv, model = self.cfg.serving.server, self.cfg.serving.model
        tok = load_tokenizer(model.spec, model.name, model.chat_template)  # no weights

        def make_tracker(transport: Transport) -> RequestTracker:
            return RequestTracker.for_server(transport, srv, tok, self.index, self.count)

        self._stop_event = asyncio.Event()
        rc = self.cfg.serving.ring
        locate = None
        ray = sys.modules.get("ray")
        if rc.transport != "shm" and ray is not None and ray.is_initialized():
            locate = self._locate  # the rings may be on other hosts: ask their GPU actors where
        rings = [self.cfg.ring_name(i) for i in range(self.replicas)]
        self._router = Router(
            rings,
            make_tracker,
            locate=locate,
            transport=rc.transport,
            rdma_device=rc.rdma_device,
            secret=self._secret,
            partition=(self.index, self.count),
        )
        await self._router.start()
        metrics_dir = None
        try:
            if self.count > 1:  # /metrics of the whole server from whichever frontend is asked
                metrics_dir = f"/dev/shm/{self.cfg.ring_name(0)}-metrics"
                dpu_metrics.enable_multiprocess(metrics_dir, str(self.index), restore=self._restarted)
            self._server = await start_http(self.cfg.serving, self._router, tok, self.port, self.count > 1)
            self._info = {"url": self._server.url, "pid": os.getpid(), "restarted": self._restarted}
            frozen = freeze_startup_heap()
            log.info("frontend %d: %s", self.index, frozen.describe())
            self._info["gc_frozen"] = frozen.objects
            self._info.update(index=self.index, count=self.count, port=self._server.port)
            ray = sys.modules.get("ray")  # None when running without Ray
            if ray is not None and ray.is_initialized():
                ip = ray.util.get_node_ip_address()
                self._info.update(node_ip=ip, node_id=ray.get_runtime_context().get_node_id())
                if srv.host in ("0.0.0.0", "::", ""):  # bound to every interface: name one that routes
                    self._info["url"] = self._server.url.replace(f"//{srv.host}:", f"//{ip}:", 1)
            self._started.set()
            await self._stop_event.wait()
        finally:
            if self._server is not None:
                await self._server.close()
            await self._router.close()
            if metrics_dir is not None:  # a clean stop: nothing to carry over
                dpu_metrics.remove_files(metrics_dir, str(self.index))

    def _locate(self, replica: int) -> dict[str, Any]:
        """Replica `replica`'s ring_info(), from its GPU actor (a Ray call, at attach time only)."""
        import ray

        gpu = ray.get_actor(self.cfg.gpu_actor_name(replica), namespace=self.cfg.namespace)
        return ray.get(gpu.ring_info.remote(), timeout=10)

    def stop(self, timeout_s: float = 10.0) -> bool:
        raycount.note_incoming("stop")
        if self._thread is None or self._stopped.is_set():
            return True
        self._started.wait(timeout_s)  # stopping mid-start: let the loop reach its wait first
        if self._loop is not None and self._stop_event is not None and not self._stopped.is_set():
            self._loop.call_soon_threadsafe(self._stop_event.set)
        return self._stopped.wait(timeout_s)

    # -- introspection (control plane) ------------------------------------------------------
    def status(self) -> dict[str, Any]:
        raycount.note_incoming("status")
        out: dict[str, Any] = {"pid": os.getpid(), "error": self._error, **self._info}
        out["state"] = "SERVING" if self._started.is_set() and not self._stopped.is_set() else "STOPPED"
        if not self._started.is_set():
            out["state"] = "STARTING"
        router = self._router
        loop = self._loop
        if router is not None and loop is not None and self._started.is_set() and not self._stopped.is_set():
            fut = asyncio.run_coroutine_threadsafe(_snapshot(router), loop)
            out["replicas"] = fut.result(timeout=5)
        return out

    def ray_counts(self) -> dict[str, int]:
        return raycount.counts()

    def pid(self) -> int:
        return os.getpid()


async def _snapshot(router) -> list[dict[str, Any]]:
    # On the loop thread: the router's state is only consistent there.
    return router.replica_status()


def wait_http(url: str, timeout_s: float) -> None:
    """Block until GET {url}/health answers 200 (any replica serving)."""
    import urllib.error
    import urllib.request

    t_end = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < t_end:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(0.05)
    raise TimeoutError(f"{url}/health not 200 after {timeout_s:g}s ({last})")


def main(argv: list[str] | None = None) -> int:
    """The frontend roles without Ray, over rings that already exist (benchmarks, debugging):
    python -m blink.actors.frontend_actor --config-json '...' --replicas N"""
    import argparse
    import signal

    ap = argparse.ArgumentParser(prog="python -m blink.actors.frontend_actor", description=main.__doc__)
    ap.add_argument("--config-json", required=True, help="DeployConfig.to_json() text")
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--index", type=int, default=0, help="this frontend's index among --count")
    ap.add_argument("--count", type=int, default=1, help="frontend processes sharing the rings and the port")
    ap.add_argument("--port", type=int, default=None, help="port to bind (default: the config's server.port)")
    a = ap.parse_args(argv)
    fe = FrontendActor(a.config_json, a.replicas, a.index, a.count, a.port)
    info = fe.start()
    print(f"blink frontend: serving on {info['url']}", file=sys.stderr, flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    return 0 if fe.stop() else 1


if __name__ == "__main__":
    raise SystemExit(main())
