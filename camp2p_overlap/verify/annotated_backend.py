"""Profiler ranges around what a step session issues: every connector op,
event record and wait of a step goes inside a ``camp2p:`` profiler range. The
bench's ``--profile-trace`` step uses it, and ``profiler_timeline.py`` reads
the ranges back from the profiler's trace (:func:`parse_event_range`).

The ranges are opened by a subclass of the step session, on its own seams
(``_submit``, ``_record``, ``wait_event``), not by the stream backend: the
session drives streams and events through the device module's API.
:func:`annotating` puts such a subclass, of whatever session class a runtime
holds, on that runtime for the steps run inside it, and the previous class
back after.

It lives outside core, which never imports it (an import contract in
``pyproject.toml``): the patch layer's session carries no annotation, so a
step pays nothing for it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from camp2p_overlap.core.keys import EventKey
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.core.overlap.streams.base import OpHandle

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


class AnnotatingSession(StepSession):
    """A step session whose every op (:meth:`_submit`), record (:meth:`_record`)
    and wait (:meth:`wait_event`) runs inside its profiler range; everything
    else is the session's own. :func:`annotated_session_class` puts it in
    front of any session class."""

    def _submit(
        self, stream: Any, kind: str, layer: int | None, stage: int | None, fn: Callable[[], Any], label: str
    ) -> OpHandle:
        with profiler_range(op_range_name(label)):
            return super()._submit(stream, kind, layer, stage, fn, label)

    def _record(self, stream: Any, key: EventKey) -> None:
        with profiler_range(event_range_name("record", stream.name, key)):
            super()._record(stream, key)

    def wait_event(self, stream: Any, key: EventKey) -> None:
        with profiler_range(event_range_name("wait", stream.name, key)):
            super().wait_event(stream, key)


@functools.cache
def annotated_session_class(base: type[StepSession]) -> type[StepSession]:
    """``base`` with :class:`AnnotatingSession`'s ranges around its ops,
    records and waits (whatever ``base`` overrides runs inside them); ``base``
    itself where it annotates already. One class per ``base``."""
    if issubclass(base, AnnotatingSession):
        return base
    return type(f"Annotating{base.__name__}", (AnnotatingSession, base), {"__module__": __name__})


class SessionClassHolder(Protocol):
    """What holds the session class steps make their sessions of (the patch
    layer's :class:`~camp2p_overlap.core.overlap.runtime.OverlapRuntime`)."""

    session_class: type[StepSession]


@contextlib.contextmanager
def annotating(runtime: SessionClassHolder) -> Iterator[type[StepSession]]:
    """Steps of ``runtime`` that start inside make annotating sessions (an
    :func:`annotated_session_class` of the session class it holds, which the
    block gets); its previous session class is back on every exit. Every
    thread's steps of ``runtime`` are annotated while inside."""
    previous = runtime.session_class
    runtime.session_class = cls = annotated_session_class(previous)
    try:
        yield cls
    finally:
        runtime.session_class = previous
