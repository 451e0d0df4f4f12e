"""`blink serve`: the serving stack (device + frontend) behind the OpenAI HTTP server until a
signal, and what every stack-running command shares (logging, one-line start-up errors)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

from blink import config as C

log = logging.getLogger("blink")


def setup_logging(level: str) -> None:
    """The frontend's log lines (requests, stats, warnings) on stderr."""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%m-%d %H:%M:%S",
        stream=sys.stderr,
    )


def fail(command: str, e: BaseException) -> int:
    """A start-up error as one line; its traceback only with --log-level debug."""
    log.debug("%s failed", command, exc_info=e)
    text = str(e) or type(e).__name__
    known = (RuntimeError, TimeoutError, OSError, ValueError, KeyError)
    print(f"blink {command}: {text if isinstance(e, known) else f'{type(e).__name__}: {text}'}", file=sys.stderr)
    return 1


def run_loop(coro: Any) -> Any:
    import uvloop

    return uvloop.run(coro)


def serve(cfg: C.BlinkConfig) -> int:
    from blink.stack import Stack, stderr_progress

    try:
        stack = Stack(cfg, stderr_progress)  # reads the ring agent's secret file, if any
    except C.ConfigError as e:
        return fail("serve", e)
    try:
        stack.start_device()
        run_loop(_serve_async(stack))
    except Exception as e:  # a model that does not load, a port in use, a device that dies: one line
        return fail("serve", e)
    finally:
        stack.shutdown()
    return 1 if stack.gave_up else 0


async def _serve_async(stack: Any) -> None:
    from blink.dpu.server import OpenAIServer, start_http
    from blink.protocol.gc_freeze import freeze_startup_heap

    cfg = stack.cfg
    stop = asyncio.Event()
    backend = await stack.start_frontend(on_give_up=stop.set)  # a device that cannot be restarted ends serve
    server = OpenAIServer(backend, stack.tokenizer, cfg.server)
    runner, port = await start_http(server, cfg.server.host, cfg.server.port)
    log.info("%s", freeze_startup_heap().describe())
    # The bound port on its own line: scripts that pass --port 0 read it from here.
    print(f"blink: serving {stack.tokenizer.name} on http://{cfg.server.host}:{port}/v1", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    now = asyncio.Event()  # a second signal: end the requests in flight at once

    def on_signal() -> None:
        (now if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await stop.wait()
        if stack.gave_up:
            print("blink: device lost", file=sys.stderr, flush=True)
        else:
            n, wait = len(server.completion.active), cfg.server.shutdown_timeout_s
            print(
                f"blink: shutting down: {n} request(s) in flight get up to {wait:g} s (a second signal ends them now)",
                file=sys.stderr,
                flush=True,
            )
            await server.drain(runner, wait, now)
    finally:
        await runner.cleanup()
        await stack.stop_frontend()
