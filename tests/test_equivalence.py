"""Overlap == serial, bitwise, over hundreds of seeded random schedules, and
every edge of the design holds in each recorded trace: once per supported
stack (``standin_stack``: that stack's runner stand-in and manifest)."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict

import pytest
from _overlap_util import (
    Schedule,
    apply_cpu,
    assert_same,
    delay_hook,
    run_step,
    serial_results,
    world,
    wrap_model,
)

from camp2p_overlap.core import trace
from camp2p_overlap.core.process import ENGINE

pytestmark = pytest.mark.usefixtures("standin_stack")

N_SCHEDULES = 210
MAX_DELAY_MS = 2.0
#: (A2E on a side stream, E2A on a side stream, minimum stages)
CONFIGS = [(True, True, 1), (True, True, 2), (False, True, 1), (True, False, 1), (True, False, 2)]
STAGE_CHOICES = [(0,), (0, 1), (0, 2), (1, 2), (0, 1, 2)]
#: Model layers drawn per world: world 0 runs every layer on FFN (3 or 4 FFN
#: layers); world 1 runs only MoE layers (index >= 1 and even), so 5..8 model
#: layers give FFN layers (2, 4) or (2, 4, 6). No schedule has fewer than 2.
LAYER_RANGE = [(3, 4), (5, 8)]
#: Steps the overlap must engage for the seeds below: the schedules whose
#: stage count reaches the drawn config's ``min_stages`` (every other gate
#: rule of ``decide()`` passes for all of them: stage ids 0..2 fit, at least
#: one direction is on, the layer list is non-empty and has no repeat).
EXPECTED_ENGAGED = 187  # 210 schedules - 23 single-stage ones drawn with min_stages=2


def ffn_layers(wi: int, num_layers: int) -> list[int]:
    """The FFN layer list world ``wi`` must run for ``num_layers`` model layers."""
    return list(range(num_layers)) if wi == 0 else [i for i in range(num_layers) if i >= 1 and i % 2 == 0]


def draw_schedule(rng: random.Random, step: int, layer_range: tuple[int, int]) -> Schedule:
    stages = rng.choice(STAGE_CHOICES)
    layers = rng.randint(*layer_range)
    tokens = tuple(rng.randint(1, 16) for _ in stages)
    return Schedule(layers, stages, tokens, step)


def test_random_schedules_equal_serial_and_every_edge_holds() -> None:
    rng = random.Random(0xC0FFEE)
    worlds = [
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
    jobs: list[tuple[int, Schedule, tuple[bool, bool, int]]] = []
    for i in range(N_SCHEDULES):
        wi = rng.randrange(len(worlds))
        sched = draw_schedule(rng, step=i + 1, layer_range=LAYER_RANGE[wi])
        jobs.append((wi, sched, rng.choice(CONFIGS)))
    # The gate engages exactly when the stage count reaches min_stages.
    expected_engaged = sum(len(sched.stages) >= cfg[2] for _, sched, cfg in jobs)
    assert expected_engaged == EXPECTED_ENGAGED

    refs = {}
    for wi, w in enumerate(worlds):
        mine = [(i, s) for i, (j, s, _) in enumerate(jobs) if j == wi]
        for (i, sched), res in zip(mine, serial_results(w, [s for _, s in mine]), strict=True):
            layers = ffn_layers(wi, sched.layers)
            assert len(layers) >= 2, f"schedule {sched} has FFN layers {layers}"
            # Every (FFN layer, stage) pair delivered an output: nothing compares {} with {}.
            assert sorted(res) == sorted(itertools.product(layers, sched.stages)), sched
            refs[i] = res

    delay_rng = random.Random(7)
    for w in worlds:
        w.transport.fault_hook = delay_hook(delay_rng, MAX_DELAY_MS)
        wrap_model(w, before=lambda _layer: delay_hook(delay_rng, MAX_DELAY_MS)("ffn", 0, 0))

    by_config: dict[tuple[bool, bool, int], list[int]] = defaultdict(list)
    for i, (_, _, cfg) in enumerate(jobs):
        by_config[cfg].append(i)
    engaged = checked = 0
    for (a2e, e2a, min_stages), idx in sorted(by_config.items()):
        apply_cpu(a2e_on_side_stream=a2e, e2a_on_side_stream=e2a, min_stages=min_stages)
        for i in idx:
            wi, sched, _ = jobs[i]
            w = worlds[wi]
            with trace.recording() as rec:
                got = run_step(w, sched)
            assert_same(got, refs[i])
            layers = tuple(w.layer_list())
            assert list(layers) == ffn_layers(wi, sched.layers)
            on = len(sched.stages) >= min_stages
            expected = (
                trace.ExpectedSchedule(layers, tuple(sorted(sched.stages)), a2e, e2a)
                if on
                else trace.ExpectedSchedule.serial(layers, sorted(sched.stages))
            )
            (step,) = rec.steps()
            ops = rec.ops(step)
            result = trace.check_step(ops, expected)
            assert result.ok, f"schedule {sched} config {(a2e, e2a, min_stages)}:\n{result}"
            side = {o.stream for o in ops if o.kind in ("a2e", "e2a")} - {"C"}
            assert bool(side) == on
            engaged += bool(side)  # counted from the trace, not from the gate rule
            checked += 1
        ENGINE.unpatch(timeout=10)
    assert checked == N_SCHEDULES
    assert engaged == expected_engaged
