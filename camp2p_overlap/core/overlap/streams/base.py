"""What the stream backend shares with the devices it drives: the device module protocol and its optional
capabilities, op handles, and the errors.

A *stream* runs work in the order it was submitted. An *event* is recorded on a stream and completes when the stream
reaches it; another stream can be made to wait on it. The compute stream
(:data:`~camp2p_overlap.core.keys.COMPUTE_STREAM`) is the caller's current stream.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol


class BackendUnavailable(RuntimeError):
    """No stream backend can serve this runner (a device module missing, no device, a backend asked for that does not
    fit the runner's device); the message says why. Every backend raises this one type."""


class StreamPoisonedError(RuntimeError):
    """An op skipped because an earlier op on the same side stream failed (the stream stays poisoned until the next
    step begins). Every backend reports skipped work with this one type."""


class Stream(Protocol):
    name: str


class DeviceModule(Protocol):
    """What the backend needs of a device module: ``torch.npu``, ``torch.cuda``, or the module registered for ``cpu``.
    Streams have ``wait_event`` and ``synchronize``; events ``record``, ``query``, ``synchronize`` and
    ``elapsed_time``, as torch's do."""

    __name__: str
    Stream: Callable[..., Any]
    Event: Callable[..., Any]

    def stream(self, stream: Any) -> AbstractContextManager[Any]: ...

    def current_stream(self) -> Any: ...

    def set_stream(self, stream: Any) -> None: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class DeviceCapabilities:
    """What a device module may offer beyond :class:`DeviceModule` (only the emulated device does; on torch.npu/cuda
    every field is None), read here, never from the module itself.

    - ``tracked(fn, label) -> OpHandle``: run ``fn`` as work of the current stream, with a handle that follows the
      kernels it queues.
    - ``peek_errors(streams) -> list``, ``take_errors(streams) -> list``: the asynchronous errors kernels of
      ``streams`` hit, read or taken.
    - ``new_log() -> log``, ``set_log(log) -> previous``: the stream log, a record of what the streams perform for
      work this thread enqueues (the edge checker's evidence).
    - ``core_state() -> list[str]``: the device's vector cores now, as report lines (which kernels hold them, which
      wait for them); the stall report gives them.
    """

    tracked: Callable[[Callable[[], Any], str], OpHandle] | None = None
    peek_errors: Callable[[Sequence[Any]], list[BaseException]] | None = None
    take_errors: Callable[..., Any] | None = None
    new_log: Callable[[], Any] | None = None
    set_log: Callable[[Any], Any] | None = None
    core_state: Callable[[], list[str]] | None = None

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
            core_state=getattr(module, "core_state", None),
        )


#: A module with none of the optional capabilities.
NO_CAPABILITIES = DeviceCapabilities()


class OpHandle(abc.ABC):
    """What an op returns (``StreamBackend.run_op``): the op's Python result once it has run (on device backends at
    once: tensors the stream fills later), or its exception."""

    start_ns: int | None = None
    end_ns: int | None = None
    #: Position in the backend's execution order (-1: the backend keeps none).
    order: int = -1

    @abc.abstractmethod
    def result(self) -> Any: ...

    @abc.abstractmethod
    def done(self) -> bool: ...

    def release(self) -> None:  # noqa: B027 - optional hook
        """Drop the op's result (keep its timing and done state): called once the session has handed the result on, so
        a handle kept for traces and stall reports does not keep the op's tensors alive."""


class DoneHandle(OpHandle):
    """A handle for work that already ran on the host: its ``value`` (None once released) or ``exception``."""

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
