"""A stream backend whose every op, record and wait is issued inside a
``camp2p:`` profiler range, around the patch layer's own backend: the bench's
``--profile-trace`` step uses it, and ``profiler_timeline.py`` reads the
ranges back from the profiler's trace (:func:`parse_event_range`).

It lives outside core, which never imports it (an import contract in
``pyproject.toml``): the patch layer's backend carries no annotation and no op
timing, so a step pays nothing for them. :func:`annotating` puts the
wrapper on a runner's :class:`~camp2p_overlap.core.overlap.streams.streamset.StreamSet`
for the steps run inside it, and takes it off again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from camp2p_overlap.core.keys import EventKey
from camp2p_overlap.core.overlap.streams.backend import StreamBackend
from camp2p_overlap.core.overlap.streams.base import OpHandle
from camp2p_overlap.core.overlap.streams.streamset import StreamSet

#: The prefix of every profiler range the patch layer's tools open.
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


@contextlib.contextmanager
def profiler_range(name: str) -> Iterator[None]:
    """A host range in a profiler trace (``torch.profiler.record_function``)."""
    from torch.profiler import record_function

    with record_function(name):
        yield


class AnnotatedBackend:
    """``inner`` (a :class:`StreamBackend`), with :meth:`submit`,
    :meth:`record` and :meth:`wait` each inside its profiler range;
    everything else is ``inner``'s own."""

    def __init__(self, inner: StreamBackend) -> None:
        self.inner = inner
        #: id(event) -> the key it was recorded under (a wait names it).
        self._keys: dict[int, EventKey] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit(self, stream: Any, fn: Callable[[], Any], label: str = "op") -> OpHandle:
        with profiler_range(op_range_name(label)):
            return self.inner.submit(stream, fn, label)

    def submit_here(self, stream: Any, fn: Callable[[], Any], label: str = "op") -> OpHandle:
        with profiler_range(op_range_name(label)):
            return self.inner.submit_here(stream, fn, label)

    def record(self, stream: Any, key: EventKey) -> Any:
        with profiler_range(event_range_name("record", _stream_name(stream), key)):
            event = self.inner.record(stream, key)
        self._keys[id(event)] = key
        return event

    def wait(self, stream: Any, event: Any) -> None:
        with profiler_range(event_range_name("wait", _stream_name(stream), self._keys.get(id(event)))):
            self.inner.wait(stream, event)


@contextlib.contextmanager
def annotating(streamset: StreamSet) -> Iterator[AnnotatedBackend]:
    """Steps on ``streamset`` run on an :class:`AnnotatedBackend` around its
    backend while inside; its own backend is back on every exit."""
    inner = streamset.backend
    wrapper = AnnotatedBackend(inner)
    streamset.backend = wrapper  # type: ignore[assignment]
    try:
        yield wrapper
    finally:
        streamset.backend = inner


def _stream_name(stream: Any) -> str:
    return str(getattr(stream, "name", "?"))
