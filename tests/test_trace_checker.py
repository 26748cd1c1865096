"""The edge checker: it passes real traces and fails every kind of broken
one, including broken schedules run end to end through a test-only session
subclass (proof that it can fail where outputs alone cannot tell)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from _overlap_util import Schedule, apply_cpu, assert_same, run_step, serial_results, world

from camp2p_overlap.core import trace
from camp2p_overlap.core.session import OverlapSession
from camp2p_overlap.core.trace import ExpectedSchedule, TraceOp

LAYERS = (0, 1, 2)
STAGES = (0, 1)


def _record(a2e: bool = True, e2a: bool = True) -> tuple[list[TraceOp], ExpectedSchedule]:
    w = world(layers=3, stage_ids=STAGES)
    apply_cpu(a2e_on_side_stream=a2e, e2a_on_side_stream=e2a)
    with trace.recording() as rec:
        run_step(w, Schedule(3, STAGES, (8, 8), step=1))
    (step,) = rec.steps()
    return rec.ops(step), ExpectedSchedule(LAYERS, STAGES, a2e, e2a)


@pytest.fixture(scope="module")
def good() -> tuple[list[TraceOp], ExpectedSchedule]:
    ops, expected = _record()
    from camp2p_overlap.core.process import ENGINE

    ENGINE.unpatch(timeout=10)
    return ops, expected


def _idx(ops: list[TraceOp], kind: str, layer: int | None = None, stage: int | None = None, detail: str = "") -> int:
    for i, o in enumerate(ops):
        if o.kind == kind and (layer is None or o.layer == layer) and (stage is None or o.stage == stage):
            if not detail or o.detail == detail:
                return i
    raise KeyError((kind, layer, stage, detail))


def _violations(ops: list[TraceOp], expected: ExpectedSchedule) -> str:
    res = trace.check_step(ops, expected)
    assert not res.ok, "the checker accepted a broken trace"
    return str(res)


def test_real_traces_pass_for_every_direction_setting() -> None:
    for a2e, e2a in [(True, True), (False, True), (True, False)]:
        ops, expected = _record(a2e, e2a)
        res = trace.check_step(ops, expected)
        assert res.ok, str(res)
        # The same trace is not a serial trace: the checker tells them apart.
        assert not trace.check_step(ops, ExpectedSchedule.serial(LAYERS, STAGES)).ok


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
    assert "compute stream order differs from the loop order" in _violations(broken, expected)

    broken = list(ops)
    st = broken[_idx(broken, "step")]
    e = _idx(broken, "e2a", 2, 1)
    broken[e] = dataclasses.replace(broken[e], end_ns=st.end_ns + 1)
    assert "e2a(L2,s1) ran outside the step (fork/join)" in _violations(broken, expected)

    broken = [o for o in ops if o.kind != "step"]
    assert "expected one step span, found 0" in _violations(broken, expected)


def test_event_graph_edges(good: Any) -> None:
    ops, expected = good
    # A wait on an event never recorded in this step.
    broken = [o for o in ops if not (o.kind == "record" and o.detail == "('a', 1, 0)")]
    text = _violations(broken, expected)
    assert "C waits on event ('a', 1, 0) that was not recorded before in this step" in text
    assert "edge 3 (FFN waits its A2E): nothing orders a2e(L1,s0) on K0 before ffn(L1,s0) on C" in text

    # The compute stream does not wait a_done (edge 3), K does not wait f_done (edge 4).
    broken = [o for o in ops if not (o.kind == "wait" and o.detail == "('a', 2, 1)")]
    assert "edge 3 (FFN waits its A2E): nothing orders a2e(L2,s1)" in _violations(broken, expected)
    broken = [o for o in ops if not (o.kind == "wait" and o.detail == "('f', 0, 0)")]
    assert "edge 4 (E2A waits its FFN): nothing orders ffn(L0,s0)" in _violations(broken, expected)

    # Fork and join.
    broken = [o for o in ops if not (o.kind == "wait" and o.detail == "('fork',)" and o.stream == "K1")]
    assert "edge 1 (fork): K1 starts with" in _violations(broken, expected)
    broken = [o for o in ops if not (o.kind == "wait" and o.detail == "('join', 0)")]
    assert "edge 7 (join): the work of K0 is not waited by C" in _violations(broken, expected)

    # An edge between two stages' streams.
    broken = list(ops)
    i = _idx(broken, "wait", detail="('f', 1, 1)")
    broken[i] = dataclasses.replace(broken[i], detail="('a', 1, 0)")
    assert "K1 waits on event ('a', 1, 0) recorded on K0: an edge between stage streams" in _violations(
        broken, expected
    )

    # The lookahead A2E issued before its group's E2A (queue order on K0).
    broken = list(ops)
    a, e = _idx(broken, "a2e", 1, 0), _idx(broken, "e2a", 0, 0)
    broken[a] = dataclasses.replace(broken[a], seq=broken[e].seq - 1)
    assert "edge 5/6 (lookahead A2E after its group's E2A): nothing orders e2a(L0,s0)" in _violations(broken, expected)


# ---------------------------------------------------------------------------
# Broken schedules run end to end: outputs stay right on the CPU backend
# (the host blocks on every result), the checker still catches them.


class NoComputeWaitOnADone(OverlapSession):
    def _wait(self, stream: Any, key: Any) -> None:
        if stream is self.C and key[0] == "a":
            return
        super()._wait(stream, key)


class NoSideWaitOnFDone(OverlapSession):
    def _wait(self, stream: Any, key: Any) -> None:
        if stream is not self.C and key[0] == "f":
            return
        super()._wait(stream, key)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (NoComputeWaitOnADone, "edge 3 (FFN waits its A2E): nothing orders a2e(L1,s0) on K0 before ffn(L1,s0) on C"),
        (NoSideWaitOnFDone, "edge 4 (E2A waits its FFN): nothing orders ffn(L1,s1) on C before e2a(L1,s1) on K1"),
    ],
)
def test_checker_fails_broken_sessions(monkeypatch: pytest.MonkeyPatch, broken: type, message: str) -> None:
    from camp2p_overlap.core.process import RUNTIME

    w = world(layers=3, stage_ids=STAGES)
    sched = Schedule(3, STAGES, (8, 8), step=1)
    (ref,) = serial_results(w, [sched])
    apply_cpu()
    monkeypatch.setattr(RUNTIME, "session_class", broken)
    with trace.recording() as rec:
        got = run_step(w, sched)
    assert_same(got, ref)  # the outputs cannot tell ...
    res = trace.check_step(rec.ops(rec.steps()[0]), ExpectedSchedule(LAYERS, STAGES, True, True))
    assert not res.ok  # ... the checker can
    assert message in str(res)


def test_serial_trace_passes_serial_schedule_only() -> None:
    w = world(layers=3, stage_ids=STAGES)
    apply_cpu(min_stages=3)  # two stages: serial path
    with trace.recording() as rec:
        run_step(w, Schedule(3, STAGES, (8, 8), step=1))
    ops = rec.ops(rec.steps()[0])
    assert trace.check_step(ops, ExpectedSchedule.serial(LAYERS, STAGES)).ok
    text = str(trace.check_step(ops, ExpectedSchedule(LAYERS, STAGES, True, True)))
    assert "a2e(L0,s0) ran on C, expected K0" in text


def test_chrome_trace_has_one_track_per_stream(good: Any) -> None:
    ops, _ = good
    events = trace.to_chrome_trace(ops)
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"C", "K0", "K1"}
    spans = [e for e in events if e["ph"] == "X" and e["cat"] in ("a2e", "ffn", "e2a")]
    assert len(spans) == 3 * len(LAYERS) * len(STAGES)
