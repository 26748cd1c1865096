"""The step gate: counts FFN steps in and out of the wrapped path, so that
``unpatch()`` drains the steps already running wrapped while new ones run
the original, and resets itself in a forked child."""

from __future__ import annotations

import threading

from camp2p_overlap.core.fork import after_fork_in_child


class _Depth(threading.local):
    """How many wrapped steps this thread is inside (re-entrant calls nest)."""

    n = 0


class StepGate:
    """How many wrapped steps are running, over all threads and on this
    one; and whether the patch layer is being removed (then no step may enter)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._open = False
        self._drainers = 0
        self._running = 0
        self._here = _Depth()
        after_fork_in_child(self._after_fork_in_child)

    def open(self) -> None:
        """Steps may enter (the patch layer is applied)."""
        with self._lock:
            self._open = True

    def close(self) -> None:
        """No step may enter any more (the patch layer is removed)."""
        with self._lock:
            self._open = False

    # enter() and exit() run on every step: the lock is taken and released
    # by hand, in a try block (half the cost of a with block).
    def enter(self) -> bool:
        """Count a step in if the gate is open and not draining."""
        lock = self._lock
        lock.acquire()
        try:
            if not self._open or self._drainers:
                return False
            self._running += 1
        finally:
            lock.release()
        self._here.n += 1
        return True

    def exit(self) -> None:
        """Count a step out (paired with an :meth:`enter` that returned True)."""
        self._here.n -= 1
        lock = self._lock  # the lock of self._idle
        lock.acquire()
        try:
            self._running -= 1
            if not self._running and self._drainers:  # only a drain waits on it
                self._idle.notify_all()
        finally:
            lock.release()

    def running_here(self) -> bool:
        """Whether this thread is inside a wrapped step."""
        return self._here.n > 0

    def running(self) -> int:
        """How many wrapped steps run now, over all threads."""
        with self._lock:
            return self._running

    @property
    def draining(self) -> bool:
        """Whether an ``unpatch()`` is waiting for the running steps."""
        return self._drainers > 0

    def drain(self, timeout: float) -> bool:
        """Stop new steps from entering and wait up to ``timeout`` seconds
        for the running ones. Every call is paired with :meth:`end_drain`."""
        with self._idle:
            self._drainers += 1
            return self._idle.wait_for(lambda: not self._running, timeout)

    def end_drain(self) -> None:
        with self._lock:
            self._drainers -= 1

    def _after_fork_in_child(self) -> None:
        """Only the forking thread survives a fork: the steps other threads
        were running are gone (unpatch must not wait for them), and a lock
        one of them held would stay held forever."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = self._here.n  # the forking thread's own steps (its thread-local survives)
        self._drainers = 0
