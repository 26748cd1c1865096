"""One runner's step and replay timings not read yet: each is read once its
end event has completed (``query()``, never a synchronize), oldest first,
into adaptive engage, and never while a graph capture is in progress
(:data:`~camp2p_overlap.core.overlap.capture_guard.GUARD`)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from camp2p_overlap.core.overlap.capture_guard import GUARD
from camp2p_overlap.core.overlap.streams.backend import StreamBackend

if TYPE_CHECKING:
    from camp2p_overlap.core.overlap.adaptive.engage import AdaptiveEngage, BucketKey, Path

#: Timings waiting for their device events, at most (older ones are dropped).
MAX_PENDING_TIMINGS = 64

#: A timing not read yet: its bucket, path, backend, token and the adaptive
#: engage it feeds (None: the runtime's).
Pending = tuple["BucketKey", "Path", StreamBackend, Any, "AdaptiveEngage | None"]


def step_timer_start(backend: StreamBackend) -> Any:
    """A step's or a replay's timing token, or None (not timed) while a graph
    capture is in progress on any thread: the timing could not be read
    before the capture ends, it would time the step beside a capture, and a
    timing pair the pool lacks would be an event made during a capture."""
    return None if GUARD.capturing() else backend.step_timer_start()


class StepTimings:
    """The timings of one runner, queued in issue order."""

    def __init__(self, adaptive: Callable[[], AdaptiveEngage]) -> None:
        #: The runtime's adaptive engage (looked up at each read: tests replace it).
        self._adaptive = adaptive
        self._pending: deque[Pending] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pending)

    def clear(self) -> None:
        """Drop every timing not read (on unpatch, and in a forked child: a
        new lock too, as a parent thread may have held the old one)."""
        self._lock = threading.Lock()
        self._pending = deque()

    def record(
        self, key: BucketKey, path: Path, backend: StreamBackend, token: Any, into: AdaptiveEngage | None = None
    ) -> None:
        """A timing, to be read when its events have completed: at once when
        it is known now and none older waits, else queued (and the older ones
        read that are ready). ``into``: the adaptive engage it feeds (a
        decode graph key's own; None: the runtime's)."""
        with self._lock:
            older = bool(self._pending)
            seconds = None if older else GUARD.read(lambda: backend.step_timer_elapsed_s(token))
            if seconds is None:
                self._pending.append((key, path, backend, token, into))
                while len(self._pending) > MAX_PENDING_TIMINGS:
                    dropped = self._pending.popleft()
                    dropped[2].step_timer_discard(dropped[3])
        if seconds is not None:
            (into or self._adaptive()).record(key, path, seconds)
        elif older:  # with none older, this one is first and not ready: nothing to read
            self.read_ready()

    def timed(
        self,
        key: BucketKey,
        path: Path,
        backend: StreamBackend,
        run: Callable[[], Any],
        into: AdaptiveEngage | None = None,
    ) -> Any:
        """``run()`` timed on the compute stream and recorded for ``key``
        (not timed while a capture is in progress; a run that raised is not
        recorded, and its event pair goes back)."""
        token = step_timer_start(backend)
        try:
            result = run()
        except BaseException:
            if token is not None:
                backend.step_timer_discard(token)
            raise
        if token is not None:
            backend.step_timer_stop(token)
            self.record(key, path, backend, token, into)
        return result

    def read_ready(self) -> None:
        """Read every timing that is ready (never waits) into its adaptive
        engage, oldest first; stop at the first not ready, and at once while
        a capture is in progress."""
        while self._pending:
            with self._lock:
                if not self._pending:
                    return
                key, path, backend, token, into = self._pending[0]
                seconds = GUARD.read(lambda b=backend, t=token: b.step_timer_elapsed_s(t))
                if seconds is None:
                    return
                self._pending.popleft()
            (into or self._adaptive()).record(key, path, seconds)
