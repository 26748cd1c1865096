"""One path: production (no recorder, no watchdog), a trace and the
watchdog run the same code. The session's log of a production step holds
the same ops, records and waits, in the same order, as a step with a
recorder and a watchdog, and the edge checker passes on it, for every
layout (rollout mode and direction switches)."""

from __future__ import annotations

from typing import Any

import pytest
from support.overlap import Schedule, SessionSpy, apply_cpu, assert_same, run_step, serial_results, world

from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.verify import edges

pytestmark = pytest.mark.usefixtures("standin_stack")

#: (mode, A2E on a side stream, E2A on a side stream): every layout.
LAYOUTS = [
    ("overlap", True, True),
    ("overlap", False, True),
    ("overlap", True, False),
    ("reorder", True, True),
    ("parity", True, True),
]


def _one_step(
    patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, w: Any, sched: Schedule, **config: Any
) -> tuple[Any, Any]:
    apply_cpu(patch_layer=patch_layer, **config)
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer, keep=True)
    got = run_step(w, sched)
    (session,) = sessions.kept
    return got, session


@pytest.mark.parametrize(("mode", "a2e", "e2a"), LAYOUTS)
def test_production_logs_what_a_trace_and_the_watchdog_see_and_every_edge_holds(
    patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, mode: str, a2e: bool, e2a: bool
) -> None:
    w = world(layers=3, stage_ids=(0, 1, 2))
    scheds = [Schedule(3, (0, 1, 2), (8, 4, 8), step=i) for i in (1, 2)]
    refs = serial_results(w, scheds, patch_layer)
    layout = {"mode": mode, "a2e_on_side_stream": a2e, "e2a_on_side_stream": e2a}
    got, production = _one_step(patch_layer, monkeypatch, w, scheds[0], **layout)
    assert_same(got, refs[0])
    with trace.recording():
        got, watched = _one_step(patch_layer, monkeypatch, w, scheds[1], watchdog_s=30.0, **layout)
    assert_same(got, refs[1])
    assert production.log() == watched.log()
    assert any(entry[0] in ("record", "wait") for entry in production.log()) == (mode == "overlap")
    # the edge checker on the production step's own log
    rec = trace.TraceRecorder()
    production.emit_trace(rec)
    expected = production.expected_schedule() if mode == "overlap" else None
    if expected is not None:
        result = edges.check_step(rec.ops(), expected, source="session", timings=False)
        assert result.ok, str(result)
