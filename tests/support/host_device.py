"""A host stand-in of a torch device module (``torch.cuda``'s stream/event
shape) whose work runs on the host when enqueued, and whose events carry
the host time (``time.perf_counter_ns``) they were recorded at: the device
world and the device backend run on it without a GPU, with real times in
their traces. Because work runs at enqueue, the host issue order must itself
be a legal protocol order (as on one in-order device queue)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from camp2p_overlap.core.overlap import decision as step_decision
from camp2p_overlap.core.overlap.streams import TorchDeviceBackend, streamset


class HostDevice:
    def __init__(self) -> None:
        self.__name__ = "hostdev"
        self.waits: list[tuple[str, int]] = []
        dev = self

        class Stream:
            def __init__(self, device: Any = None) -> None:
                self.name = "?"

            def wait_event(self, event: Any) -> None:
                assert event.t is not None, "wait on an event that was never recorded"
                dev.waits.append((self.name, event.t))

            def synchronize(self) -> None:
                pass

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t: int | None = None

            def record(self, stream: Any = None) -> None:
                self.t = time.perf_counter_ns()

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, end: Any) -> float:
                return (end.t - self.t) / 1e6  # ms, as torch.cuda.Event

        self.Stream = Stream
        self.Event = Event
        self.current: list[Any] = [Stream()]

    def current_stream(self) -> Any:
        return self.current[-1]

    def current_device(self) -> int:
        return 0

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        self.current.append(s)
        try:
            yield
        finally:
            self.current.pop()

    def is_current_stream_capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


def use_host_device(monkeypatch: pytest.MonkeyPatch, dev: HostDevice) -> None:
    """Make the patch layer's stream sets use ``dev`` through the shared
    device backend, whatever backend the configuration names."""
    monkeypatch.setattr(step_decision, "resolve_backend_name", lambda requested, device: "hostdev")
    monkeypatch.setattr(streamset, "make_backend", lambda name, device=None: TorchDeviceBackend("hostdev", dev))
