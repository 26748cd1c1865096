"""The small stream/event interface the overlap session is written against.

A *stream* runs work in the order it was submitted. An *event* is recorded
on a stream and completes when the stream reaches it; another stream can be
made to wait on it. The compute stream (:data:`~camp2p_overlap.core.keys.COMPUTE_STREAM`)
is the caller's current stream.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from camp2p_overlap.core.keys import EventKey


class BackendUnavailable(RuntimeError):
    """No stream backend can serve this runner (a device module missing, no
    device, a backend asked for that does not fit the runner's device); the
    message says why. Every backend raises this one type."""


class StreamPoisonedError(RuntimeError):
    """An op skipped because an earlier op on the same side stream failed
    (the stream stays poisoned until the next step begins). Every backend
    reports skipped work with this one type."""


class Stream(Protocol):
    name: str


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceModule(Protocol):
    """What the device backend needs of a device module: ``torch.npu``,
    ``torch.cuda``, or the module registered for the ``cpu`` backend
    (:func:`~camp2p_overlap.core.overlap.streams.register_device_module`;
    the emulated device registers itself). Streams have ``wait_event`` and
    ``synchronize``; events ``record``, ``query``, ``synchronize`` and
    ``elapsed_time``, as torch's do."""

    __name__: str
    Stream: Callable[..., Any]
    Event: Callable[..., Any]

    def stream(self, stream: Any) -> AbstractContextManager[Any]: ...

    def current_stream(self) -> Any: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class DeviceCapabilities:
    """What a device module may offer beyond :class:`DeviceModule` (only
    the emulated device does: ``torch.npu`` and ``torch.cuda`` offer none,
    and every field is then None). The backend, the edge checker and the
    serial path's trace read them here, never from the module itself.

    - ``tracked(fn, label) -> OpHandle``: run ``fn`` as work of the current
      stream, with a handle that follows the kernels it queues (kernel
      tracking).
    - ``peek_errors(streams) -> list``, ``take_errors(streams) -> list``:
      the asynchronous errors kernels of ``streams`` hit, read or taken.
    - ``new_log() -> log``, ``set_log(log) -> previous``: the stream log, a
      record of what the streams perform for work this thread enqueues
      (the edge checker's evidence).
    """

    tracked: Callable[[Callable[[], Any], str], OpHandle] | None = None
    peek_errors: Callable[[Sequence[Any]], list[BaseException]] | None = None
    take_errors: Callable[..., Any] | None = None
    new_log: Callable[[], Any] | None = None
    set_log: Callable[[Any], Any] | None = None

    @classmethod
    def of(cls, module: ModuleType | Any) -> DeviceCapabilities:
        """The capabilities ``module`` offers (a log needs both of its parts)."""
        new_log, set_log = getattr(module, "StreamLog", None), getattr(module, "set_log", None)
        logs = new_log is not None and set_log is not None
        return cls(
            tracked=getattr(module, "tracked", None),
            peek_errors=getattr(module, "peek_errors", None),
            take_errors=getattr(module, "take_errors", None),
            new_log=new_log if logs else None,
            set_log=set_log if logs else None,
        )


#: A module with none of the optional capabilities.
NO_CAPABILITIES = DeviceCapabilities()


class OpHandle(abc.ABC):
    """What :meth:`StreamBackend.submit` returns: the op's Python result once
    it has run (on device backends at once: the result holds tensors the
    stream fills later), or its exception."""

    start_ns: int | None = None
    end_ns: int | None = None
    #: Position in the backend's execution order (-1: the backend keeps none).
    order: int = -1

    @abc.abstractmethod
    def result(self) -> Any: ...

    @abc.abstractmethod
    def done(self) -> bool: ...

    def release(self) -> None:  # noqa: B027 - optional hook
        """Drop the op's result (keep its timing and done state): called once
        the session has handed the result on, so a handle kept for traces and
        stall reports does not keep the op's tensors alive."""


class DoneHandle(OpHandle):
    """A handle for work that already ran on the host: its ``value`` (None
    once released) or ``exception``."""

    __slots__ = ("end_ns", "exception", "order", "start_ns", "value")

    def __init__(
        self,
        value: Any = None,
        exc: BaseException | None = None,
        start_ns: int | None = None,
        end_ns: int | None = None,
        order: int = -1,
    ) -> None:
        self.value = value
        self.exception = exc
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.order = order

    def result(self) -> Any:
        if self.exception is not None:
            raise self.exception
        return self.value

    def done(self) -> bool:
        return True

    def release(self) -> None:
        self.value = None


class StreamBackend(abc.ABC):
    """One implementation per device kind (``cpu``, ``cuda``, ``npu``)."""

    name: str

    @abc.abstractmethod
    def compute_stream(self) -> Stream:
        """The caller's current stream (C)."""

    @abc.abstractmethod
    def new_stream(self, name: str) -> Stream:
        """A new side stream. Called outside graph capture and reused."""

    @abc.abstractmethod
    def submit(self, stream: Stream, fn: Callable[[], Any], label: str = "op") -> OpHandle:
        """Run ``fn()`` as work of ``stream``; ``label`` names it in traces
        and stall reports."""

    def scope(self, stream: Stream) -> AbstractContextManager[Any]:
        """``stream`` made current for the block, for :meth:`submit_here`:
        several ops of one stream issued in a row switch to it once. Here:
        nothing (:meth:`submit_here` is :meth:`submit`)."""
        return contextlib.nullcontext()

    def submit_here(self, stream: Stream, fn: Callable[[], Any], label: str = "op") -> OpHandle:
        """:meth:`submit` from inside :meth:`scope` of ``stream`` (the same
        op, without switching to the stream again)."""
        return self.submit(stream, fn, label)

    @abc.abstractmethod
    def record(self, stream: Stream, key: EventKey) -> Event:
        """Record an event on ``stream``. ``key`` names it, so device
        backends can reuse one event object per key."""

    @abc.abstractmethod
    def wait(self, stream: Stream, event: Event) -> None:
        """Make ``stream`` wait for ``event`` (never blocks the host on
        device backends; on the CPU backend ``C`` is the host)."""

    @abc.abstractmethod
    def is_capturing(self) -> bool:
        """Whether the current stream is capturing a graph."""

    def begin_step(self, streams: list[Stream]) -> None:  # noqa: B027 - optional hook
        """Called when a session opens (CPU: clear sticky errors)."""

    def step_errors(self, streams: list[Stream]) -> list[BaseException]:
        """Errors raised by side-stream work during the step, in order."""
        return []

    #: False only where :meth:`step_errors` is always empty and
    #: :meth:`begin_step` does nothing (a session then calls neither).
    reports_step_errors: bool = True

    def synchronize(self, stream: Stream) -> None:  # noqa: B027 - optional hook
        """Block the host until ``stream`` has finished its work (diagnostics,
        tests, the benchmark; the session itself never calls it)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release threads or other resources held by streams."""

    # -- what the streams did (traces) ------------------------------------
    def start_log(self) -> bool:
        """Start logging the records and waits the streams perform; False
        when this backend cannot (device backends: the host only enqueues
        them; their device truth comes from the profiler)."""
        return False

    def stop_log(self) -> list[Any]:
        """The records and waits performed since :meth:`start_log`
        (``StreamLogEntry`` of the CPU backend), in execution order."""
        return []

    # -- the step timer of adaptive engage: never blocks the host -----------
    def step_timer_start(self) -> Any:
        """Start timing a step on the compute stream; returns a token.
        Here: the host clock (a backend whose compute stream is the host)."""
        return [time.perf_counter(), None]

    def step_timer_stop(self, token: Any) -> None:
        """The step's work has been issued (and, here, joined)."""
        token[1] = time.perf_counter()

    def step_timer_elapsed_s(self, token: Any) -> float | None:
        """The step's time in seconds once known, else None (ask again later)."""
        return None if token[1] is None else token[1] - token[0]

    def end_marker(self) -> Any:
        """An event recorded on the compute stream now, from a pool of its
        own (a replay's end, followed by the replay watch), or None where
        the backend has none. Never called inside a capture."""
        return None

    def release_marker(self, marker: Any) -> None:  # noqa: B027 - optional hook
        """Give back an :meth:`end_marker` seen complete."""

    def step_timer_discard(self, token: Any) -> None:  # noqa: B027 - optional hook
        """A step timer that will not be read (its step raised, or it was
        dropped unread): its resources go back (device backends: the
        pooled event pair)."""
