"""Actor lifecycle helpers shared by the GPU and frontend actors."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable

log = logging.getLogger(__name__)


def reconstructed() -> bool:
    """True inside an actor that Ray restarted after it died (max_restarts)."""
    try:
        import ray
    except ImportError:  # no Ray installed: nothing restarted us
        return False
    if not ray.is_initialized():  # a frontend run without Ray (python -m blink.actors.frontend_actor)
        return False
    ctx = ray.get_runtime_context()
    if ctx.get_actor_id() is None:  # not inside an actor (plain-object use in tests)
        return False
    with warnings.catch_warnings():  # the property reads the deprecated ctx.actor_id internally
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ctx.was_current_actor_reconstructed)


def start_in_background(start: Callable[[], object], what: str, on_error: Callable[[str], None]) -> threading.Thread:
    """Run `start` on a daemon thread: a restarted actor starts itself, since nobody calls start()
    on it, and its constructor must return quickly for Ray to mark it alive."""

    def run() -> None:
        try:
            start()
        except Exception as e:  # reported through status(); the actor stays up to say why
            log.exception("%s: restart failed", what)
            on_error(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=run, name=f"{what}-restart", daemon=True)
    t.start()
    return t
