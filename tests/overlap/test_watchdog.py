"""The stall watchdog (VLLM_CAMP2P_MULTISTREAM_WATCHDOG_S, on by default): a
step whose attention peer stops answering is reported, once, naming the
(layer, stage) ops issued, the ones finished and the one pending; the
watchdog only reads (the step's outcome is the same with it on or off). One
watcher thread per process follows every step handed to it.

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
import os
import threading
import time
from typing import Any

import pytest
from support.child import run_forked
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


def _still_followed(timeout: float = 5.0) -> int:
    """How many steps the watcher still follows once they could all have ended (within ``timeout``)."""
    from camp2p_overlap.core.overlap.watch.watchdog import WATCHER

    deadline = time.perf_counter() + timeout
    while WATCHER.following() and time.perf_counter() < deadline:
        time.sleep(0.005)
    return WATCHER.following()


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
    assert not _still_followed()


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
    assert not _still_followed()


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
    assert not _still_followed()


def test_fast_steps_log_no_stall(make_world, logs, patch_layer: PatchLayer) -> None:
    w = make_world(layers=3, stage_ids=(0, 1), tokens=8)
    ref = [_serial(patch_layer, w, n) for n in (1, 2, 3)]
    _apply(patch_layer, watchdog_s=20.0)
    for n in (1, 2, 3):
        out = run_step_bounded(w, n, STEP_BOUND_S)
        assert out.error is None and not out.hung
        assert_same(out.results, ref[n - 1])
    assert stall_reports(logs) == []
    # Every step the watcher followed has ended.
    assert not _still_followed()


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
    for watchdog in (0.0, 0.3):
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
    (res_off, shape_off, n_off), (res_on, shape_on, n_on) = outcomes[0.0], outcomes[0.3]
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
    for watchdog in (0.0, 0.1):
        _apply(patch_layer, watchdog_s=watchdog)
        with FaultPlan(w, [Fault("stop", "a2e", 1, 1)]) as plan:
            plan.arm()
            out = run_step_bounded(w, 8, STEP_BOUND_S)
        errors[watchdog] = out.error
        nxt = run_step_bounded(w, 9, STEP_BOUND_S)
        assert nxt.error is None
        assert_same(nxt.results, ref_next)
    assert type(errors[0.0]) is type(errors[0.1]) is PeerTimeoutError
    assert str(errors[0.0]) == str(errors[0.1])
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
    assert not _still_followed()


def test_stopped_watchdogs_end_without_a_report_or_a_query(logs) -> None:
    """Before a graph capture the watcher following earlier steps is
    stopped (no event may be queried while a capture is in progress): its
    thread and the steps it followed have ended when the call returns, query
    nothing more and report nothing; the next step starts a new thread."""
    from camp2p_overlap.core.overlap.watch.watchdog import WATCHER, start_watchdog, stop_watchdogs

    dev = _fake_device()
    session = _fake_session(dev)
    session.close(raising=True)
    watchdog = start_watchdog(0.5, session.snapshot, 3)
    assert watchdog is not None
    watchdog.cancel()
    deadline = time.perf_counter() + 5.0
    while not any(ev.queries for ev in dev.mod.made) and time.perf_counter() < deadline:
        time.sleep(0.001)  # until it follows the step
    thread = WATCHER.thread()
    assert thread is not None and thread.is_alive()
    assert stop_watchdogs()
    assert not thread.is_alive() and WATCHER.thread() is None
    assert not watchdog.is_alive()
    queried = [ev.queries for ev in dev.mod.made]
    time.sleep(0.6)  # past its deadline
    assert not watchdog.is_alive() and not watchdog.reported
    assert [ev.queries for ev in dev.mod.made] == queried
    assert stall_reports(logs) == []
    started = WATCHER.started
    again = start_watchdog(30.0, session.snapshot, 4)
    assert again is not None and WATCHER.started == started + 1
    assert WATCHER.thread() is not None and WATCHER.thread() is not thread
    assert stop_watchdogs() and not again.is_alive()


def test_a_stop_racing_the_watchers_start_joins_only_a_started_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``stop_watchdogs()`` on another thread while a step is starting the
    watcher thread (before a capture) must not ``join()`` an unstarted
    thread (which raises): it waits for the start, then ends the thread."""
    from camp2p_overlap.core.overlap.watch import watchdog as wd

    assert wd.stop_watchdogs()
    errors: list[BaseException] = []
    stoppers: list[threading.Thread] = []
    real_thread = threading.Thread

    def stop() -> None:
        try:
            wd.stop_watchdogs(timeout=2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    class StartsLate(real_thread):
        def start(self) -> None:
            if self.name == wd.WATCHER_THREAD:
                stopper = real_thread(target=stop)
                stoppers.append(stopper)
                stopper.start()
                stopper.join(0.3)  # the stop runs now, if nothing keeps it out
            super().start()

    monkeypatch.setattr(wd.threading, "Thread", StartsLate)
    dog = wd.start_watchdog(60.0, lambda: None, 1)  # type: ignore[arg-type, return-value]
    assert dog is not None and stoppers
    for t in stoppers:
        t.join(5)
    dog.join(5)
    assert errors == [] and not dog.is_alive() and wd.WATCHER.thread() is None


def _closed_fake_step(seconds: float, step_id: int, dev=None):
    """A closed step of a fake device (its events pending until the test completes them), handed to the watcher."""
    from camp2p_overlap.core.overlap.watch.watchdog import start_watchdog

    dev = dev or _fake_device()
    session = _fake_session(dev)
    session.close(raising=True)
    watch = start_watchdog(seconds, session.snapshot, step_id)
    assert watch is not None
    watch.cancel()
    return dev, watch


def _watcher_threads() -> list[threading.Thread]:
    from camp2p_overlap.core.overlap.watch.watchdog import WATCHER_THREAD

    return [t for t in threading.enumerate() if t.name == WATCHER_THREAD and t.is_alive()]


def test_one_watcher_follows_two_steps_in_flight_on_two_devices(logs) -> None:
    """Two steps in flight at once, on two runners' devices: one watcher
    thread follows both; the one whose device completes ends unreported, the
    other is reported once at its deadline."""
    from camp2p_overlap.core.overlap.watch.watchdog import WATCHER

    _, stalled = _closed_fake_step(0.3, 1)
    done_dev, done = _closed_fake_step(30.0, 2)
    time.sleep(0.05)
    assert stalled.is_alive() and done.is_alive()
    assert _watcher_threads() == [WATCHER.thread()]  # one thread follows both
    for ev in done_dev.mod.made:
        ev.done = True
    done.join(5.0)
    assert not done.is_alive() and not done.reported
    stalled.join(5.0)
    assert not stalled.is_alive() and stalled.reported
    (text,) = stall_reports(logs)
    assert "FFN step 1 has not finished after 0.3 s" in text
    assert not _still_followed()


def test_two_steps_in_flight_on_one_device_end_with_the_later_one(logs) -> None:
    """The host ran ahead: two closed steps of one runner are in flight on
    its device (the second re-recorded the first's pooled events). One
    watcher follows both through the later one: once its events complete,
    both end unreported; if they never do, the older is reported once and
    the later one, which cannot finish before it, ends unreported."""
    dev, first = _closed_fake_step(30.0, 1)
    _, second = _closed_fake_step(30.0, 2, dev)
    time.sleep(0.05)
    assert first.is_alive() and second.is_alive()
    assert len(_watcher_threads()) == 1
    for ev in dev.mod.made:
        ev.done = True
    first.join(5.0)
    second.join(5.0)
    assert not first.is_alive() and not second.is_alive()
    assert not first.reported and not second.reported
    assert stall_reports(logs) == []

    dev, first = _closed_fake_step(0.2, 3)
    _, second = _closed_fake_step(0.25, 4, dev)
    first.join(5.0)
    second.join(5.0)
    assert first.reported and not second.reported and not second.is_alive()
    (text,) = stall_reports(logs)
    assert "FFN step 3 has not finished after 0.2 s" in text
    assert not _still_followed()


def test_a_step_not_to_follow_on_the_device_ends_with_the_hosts_part(logs) -> None:
    """``follow=False`` (upstream's capture runs unguarded: its target is
    refused): once the host has left the step the watcher ends it without a
    query; a step the host has not left by its deadline is still reported."""
    from camp2p_overlap.core.overlap.watch.watchdog import start_watchdog

    dev = _fake_device()
    session = _fake_session(dev)
    session.close(raising=True)
    watch = start_watchdog(30.0, session.snapshot, 1, follow=False)
    assert watch is not None
    watch.cancel()
    watch.join(5.0)
    assert not watch.is_alive() and not watch.reported
    assert [ev.queries for ev in dev.mod.made] == [0] * len(dev.mod.made)

    dev = _fake_device()
    live = _fake_session(dev)  # the host is still in it
    watch = start_watchdog(0.2, live.snapshot, 2, follow=False)
    assert watch is not None
    watch.join(5.0)
    assert watch.reported
    (text,) = stall_reports(logs)
    assert "FFN step 2 has not finished after 0.2 s" in text and "host: in the FFN of (L0,s0)" in text
    live.close(raising=True)
    assert not _still_followed()


def test_a_runners_completed_step_is_dropped_when_its_next_step_opens() -> None:
    """When a runner's next step opens, its thread reads the previous step's
    tail on the device: complete, the step is dropped there and its session
    dies as young as without the watchdog (kept longer, sessions reach the
    collector's oldest generation); not complete, the watcher keeps it."""
    import gc
    import weakref

    from camp2p_overlap.core.overlap.watch.watchdog import start_watchdog

    dev = _fake_device()
    first = _fake_session(dev)
    first.close(raising=True)
    start_watchdog(30.0, first.snapshot, 1).cancel()  # type: ignore[union-attr]
    for ev in dev.mod.made:
        ev.done = True
    gone = weakref.ref(first)
    del first
    second = _fake_session(dev)  # the runner's next step opens
    later = start_watchdog(30.0, second.snapshot, 2)
    assert later is not None
    gc.collect()
    assert gone() is None  # dropped by the step's thread as the next step opened
    second.close(raising=True)
    later.cancel()
    for ev in dev.mod.made:
        ev.done = False  # its device work has not run yet
    kept = weakref.ref(second)
    del second
    third = _fake_session(dev)
    last = start_watchdog(30.0, third.snapshot, 3)
    assert last is not None
    gc.collect()
    assert kept() is not None and later.is_alive()  # not complete: still followed
    third.close(raising=True)
    last.cancel()
    for ev in dev.mod.made:
        ev.done = True
    later.join(5.0)
    last.join(5.0)
    assert not later.is_alive() and not last.is_alive() and not later.reported
    assert not _still_followed()


def _in_forked_child() -> int:
    """The child's checks (an exit code: 0 passed)."""
    from camp2p_overlap.core.overlap.watch.watchdog import WATCHER

    if WATCHER.thread() is not None or WATCHER.following():
        return 10
    if WATCHER.started:
        return 11
    _, watch = _closed_fake_step(0.2, 7)
    thread = WATCHER.thread()
    if thread is None or not thread.is_alive() or WATCHER.started != 1:
        return 12
    watch.join(5.0)
    return 0 if watch.reported else 13


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_a_watcher_of_its_own() -> None:
    """A forked child has no watcher thread and follows none of its parent's
    steps; its first step starts a watcher of its own, which reports."""
    from camp2p_overlap.core.overlap.watch.watchdog import WATCHER

    dev, parent = _closed_fake_step(30.0, 1)
    deadline = time.perf_counter() + 5.0
    while WATCHER.following() and not any(ev.queries for ev in dev.mod.made) and time.perf_counter() < deadline:
        time.sleep(0.001)  # until the parent's watcher follows it
    assert WATCHER.thread() is not None and parent.is_alive()
    run_forked(
        _in_forked_child,
        {
            10: "the child inherited its parent's watcher or steps",
            11: "the child inherited its parent's thread count",
            12: "the child's first step started no watcher of its own",
            13: "the child's stalled step was not reported",
        },
    )
    assert parent.is_alive()  # the parent's watcher still follows its step
    for ev in dev.mod.made:
        ev.done = True
    parent.join(5.0)
    assert not parent.is_alive() and not parent.reported


def test_the_watchdog_is_on_by_default_and_0_turns_it_off(make_world, logs, patch_layer: PatchLayer) -> None:
    """With no watchdog setting an engaged step is handed to the watcher (at
    the default 60 s); a stalled step with ``watchdog_s=0`` hands none and
    is not reported, and ``start_watchdog`` refuses 0."""
    from camp2p_overlap.core.env_vars import DEFAULT_WATCHDOG_S
    from camp2p_overlap.core.overlap.watch.watchdog import WATCHER, start_watchdog

    w = make_world(layers=2, stage_ids=(0, 1), tokens=8, op_timeout_s=0.6)
    _apply(patch_layer)
    assert patch_layer.engine.config.watchdog_s == DEFAULT_WATCHDOG_S == 60.0
    handed = WATCHER.handed
    out = run_step_bounded(w, 1, STEP_BOUND_S)
    assert out.error is None and not out.hung
    assert WATCHER.handed == handed + 1
    assert not _still_followed() and stall_reports(logs) == []

    _apply(patch_layer, watchdog_s=0)
    handed = WATCHER.handed
    with FaultPlan(w, [Fault("stop", "a2e", 1, 1)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 2, STEP_BOUND_S)
    assert isinstance(out.error, PeerTimeoutError), out
    assert WATCHER.handed == handed and stall_reports(logs) == []
    assert start_watchdog(0.0, lambda: None, 3) is None  # type: ignore[arg-type]


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
    assert not _still_followed()


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
