"""Things that do nothing, for timing the project's own host code alone
(``camp2p-overlap overhead``): a device module whose streams and events do
nothing (driven through the real device backend), a transport whose
receives hand back one prebuilt tensor and whose sends return at once, and
an FFN model that hands back its input.

``delay_s`` adds a busy wait to every receive: a known cost outside our
code, which the overhead harness must subtract (its test checks that)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from camp2p_overlap.core.overlap.streams.backend import StreamBackend


class NoopEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: NoopEvent) -> float:
        return 0.0


class NoopStream:
    def __init__(self, device: Any = None) -> None:
        self.device = device

    def wait_event(self, event: NoopEvent) -> None:
        return None

    def synchronize(self) -> None:
        return None


_DEFAULT = NoopStream()
#: This thread's current stream, as ``torch.cuda``'s: set by ``set_stream``, and by ``stream(s)`` for its scope.
_tls = threading.local()


def _current_stream() -> NoopStream:
    return getattr(_tls, "stream", None) or _DEFAULT


def _set_stream(stream: NoopStream | None) -> None:
    _tls.stream = stream


class _stream:  # lower case: the device modules' name
    """``with stream(s):`` makes ``s`` this thread's current stream, then the one before again."""

    __slots__ = ("previous", "s")

    def __init__(self, s: NoopStream | None) -> None:
        self.s = s
        self.previous: NoopStream | None = None

    def __enter__(self) -> NoopStream | None:
        self.previous = getattr(_tls, "stream", None)
        if self.s is not None:
            _tls.stream = self.s
        return self.s

    def __exit__(self, *exc: object) -> None:
        _tls.stream = self.previous


#: A device module with the stream/event API shape of ``torch.cuda`` and
#: ``torch.npu``, whose every call does nothing (but keep the current stream).
noop_device_module = SimpleNamespace(
    __name__="noop_device",
    Stream=NoopStream,
    Event=NoopEvent,
    stream=_stream,
    current_stream=_current_stream,
    set_stream=_set_stream,
    is_current_stream_capturing=lambda: False,
    synchronize=lambda: None,
)


def noop_backend(name: str = "cpu", device: Any = None) -> StreamBackend:
    """The real device backend over :data:`noop_device_module`."""
    return StreamBackend("noop", noop_device_module, device)  # type: ignore[arg-type]


def busy_wait(seconds: float) -> None:
    """Spin for ``seconds`` of wall time (a sleep is far too coarse for µs)."""
    if seconds <= 0:
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class NoopTransport:
    """The connector's transport: ``a2e`` hands back one prebuilt hidden
    tensor (after ``delay_s`` of busy wait), ``e2a`` returns at once."""

    def __init__(self, hidden: int = 16, tokens: int = 1, delay_s: float = 0.0) -> None:
        self.hidden_states = torch.zeros(tokens, hidden)
        self.delay_s = delay_s
        self.results: dict[tuple[int, int], torch.Tensor] = {}

    def begin_step(self, step: int, layers: Any, stages: Any) -> None:
        return None

    def a2e(self, *, group: str, stage: int, layer: int, num_tokens: int, max_num_tokens: Any) -> tuple[Any, int]:
        busy_wait(self.delay_s)
        return self.hidden_states, num_tokens

    def e2a(self, **kwargs: Any) -> None:
        return None


class NoopModel:
    """The FFN model: hands its input back."""

    def compute_ffn_output(self, *, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return hidden_states
