"""Every layout == serial, bitwise, over property-based schedules
(hypothesis: layers, stage sets of 1 to 3 stages, tokens, min_stages, on
two worlds), for each layout: compute-side (the default), comm-side, and
comm-side with either direction switched off, reorder and parity, and the
pair compute-side,comm-side under adaptive engage; every edge of the design
holds in each recorded trace, and on the production path (no recorder, no
watchdog) in the step's own log: once per supported stack
(``standin_stack``: that stack's runner stand-in and manifest). A failing
schedule shrinks to a minimal one."""

from __future__ import annotations

import itertools
import random
from typing import Any

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
from support.strategies import schedules

from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.overlap.plan import (
    A2E_ONLY,
    COMM_SIDE,
    COMPUTE_SIDE,
    E2A_ONLY,
    PARITY,
    REORDER,
    Layout,
)
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


#: Every layout: its configuration, and the layouts an engaged step may run (adaptive engage: either listed one,
#: or the serial path).
LAYOUTS: dict[str, tuple[dict[str, Any], tuple[Layout, ...]]] = {
    "compute-side": ({"layouts": ("compute-side",)}, (COMPUTE_SIDE,)),
    "comm-side": ({"layouts": ("comm-side",)}, (COMM_SIDE,)),
    "comm-side A2E=0": ({"layouts": ("comm-side",), "a2e_on_side_stream": False}, (E2A_ONLY,)),
    "comm-side E2A=0": ({"layouts": ("comm-side",), "e2a_on_side_stream": False}, (A2E_ONLY,)),
    "reorder": ({"mode": "reorder"}, (REORDER,)),
    "parity": ({"mode": "parity"}, (PARITY,)),
    "compute-side,comm-side adaptive": (
        {"layouts": ("compute-side", "comm-side"), "adaptive": True},
        (COMPUTE_SIDE, COMM_SIDE),
    ),
}
each_layout = pytest.mark.parametrize("layout", list(LAYOUTS))


@st.composite
def jobs(draw: st.DrawFn) -> tuple[int, Schedule, int]:
    """(world, schedule, min_stages)."""
    wi = draw(st.integers(0, 1))
    sched = draw(schedules(layers=LAYER_RANGE[wi]))
    return wi, sched, draw(st.integers(1, 2))


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


def issue_order(layers: tuple[int, ...], stages: tuple[int, ...], layout: Layout) -> list[Call]:
    """The A2E/E2A issue order of an engaged step: the loop's (parity, e2a-only) or the overlap's."""
    return overlap_issue_order(layers, stages) if layout.prefetch else upstream_order(layers, stages)


def expected_of(layout: Layout, layers: tuple[int, ...], stages: tuple[int, ...]) -> trace.ExpectedSchedule:
    """What an engaged step of ``layout`` plans, written out from the layout."""
    return trace.ExpectedSchedule(
        layers, stages, layout.a2e_side, layout.e2a_side, layout.ffn_side, prefetch=layout.prefetch
    )


def _step(
    worlds: list, patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, job: tuple, layout: str, *, traced: bool
) -> tuple[Schedule, tuple[int, ...], tuple[int, ...], Any, Any]:
    """One step of ``job`` in ``layout``, bitwise equal to upstream's serial loop: its schedule, FFN layers and
    stages, its session (None: the serial path) and its recorder (None unless ``traced``)."""
    wi, sched, min_stages = job
    sched = Schedule(sched.layers, sched.stages, sched.tokens, next(_STEPS))
    w = worlds[wi]
    patch_layer.engine.unpatch(timeout=10)
    (ref,) = serial_results(w, [sched], patch_layer)
    layers = tuple(ffn_layers(wi, sched.layers))
    assert len(layers) >= 2, f"schedule {sched} has FFN layers {layers}"
    # Every (FFN layer, stage) pair delivered an output: nothing compares {} with {}.
    assert sorted(ref) == sorted(itertools.product(layers, sched.stages)), sched

    config, allowed = LAYOUTS[layout]
    apply_cpu(patch_layer=patch_layer, min_stages=min_stages, **config)
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer, keep=True)
    rec = None
    try:
        if traced:
            with trace.recording() as rec:
                got = run_step(w, sched)
        else:
            got = run_step(w, sched)
    finally:
        patch_layer.engine.unpatch(timeout=10)
    assert_same(got, ref, f"{layout}, schedule {sched}, min_stages {min_stages}")
    assert tuple(w.layer_list()) == layers
    stages = tuple(sorted(sched.stages))
    if len(stages) < min_stages:
        assert not sessions.kept  # the serial path: no session
        return sched, layers, stages, None, rec
    session = None
    if sessions.kept:
        (session,) = sessions.kept
        assert any(session.layout is want for want in allowed), (layout, session.layout)
        assert session.expected_schedule() == expected_of(session.layout, layers, stages)
        assert session.issued() == issue_order(layers, stages, session.layout)
    else:  # only adaptive engage runs an engaged shape serially (a serial probe, or serial decided)
        assert config.get("adaptive"), f"{layout}: schedule {sched} ran serially"
    return sched, layers, stages, session, rec


@each_layout
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=settings().max_examples * 2 // 5)
@given(job=jobs())
@example(job=(0, Schedule(4, (0, 1, 2), (5, 9, 3), 1), 2))
@example(job=(1, Schedule(8, (0, 2), (16, 1), 1), 1))
@example(job=(1, Schedule(7, (1, 2), (4, 12), 1), 2))
@example(job=(0, Schedule(3, (0,), (8,), 1), 1))
@example(job=(0, Schedule(3, (0,), (8,), 1), 2))
@example(job=(1, Schedule(8, (0, 1, 2), (3, 3, 3), 1), 2))
def test_random_schedules_equal_serial_and_every_edge_holds(
    worlds: list, patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, layout: str, job: tuple
) -> None:
    sched, layers, stages, session, rec = _step(worlds, patch_layer, monkeypatch, job, layout, traced=True)
    (step,) = rec.steps()
    ops = rec.ops(step)
    expected = trace.ExpectedSchedule.serial(layers, stages) if session is None else session.expected_schedule()
    result = edges.check_step(ops, expected)
    assert result.ok, f"{layout}: schedule {sched} min_stages {job[2]}:\n{result}"
    side = {o.stream for o in ops if o.kind in ("a2e", "ffn", "e2a")} - {"C"}
    # engaged on side streams, from the trace, not from the gate rule
    assert bool(side) == (session is not None and session.layout.side), (layout, side)
    # the A2E/E2A issue order, from the trace
    comm = sorted((o for o in ops if o.kind in ("a2e", "e2a")), key=lambda o: o.seq)
    want = upstream_order(layers, stages) if session is None else issue_order(layers, stages, session.layout)
    assert [(o.kind, o.layer, o.stage) for o in comm] == want


@each_layout
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=settings().max_examples // 4)
@given(job=jobs())
@example(job=(0, Schedule(4, (0, 1, 2), (5, 9, 3), 1), 2))
@example(job=(1, Schedule(8, (0, 2), (16, 1), 1), 1))
@example(job=(1, Schedule(7, (1, 2), (4, 12), 1), 2))
@example(job=(0, Schedule(3, (0,), (8,), 1), 1))
def test_random_schedules_on_the_production_path_equal_serial_and_every_edge_holds(
    worlds: list, patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, layout: str, job: tuple
) -> None:
    """The same schedules as production runs them (no recorder, no
    watchdog): bitwise equal to serial, and the edge checker passes on the
    step's own log (the host's issue order and its event graph)."""
    sched, layers, stages, session, _ = _step(worlds, patch_layer, monkeypatch, job, layout, traced=False)
    if session is None:
        return
    rec = trace.TraceRecorder()
    session.emit_trace(rec)
    result = edges.check_step(rec.ops(), expected_of(session.layout, layers, stages), source="session", timings=False)
    assert result.ok, f"{layout}: schedule {sched} min_stages {job[2]}:\n{result}"


def test_adaptive_engage_runs_each_listed_layout_equal_to_serial(
    worlds: list, patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adaptive engage over compute-side,comm-side learns one shape: its steps run each listed layout and the
    serial path, each bitwise equal to serial, every edge holding in each traced engaged step."""
    ran: list[str] = []
    for _ in range(12):
        _, layers, stages, session, rec = _step(
            worlds,
            patch_layer,
            monkeypatch,
            (0, Schedule(3, (0, 1), (8, 8), 1), 2),
            "compute-side,comm-side adaptive",
            traced=True,
        )
        ran.append("serial" if session is None else session.layout.name)
        if session is not None:
            (step,) = rec.steps()
            result = edges.check_step(rec.ops(step), expected_of(session.layout, layers, stages))
            assert result.ok, f"{session.layout.name}:\n{result}"
    assert {"compute-side", "comm-side", "serial"} <= set(ran), ran
