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
        #: One entry per step counted in, over all threads: a list, because its
        #: append() and pop() are each one atomic operation under the GIL, so a
        #: step counts itself in and out without taking the lock (see enter()).
        self._steps: list[None] = []
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

    # enter() and exit() run on every step and take no lock. A step counts
    # itself in (append) before it reads whether the gate is open and not
    # draining; a drain counts itself in (under the lock) before it reads the
    # running steps. Each of the four is one atomic operation under the GIL,
    # so either the step sees the drain (and counts itself out again) or the
    # drain sees the step (and waits for it): never neither. A step counting
    # itself out while a drain waits takes the lock to wake it.
    def enter(self) -> int:
        """Count a step in if the gate is open and not draining: how many
        steps this thread is inside now, this one included (1: not nested
        in another), or 0 when it is not counted in."""
        self._steps.append(None)
        if not self._open or self._drainers:
            self._steps.pop()
            if self._drainers:
                self._wake_drain()
            return 0
        self._here.n += 1
        return self._here.n

    def exit(self) -> None:
        """Count a step out (paired with an :meth:`enter` that counted it in)."""
        self._here.n -= 1
        self._steps.pop()
        if self._drainers:  # only a drain waits on it
            self._wake_drain()

    def _wake_drain(self) -> None:
        with self._lock:  # the lock of self._idle
            if not self._steps:
                self._idle.notify_all()

    def running_here(self) -> bool:
        """Whether this thread is inside a wrapped step."""
        return self._here.n > 0

    def running(self) -> int:
        """How many wrapped steps run now, over all threads."""
        return len(self._steps)

    @property
    def draining(self) -> bool:
        """Whether an ``unpatch()`` is waiting for the running steps."""
        return self._drainers > 0

    def drain(self, timeout: float) -> bool:
        """Stop new steps from entering and wait up to ``timeout`` seconds
        for the running ones. Every call is paired with :meth:`end_drain`."""
        with self._idle:
            self._drainers += 1
            return self._idle.wait_for(lambda: not self._steps, timeout)

    def end_drain(self) -> None:
        with self._lock:
            self._drainers -= 1

    def _after_fork_in_child(self) -> None:
        """Only the forking thread survives a fork: the steps other threads
        were running are gone (unpatch must not wait for them), and a lock
        one of them held would stay held forever."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._steps = [None] * self._here.n  # the forking thread's own steps (its thread-local survives)
        self._drainers = 0
