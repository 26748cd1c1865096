"""The stream backend: one small class over a torch-shaped device module (``torch.npu``, ``torch.cuda``, or the module
registered for ``cpu``). The session drives streams and events through the module's own API (``with mod.stream(s)``,
``mod.set_stream``, ``event.record(s)``, ``s.wait_event(e)``); the backend makes the streams, pools the events by
:class:`~camp2p_overlap.core.keys.EventKey` (reused across steps, so a graph capture creates none) and binds what the
module offers beyond that API.

:data:`GUARD` counts the graph captures in progress, process-wide, and is the one lock under which the patch layer's
threads (step timings, step watchdogs, the replay watch) read events: CUDA's default (*global*) capture mode, and
ACL's, fail an event query from any thread during a capture and invalidate the capture. A capture begins only once no
read is in progress; a read that would overlap a capture returns None at once (ask again later).
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
    """The streams and pooled events of one device module (``name``: ``npu``, ``cuda`` or ``cpu``). What the module
    offers beyond the stream API is bound once here, as attributes a step calls directly (None where the module
    lacks it): ``run_op``, ``peek_errors``, ``take_errors``, ``is_capturing``."""

    def __init__(self, name: str, device_module: ModuleType, device: Any = None) -> None:
        for attr in ("Stream", "Event", "stream", "current_stream", "set_stream"):
            if not hasattr(device_module, attr):
                raise BackendUnavailable(f"{device_module.__name__} has no {attr}")
        self.name = name
        self.mod = device_module
        self.device = device
        #: The pooled events, by key: a wait captures the most recent record at the time it is enqueued.
        self.events: dict[EventKey, Any] = {}
        #: Free (start, end) timing-event pairs of adaptive engage's step timer.
        self.timing_events: list[tuple[Any, Any]] = []
        #: Free replay-end markers (the replay watch).
        self._markers: list[Any] = []
        #: Streams this backend made (closed with it where they can be).
        self._made: list[Any] = []
        caps = self.capabilities = DeviceCapabilities.of(device_module)
        #: ``run_op(fn, label) -> OpHandle``: run a connector op as work of the current stream.
        self.run_op: Callable[[Callable[[], Any], str], OpHandle] = caps.tracked or run_on_host
        #: The asynchronous errors kernels of the given streams hit, read (``peek_errors``) or taken (emulated
        #: device; a real device reports them at its next synchronize).
        self.peek_errors = caps.peek_errors
        self.take_errors = caps.take_errors
        #: Whether the current stream is capturing a graph.
        self.is_capturing: Callable[[], bool] = getattr(device_module, "is_current_stream_capturing", _never)
        self._log_saved: list[Any] = []

    def compute_stream(self) -> Any:
        """The caller's current stream, named C (torch.cuda's is a new object at each call; the emulated device's is
        named once)."""
        stream = self.mod.current_stream()
        if getattr(stream, "name", None) != COMPUTE_STREAM:
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
        """Run ``fn`` as an op of ``stream`` (in its scope)."""
        with self.mod.stream(stream):
            return self.run_op(fn, label)

    def event(self, key: EventKey) -> Any:
        """The pooled event of ``key``, made on first use (a graph capture makes none: :meth:`reserve` first)."""
        event = self.events.get(key)
        if event is None:
            event = self.events[key] = self.mod.Event()
            _name(event, key, "key")
        return event

    def reserve(self, keys: Any) -> None:
        """Make the pooled events of ``keys`` now (before a graph capture, inside which none is made)."""
        for key in keys:
            self.event(key)

    def timing_pair(self) -> tuple[Any, Any]:
        """A new (start, end) pair of timing events (the pool, :attr:`timing_events`, holds the free ones)."""
        return self.mod.Event(enable_timing=True), self.mod.Event(enable_timing=True)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    # -- the stream log (the emulated device) ------------------------------
    def start_log(self) -> bool:
        """Log what the streams perform for work this thread enqueues (emulated device only): the edge checker's
        evidence."""
        caps = self.capabilities
        if caps.new_log is None or caps.set_log is None:
            return False
        self._log_saved.append(caps.set_log(caps.new_log()))
        return True

    def stop_log(self) -> Any:
        """Stop logging; returns the log, which the streams go on filling with the work already queued (read it after
        a synchronize)."""
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

    # -- the replay watch's markers ----------------------------------------
    def end_marker(self) -> Any:
        marker = self._markers.pop() if self._markers else self.mod.Event()
        marker.record(self.mod.current_stream())
        return marker

    def release_marker(self, marker: Any) -> None:
        self._markers.append(marker)


def run_on_host(fn: Callable[[], Any], label: str) -> OpHandle:
    """Run an op on the host now (a device backend's op only enqueues kernels: its handle is done at once)."""
    t0 = time.perf_counter_ns()
    try:
        value = fn()
    except BaseException as exc:  # noqa: BLE001 - handed back
        return DoneHandle(None, exc, t0, time.perf_counter_ns())
    return DoneHandle(value, None, t0, time.perf_counter_ns())


def _never() -> bool:
    return False


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
        #: How many captures are in progress (read without the lock: a capture in progress is truthy).
        self.captures = 0

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """The block is a capture: reads in progress finish first, and none starts until the block has ended."""
        with self._lock:
            self.captures += 1
        try:
            yield
        finally:
            with self._lock:
                self.captures -= 1

    def read(self, fn: Callable[[], T]) -> T | None:
        """``fn()`` (an event query, or a read built on one), unless a capture is in progress: then None, at once."""
        if self.captures:
            return None
        with self._lock:
            if self.captures:
                return None
            return fn()


#: The process's guard: a capture on any runner stops every runner's reads.
GUARD = CaptureGuard()
