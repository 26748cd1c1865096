"""Device backends over a torch device module: ``torch.npu`` (torch_npu)
and ``torch.cuda`` share the stream/event API shape, so one class serves both.

Events are pooled by :class:`~camp2p_overlap.core.keys.EventKey` and reused
across steps: a wait captures the most recent record at the time it is
enqueued, and the pool keeps graph capture from creating events step after
step.

While :attr:`TorchDeviceBackend.annotate` is on, every op, record and wait
is issued inside a profiler range named ``camp2p:...`` (:func:`op_range_name`,
:func:`event_range_name`: what ``verify/device_timeline.py`` reads back from
a profiler trace with :func:`parse_event_range`); off, the methods are the
plain ones (no per-op cost).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from camp2p_overlap.core.keys import COMPUTE_STREAM, EventKey
from camp2p_overlap.core.overlap.streams.base import (
    BackendUnavailable,
    DeviceCapabilities,
    DoneHandle,
    OpHandle,
    StreamBackend,
)

#: The prefix of every profiler range the layer and its tools open.
RANGE_PREFIX = "camp2p:"
#: What a stream does inside an event range.
EVENT_ACTIONS = ("record", "wait")


def op_range_name(label: str) -> str:
    """The range around an op (``label``: its :meth:`OpKey.label`): ``camp2p:a2e L0 s1``."""
    return f"{RANGE_PREFIX}{label}"


def event_range_name(action: str, stream_name: str, key: EventKey | None) -> str:
    """The range around a record or a wait (``action``) of ``key`` on a stream:
    ``camp2p:record C f L0 s1``; ``?`` for an event not recorded here."""
    return f"{RANGE_PREFIX}{action} {stream_name} {key.label() if key is not None else '?'}"


def parse_event_range(name: str) -> tuple[str, str, EventKey] | None:
    """``(action, stream name, key)`` of a range :func:`event_range_name`
    named (with or without its prefix), or None."""
    if name.startswith(RANGE_PREFIX):
        name = name[len(RANGE_PREFIX) :]
    parts = name.split(" ", 2)
    if len(parts) != 3 or parts[0] not in EVENT_ACTIONS:
        return None
    key = EventKey.parse(parts[2])
    return None if key is None else (parts[0], parts[1], key)


class TorchDeviceBackend(StreamBackend):
    def __init__(self, name: str, device_module: ModuleType, device: Any = None) -> None:
        for attr in ("Stream", "Event", "stream", "current_stream"):
            if not hasattr(device_module, attr):
                raise BackendUnavailable(f"{device_module.__name__} has no {attr}")
        self.name = name
        self.mod = device_module
        self.device = device
        self._events: dict[EventKey, Any] = {}
        #: id(event) -> its key (events are pooled per key), for annotations.
        self._keys: dict[int, EventKey] = {}
        self._annotate = False
        #: When set, ops are bracketed with timing events for traces.
        self.timing = False
        self._timed: list[tuple[DoneHandle, Any, Any]] = []
        #: Free (start, end) timing-event pairs for step timing.
        self._step_events: list[tuple[Any, Any]] = []
        #: Free replay-end markers (the replay watch).
        self._markers: list[Any] = []
        self._origin: Any = None
        #: Streams this backend made (closed with it where they can be).
        self._made: list[Any] = []
        #: What the module offers beyond the stream API (the emulated
        #: device only; none on torch.npu/cuda): op handles that follow
        #: their kernels, asynchronous errors per stream, the stream log.
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
        if self.timing:
            return self._timed_submit(stream, fn)
        if self._tracked is not None:
            with self.mod.stream(stream):
                return self._tracked(fn, label)
        clock = time.perf_counter_ns
        with self.mod.stream(stream):
            t0 = clock()
            try:
                value = fn()
            except BaseException as exc:  # noqa: BLE001 - handed back
                return DoneHandle(None, exc, t0, clock())
        return DoneHandle(value, None, t0, clock())

    def _timed_submit(self, stream: Any, fn: Callable[[], Any]) -> OpHandle:
        """:meth:`submit` bracketed with timing events (traces)."""
        with self.mod.stream(stream):
            start_ev = self.mod.Event(enable_timing=True)
            start_ev.record(stream)
            t0 = time.perf_counter_ns()
            try:
                value = fn()
            except BaseException as exc:  # noqa: BLE001 - handed back
                return DoneHandle(exc=exc, start_ns=t0, end_ns=time.perf_counter_ns())
            end_ev = self.mod.Event(enable_timing=True)
            end_ev.record(stream)
        handle = DoneHandle(value, start_ns=t0, end_ns=time.perf_counter_ns())
        self._timed.append((handle, start_ev, end_ev))
        return handle

    def record(self, stream: Any, key: EventKey) -> Any:
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = self.mod.Event()
            self._keys[id(event)] = key
            _name(event, key, "key")
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def reserve(self, keys: Any) -> int:
        """Make the pooled events of ``keys`` now (before a graph capture,
        inside which the layer creates none); returns how many were new."""
        made = 0
        for key in keys:
            if key not in self._events:
                event = self._events[key] = self.mod.Event()
                self._keys[id(event)] = key
                _name(event, key, "key")
                made += 1
        return made

    # -- profiler annotations ------------------------------------------
    @property
    def annotate(self) -> bool:
        """Issue ops, records and waits inside ``camp2p:`` profiler ranges."""
        return self._annotate

    @annotate.setter
    def annotate(self, on: bool) -> None:
        self._annotate = bool(on)
        if on:
            self.submit = self._annotated_submit  # type: ignore[method-assign]
            self.record = self._annotated_record  # type: ignore[method-assign]
            self.wait = self._annotated_wait  # type: ignore[method-assign]
        else:
            for name in ("submit", "record", "wait"):
                self.__dict__.pop(name, None)

    def _annotated_submit(self, stream: Any, fn: Callable[[], Any], label: str = "op") -> OpHandle:
        with profiler_range(op_range_name(label)):
            return TorchDeviceBackend.submit(self, stream, fn, label)

    def _annotated_record(self, stream: Any, key: EventKey) -> Any:
        with profiler_range(event_range_name("record", _stream_name(stream), key)):
            return TorchDeviceBackend.record(self, stream, key)

    def _annotated_wait(self, stream: Any, event: Any) -> None:
        key = self._keys.get(id(event))
        with profiler_range(event_range_name("wait", _stream_name(stream), key)):
            TorchDeviceBackend.wait(self, stream, event)

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
        """Stop the worker threads of the streams this backend made (the
        emulated device's; device streams have nothing to close)."""
        made, self._made = self._made, []
        for stream in made:
            close = getattr(stream, "close", None)
            if callable(close):
                close()

    # -- step timing for adaptive engage ---------------------------------
    def timing_start(self) -> Any:
        """Record a timing event on the compute stream (pooled events)."""
        start, end = self._step_events.pop() if self._step_events else self._new_timing_pair()
        start.record(self.mod.current_stream())
        return (start, end)

    def timing_stop(self, token: Any) -> None:
        token[1].record(self.mod.current_stream())

    def elapsed(self, token: Any) -> float | None:
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

    def timing_discard(self, token: Any) -> None:
        """Put a timing's event pair back in the pool unread (re-recording
        an event that has not completed is allowed: it then stands for its
        new record)."""
        self._step_events.append(token)

    def _new_timing_pair(self) -> tuple[Any, Any]:
        return self.mod.Event(enable_timing=True), self.mod.Event(enable_timing=True)

    # -- device timing for traces ---------------------------------------
    def start_timing(self) -> None:
        """Begin bracketing ops with timing events; times are resolved by
        :meth:`resolve_timing` after a synchronize."""
        self.timing = True
        self._timed.clear()
        self._origin = self.mod.Event(enable_timing=True)
        self._origin.record(self.mod.current_stream())
        self._origin_ns = time.perf_counter_ns()

    def resolve_timing(self) -> None:
        """Rewrite each timed handle's start/end to device time (ns since
        :meth:`start_timing`, offset to the host clock at that moment)."""
        self.mod.synchronize()
        for handle, start_ev, end_ev in self._timed:
            handle.start_ns = self._origin_ns + int(self._origin.elapsed_time(start_ev) * 1e6)
            handle.end_ns = self._origin_ns + int(self._origin.elapsed_time(end_ev) * 1e6)
        self._timed.clear()
        self.timing = False


@contextlib.contextmanager
def profiler_range(name: str) -> Iterator[None]:
    """A host range in a profiler trace (``torch.profiler.record_function``)."""
    from torch.profiler import record_function

    with record_function(name):
        yield


def _stream_name(stream: Any) -> str:
    return str(getattr(stream, "name", "?"))


def _name(obj: Any, name: Any, attr: str = "name") -> None:
    try:
        setattr(obj, attr, name)
    except (AttributeError, TypeError):
        pass
