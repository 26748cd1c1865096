"""The stream backend: one class over a torch-shaped device module
(``torch.npu``, ``torch.cuda``, or the module registered for ``cpu``), through
which the session issues its ops (in a stream's scope), event records and
waits. Events are pooled by :class:`~camp2p_overlap.core.keys.EventKey` and
reused across steps: a wait captures the most recent record at the time it
is enqueued, and a graph capture creates no event. Profiler annotation is a
wrapper outside core (``verify/annotated_backend.py``).

:data:`GUARD` counts the graph captures in progress, process-wide, and is the
one lock under which the patch layer's threads (step timings, step
watchdogs, the replay watch) read events: CUDA's default (*global*) capture
mode, and ACL's, fail an event query from any thread during a capture and
invalidate the capture. A capture begins only once no read is in progress;
a read that would overlap a capture returns None at once (ask again later).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, TypeVar

from camp2p_overlap.core.fork import after_fork_in_child
from camp2p_overlap.core.keys import COMPUTE_STREAM, EventKey
from camp2p_overlap.core.overlap.streams.base import BackendUnavailable, DeviceCapabilities, DoneHandle, OpHandle


class StreamBackend:
    """The streams, events and ops of one device module (``name``: ``npu``,
    ``cuda`` or ``cpu``)."""

    def __init__(self, name: str, device_module: ModuleType, device: Any = None) -> None:
        for attr in ("Stream", "Event", "stream", "current_stream", "set_stream"):
            if not hasattr(device_module, attr):
                raise BackendUnavailable(f"{device_module.__name__} has no {attr}")
        self.name = name
        self.mod = device_module
        self.device = device
        self._events: dict[EventKey, Any] = {}
        #: Free (start, end) timing-event pairs for the step timer.
        self._step_events: list[tuple[Any, Any]] = []
        #: Free replay-end markers (the replay watch).
        self._markers: list[Any] = []
        #: Streams this backend made (closed with it where they can be).
        self._made: list[Any] = []
        #: What the module offers beyond the stream API (the emulated device only).
        self.capabilities = DeviceCapabilities.of(device_module)
        self._tracked = self.capabilities.tracked
        self._log_saved: list[Any] = []

    def compute_stream(self) -> Any:
        stream = self.mod.current_stream()
        _name(stream, COMPUTE_STREAM)
        return stream

    def new_stream(self, name: str) -> Any:
        stream = self.mod.Stream(device=self.device) if self.device is not None else self.mod.Stream()
        _name(stream, name)
        name_thread = getattr(stream, "name_thread", None)  # the emulated device's streams are threads
        if callable(name_thread):
            name_thread(f"camp2p-overlap-stream-{name}")
        self._made.append(stream)
        return stream

    def submit(self, stream: Any, fn: Callable[[], Any], label: str = "op") -> OpHandle:
        with self.mod.stream(stream):
            return self.submit_here(stream, fn, label)

    def scope(self, stream: Any) -> Any:
        return self.mod.stream(stream)

    def set_stream(self, stream: Any) -> None:
        """Make ``stream`` the current stream of this thread (the FFN's side stream from a receive to its send)."""
        self.mod.set_stream(stream)

    def submit_here(self, stream: Any, fn: Callable[[], Any], label: str = "op") -> OpHandle:
        """:meth:`submit` inside ``self.mod.stream(stream)`` already entered
        (:meth:`scope`)."""
        if self._tracked is not None:
            return self._tracked(fn, label)
        clock = time.perf_counter_ns
        t0 = clock()
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back
            return DoneHandle(None, exc, t0, clock())
        return DoneHandle(value, None, t0, clock())

    def record(self, stream: Any, key: EventKey) -> Any:
        event = self._events.get(key)
        if event is None:
            event = self._new_event(key)
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def reserve(self, keys: Any) -> None:
        """Make the pooled events of ``keys`` now (before a graph capture, inside which none is made)."""
        for key in keys:
            if key not in self._events:
                self._new_event(key)

    def _new_event(self, key: EventKey) -> Any:
        event = self._events[key] = self.mod.Event()
        _name(event, key, "key")
        return event

    def is_capturing(self) -> bool:
        fn = getattr(self.mod, "is_current_stream_capturing", None)
        return bool(fn()) if fn is not None else False

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    # -- asynchronous errors and the stream log (the emulated device) ----
    def begin_step(self, streams: list[Any]) -> None:
        """Clear the side streams' asynchronous errors of an earlier step."""
        take = self.capabilities.take_errors
        if take is not None:
            take(streams)

    def step_errors(self, streams: list[Any]) -> list[BaseException]:
        """The asynchronous errors kernels of ``streams`` hit (emulated
        device; a real device reports them at its next synchronize)."""
        peek = self.capabilities.peek_errors
        return peek(streams) if peek is not None else []

    def start_log(self) -> bool:
        """Log what the streams perform for work this thread enqueues
        (emulated device only): the edge checker's evidence."""
        caps = self.capabilities
        if caps.new_log is None or caps.set_log is None:
            return False
        self._log_saved.append(caps.set_log(caps.new_log()))
        return True

    def stop_log(self) -> Any:
        """Stop logging; returns the log, which the streams go on filling
        with the work already queued (read it after a synchronize)."""
        set_log = self.capabilities.set_log
        if set_log is None or not self._log_saved:
            return []
        return set_log(self._log_saved.pop())

    def close(self) -> None:
        """Stop the worker threads of the streams this backend made (the emulated device's)."""
        made, self._made = self._made, []
        for stream in made:
            close = getattr(stream, "close", None)
            if callable(close):
                close()

    # -- the step timer of adaptive engage -------------------------------
    def step_timer_start(self) -> Any:
        """Record a timing event on the compute stream (pooled events)."""
        start, end = self._step_events.pop() if self._step_events else self._new_step_timer_pair()
        start.record(self.mod.current_stream())
        return (start, end)

    def step_timer_stop(self, token: Any) -> None:
        token[1].record(self.mod.current_stream())

    def step_timer_elapsed_s(self, token: Any) -> float | None:
        """Read a step's events once the end event has completed (``query()``,
        never a synchronize); the events go back to the pool."""
        start, end = token
        if not end.query():
            return None
        seconds = start.elapsed_time(end) / 1e3
        self._step_events.append((start, end))
        return seconds

    def end_marker(self) -> Any:
        marker = self._markers.pop() if self._markers else self.mod.Event()
        marker.record(self.mod.current_stream())
        return marker

    def release_marker(self, marker: Any) -> None:
        self._markers.append(marker)

    def step_timer_discard(self, token: Any) -> None:
        """A step timer's event pair back in the pool unread (an event not yet
        completed may be re-recorded: it then stands for its new record)."""
        self._step_events.append(token)

    def _new_step_timer_pair(self) -> tuple[Any, Any]:
        return self.mod.Event(enable_timing=True), self.mod.Event(enable_timing=True)


def _name(obj: Any, name: Any, attr: str = "name") -> None:
    try:
        setattr(obj, attr, name)
    except (AttributeError, TypeError):
        pass


T = TypeVar("T")


class CaptureGuard:
    """How many captures the patch layer runs now, and the lock reads take."""

    def __init__(self) -> None:
        self._reset()
        after_fork_in_child(self._reset)

    def _reset(self) -> None:
        """None in progress (at creation, and in a forked child: no capturing thread)."""
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
