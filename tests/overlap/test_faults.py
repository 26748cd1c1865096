"""Faults inside a step, on the CPU backend and the emulated world.

Chosen faults: errors inside a step (A2E, FFN, E2A at random points)
surface to the caller unchanged, never hang, leave every side stream idle,
and the next step is correct; a silent peer is reported as a stall, then
times out. A deliberately wrong order deadlocks in the emulation.

The CPU backend is the emulated device: every stream, the compute stream
included, is a worker thread and the host only enqueues. An A2E/E2A fault
fires inside its kernel, on a stream worker: it poisons that stream and
surfaces when the step ends (the side streams' errors at the session's
close, the compute stream's at the device synchronize ``World.run_step``
does), after the host has issued the whole step. A fault in the model's
host part (the FFN) is a host error and raises at once (the world then lets
the device finish what the step had issued before the next step).

Property-based fault injection (hypothesis, ``tests/support/strategies.py``): runs
each with one fault (an exception, a delay, or an attention peer that stops
answering) at a drawn (layer, stage) and op kind (A2E, FFN, E2A), drawn
stage sets, layouts (compute-side, the default; comm-side with its drawn
directions), directions and rollout modes; a failure shrinks to a minimal
run. Every run must:

* end within a bound (a hang fails the run instead of blocking the suite);
* give outputs bitwise equal to the serial path (delays) or surface the
  injected error to the caller with its exact type (raise, stop);
* leave the side streams joined: no emulated op of the step still in
  flight once its outcome is known (after the device has run what the step
  issued), every worker stream idle;
* leave the next step correct;
* leave no thread behind: after ``unpatch()`` the threads are exactly those
  from before ``apply()``, and no ``camp2p-overlap-stream-*`` thread lives.

The serial path (patch not applied) gets the same fault and must fail with
the same exception type (or give the same outputs) - the overlap changes
where the error happens, never what the caller sees.

Every test runs once per supported stack (``standin_stack``).

Layouts: ``compute-side`` (the default) runs every A2E and E2A on C in the
overlap's order and the FFNs on F, so a kernel fault poisons C and every
later op of the step; ``comm-side`` runs each stage's A2E/E2A on its side
stream K_s (the direction switches refine it), so a fault poisons that
stage's stream only.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.logs import PackageLogs
from support.overlap import (
    Schedule,
    apply_cpu,
    assert_same,
    assert_stack,
    assert_streams_idle,
    bounded,
    run_step,
    serial_results,
    stream_sets,
    world,
    wrap_model,
)
from support.strategies import DIRECTIONS, FAULT_SITES, FaultRun, fault_runs, schedules, tokens_for

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.core.overlap.streams import StreamPoisonedError, make_backend
from camp2p_overlap.core.overlap.watch.watchdog import WATCHER_THREAD
from camp2p_overlap.core.patch_layer import PatchLayer, build_patch_layer
from camp2p_overlap.emulation.device import Stream
from camp2p_overlap.emulation.faults import Fault, FaultPlan, InjectedIOError, run_step_bounded
from camp2p_overlap.emulation.world import PeerTimeoutError, World

pytestmark = pytest.mark.usefixtures("standin_stack")

# ---------------------------------------------------------------------------
# Errors at chosen points of a step.


class InjectedFault(RuntimeError):
    pass


#: Distinct step numbers across examples (the peers send per-step data).
_STEP_NUMBERS = itertools.count(1)
POINT: dict[str, Any] = {
    "sched": Schedule(3, (0, 1, 2), (5, 9, 3), step=1),
    "next": Schedule(3, (0, 1, 2), (4, 7, 2), step=2),
    "layer": 1,
    "stage": 1,
}


#: The layouts of the overlap mode (the direction switches refine comm-side only).
LAYOUTS = ("compute-side", "comm-side")


def _layout_config(layout: str, directions: tuple[bool, bool]) -> dict[str, Any]:
    """The config of ``layout``: comm-side with the direction switches, compute-side (which ignores them)."""
    if layout == "compute-side":
        return {"layouts": (layout,)}
    a2e, e2a = directions
    return {"layouts": (layout,), "a2e_on_side_stream": a2e, "e2a_on_side_stream": e2a}


@st.composite
def fault_points(draw: st.DrawFn) -> dict[str, Any]:
    """An error at a drawn op of a drawn step, then a clean step of the same shape."""
    sched = draw(schedules(multi=True))
    return {
        "sched": sched,
        "next": Schedule(sched.layers, sched.stages, draw(tokens_for(sched.stages)), step=sched.step + 1),
        "where": draw(st.sampled_from(FAULT_SITES)),
        "layer": draw(st.integers(0, sched.layers - 1)),
        "stage": draw(st.sampled_from(sched.stages)),
        "layout": draw(st.sampled_from(LAYOUTS)),
        "dirs": draw(st.sampled_from(DIRECTIONS)),
    }


#: The op timeout of the runs with an injected error. Where the error leaves
#: an op waiting for its peer (a poisoned stream never sends the E2A the peer
#: waits for), that op times out and the step ends with the injected error,
#: the first one: the timeout only bounds how long that takes. The clean
#: steps' ops wait for their peer a few ms.
ERROR_OP_TIMEOUT_S = 1.0


@pytest.fixture
def error_world(standin_stack: str) -> World:
    return world(layers=4, stage_ids=(0, 1, 2), op_timeout_s=ERROR_OP_TIMEOUT_S)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=settings().max_examples // 2)
@given(p=fault_points())
@example(p={**POINT, "where": "a2e", "layout": "comm-side", "dirs": (True, True)})
@example(p={**POINT, "where": "ffn", "layout": "comm-side", "dirs": (False, True)})
@example(p={**POINT, "where": "e2a", "layout": "comm-side", "dirs": (True, False)})
@example(p={**POINT, "where": "a2e", "layout": "compute-side", "dirs": (True, True)})
@example(p={**POINT, "where": "ffn", "layout": "compute-side", "dirs": (True, True)})
@example(p={**POINT, "where": "e2a", "layout": "compute-side", "dirs": (True, True)})
def test_injected_errors_surface_unchanged_and_the_next_step_is_correct(
    error_world: World, patch_layer: PatchLayer, p: dict[str, Any]
) -> None:
    w = error_world
    steps = itertools.count(2 * next(_STEP_NUMBERS) + 1)
    p = {**p, "sched": replace(p["sched"], step=next(steps)), "next": replace(p["next"], step=next(steps))}
    patch_layer.engine.unpatch(timeout=10)
    (ref,) = serial_results(w, [p["next"]], patch_layer)
    raised: dict[str, Any] = {}
    target: dict[str, Any] = {}

    def hook(kind: str, layer: int, stage: int) -> None:
        if (kind, layer, stage) == (target.get("where"), target.get("layer"), target.get("stage")):
            raised["exc"] = InjectedFault(f"injected {kind} fault at layer {layer} stage {stage}")
            raise raised["exc"]

    ffn_calls: list[tuple[int, int]] = []

    def before_ffn(layer: int, stage: int) -> None:
        ffn_calls.append((layer, stage))
        hook("ffn", layer, stage)

    original = wrap_model(w, before_with_stage=before_ffn)
    w.transport.fault_hook = hook
    try:
        apply_cpu(patch_layer=patch_layer, **_layout_config(p["layout"], p["dirs"]))
        target.clear()
        target.update(where=p["where"], layer=p["layer"], stage=p["stage"])
        raised.clear()
        ffn_calls.clear()
        with pytest.raises(InjectedFault) as info:
            bounded(lambda p=p: run_step(w, p["sched"]), timeout=30)
        assert info.value is raised["exc"], "the caller must get the injected exception object itself"
        assert str(info.value) == f"injected {p['where']} fault at layer {p['layer']} stage {p['stage']}"
        assert_streams_idle(timeout=5, patch_layer=patch_layer)
        sched = p["sched"]
        order = [(L, s) for L in range(sched.layers) for s in sorted(sched.stages)]
        at = order.index((p["layer"], p["stage"]))
        if p["where"] == "ffn":
            # A host error: the loop stops in that FFN.
            assert ffn_calls == order[: at + 1]
        elif p["where"] == "a2e" or p["layout"] == "compute-side" or p["dirs"] != (False, True):
            # A kernel error does not stop the host (it no longer surfaces at
            # the receive, as when the host ran C): the host issues the whole
            # step, every FFN once in loop order, and the error surfaces at
            # the step's end.
            assert ffn_calls == order
        else:
            # A2E on C, E2A on K_s: before the stage's next A2E the host
            # checks K_s's errors and raises one that has already happened,
            # so the loop may stop there, after the failed E2A's own FFN.
            assert ffn_calls == order[: len(ffn_calls)] and len(ffn_calls) > at
        target.clear()
        assert_same(bounded(lambda p=p: run_step(w, p["next"]), timeout=30), ref)
        assert_streams_idle(timeout=5, patch_layer=patch_layer)
    finally:
        patch_layer.engine.unpatch(timeout=10)
        w.transport.fault_hook = None
        vars(w.transport).pop("a2e", None)  # the examples share the world: undo wrap_model
        vars(w.runner.model).pop("compute_ffn_output", None)
        assert w.runner.model.compute_ffn_output == original


@pytest.mark.parametrize("layout", LAYOUTS)
def test_error_in_first_prefetch_of_another_stage_surfaces_at_the_end_of_the_step(
    patch_layer: PatchLayer, layout: str
) -> None:
    """The prologue A2E of stage 1 fails in its kernel (on K1 in comm-side, on
    C in compute-side). It used to surface at the loop's receive of (L0, s1),
    before FFN(L0, s1); on the device it is an asynchronous error of its
    stream: the host issues the whole step (every FFN), the error surfaces
    when the step ends, and the stream's later ops are skipped. comm-side:
    K1's, so stage 1 delivers nothing while stage 0 does; compute-side: C's,
    which holds every E2A of the step, so nothing is delivered."""
    w = world(layers=3, stage_ids=(0, 1))
    sched = Schedule(3, (0, 1), (8, 8), step=1)
    nxt = Schedule(3, (0, 1), (8, 8), step=2)
    (ref,) = serial_results(w, [nxt], patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer, layouts=(layout,))
    ffn_layers: list[int] = []
    wrap_model(w, before=ffn_layers.append)

    def hook(kind: str, layer: int, stage: int) -> None:
        if (kind, layer, stage) == ("a2e", 0, 1):
            raise InjectedFault("prologue a2e of stage 1")

    w.transport.fault_hook = hook
    with pytest.raises(InjectedFault, match=r"^prologue a2e of stage 1$"):
        bounded(lambda: run_step(w, sched))
    assert ffn_layers == [0, 0, 1, 1, 2, 2]  # the host was not stopped
    assert not [key for key in w.transport.results if key[1] == 1]  # stage 1 delivers nothing
    if layout == "comm-side":
        # K1 is poisoned from its first op on, while stage 0's first E2A
        # (which depends on nothing of K1) still runs on K0.
        assert (0, 0) in w.transport.results
    else:
        # C is poisoned from its second op on (the prologue's A2E of stage 1): every E2A is behind it.
        assert w.transport.results == {}
    assert_streams_idle(patch_layer=patch_layer)
    w.transport.fault_hook = None
    assert_same(bounded(lambda: run_step(w, nxt)), ref)


def test_model_error_surfaces_and_streams_join(patch_layer: PatchLayer) -> None:
    """A model error is a host error: it raises at once."""
    w = world(layers=4, stage_ids=(0, 1, 2))
    sched = Schedule(4, (0, 1, 2), (4, 9, 16), step=5)
    nxt = Schedule(4, (0, 1, 2), (16, 1, 7), step=6)
    (ref,) = serial_results(w, [nxt], patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer)
    calls: list[int] = []

    def before(layer: int) -> None:
        calls.append(layer)
        if len(calls) == 8:
            raise ZeroDivisionError("model blew up at its 8th call")

    original = wrap_model(w, before=before)
    with pytest.raises(ZeroDivisionError, match=r"^model blew up at its 8th call$"):
        bounded(lambda: run_step(w, sched))
    assert len(calls) == 8  # raised at once: the loop went no further
    assert_streams_idle(patch_layer=patch_layer)
    w.runner.model.compute_ffn_output = original
    assert_same(bounded(lambda: run_step(w, nxt)), ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_silent_peer_is_reported_as_a_stall_then_times_out(
    logs: PackageLogs, patch_layer: PatchLayer, layout: str
) -> None:
    w = world(layers=3, stage_ids=(0, 1), op_timeout_s=1.0)
    apply_cpu(patch_layer=patch_layer, watchdog_s=0.2, layouts=(layout,))

    def hook(kind: str, layer: int, stage: int) -> None:
        if (kind, layer, stage) == ("a2e", 1, 1):
            w.transport.stop_peer(1)  # attention rank of stage 1 stops answering

    w.transport.fault_hook = hook
    with pytest.raises(PeerTimeoutError, match=r"\(peer stopped\)"):
        bounded(lambda: run_step(w, Schedule(3, (0, 1), (8, 8), step=1)))
    (report,) = logs.texts("has not finished after 0.2 s", logging.WARNING)
    # It names the op that waits for the silent peer, where it runs, and its pending event.
    stream = "K1" if layout == "comm-side" else "C"
    assert f"likely missing peer op: a2e(L1,s1) on {stream}" in report
    assert "event a L1 s1: pending" in report
    if layout == "compute-side":
        assert "compute stream C is blocked in a2e(L1,s1)" in report
        assert "FFN stream: F waits for a2e(L1,s1) on C (event a L1 s1 pending)" in report
    assert_streams_idle(patch_layer=patch_layer)


# ---------------------------------------------------------------------------
# Property-based fault injection: one drawn fault per run.

STEP_BOUND_S = 20.0


def _camp2p_threads() -> list[threading.Thread]:
    """The patch layer's threads a step leaves behind (not the process's step watcher: it outlives its steps)."""
    return [t for t in threading.enumerate() if t.name.startswith("camp2p-overlap-") and t.name != WATCHER_THREAD]


def _threads() -> set[threading.Thread]:
    """Every thread but the step watcher (it ends and starts again on its own, between steps)."""
    return {t for t in threading.enumerate() if t.name != WATCHER_THREAD}


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("camp2p-overlap-stream-")]


def _side_streams(patch_layer: PatchLayer) -> list[Stream]:
    return [k for s in stream_sets(patch_layer) for k in s.streams.values() if isinstance(k, Stream)]


class Runner:
    def __init__(self, make_world: Callable[..., World], op_timeout_s: float) -> None:
        self.make_world = make_world
        self.op_timeout_s = op_timeout_s
        self.worlds: dict[tuple[int, tuple[int, ...]], World] = {}
        #: The runner's own patch layer (not the process-wide one).
        self.patch_layer = build_patch_layer()

    def world(self, run: FaultRun) -> World:
        key = (run.layers, run.stages)
        if key not in self.worlds:
            self.worlds[key] = self.make_world(
                layers=run.layers, stage_ids=run.stages, tokens=16, op_timeout_s=self.op_timeout_s
            )
        return self.worlds[key]

    def step(self, w: World, n: int, tokens: dict[int, int]):
        out = run_step_bounded(w, n, STEP_BOUND_S, tokens=tokens)
        assert not out.hung, f"step {n} did not finish within {STEP_BOUND_S} s"
        return out

    def check(self, run: FaultRun, layout: str, *, serial_too: bool = True) -> None:
        w = self.world(run)
        fault = run.fault
        n = next(_STEP_NUMBERS)
        a, b = 2 * n + 11, 2 * n + 12  # step numbers: peers send per-step data
        self.patch_layer.engine.unpatch(timeout=10)  # a failed example may have left it applied
        assert not self.patch_layer.engine.is_applied()
        ref_a = self.step(w, a, run.tokens)
        ref_b = self.step(w, b, run.tokens)
        assert ref_a.error is None and ref_b.error is None

        if serial_too:
            # The serial path with the same fault: what the caller must see.
            with FaultPlan(w, [fault]) as plan:
                plan.arm()
                ser = self.step(w, a, run.tokens)
            assert len(plan.fired) == 1
            want = fault.expected_error()
            assert (type(ser.error) if ser.error else None) is want, f"{run}: serial path gave {ser.error!r}"

        before = _threads()
        assert not _stream_threads(), f"{run}: stream threads alive before apply: {_stream_threads()}"
        cfg = OverlapConfig(
            enabled=True,
            backend="cpu",
            adaptive=False,
            mode=run.mode,  # type: ignore[arg-type]
            **_layout_config(layout, run.directions),
        )
        report = self.patch_layer.engine.apply(config=cfg, strict=True)
        assert report.applied
        assert_stack(report)
        try:
            with FaultPlan(w, [fault]) as plan:
                plan.arm()
                out = self.step(w, a, run.tokens)
                # Joined: nothing of the step still in flight on any group
                # once its outcome is known (after a host error the world let
                # the device finish what the step had issued).
                busy = {s: p.busy for s, p in w.transport.peers.items() if p.busy is not None}
            assert not busy, f"{run}: ops still running after the step returned: {busy}"
            assert len(plan.fired) == 1, f"{run}: fault fired {len(plan.fired)} times"
            for k in _side_streams(self.patch_layer):
                assert k.drain(timeout=5.0), f"{run}: side stream {k.name} not idle"
            want = fault.expected_error()
            if want is None:
                assert out.error is None, f"{run}: unexpected {out.error!r}"
                assert_same(out.results, ref_a.results, f"{run}: outputs differ from the serial path")
            else:
                assert type(out.error) is want, f"{run}: expected {want.__name__}, got {out.error!r}"
                if fault.action == "raise":
                    assert "injected" in str(out.error), f"{run}: a different error surfaced: {out.error!r}"
            nxt = self.step(w, b, run.tokens)
            assert nxt.error is None, f"{run}: the next step failed: {nxt.error!r}"
            assert_same(nxt.results, ref_b.results, f"{run}: the next step's outputs differ")
        finally:
            assert self.patch_layer.engine.unpatch(timeout=10)
        assert not _stream_threads(), f"{run}: stream threads left after unpatch: {_stream_threads()}"
        for t in _camp2p_threads():
            t.join(5.0)
        after = _threads()
        assert after == before, f"{run}: threads differ: new {after - before}, gone {before - after}"


@pytest.fixture
def runners() -> Iterator[dict[float, Runner]]:
    """One runner (its worlds, its patch layer) per op timeout; the examples of a test share them."""
    made: dict[float, Runner] = {}
    yield made
    for r in made.values():
        r.patch_layer.engine.unpatch(timeout=10)


def _runner(runners: dict[float, Runner], op_timeout_s: float) -> Runner:
    if op_timeout_s not in runners:
        runners[op_timeout_s] = Runner(world, op_timeout_s)
    return runners[op_timeout_s]


SHARED = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def _run(action: str, **kw: Any) -> FaultRun:
    """An explicit example: a fault on the overlap path (all three stages)."""
    base: dict[str, Any] = {
        "layers": 3,
        "stages": (0, 1, 2),
        "directions": (True, True),
        "mode": "overlap",
        "tokens": {0: 5, 1: 9, 2: 3},
    }
    fault = kw.pop("fault")
    return FaultRun(fault=fault, **{**base, **kw})


CS, KS = "compute-side", "comm-side"


@SHARED
@given(run=fault_runs("raise"), layout=st.sampled_from(LAYOUTS))
@example(run=_run("raise", fault=Fault("raise", "a2e", 1, 1)), layout=CS)
@example(run=_run("raise", fault=Fault("raise", "e2a", 0, 2)), layout=CS)
@example(run=_run("raise", fault=Fault("raise", "a2e", 1, 1)), layout=KS)
@example(run=_run("raise", fault=Fault("raise", "ffn", 2, 0, exc_type=InjectedIOError)), layout=KS)
@example(run=_run("raise", fault=Fault("raise", "e2a", 0, 2), directions=(True, False)), layout=KS)
@example(run=_run("raise", fault=Fault("raise", "a2e", 2, 1), mode="reorder"), layout=CS)
@example(run=_run("raise", fault=Fault("raise", "e2a", 1, 0), mode="parity"), layout=CS)
def test_injected_exceptions_surface_with_their_type(runners: dict[float, Runner], run: FaultRun, layout: str) -> None:
    _runner(runners, ERROR_OP_TIMEOUT_S).check(run, layout)


@SHARED
@given(run=fault_runs("delay"), layout=st.sampled_from(LAYOUTS))
@example(run=_run("delay", fault=Fault("delay", "a2e", 1, 1, delay_s=0.01)), layout=CS)
@example(run=_run("delay", fault=Fault("delay", "a2e", 1, 1, delay_s=0.01)), layout=KS)
@example(run=_run("delay", fault=Fault("delay", "ffn", 0, 2, delay_s=0.01)), layout=KS)
@example(run=_run("delay", fault=Fault("delay", "e2a", 2, 0, delay_s=0.01), mode="reorder"), layout=CS)
def test_injected_delays_keep_outputs_bitwise_equal(runners: dict[float, Runner], run: FaultRun, layout: str) -> None:
    _runner(runners, 10.0).check(run, layout)


@settings(SHARED, max_examples=max(settings().max_examples // 4, 4))
@given(run=fault_runs("stop"), layout=st.sampled_from(LAYOUTS))
@example(run=_run("stop", fault=Fault("stop", "a2e", 1, 1)), layout=CS)
@example(run=_run("stop", fault=Fault("stop", "e2a", 0, 2)), layout=CS)
@example(run=_run("stop", fault=Fault("stop", "a2e", 1, 1)), layout=KS)
@example(run=_run("stop", fault=Fault("stop", "e2a", 0, 2)), layout=KS)
@example(run=_run("stop", fault=Fault("stop", "a2e", 1, 0), mode="reorder"), layout=CS)
def test_stopped_peers_time_out_and_leave_nothing_behind(
    runners: dict[float, Runner], run: FaultRun, layout: str
) -> None:
    _runner(runners, 0.3).check(run, layout)


@pytest.mark.slow
@settings(SHARED, max_examples=settings().max_examples * 4)
@given(run=st.sampled_from(["raise", "delay", "stop"]).flatmap(fault_runs), layout=st.sampled_from(LAYOUTS))
def test_fault_injection_many_examples(runners: dict[float, Runner], run: FaultRun, layout: str) -> None:
    timeout = {"stop": 0.3, "raise": ERROR_OP_TIMEOUT_S}.get(run.fault.action, 10.0)
    _runner(runners, timeout).check(run, layout)


def test_the_harness_catches_a_hang(patch_layer: PatchLayer) -> None:
    """The bound is real: a delay longer than the bound is reported as hung
    (so a deadlocked overlap would fail a run rather than block the suite)."""
    w = world(layers=1, stage_ids=(0, 1), tokens=4)
    assert patch_layer.engine.apply(
        config=OverlapConfig(enabled=True, backend="cpu", adaptive=False), strict=True
    ).applied
    with FaultPlan(w, [Fault("delay", "e2a", 0, 1, delay_s=1.5)]) as plan:
        plan.arm()
        out = run_step_bounded(w, 1, 0.2)
        assert out.hung
        # Let it finish before the plan is removed and the patch layer unpatched.
        for t in threading.enumerate():
            if t.name == "camp2p-test-step-1":
                t.join(10)
    assert patch_layer.engine.unpatch(timeout=10)


# ---------------------------------------------------------------------------
# The wrong order deadlocks: the emulation models the protocol.


class LookaheadBeforeE2A(StepSession):
    """Test-only broken schedule: queues the lookahead A2E of a stage on its
    A2E stream (K_s, or C) ahead of that stage's E2A."""

    def send(self, call: Any, output: Any, context: Any, stage: int | None) -> Any:
        key = self.stage_layer_of(context)
        if key is not None:
            nxt = self.plan.next_layer(key[0])
            if nxt is not None:
                self.issue_a2e(nxt, key[1])
        return super().send(call, output, context, stage)

    def issue_a2e(self, layer: int, stage: int) -> None:
        if self.a2e_issued(layer, stage):
            return  # already queued, too early
        super().issue_a2e(layer, stage)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lookahead_queued_before_its_e2a_deadlocks_until_the_op_timeout(
    monkeypatch: pytest.MonkeyPatch, patch_layer: PatchLayer, layout: str
) -> None:
    """The lookahead A2Es deadlock: in comm-side both stages', each on its
    own side stream; in compute-side the first one on C, with the rest of
    the step behind it. The host no longer blocks in stage 0's receive, so
    the error the step reports is the one of the A2E the device started
    first (a device reports asynchronous errors in the order its kernels
    ran): either group's."""
    w = world(layers=3, stage_ids=(0, 1), op_timeout_s=0.5)
    apply_cpu(patch_layer=patch_layer, layouts=(layout,))
    # Control: the real order completes with the same short timeout.
    run_step(w, Schedule(3, (0, 1), (8, 8), step=1))
    monkeypatch.setattr(patch_layer.runtime, "session_class", LookaheadBeforeE2A)
    with pytest.raises(
        PeerTimeoutError,
        match=r"^a2e\(L1\) on afd1?: no data from attention after 0.5 s \(waiting for this stage's e2a\)$",
    ):
        bounded(lambda: run_step(w, Schedule(3, (0, 1), (8, 8), step=2)), timeout=30)
    assert_streams_idle(patch_layer=patch_layer)


def test_wrong_order_on_one_stream_deadlocks_driving_the_backend_directly() -> None:
    """Same as above without the session: on one side stream of the emulated device,
    A2E(1) queued before E2A(0) of the same group waits for an E2A that
    can only run after it."""
    w = world(layers=2, stage_ids=(0,), op_timeout_s=0.4)
    t = w.transport
    t.begin_step(1, [0, 1], [0])
    backend = make_backend("cpu")
    try:
        k = backend.new_stream("K0")
        a0 = backend.submit(k, lambda: t.a2e(group="afd", stage=0, layer=0, num_tokens=4), label="a2e L0")
        hidden, bs = a0.result()
        a1 = backend.submit(k, lambda: t.a2e(group="afd", stage=0, layer=1, num_tokens=4), label="a2e L1")
        e0 = backend.submit(
            k,
            lambda: t.e2a(group="afd", stage=0, layer=0, routed=hidden, shared=None, atten_batch_size=bs),
            label="e2a L0",
        )
        assert k.drain(timeout=10)
        # Kernel errors are asynchronous: the ops' handles and the stream carry them.
        assert isinstance(a1.exception(), PeerTimeoutError)
        assert "waiting for this stage's e2a" in str(a1.exception())
        assert isinstance(e0.exception(), StreamPoisonedError) and "e2a L0 skipped" in str(e0.exception())
        assert backend.peek_errors([k]) == [a1.exception()]
        # The right order on the same stream completes.
        t.begin_step(2, [0, 1], [0])
        backend.take_errors([k])
        a0 = backend.submit(k, lambda: t.a2e(group="afd", stage=0, layer=0, num_tokens=4))
        hidden, bs = a0.result()
        backend.submit(k, lambda: t.e2a(group="afd", stage=0, layer=0, routed=hidden, shared=None, atten_batch_size=bs))
        a1 = backend.submit(k, lambda: t.a2e(group="afd", stage=0, layer=1, num_tokens=4))
        assert k.drain(timeout=10)
        assert a1.result()[0].shape == (4, w.spec.shape.hidden)
    finally:
        backend.close()
