"""Count the Ray calls a process makes, to prove the token path never touches Ray.

`install()` wraps the Python entry points every Ray call goes through in this process:
actor method submission (`ActorHandle._actor_method_call`), task submission
(`RemoteFunction._remote`), actor creation (`ActorClass._remote`) and `ray.get / wait / put`.
The actors call it at construction and count the calls they receive themselves
(`note_incoming`), so a test can read every process's counts before and after N tokens.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_installed = False


def _wrap(owner: object, attr: str, key: str) -> None:
    orig = getattr(owner, attr)

    @functools.wraps(orig)
    def counted(*args, **kwargs):
        with _lock:
            _counts[key] += 1
        return orig(*args, **kwargs)

    setattr(owner, attr, counted)


def install() -> None:
    """Idempotent: wrap this process's Ray entry points once."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    try:
        import ray
        import ray.actor
        import ray.remote_function
    except ImportError:  # no Ray installed: this process cannot make Ray calls at all
        return

    _wrap(ray.actor.ActorHandle, "_actor_method_call", "actor_method_call")
    _wrap(ray.actor.ActorClass, "_remote", "actor_create")
    _wrap(ray.remote_function.RemoteFunction, "_remote", "task_submit")
    for fn in ("get", "wait", "put"):
        _wrap(ray, fn, fn)


def note_incoming(method: str) -> None:
    with _lock:
        _counts[f"in:{method}"] += 1


def counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)
