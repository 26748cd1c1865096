"""Graph captures in progress, process-wide, and the one lock under which
the patch layer's threads read events.

CUDA's default (*global*) capture mode, and ACL's, refuse an event query
from any thread while a capture is in progress: the query fails and the
capture is invalidated. The patch layer queries events from more than one
thread: the adaptive step timings (any runner's step thread), the step
watchdogs and the replay watch. Each of those reads goes through
:meth:`CaptureGuard.read`, and each capture the patch layer wraps (the wrapped
``_capture_graphs``) runs inside :meth:`CaptureGuard.capture`: a capture
begins only once no read is in progress, and no read starts until it has
ended. A read that would overlap a capture returns None (not known yet:
ask again later), never waits for the capture.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from camp2p_overlap.core.fork import after_fork_in_child

T = TypeVar("T")


class CaptureGuard:
    """How many captures the patch layer runs now, and the lock reads take."""

    def __init__(self) -> None:
        self._reset()
        after_fork_in_child(self._reset)

    def _reset(self) -> None:
        """None in progress (at creation, and in a forked child, whose
        capturing thread, if any, did not survive the fork)."""
        self._lock = threading.Lock()
        self._captures = 0

    def capturing(self) -> bool:
        """Whether a capture is in progress (one attribute read)."""
        return self._captures > 0

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """The block is a capture: reads in progress finish first, and none
        starts until the block has ended."""
        with self._lock:
            self._captures += 1
        try:
            yield
        finally:
            with self._lock:
                self._captures -= 1

    def read(self, fn: Callable[[], T]) -> T | None:
        """``fn()`` (an event query, or a read built on one), unless a
        capture is in progress: then None, at once."""
        if self._captures:
            return None
        with self._lock:
            if self._captures:
                return None
            return fn()


#: The process's guard: a capture on any runner stops every runner's reads.
GUARD = CaptureGuard()
