"""A process forked after overlap steps ran (CPU backend: stream worker
threads exist in the parent, not in the child) still runs correct overlap
steps in the child: the child forgets the parent's stream sets and makes
its own."""

from __future__ import annotations

import multiprocessing as mp
import sys

import pytest
import torch
from _overlap_util import Schedule, apply_cpu, run_step, serial_results, world

from camp2p_overlap import wrappers

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork start method is Linux-only here")

_W = None
_SCHED = Schedule(3, (0, 1), (8, 8), step=5)


def _child(q: mp.Queue) -> None:  # runs in the forked child
    try:
        sets_inherited = wrappers.stream_set_count()
        out = run_step(_W, _SCHED)
        q.put((sets_inherited, wrappers.stream_set_count(), {k: v.tolist() for k, v in out.items()}))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(repr(exc))


def test_forked_child_gets_fresh_streams_and_correct_outputs() -> None:
    global _W
    _W = world(layers=3, stage_ids=(0, 1), tokens=8)
    (ref,) = serial_results(_W, [_SCHED])
    apply_cpu()
    assert all(torch.equal(a, b) for a, b in zip(run_step(_W, _SCHED).values(), ref.values(), strict=True))
    assert wrappers.stream_set_count() == 1

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
    inherited, after, out = got
    assert inherited == 0  # the parent's sets (dead threads in the child) are forgotten
    assert after == 1
    assert out.keys() == ref.keys()
    assert all(torch.equal(torch.tensor(out[k]), ref[k]) for k in ref)
    assert proc.exitcode == 0
