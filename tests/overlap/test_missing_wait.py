"""Fault injection: a schedule missing one event wait, run end to end on the
CPU backend, is caught by the outputs (a consumer reads a buffer its
producer's kernel has not filled) and by the edge checker reading what the
backend's streams performed, not what the session says it asked for.

The waits are removed in two places: in the session (a subclass that skips
the wait) and in the backend (``CpuBackend.wait`` drops it while the
session still records that it asked for it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.overlap import Schedule, apply_cpu, assert_same, run_step, serial_results, world, wrap_model

from camp2p_overlap.core.keys import A_DONE, F_DONE, EventKey
from camp2p_overlap.core.layer import Layer, build_layer
from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.observe.trace import ExpectedSchedule
from camp2p_overlap.core.overlap.session import OverlapSession
from camp2p_overlap.core.overlap.streams.cpu import CpuBackend, HostStream, WorkerStream
from camp2p_overlap.verify import edges

LAYERS = (0, 1, 2)
STAGES = (0, 1)
SCHED = Schedule(3, STAGES, (8, 8), step=1)
EXPECTED = ExpectedSchedule(LAYERS, STAGES, True, True)
EDGE3 = "edge 3 (FFN waits its A2E)"
EDGE4 = "edge 4 (E2A waits its FFN)"


class SessionSkipsComputeWaitForA2E(OverlapSession):
    def wait_event(self, stream: Any, key: EventKey) -> None:
        if stream is self.compute and key.kind == A_DONE:
            return
        super().wait_event(stream, key)


class SessionSkipsStageWaitForFFN(OverlapSession):
    def wait_event(self, stream: Any, key: EventKey) -> None:
        if stream is not self.compute and key.kind == F_DONE:
            return
        super().wait_event(stream, key)


def _backend_dropping(stream_type: type, kind: str) -> Callable[..., None]:
    """A ``CpuBackend.wait`` that silently drops waits of ``stream_type`` on
    events of ``kind`` (the session believes it waited)."""
    original = CpuBackend.wait

    def wait(self: CpuBackend, stream: Any, event: Any) -> None:
        if isinstance(stream, stream_type) and event.key.kind == kind:
            return
        original(self, stream, event)

    return wait


def _hold_a2e_fill_until_its_ffn_ran(w: Any) -> None:
    """Make a stale read certain, not likely: each A2E kernel fills its
    buffer only once the FFN of its (layer, stage) has finished (or after 10 s:
    a correct schedule would wait that long, so only broken ones use this)."""
    ran: dict[tuple[int, int], threading.Event] = {}
    lock = threading.Lock()
    current: list[tuple[int, int]] = []

    def flag(key: tuple[int, int]) -> threading.Event:
        with lock:
            return ran.setdefault(key, threading.Event())

    def before(layer: int, stage: int) -> None:
        current.append((layer, stage))

    def after(_: Any) -> None:
        flag(current.pop()).set()

    def hook(kind: str, layer: int, stage: int) -> None:
        if kind == "a2e":
            flag((layer, stage)).wait(10.0)

    wrap_model(w, after=after, before_with_stage=before)
    w.transport.fault_hook = hook


def _run_broken(monkeypatch: pytest.MonkeyPatch, *, session: type | None = None, wait: Any = None, hold: bool = False):
    """One step of a layer of its own with the schedule broken as asked."""
    w = world(layers=3, stage_ids=STAGES)
    layer = build_layer()
    (ref,) = serial_results(w, [SCHED], layer)
    apply_cpu(layer=layer)
    if session is not None:
        monkeypatch.setattr(layer.runtime, "session_class", session)
    if wait is not None:
        monkeypatch.setattr(CpuBackend, "wait", wait)
    if hold:
        _hold_a2e_fill_until_its_ffn_ran(w)
    try:
        with trace.recording() as rec:
            got = run_step(w, SCHED)
    finally:
        assert layer.engine.unpatch(timeout=10)
    return got, ref, rec.ops(rec.steps()[0])


def _differs(got: dict, ref: dict) -> list[tuple[int, int]]:
    assert sorted(got) == sorted(ref)
    return [k for k in ref if not torch.equal(got[k], ref[k])]


def test_control_every_wait_in_place_passes(layer: Layer) -> None:
    """Control: the same world and step with every wait in place gives the
    serial outputs and a clean check."""
    w = world(layers=3, stage_ids=STAGES)
    (ref,) = serial_results(w, [SCHED], layer=layer)
    apply_cpu(layer=layer)
    try:
        with trace.recording() as rec:
            got = run_step(w, SCHED)
    finally:
        layer.engine.unpatch(timeout=10)
    assert_same(got, ref)
    res = edges.check_step(rec.ops(rec.steps()[0]), EXPECTED)
    assert res.ok, str(res)


def test_session_without_compute_wait_for_a2e(monkeypatch: pytest.MonkeyPatch, layer: Layer) -> None:
    got, ref, ops = _run_broken(monkeypatch, session=SessionSkipsComputeWaitForA2E, hold=True)
    assert _differs(got, ref) == sorted(ref)  # every FFN read an unfilled buffer
    text = str(edges.check_step(ops, EXPECTED))
    for L in LAYERS:
        for s in STAGES:
            assert f"{EDGE3}: nothing orders a2e(L{L},s{s}) on K{s} before ffn(L{L},s{s}) on C" in text
            assert f"ffn(L{L},s{s}) started" in text  # and the kernel times say so


def test_backend_dropping_compute_wait_for_a2e(monkeypatch: pytest.MonkeyPatch) -> None:
    got, ref, ops = _run_broken(monkeypatch, wait=_backend_dropping(HostStream, A_DONE), hold=True)
    assert _differs(got, ref) == sorted(ref)
    performed = str(edges.check_step(ops, EXPECTED))
    asked = str(edges.check_step(ops, EXPECTED, source="session"))
    assert f"{EDGE3}: nothing orders a2e(L1,s0) on K0 before ffn(L1,s0) on C" in performed
    # The session's own record says it waited: its graph has every edge 3.
    assert any(o.kind == "wait" and o.source == "session" and o.detail == EventKey(A_DONE, 1, 0).label() for o in ops)
    assert EDGE3 not in asked


def test_session_without_stage_wait_for_ffn(monkeypatch: pytest.MonkeyPatch) -> None:
    got, ref, ops = _run_broken(monkeypatch, session=SessionSkipsStageWaitForFFN)
    # The outputs cannot tell on CPU: the compute stream is the host, so the
    # FFN has finished before the loop even issues its send.
    assert_same(got, ref)
    text = str(edges.check_step(ops, EXPECTED))
    assert f"{EDGE4}: nothing orders ffn(L1,s1) on C before e2a(L1,s1) on K1" in text


def test_backend_dropping_stage_wait_for_ffn(monkeypatch: pytest.MonkeyPatch) -> None:
    got, ref, ops = _run_broken(monkeypatch, wait=_backend_dropping(WorkerStream, F_DONE))
    assert_same(got, ref)  # as above: the host finished the FFN before the send
    performed = str(edges.check_step(ops, EXPECTED))
    asked = edges.check_step(ops, EXPECTED, source="session")
    assert f"{EDGE4}: nothing orders ffn(L0,s0) on C before e2a(L0,s0) on K0" in performed
    assert asked.ok, str(asked)  # only what the streams performed shows it


def test_skipped_wait_reads_the_unfilled_buffer_directly() -> None:
    """The backend contract under the outputs above: a side-stream op's
    value is out before its launched kernel has filled it; an event recorded
    after the op fires only once the kernel has run."""
    from camp2p_overlap.core.overlap.streams.cpu import launch

    b = CpuBackend()
    try:
        k = b.new_stream("K0")
        gate = threading.Event()

        def op() -> torch.Tensor:
            out = torch.full((4,), float("nan"))

            def kernel() -> None:
                gate.wait(10)
                out.fill_(1.0)

            launch(kernel)
            return out

        h = b.submit(k, op, label="a2e L0 s0")
        ev = b.record(k, EventKey(A_DONE, 0, 0))
        early = h.result()  # no wait: the value, unfilled
        assert torch.isnan(early).all() and not h.done() and not ev.query()
        gate.set()
        b.wait(b.compute_stream(), ev)
        assert h.done() and torch.equal(early, torch.ones(4))
    finally:
        b.close()
