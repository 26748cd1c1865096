"""A process forked after overlap steps ran (CPU backend: stream worker
threads exist in the parent, not in the child) still runs correct overlap
steps in the child: the child forgets the parent's stream sets and makes
its own."""

from __future__ import annotations

import multiprocessing as mp
import sys

import pytest
import torch
from support.overlap import Schedule, apply_cpu, assert_same, run_step, serial_results, world

from camp2p_overlap.core.patch_layer import PATCH_LAYER

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork start method is Linux-only here")

_W = None
_SCHED = Schedule(3, (0, 1), (8, 8), step=5)


def _child(q: mp.Queue) -> None:  # runs in the forked child
    try:
        sets_inherited = len(PATCH_LAYER.runtime.runners.stream_sets())
        before = dict(PATCH_LAYER.runtime.stats()["layout_steps"])
        out = run_step(_W, _SCHED)
        after = PATCH_LAYER.runtime.stats()["layout_steps"]
        engaged = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
        sets = len(PATCH_LAYER.runtime.runners.stream_sets())
        q.put((sets_inherited, sets, engaged, {k: v.tolist() for k, v in out.items()}))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(repr(exc))


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_forked_child_gets_fresh_streams_and_correct_outputs(layout: str) -> None:
    global _W
    _W = world(layers=3, stage_ids=(0, 1), tokens=8)
    (ref,) = serial_results(_W, [_SCHED])
    apply_cpu(layouts=(layout,))
    assert_same(run_step(_W, _SCHED), ref)
    assert len(PATCH_LAYER.runtime.runners.stream_sets()) == 1

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(q,))
    proc.start()
    try:
        got = q.get(timeout=60)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert not isinstance(got, str), got
    inherited, after, engaged, out = got
    assert inherited == 0  # the parent's sets (dead threads in the child) are forgotten
    assert after == 1
    assert engaged == {layout: 1}  # the child's step engaged, in the layout
    assert out.keys() == ref.keys()
    assert_same({k: torch.tensor(v) for k, v in out.items()}, ref)
    assert proc.exitcode == 0


def _child_unpatch(q: mp.Queue) -> None:
    from camp2p_overlap.core.patch_layer import PATCH_LAYER

    try:
        q.put((PATCH_LAYER.engine.unpatch(timeout=5), PATCH_LAYER.engine.is_applied()))
    except BaseException as exc:  # noqa: BLE001
        q.put(repr(exc))


def test_fork_while_another_thread_runs_a_step_leaves_the_child_able_to_unpatch() -> None:
    """The parent forks while a step is in flight on another thread (holding
    its step count): the child has no such thread, so unpatch there must not
    wait for it."""
    import threading

    from camp2p_overlap.core.patch_layer import PATCH_LAYER

    w = world(layers=2, stage_ids=(0, 1), tokens=8)
    apply_cpu()
    inside = threading.Event()
    release = threading.Event()
    model = w.runner.model
    real = model.compute_ffn_output

    def slow(**kw: object) -> object:
        inside.set()
        release.wait(30)
        return real(**kw)

    model.compute_ffn_output = slow
    t = threading.Thread(target=lambda: run_step(w, Schedule(2, (0, 1), (8, 8), step=1)))
    t.start()
    try:
        assert inside.wait(30)
        assert PATCH_LAYER.engine.gate.running() == 1  # the step is counted in the parent
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        proc = ctx.Process(target=_child_unpatch, args=(q,))
        proc.start()
        got = q.get(timeout=60)
        proc.join(timeout=30)
    finally:
        release.set()
        t.join(30)
    assert got == (True, False), got
