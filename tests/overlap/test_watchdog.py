"""The stall watchdog (VLLM_CAMP2P_MULTISTREAM_WATCHDOG_S): a step whose
attention peer stops answering is reported, once, naming the (layer, stage)
ops issued, the ones finished and the one pending; the watchdog only reads
(the step's outcome is the same with it on or off)."""

from __future__ import annotations

import threading

import pytest
from support.logs import PackageLogs
from support.overlap import assert_same

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.layer import Layer
from camp2p_overlap.core.observe.trace import ExpectedSchedule, recording
from camp2p_overlap.emulation.faults import Fault, FaultPlan, run_step_bounded
from camp2p_overlap.emulation.world import PeerTimeoutError
from camp2p_overlap.verify.edges import check_step

STEP_BOUND_S = 30.0  # a step that takes longer than this is a hang


def stall_reports(cap: PackageLogs) -> list[str]:
    return [m for m in cap.messages if "has not finished after" in m]


def _wait_watchdogs_gone(timeout: float = 5.0) -> list[threading.Thread]:
    for t in threading.enumerate():
        if t.name == "camp2p-overlap-watchdog":
            t.join(timeout)
    return [t for t in threading.enumerate() if t.name == "camp2p-overlap-watchdog"]


def _serial(layer: Layer, world, step: int) -> dict:
    assert not layer.engine.is_applied()
    out = run_step_bounded(world, step, STEP_BOUND_S)
    assert not out.hung and out.error is None, out
    return out.results


def _apply(layer: Layer, **overrides: object) -> None:
    layer.engine.unpatch()
    report = layer.engine.apply(
        config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, **overrides), strict=True
    )
    assert report.applied


def test_stopped_peer_a2e_is_reported_once_with_the_pending_op(make_world, logs, layer: Layer) -> None:
    w = make_world(layers=3, stage_ids=(0, 1, 2), tokens=8, op_timeout_s=1.2)
    _apply(layer, watchdog_s=0.25)
    with FaultPlan(w, [Fault("stop", "a2e", 1, 1)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 5, STEP_BOUND_S)
    assert not out.hung
    assert isinstance(out.error, PeerTimeoutError)
    reports = stall_reports(logs)
    assert len(reports) == 1, reports  # once per step, although the step outlived the watchdog 4x
    text = reports[0]
    # The pending op, where it runs, and that it is the likely culprit.
    assert "a2e(L1,s1) on K1: RUNNING for" in text
    assert "likely missing peer op: a2e(L1,s1) on K1" in text
    assert "attention peer of stage 1 (group afd1) has not answered" in text
    assert "compute stream C is blocked in receive (L1,s1), waiting for a2e(L1,s1)" in text
    # What was issued and finished for the stuck stage, and its pending event.
    assert "stage 1 (stream K1, group afd1): 3 op(s) issued" in text
    assert "a2e(L0,s1) on K1: done" in text and "e2a(L0,s1) on K1: done" in text
    assert "event a L1 s1: pending" in text  # events by their EventKey label
    assert "event a L1 s0: done" in text
    assert text.rstrip().endswith("ops not finished: a2e(L1,s1) on K1")
    # Other stages are not blamed.
    assert text.count("likely missing peer op") == 1
    assert not _wait_watchdogs_gone()


def test_stopped_peer_e2a_reports_it_and_the_a2e_queued_behind_it(make_world, logs, layer: Layer) -> None:
    w = make_world(layers=3, stage_ids=(0, 2), tokens=8, op_timeout_s=1.2)
    _apply(layer, watchdog_s=0.3)
    with FaultPlan(w, [Fault("stop", "e2a", 0, 0)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 3, STEP_BOUND_S)
    assert isinstance(out.error, PeerTimeoutError), out
    (text,) = stall_reports(logs)
    assert "e2a(L0,s0) on K0: RUNNING for" in text
    # The lookahead A2E of stage 0 waits behind it on the same stream (FIFO).
    assert "a2e(L1,s0) on K0: queued" in text
    assert "likely missing peer op: e2a(L0,s0) on K0" in text
    assert "attention peer of stage 0 (group afd) has not acknowledged" in text
    assert "compute stream C is blocked in receive (L1,s0), waiting for a2e(L1,s0)" in text
    assert "stage 2 (stream K2, group afd2)" in text
    assert text.count("likely missing peer op") == 1
    assert "ops not finished: e2a(L0,s0) on K0, a2e(L1,s0) on K0" in text


def test_a2e_on_the_compute_stream_is_named_when_it_stalls(make_world, logs, layer: Layer) -> None:
    w = make_world(layers=2, stage_ids=(0, 1), tokens=8, op_timeout_s=1.0)
    _apply(layer, watchdog_s=0.25, a2e_on_side_stream=False)
    with FaultPlan(w, [Fault("stop", "a2e", 1, 0)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 2, STEP_BOUND_S)
    assert isinstance(out.error, PeerTimeoutError), out
    (text,) = stall_reports(logs)
    assert "compute stream C is blocked in receive (L1,s0), running a2e(L1,s0) on the compute stream" in text
    assert "compute stream C is blocked in a2e(L1,s0), issued on the compute stream" in text
    assert "likely missing peer op: a2e(L1,s0) on C (RUNNING for" in text
    assert text.count("likely missing peer op") == 1


def test_a2e_on_the_compute_stream_behind_a_stalled_e2a_blames_the_e2a(make_world, logs, layer: Layer) -> None:
    """A2E on C, E2A on K_s: the next receive of the stage waits the stage's
    last E2A before it issues its A2E. The A2E is not issued, so it is not
    blamed: the E2A the peer never acknowledged is."""
    w = make_world(layers=2, stage_ids=(0, 1), tokens=8, op_timeout_s=1.0)
    _apply(layer, watchdog_s=0.25, a2e_on_side_stream=False)
    with FaultPlan(w, [Fault("stop", "e2a", 0, 0)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 2, STEP_BOUND_S)
    assert isinstance(out.error, PeerTimeoutError), out
    (text,) = stall_reports(logs)
    assert "compute stream C is blocked in receive (L1,s0), waiting for the last e2a of stage 0 on K0" in text
    assert "e2a(L0,s0) on K0: RUNNING for" in text
    assert "likely missing peer op: e2a(L0,s0) on K0" in text
    assert "a2e(L1,s0)" not in text  # never issued: neither listed nor blamed
    assert text.count("likely missing peer op") == 1


def test_e2a_on_the_compute_stream_is_named_once_when_it_stalls(make_world, logs, layer: Layer) -> None:
    w = make_world(layers=2, stage_ids=(0, 1), tokens=8, op_timeout_s=1.0)
    _apply(layer, watchdog_s=0.25, e2a_on_side_stream=False)
    with FaultPlan(w, [Fault("stop", "e2a", 0, 0)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 2, STEP_BOUND_S)
    assert isinstance(out.error, PeerTimeoutError), out
    (text,) = stall_reports(logs)
    assert "compute stream C is not waiting on a receive (FFN or E2A issue); next receive (L0,s1)" in text
    assert "compute stream C is blocked in e2a(L0,s0), issued on the compute stream" in text
    assert "e2a(L0,s0) on C: RUNNING for" in text
    assert "likely missing peer op: e2a(L0,s0) on C (RUNNING for" in text
    assert "the attention peer of stage 0 (group afd) has not acknowledged" in text
    assert text.count("likely missing peer op") == 1
    assert text.rstrip().endswith("ops not finished: e2a(L0,s0) on C")


def test_fast_steps_log_no_stall(make_world, logs, layer: Layer) -> None:
    w = make_world(layers=3, stage_ids=(0, 1), tokens=8)
    ref = [_serial(layer, w, n) for n in (1, 2, 3)]
    _apply(layer, watchdog_s=20.0)
    for n in (1, 2, 3):
        out = run_step_bounded(w, n, STEP_BOUND_S)
        assert out.error is None and not out.hung
        assert_same(out.results, ref[n - 1])
    assert stall_reports(logs) == []
    # Cancelled timers leave no thread behind.
    assert not _wait_watchdogs_gone()


def _expected(layer: Layer, world) -> ExpectedSchedule:
    """The schedule a world's step should have under ``layer``'s config."""
    cfg = layer.engine.config
    return ExpectedSchedule(
        tuple(world.layer_list()), tuple(world.spec.stage_ids), cfg.a2e_on_side_stream, cfg.e2a_on_side_stream
    )


def _shape(ops) -> list[tuple]:
    return sorted((o.kind, o.layer, o.stage, o.stream) for o in ops if o.kind in ("a2e", "ffn", "e2a"))


@pytest.mark.parametrize(
    "fault",
    [Fault("delay", "e2a", 1, 0, delay_s=0.4), Fault("delay", "a2e", 2, 1, delay_s=0.4)],
    ids=lambda f: f.describe(),
)
def test_watchdog_only_reads_a_slow_step_has_the_same_outcome(make_world, logs, fault, layer: Layer) -> None:
    """A step slower than the watchdog: the report fires mid-step and the
    outputs, the ops and their streams are those of the same step without
    a watchdog (and of the serial path)."""
    w = make_world(layers=3, stage_ids=(0, 1), tokens=8)
    ref = _serial(layer, w, 7)
    outcomes = {}
    for watchdog in (None, 0.05):
        _apply(layer, watchdog_s=watchdog)
        with FaultPlan(w, [fault]) as plan, recording() as rec:
            plan.arm()
            out = run_step_bounded(w, 7, STEP_BOUND_S)
            assert len(plan.fired) == 1
        assert out.error is None and not out.hung, out
        (step,) = rec.steps()
        ops = rec.ops(step)
        assert check_step(ops, _expected(layer, w)).ok
        outcomes[watchdog] = (out.results, _shape(ops), len(stall_reports(logs)))
    (res_off, shape_off, n_off), (res_on, shape_on, n_on) = outcomes[None], outcomes[0.05]
    assert n_off == 0 and n_on == 1
    assert shape_on == shape_off
    assert res_on.keys() == res_off.keys() == ref.keys()
    assert_same(res_on, ref)
    assert_same(res_off, ref)
    # The report of the slow step shows the delayed op running, not blamed on a peer.
    text = stall_reports(logs)[0]
    assert f"{fault.op}(L{fault.layer},s{fault.stage}) on K{fault.stage}: RUNNING" in text


def test_watchdog_only_reads_a_failing_step_fails_the_same_way(make_world, logs, layer: Layer) -> None:
    w = make_world(layers=2, stage_ids=(0, 1), tokens=8, op_timeout_s=0.6)
    ref_next = _serial(layer, w, 9)
    errors = {}
    for watchdog in (None, 0.1):
        _apply(layer, watchdog_s=watchdog)
        with FaultPlan(w, [Fault("stop", "a2e", 1, 1)]) as plan:
            plan.arm()
            out = run_step_bounded(w, 8, STEP_BOUND_S)
        errors[watchdog] = out.error
        nxt = run_step_bounded(w, 9, STEP_BOUND_S)
        assert nxt.error is None
        assert_same(nxt.results, ref_next)
    assert type(errors[None]) is type(errors[0.1]) is PeerTimeoutError
    assert str(errors[None]) == str(errors[0.1])
    assert len(stall_reports(logs)) == 1


def test_report_on_a_device_backend_reads_events_not_handles() -> None:
    """On a device backend every op returns at once (the host enqueued it);
    the report tells done from pending by the event recorded after each op,
    never by a sync."""
    from types import SimpleNamespace

    from camp2p_overlap.core.overlap.plan import StepPlan
    from camp2p_overlap.core.overlap.session import OverlapSession
    from camp2p_overlap.core.overlap.streams.base import DoneHandle, StreamBackend
    from camp2p_overlap.core.overlap.streams.streamset import StreamSet
    from camp2p_overlap.core.overlap.watchdog import stall_report

    class Event:
        def __init__(self) -> None:
            self.done = False
            self.queries = 0

        def query(self) -> bool:
            self.queries += 1
            return self.done

        def synchronize(self) -> None:
            raise AssertionError("the stall report must not synchronize")

    class Device(StreamBackend):
        name = "fake-device"

        def __init__(self) -> None:
            self.events: list[Event] = []

        def compute_stream(self) -> object:
            return SimpleNamespace(name="C")

        def new_stream(self, name: str) -> object:
            return SimpleNamespace(name=name)

        def submit(self, stream, fn, label="op"):
            return DoneHandle(fn(), start_ns=0, end_ns=0)

        def record(self, stream, key) -> Event:
            ev = Event()
            self.events.append(ev)
            return ev

        def wait(self, stream, event) -> None:
            pass

        def is_capturing(self) -> bool:
            return False

    dev = Device()
    session = OverlapSession(
        connector=object(),
        plan=StepPlan((0, 1), (0, 2), {"max_num_tokens": 4}),
        streamset=StreamSet(dev, range(3)),
    )

    def recv(**kw):
        return SimpleNamespace(hidden_states=None, context=SimpleNamespace(key=(kw["layer_idx"], kw["ubatch_idx"])))

    session.recv(recv, {"ubatch_idx": 0, "layer_idx": 0, "max_num_tokens": 4})
    text = stall_report(session.snapshot())
    assert "a2e(L0,s0) on K0: enqueued, not complete on the device" in text
    assert "a2e(L0,s2) on K2: enqueued, not complete on the device" in text
    assert "likely missing peer op: a2e(L0,s2) on K2 (enqueued, not complete on the device)" in text
    assert "ops not finished: a2e(L0,s0) on K0, a2e(L0,s2) on K2" in text
    # One report queries each event once, although each op's state is read
    # for its stage line, the culprit and the unfinished list.
    assert dev.events and [ev.queries for ev in dev.events] == [1] * len(dev.events)
    for ev in dev.events:
        ev.done = True
    text = stall_report(session.snapshot())
    assert "a2e(L0,s0) on K0: done" in text and "a2e(L0,s2) on K2: done" in text
    assert "every issued op has finished" in text and "ops not finished: none" in text
    session.close(raising=True)
