"""The one host stand-in of a torch device module (``torch.cuda``'s
stream/event shape) of the suite: work runs on the host when enqueued (so
the host issue order must itself be a legal protocol order, as on one
in-order device queue), events carry the clock time they were last
recorded at (``time.perf_counter_ns`` by default: the device world and the
device backend run on it without a GPU, with real times in their traces;
a counter where a test wants ticks), and it counts what the patch layer asked of
it: streams and events made, waits, synchronizes, queries.
``use_host_device_module`` makes the patch layer's stream sets use it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from camp2p_overlap.core.overlap import runner_state
from camp2p_overlap.core.overlap import step as step_decision
from camp2p_overlap.core.overlap.streams import StreamBackend


class HostDeviceModule:
    def __init__(
        self, *, name: str = "hostdev", clock: Callable[[], int] = time.perf_counter_ns, tick_ms: float = 1e-6
    ) -> None:
        """``clock``: the time events record, in units of ``tick_ms``
        milliseconds (``elapsed_time`` answers in ms, as torch.cuda's)."""
        self.__name__ = name
        self.clock = clock
        self.tick_ms = tick_ms
        self.events_created = 0
        self.streams_created = 0
        #: What ``is_current_stream_capturing`` answers.
        self.capturing = False
        #: (stream name, event, the event's time) of every wait, in order.
        self.waits: list[tuple[str, Any, int]] = []
        self.syncs = 0
        self.queries = 0
        dev = self

        class Stream:
            def __init__(self, device: Any = None) -> None:
                dev.streams_created += 1
                self.name = "?"  # the backend names the streams it uses

            def wait_event(self, event: Any) -> None:
                assert event.t is not None, "wait on an event that was never recorded"
                dev.waits.append((self.name, event, event.t))

            def synchronize(self) -> None:
                dev.syncs += 1

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                dev.events_created += 1
                self.t: int | None = None

            def record(self, stream: Any = None) -> None:
                self.t = dev.clock()

            def query(self) -> bool:
                dev.queries += 1
                return True

            def synchronize(self) -> None:
                dev.syncs += 1

            def elapsed_time(self, end: Any) -> float:
                return (end.t - self.t) * dev.tick_ms

        self.Stream = Stream
        self.Event = Event
        self.current: list[Any] = [Stream()]  # the default (compute) stream

    def current_stream(self) -> Any:
        return self.current[-1]

    def current_stream_name(self) -> str:
        """The name of the stream work enqueued now runs on (``?`` unnamed)."""
        return self.current[-1].name

    def current_device(self) -> int:
        return 0

    def set_stream(self, s: Any) -> None:
        """Make ``s`` the current stream (inside a ``stream`` scope: until the scope ends, as torch's)."""
        self.current[-1] = s

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        self.current.append(s)
        try:
            yield
        finally:
            self.current.pop()

    def is_current_stream_capturing(self) -> bool:
        return self.capturing

    def now(self) -> int:
        return self.clock()

    def synchronize(self) -> None:
        self.syncs += 1


def use_host_device_module(monkeypatch: pytest.MonkeyPatch, dev: HostDeviceModule) -> None:
    """Make every layer's stream sets use ``dev`` through the shared device
    backend, whatever backend the configuration names."""
    monkeypatch.setattr(step_decision, "resolve_backend_name", lambda requested, device: dev.__name__)
    monkeypatch.setattr(runner_state, "make_backend", lambda name, device=None: StreamBackend(dev.__name__, dev))
