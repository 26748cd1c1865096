"""One path: production (no recorder, no watchdog), a trace and the
watchdog run the same code. The session's log of a production step holds
the same ops, records and waits, in the same order, as a step with a
recorder and a watchdog, and the edge checker passes on it, for every
layout (compute-side, the default; comm-side, and with either direction
switched off; reorder and parity)."""

from __future__ import annotations

from typing import Any

import pytest
from support.overlap import Schedule, SessionSpy, apply_cpu, assert_same, run_step, serial_results, world

from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.overlap.plan import A2E_ONLY, COMM_SIDE, COMPUTE_SIDE, E2A_ONLY, PARITY, REORDER
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.verify import edges

pytestmark = pytest.mark.usefixtures("standin_stack")

#: Every layout: its configuration, and the layout an engaged step runs.
LAYOUTS = {
    "compute-side": ({"mode": "overlap", "layouts": ("compute-side",)}, COMPUTE_SIDE),
    "comm-side": ({"mode": "overlap", "layouts": ("comm-side",)}, COMM_SIDE),
    "comm-side A2E=0": ({"mode": "overlap", "layouts": ("comm-side",), "a2e_on_side_stream": False}, E2A_ONLY),
    "comm-side E2A=0": ({"mode": "overlap", "layouts": ("comm-side",), "e2a_on_side_stream": False}, A2E_ONLY),
    "reorder": ({"mode": "reorder"}, REORDER),
    "parity": ({"mode": "parity"}, PARITY),
}


def _one_step(
    patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, w: Any, sched: Schedule, **config: Any
) -> tuple[Any, Any]:
    apply_cpu(patch_layer=patch_layer, **config)
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer, keep=True)
    got = run_step(w, sched)
    (session,) = sessions.kept
    return got, session


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_production_logs_what_a_trace_and_the_watchdog_see_and_every_edge_holds(
    patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    config, layout = LAYOUTS[name]
    w = world(layers=3, stage_ids=(0, 1, 2))
    scheds = [Schedule(3, (0, 1, 2), (8, 4, 8), step=i) for i in (1, 2)]
    refs = serial_results(w, scheds, patch_layer)
    got, production = _one_step(patch_layer, monkeypatch, w, scheds[0], **config)
    assert_same(got, refs[0])
    with trace.recording():
        got, watched = _one_step(patch_layer, monkeypatch, w, scheds[1], watchdog_s=30.0, **config)
    assert_same(got, refs[1])
    assert production.layout is watched.layout is layout
    assert production.log() == watched.log()
    log = production.log()
    assert any(entry[0] in ("record", "wait") for entry in log) == layout.side
    # The side streams the step touched (F, or K_s of each stage), each joined by C.
    sides = {"compute-side": {"F": "join"}, "reorder": {}, "parity": {}}.get(
        name, {f"K{s}": f"join s{s}" for s in (0, 1, 2)}
    )
    assert {stream for _, _, stream in log} - {"C"} == set(sides)
    assert {
        label for kind, label, stream in log if kind == "wait" and stream == "C" and label.startswith("join")
    } == set(sides.values())
    # the edge checker on the production step's own log
    rec = trace.TraceRecorder()
    production.emit_trace(rec)
    expected = production.expected_schedule()
    assert (expected.a2e_side, expected.e2a_side, expected.ffn_side) == (
        layout.a2e_side,
        layout.e2a_side,
        layout.ffn_side,
    )
    result = edges.check_step(rec.ops(), expected, source="session", timings=False)
    assert result.ok, str(result)
