"""The CPU backend: each side stream is a worker thread with a FIFO of work,
the calling thread is the compute stream, and events are flags a stream sets
when it reaches them.

Torch CPU ops and sleeps release the GIL, so side-stream work really runs
concurrently with the compute thread. Like a device stream, a side stream
whose op failed becomes *poisoned*: later ops submitted to it are skipped
(their handles carry :class:`StreamPoisonedError`) while its event records
and waits still complete, so nothing downstream hangs on it. The poison is
cleared when the next step begins.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from camp2p_overlap.core.streams.base import DoneHandle, OpHandle, Stream, StreamBackend, StreamPoisonedError


class CpuEvent:
    __slots__ = ("_flag", "key", "seq", "stream_name")
    _counter = itertools.count()

    def __init__(self, key: Hashable, stream_name: str) -> None:
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
        return f"CpuEvent({self.key!r} on {self.stream_name}, {state})"


class CpuHandle(OpHandle):
    __slots__ = ("_done", "_exc", "_value", "end_ns", "start_ns")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._exc: BaseException | None = None
        self.start_ns: int | None = None
        self.end_ns: int | None = None

    def _finish(self, value: Any = None, exc: BaseException | None = None) -> None:
        self._value = value
        self._exc = exc
        self._done.set()

    def result(self) -> Any:
        self._done.wait()
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
        self.name = "C"

    def __repr__(self) -> str:
        return "HostStream(C)"


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
        self.current: str | None = None  # what the worker is doing now (watchdog)
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

    # -- worker side ---------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            kind = item[0]
            if kind is _STOP:
                return
            try:
                if kind == "run":
                    self._do_run(*item[1:])
                elif kind == "record":
                    item[1].set()
                elif kind == "wait":
                    self.current = f"wait {item[1]!r}"
                    item[1].synchronize()
            finally:
                # Drop the item (its closure holds the op's arguments) before
                # blocking on the next one.
                del item
                self.current = None
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
        self.current = label
        handle.start_ns = time.perf_counter_ns()
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            handle.end_ns = time.perf_counter_ns()
            self.poisoned = exc
            self.errors.append(exc)
            handle._finish(exc=exc)
            return
        handle.end_ns = time.perf_counter_ns()
        handle._finish(value=value)

    def __repr__(self) -> str:
        return f"WorkerStream({self.name})"


class CpuBackend(StreamBackend):
    name = "cpu"

    def __init__(self) -> None:
        self._host = HostStream()
        self._streams: list[WorkerStream] = []
        self._lock = threading.Lock()

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
        start = time.perf_counter_ns()
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001
            return DoneHandle(exc=exc, start_ns=start, end_ns=time.perf_counter_ns())
        return DoneHandle(value, start_ns=start, end_ns=time.perf_counter_ns())

    def record(self, stream: Stream, key: Hashable) -> CpuEvent:
        event = CpuEvent(key, stream.name)
        if isinstance(stream, WorkerStream):
            stream.put(("record", event))
        else:
            event.set()
        return event

    def wait(self, stream: Stream, event: Any) -> None:
        if isinstance(stream, WorkerStream):
            stream.put(("wait", event))
        else:
            event.synchronize()

    def is_capturing(self) -> bool:
        return False

    def begin_step(self, streams: list[Stream]) -> None:
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
