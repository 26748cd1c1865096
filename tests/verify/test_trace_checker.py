"""The edge checker: it passes real traces and fails every kind of broken
one, on either record of the step's events (the session's, the backend's).
Broken schedules run end to end are in test_missing_wait.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from support.overlap import Schedule, apply_cpu, run_step, world

from camp2p_overlap.core.keys import EventKey
from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.observe.trace import ExpectedSchedule, TraceOp
from camp2p_overlap.core.patch_layer import PatchLayer, build_patch_layer
from camp2p_overlap.verify import edges

LAYERS = (0, 1, 2)
STAGES = (0, 1)


#: Each layout of the overlap mode: (layout listed, A2E on K_s, E2A on K_s, FFN on F).
LAYOUTS = {
    "compute-side": ("compute-side", False, False, True),
    "comm-side": ("comm-side", True, True, False),
    "e2a-only": ("comm-side", False, True, False),
    "a2e-only": ("comm-side", True, False, False),
}


def _record(layout: str = "comm-side") -> tuple[list[TraceOp], ExpectedSchedule]:
    """The trace of one engaged step in ``layout``, by a patch layer of its own."""
    # A module fixture runs before the per-test state of conftest's ``_clean_state``: set its torch thread count
    # here, as the emulated device's process-wide default stream may start now and keeps the count it starts with
    # (a serial reference on it would then differ from an FFN on F in the last bits, in a later test).
    torch.set_num_threads(1)
    listed, a2e, e2a, ffn = LAYOUTS[layout]
    w = world(layers=3, stage_ids=STAGES)
    patch_layer = build_patch_layer()
    switches = {} if ffn else {"a2e_on_side_stream": a2e, "e2a_on_side_stream": e2a}
    apply_cpu(patch_layer=patch_layer, layouts=(listed,), **switches)
    try:
        with trace.recording() as rec:
            run_step(w, Schedule(3, STAGES, (8, 8), step=1))
    finally:
        assert patch_layer.engine.unpatch(timeout=10)
    (step,) = rec.steps()
    return rec.ops(step), ExpectedSchedule(LAYERS, STAGES, a2e, e2a, ffn)


@pytest.fixture(scope="module")
def good() -> tuple[list[TraceOp], ExpectedSchedule]:
    """A comm-side step: A2E and E2A on K0, K1; the FFN on C."""
    return _record("comm-side")


@pytest.fixture(scope="module")
def good_cs() -> tuple[list[TraceOp], ExpectedSchedule]:
    """A compute-side step (the default layout): A2E and E2A on C in the overlap's order; the FFN on F."""
    return _record("compute-side")


def _idx(ops: list[TraceOp], kind: str, layer: int | None = None, stage: int | None = None, detail: str = "") -> int:
    for i, o in enumerate(ops):
        if o.kind == kind and (layer is None or o.layer == layer) and (stage is None or o.stage == stage):
            if not detail or o.detail == detail:
                return i
    raise KeyError((kind, layer, stage, detail))


def _violations(ops: list[TraceOp], expected: ExpectedSchedule) -> str:
    res = edges.check_step(ops, expected)
    assert not res.ok, "the checker accepted a broken trace"
    return str(res)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_real_traces_pass_for_every_layout(layout: str) -> None:
    ops, expected = _record(layout)
    res = edges.check_step(ops, expected)
    assert res.ok, str(res)
    assert any(o.source == "backend" for o in ops)  # ... read from what the streams performed
    session = edges.check_step(ops, expected, source="session")
    assert session.ok, str(session)  # and the session's record agrees
    # The same trace is not a serial trace: the checker tells them apart.
    assert not edges.check_step(ops, ExpectedSchedule.serial(LAYERS, STAGES)).ok


def test_unknown_source_is_refused(good: Any) -> None:
    ops, expected = good
    with pytest.raises(ValueError, match="source must be auto, backend, session or device"):
        edges.check_step(ops, expected, source="host")


def test_missing_duplicated_and_unplanned_ops(good: Any) -> None:
    ops, expected = good
    broken = list(ops)
    del broken[_idx(broken, "a2e", 1, 0)]
    assert "a2e(L1,s0) ran 0 times" in _violations(broken, expected)

    broken = [*ops, ops[_idx(ops, "ffn", 2, 1)]]
    assert "ffn(L2,s1) ran 2 times" in _violations(broken, expected)

    # An A2E past the step's last layer.
    a = ops[_idx(ops, "a2e", 2, 0)]
    broken = [*ops, dataclasses.replace(a, layer=3, start_ns=a.end_ns + 10, end_ns=a.end_ns + 20)]
    assert "a2e(L3,s0) is outside the step's plan" in _violations(broken, expected)


def test_wrong_streams(good: Any) -> None:
    ops, expected = good
    broken = list(ops)
    i = _idx(broken, "e2a", 0, 1)
    broken[i] = dataclasses.replace(broken[i], stream="K0")
    text = _violations(broken, expected)
    assert "e2a(L0,s1) ran on K0, expected K1" in text
    assert "ran on another stage's stream K0" in text


def test_timing_edges(good: Any) -> None:
    ops, expected = good
    # Edge 3: FFN started before its A2E ended.
    broken = list(ops)
    a, f = broken[_idx(broken, "a2e", 1, 0)], _idx(broken, "ffn", 1, 0)
    broken[f] = dataclasses.replace(broken[f], start_ns=a.end_ns - 1000)
    assert "ffn(L1,s0) started 1000 ns before its a2e ended" in _violations(broken, expected)
    # Edge 4: E2A started before its FFN ended.
    broken = list(ops)
    f, e = broken[_idx(broken, "ffn", 1, 1)], _idx(broken, "e2a", 1, 1)
    broken[e] = dataclasses.replace(broken[e], start_ns=f.end_ns - 500)
    assert "e2a(L1,s1) started 500 ns before its ffn ended" in _violations(broken, expected)
    # Edge 6: two ops of one group at once.
    broken = list(ops)
    e, a = broken[_idx(broken, "e2a", 0, 0)], _idx(broken, "a2e", 1, 0)
    broken[a] = dataclasses.replace(broken[a], start_ns=e.end_ns - 1)
    assert "group of stage 0: a2e(L1) started before e2a(L0) ended" in _violations(broken, expected)


def test_compute_stream_order_and_step_span(good: Any) -> None:
    ops, expected = good
    broken = list(ops)
    i, j = _idx(broken, "ffn", 0, 1), _idx(broken, "ffn", 1, 0)
    fi, fj = broken[i], broken[j]
    broken[i] = dataclasses.replace(fi, start_ns=fj.start_ns, end_ns=fj.end_ns)
    broken[j] = dataclasses.replace(fj, start_ns=fi.start_ns, end_ns=fi.end_ns)
    assert "stream C order differs from the step's issue order at position 1" in _violations(broken, expected)

    broken = list(ops)
    st = broken[_idx(broken, "step")]
    e = _idx(broken, "e2a", 2, 1)
    broken[e] = dataclasses.replace(broken[e], end_ns=st.end_ns + 1)
    assert "e2a(L2,s1) ran outside the step (fork/join)" in _violations(broken, expected)

    broken = [o for o in ops if o.kind != "step"]
    assert "expected one step span, found 0" in _violations(broken, expected)


def _without(ops: list[TraceOp], source: str, kind: str, detail: str, stream: str | None = None) -> list[TraceOp]:
    """``ops`` less the ``source``'s record or wait of ``detail`` (on ``stream``)."""
    drop = [
        o
        for o in ops
        if o.kind == kind and o.source == source and o.detail == detail and (stream is None or o.stream == stream)
    ]
    assert drop, (kind, detail, source)
    return [o for o in ops if all(o is not d for d in drop)]


@pytest.mark.parametrize("source", ["session", "backend"])
def test_event_graph_edges(good: Any, source: str) -> None:
    """Both records of a step's events (what the session asked for, what the
    CPU streams performed) build the same graph, and the checker fails each
    missing edge on either."""
    ops, expected = good
    assert any(o.source == "backend" for o in ops), "the CPU backend logs what its streams performed"
    assert edges.check_step(ops, expected, source=source).ok

    def violations(broken: list[TraceOp]) -> str:
        res = edges.check_step(broken, expected, source=source)
        assert not res.ok, "the checker accepted a broken trace"
        return str(res)

    # A wait on an event never recorded in this step (a detail is the event's label).
    a_1_0 = EventKey("a", 1, 0).label()
    assert a_1_0 == "a L1 s0" and EventKey.parse(a_1_0) == EventKey("a", 1, 0)
    text = violations(_without(ops, source, "record", a_1_0))
    assert "C waits on event a L1 s0 that was not recorded before in this step" in text
    assert "edge 3 (FFN waits its A2E): nothing orders a2e(L1,s0) on K0 before ffn(L1,s0) on C" in text

    # The compute stream does not wait a_done (edge 3), K does not wait f_done (edge 4).
    text = violations(_without(ops, source, "wait", EventKey("a", 2, 1).label()))
    assert "edge 3 (FFN waits its A2E): nothing orders a2e(L2,s1)" in text
    text = violations(_without(ops, source, "wait", EventKey("f", 0, 0).label()))
    assert "edge 4 (E2A waits its FFN): nothing orders ffn(L0,s0)" in text

    # Fork and join.
    assert "edge 1 (fork): K1 starts with" in violations(_without(ops, source, "wait", EventKey.fork().label(), "K1"))
    text = violations(_without(ops, source, "wait", EventKey.join(0).label()))
    assert "edge 7 (join): the work of K0 is not waited by C" in text

    # An edge between two stages' streams: K1 waits an event recorded on K0.
    broken = list(ops)
    f_1_1 = EventKey("f", 1, 1).label()
    i = next(j for j, o in enumerate(broken) if o.kind == "wait" and o.source == source and o.detail == f_1_1)
    rec = next(o for o in broken if o.kind == "record" and o.source == source and o.detail == a_1_0)
    broken[i] = dataclasses.replace(broken[i], detail=rec.detail, event=rec.event)
    text = violations(broken)
    assert "K1 waits on event a L1 s0 recorded on K0: an edge between stage streams" in text

    # The lookahead A2E queued before its group's E2A (stream order on K0).
    broken = list(ops)
    a, e = _idx(broken, "a2e", 1, 0), _idx(broken, "e2a", 0, 0)
    field = "seq" if source == "session" else "order"
    broken[a] = dataclasses.replace(broken[a], **{field: getattr(broken[e], field) - 1})
    assert "edge 5/6 (lookahead A2E after its group's E2A): nothing orders e2a(L0,s0)" in violations(broken)


def test_backend_waits_must_return_after_their_event_fired(good: Any) -> None:
    """What only the backend's log can show: a wait that let its stream go
    before the event fired (a broken backend), and an op the backend never
    placed in its execution order."""
    ops, expected = good
    broken = list(ops)
    key = EventKey("a", 1, 1).label()
    i = next(j for j, o in enumerate(broken) if o.kind == "wait" and o.source == "backend" and o.detail == key)
    rec = next(o for o in broken if o.kind == "record" and o.source == "backend" and o.detail == key)
    broken[i] = dataclasses.replace(broken[i], end_ns=rec.end_ns - 1)
    text = str(edges.check_step(broken, expected))
    assert "C's wait on event a L1 s1 returned before that event fired" in text
    assert edges.check_step(broken, expected, source="session").ok  # the session's record cannot tell

    broken = list(ops)
    f = _idx(broken, "ffn", 0, 1)
    broken[f] = dataclasses.replace(broken[f], order=-1)
    assert "ffn(L0,s1) on C has no place in the backend's execution order" in str(edges.check_step(broken, expected))


def test_serial_trace_passes_serial_schedule_only(patch_layer: PatchLayer) -> None:
    w = world(layers=3, stage_ids=STAGES)
    apply_cpu(patch_layer=patch_layer, min_stages=3)  # two stages: serial path
    with trace.recording() as rec:
        run_step(w, Schedule(3, STAGES, (8, 8), step=1))
    ops = rec.ops(rec.steps()[0])
    assert edges.check_step(ops, ExpectedSchedule.serial(LAYERS, STAGES)).ok
    text = str(edges.check_step(ops, ExpectedSchedule(LAYERS, STAGES, True, True)))
    assert "a2e(L0,s0) ran on C, expected K0" in text


def test_chrome_trace_has_one_track_per_stream(good: Any) -> None:
    ops, _ = good
    events = edges.to_chrome_trace(ops)
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"C", "K0", "K1"}
    spans = [e for e in events if e["ph"] == "X" and e["cat"] in ("a2e", "ffn", "e2a")]
    assert len(spans) == 3 * len(LAYERS) * len(STAGES)


# ---------------------------------------------------------------------------
# compute-side (the default layout): A2E and E2A on C in the overlap's order, the FFN on F
# ---------------------------------------------------------------------------


def _swapped(ops: list[TraceOp], x: int, y: int) -> list[TraceOp]:
    """``ops`` with ops ``x`` and ``y`` swapped in time and in every order (host issue, backend execution)."""
    broken, a, b = list(ops), ops[x], ops[y]
    when = ("start_ns", "end_ns", "seq", "order")
    broken[x] = dataclasses.replace(a, **{k: getattr(b, k) for k in when})
    broken[y] = dataclasses.replace(b, **{k: getattr(a, k) for k in when})
    return broken


def test_compute_side_ffn_on_the_wrong_stream(good_cs: Any) -> None:
    ops, expected = good_cs
    assert {o.stream for o in ops if o.kind == "ffn"} == {"F"}
    assert {o.stream for o in ops if o.kind in ("a2e", "e2a")} == {"C"}
    broken = list(ops)
    i = _idx(broken, "ffn", 1, 0)
    broken[i] = dataclasses.replace(broken[i], stream="C")
    text = _violations(broken, expected)
    assert "ffn(L1,s0) ran on C, expected F" in text
    # ... and C's and F's programs are no longer the step's issue order.
    assert "stream C order differs from the step's issue order" in text
    assert "stream F order differs from the step's issue order at position 2" in text


@pytest.mark.parametrize("timings", [True, False])
def test_compute_side_c_order(good_cs: Any, timings: bool) -> None:
    """C runs the overlap's order: the prologue's A2E(L0) of every stage, then per (layer, stage) the E2A and
    at once the stage's lookahead A2E. A swap on C fails, in host times and in the issue order alike."""
    ops, expected = good_cs
    assert edges.check_step(ops, expected, timings=timings).ok

    def violations(broken: list[TraceOp]) -> str:
        res = edges.check_step(broken, expected, timings=timings)
        assert not res.ok, "the checker accepted a broken trace"
        return str(res)

    # E2A(L0,s0) and its lookahead A2E(L1,s0) swapped: the lookahead ran first.
    text = violations(_swapped(ops, _idx(ops, "e2a", 0, 0), _idx(ops, "a2e", 1, 0)))
    assert (
        "stream C order differs from the step's issue order at position 2: "
        "ran [('a2e', 1, 0), ('e2a', 0, 0), ('e2a', 0, 1)], expected [('e2a', 0, 0), ('a2e', 1, 0), ('e2a', 0, 1)]"
    ) in text
    assert "edge 5/6 (lookahead A2E after its group's E2A): nothing orders e2a(L0,s0) on C before a2e(L1,s0)" in text

    # The prologue's two receives swapped: no edge of one stage orders them, the issue order does.
    text = violations(_swapped(ops, _idx(ops, "a2e", 0, 0), _idx(ops, "a2e", 0, 1)))
    assert "stream C order differs from the step's issue order at position 0" in text

    # A lookahead issued late: A2E(L1,s0) after E2A(L0,s1).
    text = violations(_swapped(ops, _idx(ops, "a2e", 1, 0), _idx(ops, "e2a", 0, 1)))
    assert "stream C order differs from the step's issue order at position 3" in text


@pytest.mark.parametrize("source", ["session", "backend"])
def test_compute_side_event_graph(good_cs: Any, source: str) -> None:
    """The edges of compute-side on either record of the step's events: F forks from C, waits each a_done;
    C waits each f_done before the E2A, and the join of F at close."""
    ops, expected = good_cs
    assert edges.check_step(ops, expected, source=source).ok

    def violations(broken: list[TraceOp]) -> str:
        res = edges.check_step(broken, expected, source=source)
        assert not res.ok, "the checker accepted a broken trace"
        return str(res)

    # Fork: F does not wait C's fork (its first wait is an a_done of C, which is not the fork).
    text = violations(_without(ops, source, "wait", EventKey.fork().label(), "F"))
    assert "edge 1 (fork): F starts with wait a L0 s0, not a wait on the fork event of C" in text
    # Join: C does not wait F's join; F does not record it.
    text = violations(_without(ops, source, "wait", EventKey.join(None).label(), "C"))
    assert "edge 7 (join): the work of F is not waited by C after the step's last op on C" in text
    text = violations(_without(ops, source, "record", EventKey.join(None).label(), "F"))
    assert "C waits on event join that was not recorded before in this step" in text
    # Edge 3: F does not wait a_done; edge 4: C does not wait f_done.
    text = violations(_without(ops, source, "wait", EventKey("a", 1, 0).label(), "F"))
    assert "edge 3 (FFN waits its A2E): nothing orders a2e(L1,s0) on C before ffn(L1,s0) on F" in text
    text = violations(_without(ops, source, "wait", EventKey("f", 0, 1).label(), "C"))
    assert "edge 4 (E2A waits its FFN): nothing orders ffn(L0,s1) on F before e2a(L0,s1) on C" in text


def test_chrome_trace_shows_the_ffn_stream(good_cs: Any) -> None:
    ops, _ = good_cs
    events = edges.to_chrome_trace(ops)
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(tracks.values()) == ["C", "F"]
    spans = [e for e in events if e["ph"] == "X" and e["cat"] in ("a2e", "ffn", "e2a")]
    assert len(spans) == 3 * len(LAYERS) * len(STAGES)
    assert {tracks[e["tid"]] for e in spans if e["cat"] == "ffn"} == {"F"}
    assert {tracks[e["tid"]] for e in spans if e["cat"] != "ffn"} == {"C"}
