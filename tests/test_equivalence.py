"""Overlap == serial, bitwise, over hundreds of seeded random schedules, and
every edge of the design holds in each recorded trace."""

from __future__ import annotations

import random
from collections import defaultdict

from _overlap_util import (
    Schedule,
    apply_cpu,
    assert_same,
    delay_hook,
    random_schedule,
    run_step,
    serial_results,
    world,
    wrap_model,
)

from camp2p_overlap.core import trace
from camp2p_overlap.core.engine import ENGINE

N_SCHEDULES = 210
MAX_DELAY_MS = 2.0
#: (A2E on a side stream, E2A on a side stream, minimum stages)
CONFIGS = [(True, True, 1), (True, True, 2), (False, True, 1), (True, False, 1), (True, False, 2)]


def test_random_schedules_equal_serial_and_every_edge_holds() -> None:
    rng = random.Random(0xC0FFEE)
    worlds = [
        world(layers=4, stage_ids=(0, 1, 2), op_timeout_s=10.0),
        # Layer lists that skip layers: only MoE layers 1, 3, 5 (of 6) run on FFN.
        world(
            layers=6,
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
        sched = random_schedule(rng, step=i + 1, max_layers=4 if wi == 0 else 6)
        jobs.append((wi, sched, rng.choice(CONFIGS)))

    refs = {}
    for wi, w in enumerate(worlds):
        mine = [(i, s) for i, (j, s, _) in enumerate(jobs) if j == wi]
        for (i, _), res in zip(mine, serial_results(w, [s for _, s in mine]), strict=True):
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
            # An empty layer list (gated world, one layer) runs nothing at all.
            on = len(sched.stages) >= min_stages and bool(layers)
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
            engaged += on
            checked += 1
        ENGINE.unpatch(timeout=10)
    assert checked == N_SCHEDULES
    assert engaged >= N_SCHEDULES // 2  # the overlap really ran for most schedules
