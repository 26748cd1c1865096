"""The step gate: counts FFN steps in and out of the wrapped path, so that
``unpatch()`` drains the steps already running wrapped while new ones run
the original, and resets itself in a forked child."""

from __future__ import annotations

import os
import threading
import weakref


class StepGate:
    """Per thread, how many wrapped steps are running; and whether the
    layer is being removed (then no step may enter)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._open = False
        self._drainers = 0
        self._active: dict[int, int] = {}
        if hasattr(os, "register_at_fork"):
            ref = weakref.WeakMethod(self._after_fork_in_child)
            os.register_at_fork(after_in_child=lambda: (m := ref()) is not None and m())

    def open(self) -> None:
        """Steps may enter (the layer is applied)."""
        with self._lock:
            self._open = True

    def close(self) -> None:
        """No step may enter any more (the layer is removed)."""
        with self._lock:
            self._open = False

    def enter(self) -> bool:
        """Count a step in if the gate is open and not draining."""
        with self._lock:
            if not self._open or self._drainers:
                return False
            me = threading.get_ident()
            self._active[me] = self._active.get(me, 0) + 1
            return True

    def exit(self) -> None:
        with self._lock:  # the lock of self._idle
            me = threading.get_ident()
            n = self._active.get(me, 0) - 1
            if n <= 0:
                self._active.pop(me, None)
            else:
                self._active[me] = n
            if not self._active and self._drainers:  # only a drain waits on it
                self._idle.notify_all()

    def running_here(self) -> bool:
        """Whether this thread is inside a wrapped step."""
        with self._lock:
            return bool(self._active.get(threading.get_ident()))

    def running(self) -> int:
        """How many wrapped steps run now, over all threads."""
        with self._lock:
            return sum(self._active.values())

    @property
    def draining(self) -> bool:
        """Whether an ``unpatch()`` is waiting for the running steps."""
        return self._drainers > 0

    def drain(self, timeout: float) -> bool:
        """Stop new steps from entering and wait up to ``timeout`` seconds
        for the running ones. Every call is paired with :meth:`end_drain`."""
        with self._idle:
            self._drainers += 1
            return self._idle.wait_for(lambda: not self._active, timeout)

    def end_drain(self) -> None:
        with self._lock:
            self._drainers -= 1

    def _after_fork_in_child(self) -> None:
        """Only the forking thread survives a fork: the steps other threads
        were running are gone (unpatch must not wait for them), and a lock
        one of them held would stay held forever."""
        me = threading.get_ident()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        mine = self._active.get(me)
        self._active = {me: mine} if mine else {}
        self._drainers = 0
