"""The CPU backend: each side stream is a worker thread with a FIFO of work,
the calling thread is the compute stream, and events are flags a stream sets
when it reaches them.

Torch CPU ops and sleeps release the GIL, so side-stream work really runs
concurrently with the compute thread. Like a device stream, a side stream
whose op failed becomes *poisoned*: later ops submitted to it are skipped
(their handles carry :class:`StreamPoisonedError`) while its event records
and waits still complete, so nothing downstream hangs on it. The poison is
cleared when the next step begins.

Asynchrony as on a device: an op may :func:`launch` *kernels* (the part of
the work that fills its outputs). On a side stream the op's value is handed
out as soon as the op returns (its tensors still unfilled) and the worker
runs the kernels afterwards, before the stream's next item; on the compute
stream (the host) a kernel runs at once. A consumer that skipped its event
wait therefore reads a buffer the kernel has not filled yet.

What the streams did is logged while a log is open (:meth:`CpuBackend.start_log`):
every event a stream recorded (when it fired) and every wait a stream
performed (on which event, when it began and when it was satisfied), in
execution order; the edge checker reads this instead of the session's own
record of its waits.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core.keys import COMPUTE_STREAM, EventKey
from camp2p_overlap.core.overlap.streams.base import DoneHandle, OpHandle, Stream, StreamBackend, StreamPoisonedError

#: Execution order across every stream of every CPU backend: taken when a
#: stream starts an item (an op, a record, a wait). ``next()`` on a count is
#: atomic under the GIL.
_order = itertools.count()

_launching = threading.local()


def launch(kernel: Callable[[], None]) -> None:
    """Queue ``kernel`` as device-like work of the op now running: on a side
    stream it runs after the op has handed out its value and before the
    stream's next item (a failure poisons the stream, as the op's own would);
    on the compute stream, or outside any backend, it runs now."""
    pending = getattr(_launching, "kernels", None)
    if pending is None:
        kernel()
    else:
        pending.append(kernel)


@dataclass(frozen=True, slots=True)
class StreamLogEntry:
    """One record or wait a stream performed, as the stream performed it."""

    stream: str
    kind: str  # "record" | "wait"
    key: EventKey
    #: The event's identity (:attr:`CpuEvent.seq`): a wait binds to the record
    #: of this very event, not to a name.
    event: int
    #: Position in execution order (:data:`_order`).
    order: int
    #: record: when the event fired (start == end); wait: when the stream began
    #: waiting and when the event let it go.
    start_ns: int
    end_ns: int


class CpuEvent:
    __slots__ = ("_flag", "key", "seq", "stream_name")
    _counter = itertools.count()

    def __init__(self, key: EventKey, stream_name: str) -> None:
        self.key = key
        self.stream_name = stream_name
        self._flag = threading.Event()
        self.seq = next(CpuEvent._counter)

    def set(self) -> None:
        self._flag.set()

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self, timeout: float | None = None) -> bool:
        return self._flag.wait(timeout)

    def __repr__(self) -> str:
        state = "done" if self.query() else "pending"
        return f"CpuEvent({self.key.label()} on {self.stream_name}, {state})"


class CpuHandle(OpHandle):
    """A side-stream op: its value is out once the op has returned (its
    launched kernels may still be filling it); ``done()`` once the kernels
    have run too. ``end_ns`` is when the kernels finished."""

    __slots__ = ("_done", "_exc", "_out", "_value", "end_ns", "order", "start_ns")

    def __init__(self) -> None:
        self._out = threading.Event()
        self._done = threading.Event()
        self._value: Any = None
        self._exc: BaseException | None = None
        self.start_ns: int | None = None
        self.end_ns: int | None = None
        self.order = -1

    def _publish(self, value: Any) -> None:
        self._value = value
        self._out.set()

    def _finish(self, value: Any = None, exc: BaseException | None = None) -> None:
        if not self._out.is_set():
            self._value = value
        self._exc = exc
        self._out.set()
        self._done.set()

    def result(self) -> Any:
        """The op's value as soon as the op returned (not waiting for its
        kernels: order after them with an event, as on a device), or the
        op's error, or its kernels' error if they already failed."""
        self._out.wait()
        if self._exc is not None:
            raise self._exc
        return self._value

    def exception(self) -> BaseException | None:
        self._done.wait()
        return self._exc

    def done(self) -> bool:
        return self._done.is_set()

    def release(self) -> None:
        self._value = None


class HostStream:
    """The compute stream: whatever thread calls into the session."""

    def __init__(self) -> None:
        self.name = COMPUTE_STREAM

    def __repr__(self) -> str:
        return f"HostStream({self.name})"


_STOP = object()


class WorkerStream:
    """A side stream: one daemon thread draining a FIFO."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.errors: list[BaseException] = []
        self.poisoned: BaseException | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        #: What the worker is doing now (see :attr:`current`): an op's label,
        #: or the event it waits on (named only when asked: no text per wait).
        self._doing: str | CpuEvent | None = None
        #: Where records and waits performed are logged (None: not logging).
        self.log: list[StreamLogEntry] | None = None
        #: Kernels launched by the op now running (this thread's launch() target).
        self._kernels: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name=f"camp2p-overlap-stream-{name}", daemon=True)
        self._thread.start()

    # -- producer side -------------------------------------------------
    def put(self, item: tuple[Any, ...]) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put(item)

    def drain(self, timeout: float | None = None) -> bool:
        """Block until every item submitted so far has been processed."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stop(self, timeout: float | None = 5.0) -> bool:
        self._queue.put((_STOP,))
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread:
        """The worker thread that runs this stream's work, in FIFO order."""
        return self._thread

    @property
    def current(self) -> str | None:
        """What the worker is doing now: an op's label, ``wait <event label>``,
        or None when idle (diagnostics: read from any thread)."""
        doing = self._doing
        if doing is None or isinstance(doing, str):
            return doing
        key = getattr(doing, "key", None)
        return f"wait {key.label()}" if isinstance(key, EventKey) else "wait"

    # -- worker side ---------------------------------------------------
    def _run(self) -> None:
        _launching.kernels = self._kernels
        while True:
            item = self._queue.get()
            kind = item[0]
            if kind is _STOP:
                return
            try:
                if kind == "run":
                    self._do_run(*item[1:])
                elif kind == "record":
                    _fire(item[1], self.name, self.log)
                elif kind == "wait":
                    self._doing = item[1]
                    _perform_wait(item[1], self.name, self.log)
            finally:
                # Drop the item (its closure holds the op's arguments) before
                # blocking on the next one.
                del item
                self._doing = None
                with self._idle:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.notify_all()

    def _do_run(self, handle: CpuHandle, label: str, fn: Callable[[], Any]) -> None:
        if self.poisoned is not None:
            handle._finish(
                exc=StreamPoisonedError(
                    f"{label} skipped on stream {self.name}: an earlier op failed "
                    f"({type(self.poisoned).__name__}: {self.poisoned})"
                )
            )
            return
        self._doing = label
        handle.order = next(_order)
        handle.start_ns = time.perf_counter_ns()
        kernels = self._kernels  # what fn() launches (see launch())
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            kernels.clear()
            return self._failed(handle, exc)
        handle._publish(value)  # out now; its kernels fill it below
        if kernels:
            try:
                self._doing = f"{label} (kernel)"
                for kernel in kernels:
                    kernel()
            except BaseException as exc:  # noqa: BLE001 - an asynchronous error, as on a device
                return self._failed(handle, exc)
            finally:
                kernels.clear()
        handle.end_ns = time.perf_counter_ns()
        handle._finish(value=value)

    def _failed(self, handle: CpuHandle, exc: BaseException) -> None:
        handle.end_ns = time.perf_counter_ns()
        self.poisoned = exc
        self.errors.append(exc)
        handle._finish(exc=exc)

    def __repr__(self) -> str:
        return f"WorkerStream({self.name})"


def _fire(event: CpuEvent, stream: str, log: list[StreamLogEntry] | None) -> None:
    if log is not None:  # logged before the event lets anyone go
        now = time.perf_counter_ns()
        log.append(StreamLogEntry(stream, "record", event.key, event.seq, next(_order), now, now))
    event.set()


def _perform_wait(event: CpuEvent, stream: str, log: list[StreamLogEntry] | None) -> None:
    if log is None:
        event.synchronize()
        return
    order, t0 = next(_order), time.perf_counter_ns()
    event.synchronize()
    log.append(StreamLogEntry(stream, "wait", event.key, event.seq, order, t0, time.perf_counter_ns()))


class CpuBackend(StreamBackend):
    name = "cpu"

    def __init__(self) -> None:
        self._host = HostStream()
        self._streams: list[WorkerStream] = []
        self._lock = threading.Lock()
        #: The open stream log (records and waits performed), or None.
        self._log: list[StreamLogEntry] | None = None
        #: Set by start_log, cleared by the next begin_step: a log still open
        #: at a step that did not start it is a step that never closed.
        self._log_fresh = False

    def compute_stream(self) -> HostStream:
        return self._host

    def new_stream(self, name: str) -> WorkerStream:
        stream = WorkerStream(name)
        with self._lock:
            self._streams.append(stream)
        return stream

    def submit(self, stream: Stream, fn: Callable[[], Any], label: str = "op") -> OpHandle:
        if isinstance(stream, WorkerStream):
            handle = CpuHandle()
            stream.put(("run", handle, label, fn))
            return handle
        order, start = next(_order), time.perf_counter_ns()
        try:
            value = fn()  # launched kernels run at once: the host is C
        except BaseException as exc:  # noqa: BLE001
            return DoneHandle(exc=exc, start_ns=start, end_ns=time.perf_counter_ns(), order=order)
        return DoneHandle(value, start_ns=start, end_ns=time.perf_counter_ns(), order=order)

    def record(self, stream: Stream, key: EventKey) -> CpuEvent:
        event = CpuEvent(key, stream.name)
        if isinstance(stream, WorkerStream):
            stream.put(("record", event))
        else:
            _fire(event, stream.name, self._log)
        return event

    def wait(self, stream: Stream, event: Any) -> None:
        if isinstance(stream, WorkerStream):
            stream.put(("wait", event))
        else:
            _perform_wait(event, stream.name, self._log)

    # -- what the streams did ------------------------------------------
    def start_log(self) -> bool:
        """Log every record and wait the streams perform from now on (one
        step at a time: the stream set's lock serializes steps)."""
        log: list[StreamLogEntry] = []
        with self._lock:
            self._log = log
            self._log_fresh = True
            for s in self._streams:
                s.log = log
        return True

    def stop_log(self) -> list[StreamLogEntry]:
        """Close the log and return it, in execution order. Call once the
        streams are joined (everything they performed is in)."""
        with self._lock:
            log, self._log = self._log, None
            for s in self._streams:
                s.log = None
        return sorted(log or [], key=lambda e: e.order)

    def is_capturing(self) -> bool:
        return False

    def begin_step(self, streams: list[Stream]) -> None:
        if self._log is not None and not self._log_fresh:
            self.stop_log()  # left open by a step that never closed: stop it growing
        self._log_fresh = False
        for s in streams:
            if isinstance(s, WorkerStream):
                s.poisoned = None
                s.errors.clear()

    def step_errors(self, streams: list[Stream]) -> list[BaseException]:
        return [e for s in streams if isinstance(s, WorkerStream) for e in s.errors]

    def synchronize(self, stream: Stream) -> None:
        if isinstance(stream, WorkerStream):
            stream.drain()

    def close(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, []
        for s in streams:
            s.stop()
