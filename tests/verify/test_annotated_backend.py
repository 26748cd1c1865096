"""The annotating session: every op, record and wait a step issues runs inside
its named profiler range (a wait named by its key), whatever session class the
runtime held is the base (its own overrides run inside the ranges), and that
class is the runtime's again on every exit of ``annotating``."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import pytest
from support.overlap import Schedule, apply_cpu, assert_same, run_step, serial_results, world

from camp2p_overlap.core.keys import EventKey, OpKey
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.core.patch_layer import build_patch_layer
from camp2p_overlap.verify import annotated_backend
from camp2p_overlap.verify.annotated_backend import (
    RANGE_PREFIX,
    AnnotatingSession,
    annotated_session_class,
    annotating,
    event_range_name,
    op_range_name,
    parse_event_range,
)

LAYOUTS = ("comm-side", "compute-side")


class Ranges:
    """A fake ``profiler_range``: the names opened, in order, and those open now."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.open: list[str] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.opened.append(name)
        self.open.append(name)
        try:
            yield
        finally:
            self.open.pop()


@pytest.fixture
def ranges(monkeypatch: pytest.MonkeyPatch) -> Ranges:
    fake = Ranges()
    monkeypatch.setattr(annotated_backend, "profiler_range", fake)
    return fake


def _range_of(kind: str, label: str, stream: str) -> str:
    """The range an entry of ``StepSession.log()`` is issued in."""
    if kind in ("record", "wait"):
        key = EventKey.parse(label)
        assert key is not None, label
        return event_range_name(kind, stream, key)
    return op_range_name(label)


def _spy(ranges: Ranges, sessions: list[StepSession], inside: list[tuple[str, str | None]]) -> type[StepSession]:
    """A session class of the test's own (what a runtime holds before ``annotating``): it keeps its sessions and
    notes, at each seam it overrides and when each connector op runs, the range expected and the range open."""

    def top() -> str | None:
        return ranges.open[-1] if ranges.open else None

    class Spy(StepSession):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            sessions.append(self)

        def _submit(self, stream: Any, kind: str, layer: int | None, stage: int | None, fn: Any, label: str) -> Any:
            def run() -> Any:
                inside.append((op_range_name(label), top()))
                return fn()

            return super()._submit(stream, kind, layer, stage, run, label)

        def _record(self, stream: Any, key: EventKey) -> None:
            inside.append((event_range_name("record", stream.name, key), top()))
            super()._record(stream, key)

        def wait_event(self, stream: Any, key: EventKey) -> None:
            inside.append((event_range_name("wait", stream.name, key), top()))
            super().wait_event(stream, key)

    return Spy


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_steps_ops_records_and_waits_are_issued_inside_their_ranges(ranges: Ranges, layout: str) -> None:
    """One step through a patch layer whose runtime makes annotating sessions: each entry of the session's log
    (every record, wait and op, in issue order) opened its range, and nothing else did; each ran inside its
    range; the outputs are the serial run's; the runtime's class is its own again after."""
    sched = Schedule(3, (0, 1), (8, 8), step=1)
    w = world(layers=3, stage_ids=(0, 1), tokens=8)
    patch_layer = build_patch_layer()
    (ref,) = serial_results(w, [sched], patch_layer)
    apply_cpu(patch_layer=patch_layer, layouts=(layout,))
    sessions: list[StepSession] = []
    inside: list[tuple[str, str | None]] = []
    spy = _spy(ranges, sessions, inside)
    runtime = patch_layer.runtime
    runtime.session_class = spy
    try:
        with annotating(runtime) as cls:
            assert runtime.session_class is cls
            assert issubclass(cls, AnnotatingSession) and issubclass(cls, spy)
            got = run_step(w, sched)
        assert runtime.session_class is spy
    finally:
        assert patch_layer.engine.unpatch(timeout=10)
    assert_same(got, ref)
    (session,) = sessions
    log = session.log()
    kinds = {kind for kind, _, _ in log}
    assert {"record", "wait", "a2e", "e2a"} <= kinds, kinds
    assert ranges.opened == [_range_of(*entry) for entry in log]
    assert ranges.open == []
    assert inside and all(want == seen for want, seen in inside), [x for x in inside if x[0] != x[1]]
    # Read back as the keys they were made from: a record or a wait names its key (no '?'), an op its OpKey.
    for (kind, label, stream), name in zip(log, ranges.opened, strict=True):
        if kind in ("record", "wait"):
            assert parse_event_range(name) == (kind, stream, EventKey.parse(label))
        else:
            assert parse_event_range(name) is None
            assert OpKey.parse(name.removeprefix(RANGE_PREFIX)) == OpKey.parse(label) is not None


def test_the_previous_session_class_is_back_on_every_exit(ranges: Ranges) -> None:
    class Mine(StepSession):
        pass

    runtime = types.SimpleNamespace(session_class=Mine)
    with annotating(runtime) as cls:
        assert runtime.session_class is cls is annotated_session_class(Mine)
        assert cls.__mro__[1:3] == (AnnotatingSession, Mine)
        with annotating(runtime) as again:  # nested: one annotation, not two
            assert again is cls
        assert runtime.session_class is cls
    assert runtime.session_class is Mine
    with pytest.raises(RuntimeError, match="in the step"), annotating(runtime):
        raise RuntimeError("in the step")
    assert runtime.session_class is Mine
    with pytest.raises(KeyboardInterrupt), annotating(runtime):
        raise KeyboardInterrupt
    assert runtime.session_class is Mine
    assert annotated_session_class(StepSession) is annotated_session_class(StepSession)
    assert ranges.opened == []  # no session ran
