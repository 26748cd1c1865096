"""The one fork hook of the package: everything a forked child must not
inherit is reset here, in the order it was registered.

A child of ``fork`` has only the thread that forked: a lock another thread
held stays held, a watcher thread or a stream worker does not exist, and
counts and side streams belong to the parent. Each owner registers how to
reset its part with :func:`after_fork_in_child` (a bound method is held
weakly: an object that dies needs no reset); this module makes the one
``os.register_at_fork`` call. Imports only the standard library.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

Reset = Callable[[], object]

#: The resets, in registration order (weak for bound methods).
_RESETS: list[Callable[[], Reset | None]] = []
_lock = threading.Lock()


def held_weakly_if_bound(callback: Callable[..., Any]) -> Callable[[], Callable[..., Any] | None]:
    """A reference to ``callback`` called like a weak one: weak for a bound
    method (its object may die: the reference then gives None), strong for
    a function (the package's hooks keep theirs alive)."""
    if hasattr(callback, "__self__") and hasattr(callback, "__func__"):
        return weakref.WeakMethod(callback)  # type: ignore[arg-type]
    return lambda: callback


def after_fork_in_child(reset: Reset) -> None:
    """Call ``reset()`` in every forked child, right after the fork (before
    the child runs anything else of ours)."""
    ref = held_weakly_if_bound(reset)
    with _lock:
        if len(_RESETS) >= 64 and len(_RESETS) % 64 == 0:  # drop the resets of objects gone
            _RESETS[:] = [r for r in _RESETS if r() is not None]
        _RESETS.append(ref)


def registered() -> int:
    """How many resets are registered and alive (tests)."""
    with _lock:
        return sum(1 for r in _RESETS if r() is not None)


def _reset_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # the parent's may have been held by another thread
    for ref in list(_RESETS):
        reset = ref()
        if reset is not None:
            reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
