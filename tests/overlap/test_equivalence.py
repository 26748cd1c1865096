"""Overlap (and the parity and reorder modes) == serial, bitwise, over
property-based schedules (hypothesis: layers, stage sets, tokens,
directions, min_stages, modes, on two worlds), and every edge of the design
holds in each recorded trace: once per supported stack (``standin_stack``:
that stack's runner stand-in and manifest). A failing schedule shrinks to a
minimal one."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.overlap import (
    Call,
    Schedule,
    SessionSpy,
    apply_cpu,
    assert_same,
    delay_hook,
    overlap_issue_order,
    run_step,
    serial_results,
    upstream_order,
    world,
    wrap_model,
)
from support.strategies import DIRECTIONS, MODES, schedules

from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.verify import edges

pytestmark = pytest.mark.usefixtures("standin_stack")

MAX_DELAY_MS = 2.0
#: Model layers drawn per world: world 0 runs every layer on FFN (3 or 4 FFN
#: layers); world 1 runs only MoE layers (index >= 1 and even), so 5..8 model
#: layers give FFN layers (2, 4) or (2, 4, 6). No schedule has fewer than 2.
LAYER_RANGE = [(3, 4), (5, 8)]
_STEPS = itertools.count(1)


def ffn_layers(wi: int, num_layers: int) -> list[int]:
    """The FFN layer list world ``wi`` must run for ``num_layers`` model layers."""
    return list(range(num_layers)) if wi == 0 else [i for i in range(num_layers) if i >= 1 and i % 2 == 0]


@st.composite
def jobs(draw: st.DrawFn) -> tuple[int, Schedule, tuple[bool, bool, int], str]:
    """(world, schedule, (A2E side, E2A side, min_stages), mode)."""
    wi = draw(st.integers(0, 1))
    sched = draw(schedules(layers=LAYER_RANGE[wi]))
    a2e, e2a = draw(st.sampled_from(DIRECTIONS))
    return wi, sched, (a2e, e2a, draw(st.integers(1, 2))), draw(st.sampled_from(MODES))


@pytest.fixture
def worlds(standin_stack: str) -> list:
    ws = [
        world(layers=4, stage_ids=(0, 1, 2), op_timeout_s=10.0),
        # Layer lists that skip layers: only MoE layers 2, 4, 6 (of up to 8) run on FFN.
        world(
            layers=8,
            stage_ids=(0, 1, 2),
            op_timeout_s=10.0,
            compute_gate_on_attention=True,
            first_k_dense_replace=1,
            moe_layer_freq=2,
            seed=3,
        ),
    ]
    delay_rng = random.Random(7)  # timing noise only: it changes no output
    for w in ws:
        w.transport.fault_hook = delay_hook(delay_rng, MAX_DELAY_MS)
        wrap_model(w, before=lambda _layer: delay_hook(delay_rng, MAX_DELAY_MS)("ffn", 0, 0))
    return ws


def issue_order(layers: tuple[int, ...], stages: tuple[int, ...], mode: str) -> list[Call]:
    """The A2E/E2A issue order of a parity (the loop's) or reorder (the overlap's) step."""
    return upstream_order(layers, stages) if mode == "parity" else overlap_issue_order(layers, stages)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=settings().max_examples * 3)
@given(job=jobs())
@example(job=(0, Schedule(4, (0, 1, 2), (5, 9, 3), 1), (True, True, 2), "overlap"))
@example(job=(1, Schedule(8, (0, 2), (16, 1), 1), (False, True, 1), "overlap"))
@example(job=(1, Schedule(7, (1, 2), (4, 12), 1), (True, False, 2), "overlap"))
@example(job=(0, Schedule(3, (0,), (8,), 1), (True, True, 1), "overlap"))
@example(job=(0, Schedule(3, (0,), (8,), 1), (True, True, 2), "overlap"))
@example(job=(1, Schedule(8, (0, 1, 2), (3, 3, 3), 1), (True, True, 2), "reorder"))
@example(job=(0, Schedule(4, (0, 1, 2), (7, 2, 9), 1), (True, True, 2), "parity"))
def test_random_schedules_equal_serial_and_every_edge_holds(worlds: list, patch_layer: PatchLayer, job: tuple) -> None:
    wi, sched, (a2e, e2a, min_stages), mode = job
    sched = Schedule(sched.layers, sched.stages, sched.tokens, next(_STEPS))
    w = worlds[wi]
    patch_layer.engine.unpatch(timeout=10)
    (ref,) = serial_results(w, [sched], patch_layer)
    layers = tuple(ffn_layers(wi, sched.layers))
    assert len(layers) >= 2, f"schedule {sched} has FFN layers {layers}"
    # Every (FFN layer, stage) pair delivered an output: nothing compares {} with {}.
    assert sorted(ref) == sorted(itertools.product(layers, sched.stages)), sched

    apply_cpu(patch_layer=patch_layer, a2e_on_side_stream=a2e, e2a_on_side_stream=e2a, min_stages=min_stages, mode=mode)
    try:
        with trace.recording() as rec:
            got = run_step(w, sched)
    finally:
        patch_layer.engine.unpatch(timeout=10)
    assert_same(got, ref)
    assert tuple(w.layer_list()) == layers
    on = len(sched.stages) >= min_stages
    stages = tuple(sorted(sched.stages))
    (step,) = rec.steps()
    ops = rec.ops(step)
    comm = [o for o in ops if o.kind in ("a2e", "e2a")]
    side = {o.stream for o in comm} - {"C"}
    if mode == "overlap" or not on:
        expected = (
            trace.ExpectedSchedule(layers, stages, a2e, e2a) if on else trace.ExpectedSchedule.serial(layers, stages)
        )
        result = edges.check_step(ops, expected)
        assert result.ok, f"schedule {sched} config {(a2e, e2a, min_stages)}:\n{result}"
        assert bool(side) == on  # engaged, from the trace, not from the gate rule
    else:
        # parity / reorder: every op on the compute stream, in the mode's issue order.
        assert not side, f"{mode}: ops on side streams {side}"
        issued = [(o.kind, o.layer, o.stage) for o in sorted(comm, key=lambda o: o.seq)]
        assert issued == issue_order(layers, stages, mode)
        if mode == "parity":
            result = edges.check_step(ops, trace.ExpectedSchedule.serial(layers, stages))
            assert result.ok, f"parity schedule {sched}:\n{result}"


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=jobs())
@example(job=(0, Schedule(4, (0, 1, 2), (5, 9, 3), 1), (True, True, 2), "overlap"))
@example(job=(1, Schedule(8, (0, 2), (16, 1), 1), (False, True, 1), "overlap"))
@example(job=(1, Schedule(7, (1, 2), (4, 12), 1), (True, False, 2), "overlap"))
@example(job=(0, Schedule(4, (0, 1, 2), (7, 2, 9), 1), (True, True, 2), "parity"))
def test_random_schedules_on_the_production_path_equal_serial_and_every_edge_holds(
    worlds: list, patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, job: tuple
) -> None:
    """The same schedules as production runs them (no recorder, no
    watchdog): bitwise equal to serial, and the edge checker passes on the
    step's own log (the host's issue order and its event graph)."""
    wi, sched, (a2e, e2a, min_stages), mode = job
    sched = Schedule(sched.layers, sched.stages, sched.tokens, next(_STEPS))
    w = worlds[wi]
    patch_layer.engine.unpatch(timeout=10)
    (ref,) = serial_results(w, [sched], patch_layer)
    apply_cpu(patch_layer=patch_layer, a2e_on_side_stream=a2e, e2a_on_side_stream=e2a, min_stages=min_stages, mode=mode)
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer, keep=True)
    try:
        got = run_step(w, sched)
    finally:
        patch_layer.engine.unpatch(timeout=10)
    assert_same(got, ref)
    layers, stages = tuple(ffn_layers(wi, sched.layers)), tuple(sorted(sched.stages))
    if len(stages) < min_stages:
        assert not sessions.kept  # the serial path: no session
        return
    (session,) = sessions.kept
    if mode != "overlap":
        assert session.issued() == issue_order(layers, stages, mode)
        return
    rec = trace.TraceRecorder()
    session.emit_trace(rec)
    result = edges.check_step(
        rec.ops(), trace.ExpectedSchedule(layers, stages, a2e, e2a), source="session", timings=False
    )
    assert result.ok, f"schedule {sched} config {(a2e, e2a, min_stages)}:\n{result}"
