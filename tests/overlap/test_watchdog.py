"""The stall watchdog (VLLM_CAMP2P_MULTISTREAM_WATCHDOG_S): a step whose
attention peer stops answering is reported, once, naming the (layer, stage)
ops issued, the ones finished and the one pending; the watchdog only reads
(the step's outcome is the same with it on or off).

The CPU backend is the emulated device: the host enqueues every op and runs
ahead, so by the time a stall is reported the host has usually issued and
closed the whole step, and the report says where each *stream* of the
device is (the op it runs, the event it waits for). The watchdog follows a
closed step's device work until it has finished, or reports at the deadline.

The per-stage side streams (K_s) are the ``comm-side`` layout's (and its
e2a-only / a2e-only refinements): those tests list it. In the default
``compute-side`` layout every A2E and E2A runs on C in the overlap's order
and the FFNs on F: the report names C blocked in the stalled op and says
where F is on its own "FFN stream:" line.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

import pytest
from support.logs import PackageLogs
from support.overlap import assert_same

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.observe.trace import ExpectedSchedule, recording
from camp2p_overlap.core.overlap.plan import layouts_of
from camp2p_overlap.core.overlap.rank_group import Membership, RankGroup
from camp2p_overlap.core.overlap.watch.stall_report import peer_lines
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.emulation.faults import Fault, FaultPlan, run_step_bounded
from camp2p_overlap.emulation.world import PeerTimeoutError
from camp2p_overlap.verify.edges import check_step

STEP_BOUND_S = 30.0  # a step that takes longer than this is a hang
#: The layouts listed where a test is about the per-stage side streams K_s.
COMM_SIDE = ("comm-side",)


def stall_reports(cap: PackageLogs) -> list[str]:
    return [m for m in cap.messages if "has not finished after" in m]


def _wait_watchdogs_gone(timeout: float = 5.0) -> list[threading.Thread]:
    for t in threading.enumerate():
        if t.name == "camp2p-overlap-watchdog":
            t.join(timeout)
    return [t for t in threading.enumerate() if t.name == "camp2p-overlap-watchdog"]


def _serial(patch_layer: PatchLayer, world, step: int) -> dict:
    assert not patch_layer.engine.is_applied()
    out = run_step_bounded(world, step, STEP_BOUND_S)
    assert not out.hung and out.error is None, out
    return out.results


def _apply(patch_layer: PatchLayer, **overrides: object) -> None:
    patch_layer.engine.unpatch()
    report = patch_layer.engine.apply(
        config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, **overrides), strict=True
    )
    assert report.applied


def test_stopped_peer_a2e_is_reported_once_with_the_pending_op(make_world, logs, patch_layer: PatchLayer) -> None:
    """The host ran ahead: it issued the whole step (every op of every
    stage) and closed it before the report, so the report no longer shows
    the host blocked in a receive: C waits on the device for the stalled
    A2E's event, the ops behind it are queued, and the other stages' streams
    wait for C (they are not blamed)."""
    w = make_world(layers=3, stage_ids=(0, 1, 2), tokens=8, op_timeout_s=1.2)
    _apply(patch_layer, watchdog_s=0.25, layouts=COMM_SIDE)
    with FaultPlan(w, [Fault("stop", "a2e", 1, 1)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 5, STEP_BOUND_S)
    assert not out.hung
    assert isinstance(out.error, PeerTimeoutError)
    reports = stall_reports(logs)
    assert len(reports) == 1, reports  # once per step, although the step outlived the watchdog 4x
    text = reports[0]
    assert "FFN stream:" not in text  # comm-side: the FFN runs on C
    # The pending op, where it runs, and that it is the likely culprit.
    assert "a2e(L1,s1) on K1: RUNNING for" in text
    assert "likely missing peer op: a2e(L1,s1) on K1" in text
    assert "attention peer of stage 1 (group afd1) has not answered" in text
    assert "step 0: 9/9 receives handed to the loop" in text
    assert "host: has issued the whole step and closed it" in text
    assert "compute stream C is waiting on the device for a2e(L1,s1) on K1 (event a L1 s1 pending)" in text
    # What was issued and finished for the stuck stage, and its pending event.
    assert "stage 1 (stream K1, group afd1): 6 op(s) issued; K1 is at a2e(L1,s1) (RUNNING for" in text
    assert "a2e(L0,s1) on K1: done" in text and "e2a(L0,s1) on K1: done" in text
    assert "e2a(L1,s1) on K1: queued" in text  # issued, behind the stalled op on K1
    assert "event a L1 s1: pending" in text  # events by their EventKey label
    assert "event a L1 s0: done" in text
    # The other stages' streams wait for FFNs C cannot reach: not blamed.
    assert "stage 0 (stream K0, group afd): 6 op(s) issued; K0 waits for the FFN of (L2,s0) on C" in text
    assert "stage 2 (stream K2, group afd2): 6 op(s) issued; K2 waits for the FFN of (L1,s2) on C" in text
    assert text.count("likely missing peer op") == 1
    assert "FFN rank group" not in text and "FFN peers" not in text  # one FFN rank: no group block
    assert text.rstrip().endswith(
        "ops not finished: a2e(L1,s1) on K1, e2a(L1,s1) on K1, a2e(L2,s1) on K1, e2a(L1,s2) on K2, "
        "a2e(L2,s2) on K2, e2a(L2,s0) on K0, e2a(L2,s1) on K1, e2a(L2,s2) on K2"
    )
    assert not _wait_watchdogs_gone()


def test_stopped_peer_e2a_reports_it_and_the_a2e_queued_behind_it(make_world, logs, patch_layer: PatchLayer) -> None:
    """C waits on the device for the A2E queued behind the stalled E2A (the
    host issued the whole step: it is not blocked in that receive)."""
    w = make_world(layers=3, stage_ids=(0, 2), tokens=8, op_timeout_s=1.2)
    _apply(patch_layer, watchdog_s=0.3, layouts=COMM_SIDE)
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
    assert "compute stream C is waiting on the device for a2e(L1,s0) on K0 (event a L1 s0 pending)" in text
    assert "stage 0 (stream K0, group afd): 6 op(s) issued; K0 is at e2a(L0,s0) (RUNNING for" in text
    assert "stage 2 (stream K2, group afd2): 6 op(s) issued; K2 waits for the FFN of (L1,s2) on C" in text
    assert text.count("likely missing peer op") == 1
    assert "ops not finished: e2a(L0,s0) on K0, a2e(L1,s0) on K0, e2a(L1,s0) on K0, a2e(L2,s0) on K0" in text


def test_compute_side_stopped_peer_a2e_blocks_c_and_the_ffn_stream_waits_for_it(
    make_world, logs, patch_layer: PatchLayer
) -> None:
    """compute-side (the default): every A2E and E2A on C in the overlap's order, the FFNs on F. A stopped A2E
    blocks C itself, with the rest of the step queued behind it on C (not blamed); F waits for that A2E's
    a_done, and the report says so on its "FFN stream:" line."""
    w = make_world(layers=3, stage_ids=(0, 1, 2), tokens=8, op_timeout_s=1.2)
    _apply(patch_layer, watchdog_s=0.25)
    assert patch_layer.engine.config.layouts == ("compute-side",)
    with FaultPlan(w, [Fault("stop", "a2e", 1, 1)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 5, STEP_BOUND_S)
    assert not out.hung
    assert isinstance(out.error, PeerTimeoutError), out
    (text,) = stall_reports(logs)
    lines = text.splitlines()
    assert "  host: has issued the whole step and closed it; the streams below are where the device is" in lines
    i = next(j for j, line in enumerate(lines) if line.startswith("  compute stream C"))
    assert lines[i].startswith("  compute stream C is blocked in a2e(L1,s1), issued on the compute stream (RUNNING for")
    # The FFN stream's line comes right after C's, and names what F waits for.
    assert lines[i + 1] == "  FFN stream: F waits for a2e(L1,s1) on C (event a L1 s1 pending)"
    assert text.count("FFN stream:") == 1
    # Each stage's ops run on C: no side stream of a stage is named.
    assert "  stage 1 (stream C, group afd1): 6 op(s) issued" in lines
    assert "K0" not in text and "K1" not in text and "K2" not in text
    assert "a2e(L1,s1) on C: RUNNING for" in text
    assert "e2a(L1,s1) on C: queued" in text and "e2a(L0,s2) on C: queued" in text
    assert "likely missing peer op: a2e(L1,s1) on C (RUNNING for" in text
    assert "attention peer of stage 1 (group afd1) has not answered" in text
    assert text.count("likely missing peer op") == 1
    assert "event a L1 s1: pending" in text and "event join: pending" in text
    assert not _wait_watchdogs_gone()


def test_compute_side_stopped_peer_e2a_blocks_c_and_the_lookahead_behind_it(
    make_world, logs, patch_layer: PatchLayer
) -> None:
    """compute-side: a stopped E2A blocks C; its stage's lookahead A2E is queued right behind it on C (the
    overlap's order), and F waits for that A2E."""
    w = make_world(layers=3, stage_ids=(0, 2), tokens=8, op_timeout_s=1.2)
    _apply(patch_layer, watchdog_s=0.3)
    with FaultPlan(w, [Fault("stop", "e2a", 0, 0)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 3, STEP_BOUND_S)
    assert isinstance(out.error, PeerTimeoutError), out
    (text,) = stall_reports(logs)
    assert "compute stream C is blocked in e2a(L0,s0), issued on the compute stream (RUNNING for" in text
    assert "  FFN stream: F waits for a2e(L1,s0) on C (event a L1 s0 pending)" in text
    assert "e2a(L0,s0) on C: RUNNING for" in text and "a2e(L1,s0) on C: queued" in text
    assert "likely missing peer op: e2a(L0,s0) on C (RUNNING for" in text
    assert "attention peer of stage 0 (group afd) has not acknowledged" in text
    assert text.count("likely missing peer op") == 1


def test_a2e_on_the_compute_stream_is_named_when_it_stalls(make_world, logs, patch_layer: PatchLayer) -> None:
    """C itself runs the stalled A2E on the device (the host is not in the
    receive: it has issued the rest of the step behind it); the next
    stage's A2E, queued behind it on C, is not blamed."""
    w = make_world(layers=2, stage_ids=(0, 1), tokens=8, op_timeout_s=1.0)
    _apply(patch_layer, watchdog_s=0.25, layouts=COMM_SIDE, a2e_on_side_stream=False)
    with FaultPlan(w, [Fault("stop", "a2e", 1, 0)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 2, STEP_BOUND_S)
    assert isinstance(out.error, PeerTimeoutError), out
    (text,) = stall_reports(logs)
    assert "host: has issued the whole step and closed it" in text
    assert "compute stream C is blocked in a2e(L1,s0), issued on the compute stream (RUNNING for" in text
    assert "likely missing peer op: a2e(L1,s0) on C (RUNNING for" in text
    assert "a2e(L1,s1) on C: queued" in text
    assert "stage 1 (stream K1, group afd1): 4 op(s) issued; K1 waits for the FFN of (L1,s1) on C" in text
    assert text.count("likely missing peer op") == 1


def test_a2e_on_the_compute_stream_behind_a_stalled_e2a_blames_the_e2a(
    make_world, logs, patch_layer: PatchLayer
) -> None:
    """A2E on C, E2A on K_s: C waits the stage's last E2A before it runs the
    stage's next A2E. The host does not block on that wait (it enqueues it
    and issues the A2E behind it), so the A2E is listed, queued on C, and
    not blamed: the E2A the peer never acknowledged is, and C is named
    waiting on the device for it."""
    w = make_world(layers=2, stage_ids=(0, 1), tokens=8, op_timeout_s=1.0)
    _apply(patch_layer, watchdog_s=0.25, layouts=COMM_SIDE, a2e_on_side_stream=False)
    with FaultPlan(w, [Fault("stop", "e2a", 0, 0)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 2, STEP_BOUND_S)
    assert isinstance(out.error, PeerTimeoutError), out
    (text,) = stall_reports(logs)
    assert "compute stream C is waiting on the device for e2a(L0,s0) on K0 (event e L0 s0 pending)" in text
    assert "e2a(L0,s0) on K0: RUNNING for" in text
    assert "likely missing peer op: e2a(L0,s0) on K0" in text
    assert "a2e(L1,s0) on C: queued" in text  # issued behind C's wait: listed, not blamed
    assert "likely missing peer op: a2e" not in text
    assert text.count("likely missing peer op") == 1


def test_e2a_on_the_compute_stream_is_named_once_when_it_stalls(make_world, logs, patch_layer: PatchLayer) -> None:
    """C runs the stalled E2A on the device; the host is past it (it issued
    the whole step, so the report no longer says C is "not waiting on a
    receive"): the side streams' lookahead A2Es wait for C's E2A of their
    stage, and only the stalled E2A is blamed."""
    w = make_world(layers=2, stage_ids=(0, 1), tokens=8, op_timeout_s=1.0)
    _apply(patch_layer, watchdog_s=0.25, layouts=COMM_SIDE, e2a_on_side_stream=False)
    with FaultPlan(w, [Fault("stop", "e2a", 0, 0)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 2, STEP_BOUND_S)
    assert isinstance(out.error, PeerTimeoutError), out
    (text,) = stall_reports(logs)
    assert "host: has issued the whole step and closed it" in text
    assert "compute stream C is blocked in e2a(L0,s0), issued on the compute stream (RUNNING for" in text
    assert "e2a(L0,s0) on C: RUNNING for" in text
    assert "likely missing peer op: e2a(L0,s0) on C (RUNNING for" in text
    assert "the attention peer of stage 0 (group afd) has not acknowledged" in text
    assert "K0 waits for e2a(L0,s0) on C (event ec L0 s0 pending)" in text
    assert "K1 waits for e2a(L0,s1) on C (event ec L0 s1 pending)" in text
    assert text.count("likely missing peer op") == 1
    assert text.rstrip().endswith(
        "ops not finished: e2a(L0,s0) on C, a2e(L1,s0) on K0, e2a(L0,s1) on C, a2e(L1,s1) on K1, "
        "e2a(L1,s0) on C, e2a(L1,s1) on C"
    )


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_a_host_held_in_the_ffn_is_reported_from_the_live_session(
    make_world, logs, patch_layer: PatchLayer, layout: str
) -> None:
    """The host's own part can stall too (here the model's host part sleeps):
    the report then comes from the open session, says where the host is and
    the stream the FFN is on (C in comm-side, F in compute-side), and blames
    no peer (every op issued so far has run on the device)."""
    w = make_world(layers=2, stage_ids=(0, 1), tokens=8)
    ref = _serial(patch_layer, w, 4)
    _apply(patch_layer, watchdog_s=0.2, layouts=(layout,))
    with FaultPlan(w, [Fault("delay", "ffn", 1, 0, delay_s=0.6)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 4, STEP_BOUND_S)
    assert out.error is None and not out.hung, out
    assert_same(out.results, ref)
    (text,) = stall_reports(logs)
    assert "step 0: 3/4 receives handed to the loop" in text
    assert "host: in the FFN of (L1,s0) (the model's host part); its send is not issued yet" in text
    if layout == "comm-side":
        assert "compute stream C is at the FFN of (L1,s0), whose send the host has not issued yet" in text
        assert "FFN stream:" not in text
    else:
        assert "  compute stream C has run everything issued so far\n" in text
        assert "  FFN stream: F is at the FFN of (L1,s0), whose send the host has not issued yet\n" in text
    assert "every issued op has finished" in text and "likely missing peer op" not in text
    assert "ops not finished: none" in text
    assert not _wait_watchdogs_gone()


def test_fast_steps_log_no_stall(make_world, logs, patch_layer: PatchLayer) -> None:
    w = make_world(layers=3, stage_ids=(0, 1), tokens=8)
    ref = [_serial(patch_layer, w, n) for n in (1, 2, 3)]
    _apply(patch_layer, watchdog_s=20.0)
    for n in (1, 2, 3):
        out = run_step_bounded(w, n, STEP_BOUND_S)
        assert out.error is None and not out.hung
        assert_same(out.results, ref[n - 1])
    assert stall_reports(logs) == []
    # Cancelled timers leave no thread behind.
    assert not _wait_watchdogs_gone()


def _expected(patch_layer: PatchLayer, world) -> ExpectedSchedule:
    """The schedule a world's step should have under ``patch_layer``'s config (its first listed layout)."""
    (layout, *_) = layouts_of(patch_layer.engine.config)
    return ExpectedSchedule(
        tuple(world.layer_list()),
        tuple(world.spec.stage_ids),
        layout.a2e_side,
        layout.e2a_side,
        layout.ffn_side,
        layout.prefetch,
    )


def _shape(ops) -> list[tuple]:
    return sorted((o.kind, o.layer, o.stage, o.stream) for o in ops if o.kind in ("a2e", "ffn", "e2a"))


@pytest.mark.parametrize(
    "fault",
    # The watchdog fires well after every op before the delayed one has run,
    # even on a loaded machine, and well before the delayed op ends.
    [Fault("delay", "e2a", 1, 0, delay_s=1.0), Fault("delay", "a2e", 2, 1, delay_s=1.0)],
    ids=lambda f: f.describe(),
)
@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_watchdog_only_reads_a_slow_step_has_the_same_outcome(
    make_world, logs, fault, patch_layer: PatchLayer, layout: str
) -> None:
    """A step slower than the watchdog: the report fires mid-step and the
    outputs, the ops and their streams are those of the same step without
    a watchdog (and of the serial path)."""
    w = make_world(layers=3, stage_ids=(0, 1), tokens=8)
    ref = _serial(patch_layer, w, 7)
    outcomes = {}
    for watchdog in (None, 0.3):
        _apply(patch_layer, watchdog_s=watchdog, layouts=(layout,))
        with FaultPlan(w, [fault]) as plan, recording() as rec:
            plan.arm()
            out = run_step_bounded(w, 7, STEP_BOUND_S)
            assert len(plan.fired) == 1
        assert out.error is None and not out.hung, out
        (step,) = rec.steps()
        ops = rec.ops(step)
        res = check_step(ops, _expected(patch_layer, w))
        assert res.ok, str(res)
        outcomes[watchdog] = (out.results, _shape(ops), len(stall_reports(logs)))
    (res_off, shape_off, n_off), (res_on, shape_on, n_on) = outcomes[None], outcomes[0.3]
    assert n_off == 0 and n_on == 1
    assert shape_on == shape_off
    assert res_on.keys() == res_off.keys() == ref.keys()
    assert_same(res_on, ref)
    assert_same(res_off, ref)
    # The report of the slow step shows the delayed op running, not blamed on a peer.
    text = stall_reports(logs)[0]
    stream = "C" if layout == "compute-side" else f"K{fault.stage}"
    assert f"{fault.op}(L{fault.layer},s{fault.stage}) on {stream}: RUNNING" in text


def test_watchdog_only_reads_a_failing_step_fails_the_same_way(make_world, logs, patch_layer: PatchLayer) -> None:
    w = make_world(layers=2, stage_ids=(0, 1), tokens=8, op_timeout_s=0.6)
    ref_next = _serial(patch_layer, w, 9)
    errors = {}
    for watchdog in (None, 0.1):
        _apply(patch_layer, watchdog_s=watchdog)
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


def _fake_device():
    """A stream backend over a device module whose ops return at once (DoneHandles) and whose events complete when
    a test says so (``dev.mod.made``: every event made, in order); a synchronize fails the test."""
    import contextlib

    from camp2p_overlap.core.overlap.streams.backend import StreamBackend

    class Event:
        def __init__(self, **_: object) -> None:
            self.done = False
            self.queries = 0

        def record(self, stream: object = None) -> None:
            pass

        def query(self) -> bool:
            self.queries += 1
            return self.done

        def synchronize(self) -> None:
            raise AssertionError("the stall report must not synchronize")

    class FakeStream:
        def __init__(self, device: object = None, name: str = "?") -> None:
            self.name = name

        def wait_event(self, event: Event) -> None:
            pass

        def synchronize(self) -> None:
            raise AssertionError("the watchdog must not synchronize")

    class Module:
        __name__ = "fake-device"
        Stream = FakeStream

        def __init__(self) -> None:
            self.made: list[Event] = []
            self.caller = self.current = FakeStream(name="C")

        def Event(self, **kw: object) -> Event:
            ev = Event(**kw)
            self.made.append(ev)
            return ev

        def stream(self, stream: object) -> contextlib.AbstractContextManager[object]:
            return contextlib.nullcontext(stream)

        def current_stream(self) -> FakeStream:
            return self.caller

        def set_stream(self, stream: FakeStream) -> None:
            self.current = stream

    return StreamBackend("fake-device", Module())  # type: ignore[arg-type]


def _fake_session(dev, layout=None):
    """A session of ``dev`` in ``layout`` (None: comm-side) after its first receive (the prologue issued)."""
    from types import SimpleNamespace

    from camp2p_overlap.core.overlap.plan import COMM_SIDE, StepPlan
    from camp2p_overlap.core.overlap.session import StepSession
    from camp2p_overlap.core.overlap.streams.streamset import StreamSet

    session = StepSession(
        connector=object(),
        plan=StepPlan((0, 1), (0, 2), {"max_num_tokens": 4}),
        streamset=StreamSet(dev, range(3)),
        layout=layout or COMM_SIDE,
    )

    def recv(**kw):
        return SimpleNamespace(hidden_states=None, context=SimpleNamespace(key=(kw["layer_idx"], kw["ubatch_idx"])))

    session.recv(recv, {"ubatch_idx": 0, "layer_idx": 0, "max_num_tokens": 4})
    return session


def test_report_on_a_device_backend_reads_events_not_handles() -> None:
    """On a device backend every op returns at once (the host enqueued it);
    the report tells done from pending by the event recorded after each op,
    and where each stream is by the events it waits for, never by a sync.
    A side stream still waiting for the fork (C has not reached the step)
    is at a wait, not at an op: nothing is blamed on a peer then."""
    from camp2p_overlap.core.overlap.watch.stall_report import stall_report

    dev = _fake_device()
    session = _fake_session(dev)
    text = stall_report(session.snapshot())
    assert "host: in the FFN of (L0,s0) (the model's host part)" in text
    assert "compute stream C has not reached its record of event fork yet" in text
    assert "stage 0 (stream K0, group afd): 1 op(s) issued; K0 waits for the start of the step on C" in text
    assert "a2e(L0,s0) on K0: enqueued, not complete on the device" in text
    assert "likely missing peer op" not in text
    # One report queries each event once, although each op's state is read
    # for its stage line, its stream's position, the culprit and the list.
    assert dev.mod.made and [ev.queries for ev in dev.mod.made] == [1] * len(dev.mod.made)
    fork = dev.mod.made[0]
    fork.done = True
    text = stall_report(session.snapshot())
    assert "compute stream C is waiting on the device for a2e(L0,s0) on K0 (event a L0 s0 pending)" in text
    assert "a2e(L0,s0) on K0: enqueued, not complete on the device" in text
    assert "a2e(L0,s2) on K2: enqueued, not complete on the device" in text
    assert "likely missing peer op: a2e(L0,s0) on K0 (enqueued, not complete on the device)" in text
    assert "likely missing peer op: a2e(L0,s2) on K2 (enqueued, not complete on the device)" in text
    assert "ops not finished: a2e(L0,s0) on K0, a2e(L0,s2) on K2" in text
    assert [ev.queries for ev in dev.mod.made] == [2] * len(dev.mod.made)
    for ev in dev.mod.made:
        ev.done = True
    text = stall_report(session.snapshot())
    assert "a2e(L0,s0) on K0: done" in text and "a2e(L0,s2) on K2: done" in text
    assert "every issued op has finished" in text and "ops not finished: none" in text
    # Closed, the session keeps the step as the host left it: its join.
    session.close(raising=True)
    snap = session.snapshot()
    assert snap.closed
    text = stall_report(snap)
    assert "host: has issued the whole step and closed it" in text
    assert "compute stream C is waiting on the device for the last op of stage 0 on K0 (event join s0 pending)" in text


def test_report_on_a_device_backend_in_compute_side_follows_c_and_f() -> None:
    """compute-side on a device backend: C holds the prologue's receives and F waits for them; where each is
    comes from the events alone (F's line first waits C's fork, then the first receive's a_done), the first
    unfinished receive on C is the one blamed, and after close C waits F's join."""
    from camp2p_overlap.core.overlap.plan import COMPUTE_SIDE
    from camp2p_overlap.core.overlap.watch.stall_report import stall_report

    dev = _fake_device()
    session = _fake_session(dev, COMPUTE_SIDE)
    assert dev.mod.current.name == "F"  # the loop's work runs on F from the first receive
    text = stall_report(session.snapshot())
    assert "host: in the FFN of (L0,s0) (the model's host part)" in text
    assert "  compute stream C has not reached its record of event fork yet\n" in text
    assert "  FFN stream: F waits for the start of the step on C (event fork pending)\n" in text
    assert "stage 0 (stream C, group afd): 1 op(s) issued\n" in text
    assert "likely missing peer op" not in text
    fork = dev.mod.made[0]
    fork.done = True
    text = stall_report(session.snapshot())
    assert (
        "  compute stream C is blocked in a2e(L0,s0), issued on the compute stream (enqueued, not complete on the "
        "device)\n  FFN stream: F waits for a2e(L0,s0) on C (event a L0 s0 pending)\n"
    ) in text
    assert "a2e(L0,s2) on C: enqueued, not complete on the device" in text
    assert "likely missing peer op: a2e(L0,s0) on C (enqueued, not complete on the device)" in text
    assert text.count("likely missing peer op") == 1  # a2e(L0,s2) waits behind it on C
    for ev in dev.mod.made:
        ev.done = True
    text = stall_report(session.snapshot())
    assert "every issued op has finished" in text
    assert "  FFN stream: F is at the FFN of (L0,s0), whose send the host has not issued yet" in text
    session.close(raising=True)
    assert dev.mod.current.name == "C"  # the caller's stream is current again
    text = stall_report(session.snapshot())
    assert "host: has issued the whole step and closed it" in text
    assert (
        "compute stream C is waiting on the device for the last work of the FFN stream F (event join pending)" in text
    )
    assert "  FFN stream: F has not reached its record of event join yet" in text


def test_after_the_host_closes_the_step_the_watchdog_follows_the_device(logs) -> None:
    """Cancelled when the host leaves the step, the watchdog keeps reading
    the closed step's events (queries only): it ends without a report once
    they have completed, and reports once at the deadline if they do not."""
    from camp2p_overlap.core.overlap.watch.watchdog import start_watchdog

    dev = _fake_device()
    session = _fake_session(dev)
    session.close(raising=True)
    watchdog = start_watchdog(30.0, session.snapshot, 1)
    assert watchdog is not None
    watchdog.cancel()
    watchdog.join(0.1)
    assert watchdog.is_alive()  # the device has not run the step yet
    for ev in dev.mod.made:
        ev.done = True
    watchdog.join(5.0)
    assert not watchdog.is_alive() and not watchdog.reported
    assert stall_reports(logs) == []

    dev = _fake_device()
    session = _fake_session(dev)
    session.close(raising=True)
    watchdog = start_watchdog(0.2, session.snapshot, 2)
    assert watchdog is not None
    watchdog.cancel()
    watchdog.join(5.0)
    assert not watchdog.is_alive() and watchdog.reported
    (text,) = stall_reports(logs)
    assert "FFN step 2 has not finished after 0.2 s" in text
    assert "event join s2: pending" in text
    assert not _wait_watchdogs_gone()


def test_stopped_watchdogs_end_without_a_report_or_a_query(logs) -> None:
    """Before a graph capture the watchdogs following earlier steps are
    stopped (no event may be queried while a capture is in progress): they
    have ended when the call returns, query nothing more and report nothing."""
    from camp2p_overlap.core.overlap.watch.watchdog import start_watchdog, stop_watchdogs

    dev = _fake_device()
    session = _fake_session(dev)
    session.close(raising=True)
    watchdog = start_watchdog(0.5, session.snapshot, 3)
    assert watchdog is not None
    watchdog.cancel()
    deadline = time.perf_counter() + 5.0
    while not any(ev.queries for ev in dev.mod.made) and time.perf_counter() < deadline:
        time.sleep(0.001)  # until it follows the step
    assert stop_watchdogs()
    assert not watchdog.is_alive()
    queried = [ev.queries for ev in dev.mod.made]
    time.sleep(0.6)  # past its deadline
    assert not watchdog.is_alive() and not watchdog.reported
    assert [ev.queries for ev in dev.mod.made] == queried
    assert stall_reports(logs) == []


def test_a_stop_racing_a_start_joins_only_started_watchdogs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``stop_watchdogs()`` on another thread while ``start_watchdog`` is
    between listing its thread and starting it (before a capture) must not
    ``join()`` an unstarted thread (which raises)."""
    from camp2p_overlap.core.overlap.watch import watchdog as wd

    errors: list[BaseException] = []
    stoppers: list[threading.Thread] = []
    real_start = wd.StepWatchdog.start

    def start_late(self: wd.StepWatchdog) -> None:
        def stop() -> None:
            try:
                wd.stop_watchdogs(timeout=2)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        stopper = threading.Thread(target=stop)
        stoppers.append(stopper)
        stopper.start()
        stopper.join(0.3)  # the stop runs now, if nothing keeps it out
        real_start(self)

    monkeypatch.setattr(wd.StepWatchdog, "start", start_late)
    dog = wd.start_watchdog(60.0, lambda: None, 1)  # type: ignore[arg-type, return-value]
    assert dog is not None
    for t in stoppers:
        t.join(5)
    dog.join(5)
    assert errors == [] and not dog.is_alive()


def _groups(size: int) -> list[RankGroup]:
    """``size`` FFN ranks over one in-process store (as tests/overlap/test_rank_group.py's ``groups``)."""
    import torch.distributed as dist

    store, members = dist.HashStore(), tuple(range(size))
    return [RankGroup(Membership(size, r, members, "test group", store), timeout_s=5.0) for r in range(size)]


def test_a_stall_in_an_ffn_rank_group_names_this_rank_and_each_peers_heartbeat(
    make_world, logs, patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the runtime's FFN rank group (four ranks here): the report says which FFN rank this is and the op it is
    blocked in; per peer its last heartbeat (step count, age) and which peers stopped answering (rank 2's heartbeat
    is old, rank 3 never beat); rank 1 beats on."""
    gs = _groups(4)
    gs[1].steps = 7
    gs[1].start_heartbeat(interval_s=0.05)
    gs[2].store.set("hb/2", json.dumps({"t": time.time() - 30.0, "steps": 4}))
    try:
        deadline = time.monotonic() + 5
        while not gs[0].store.check(["hb/1"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        w = make_world(layers=3, stage_ids=(0, 1, 2), tokens=8, op_timeout_s=1.2)
        _apply(patch_layer, watchdog_s=0.25, layouts=COMM_SIDE)
        monkeypatch.setattr(patch_layer.runtime, "group_joined", True)
        monkeypatch.setattr(patch_layer.runtime, "group", gs[0])
        with FaultPlan(w, [Fault("stop", "a2e", 1, 1)]) as plan:
            plan.arm()
            out = run_step_bounded(w, 5, STEP_BOUND_S)
    finally:
        gs[1].stop()
    assert isinstance(out.error, PeerTimeoutError), out
    (text,) = stall_reports(logs)
    lines = text.splitlines()
    i = next(j for j, line in enumerate(lines) if line.startswith("  FFN rank group:"))
    assert lines[i].startswith(
        "  FFN rank group: this is FFN rank 0 of 4 (global rank 0; test group); "
        "this rank is blocked in a2e(L1,s1) on K1 (RUNNING for"
    )
    assert lines[i + 1].startswith("    peer FFN rank 1 (global rank 1): last heartbeat 0.")
    assert lines[i + 1].endswith(" s ago, at 7 step(s)")
    assert lines[i + 2].startswith("    peer FFN rank 2 (global rank 2): last heartbeat 3")
    assert lines[i + 2].endswith(" s ago, at 4 step(s): stopped answering")
    assert lines[i + 3] == "    peer FFN rank 3 (global rank 3): no heartbeat: stopped answering"
    assert lines[i + 4] == "  FFN peers that stopped answering: rank(s) 2, 3"
    assert "likely missing peer op: a2e(L1,s1) on K1" in text  # the rest of the report as without a group
    assert text.rstrip().splitlines()[-1].startswith("  ops not finished: a2e(L1,s1) on K1")
    assert not _wait_watchdogs_gone()


class _Peers:
    """A group whose ``peers()`` blocks until released (a store that does not answer), or raises."""

    size, rank, members, source, broken = 2, 1, (4, 5), "stand-in", None

    def __init__(self, raises: bool = False) -> None:
        self.raises = raises
        self.release = threading.Event()

    def peers(self) -> list[dict[str, Any]]:
        if self.raises:
            raise ConnectionError("store gone")
        self.release.wait(10.0)
        return [{"rank": 0, "member": 4, "steps": 1, "age_s": 0.1, "stopped": False}]


def test_reading_the_peers_never_raises_and_waits_a_bounded_time() -> None:
    """The peers' heartbeats are store reads: a store that does not answer costs the report ``timeout_s`` at most,
    one that fails is named; neither raises into the watchdog."""
    blocked = _Peers()
    t0 = time.monotonic()
    lines = peer_lines(blocked, "e2a(L0,s0) on C (RUNNING for 1.00 s)", timeout_s=0.2)  # type: ignore[arg-type]
    took = time.monotonic() - t0
    blocked.release.set()
    assert took < 2.0, took
    assert lines == [
        "  FFN rank group: this is FFN rank 1 of 2 (global rank 5; stand-in); "
        "this rank is blocked in e2a(L0,s0) on C (RUNNING for 1.00 s)",
        "    peers' heartbeats: not read: the store did not answer within 0.2 s",
    ]
    failing = peer_lines(_Peers(raises=True), "x", timeout_s=5.0)  # type: ignore[arg-type]
    assert failing[1] == "    peers' heartbeats: not read (ConnectionError: store gone)"
    broken = _Peers()
    broken.broken = "exchange x/3/times: no answer from rank(s) [0]"  # type: ignore[assignment]
    broken.release.set()
    text = peer_lines(broken, "x")  # type: ignore[arg-type]
    assert text[0].startswith(
        "  FFN rank group: this is FFN rank 1 of 2 (global rank 5; stand-in); the group is broken"
    )
    assert text[1:] == [
        "    peer FFN rank 0 (global rank 4): last heartbeat 0.10 s ago, at 1 step(s)",
        "  FFN peers that stopped answering: none (every peer's heartbeat is recent)",
    ]
