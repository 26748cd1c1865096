"""Fault injection: a schedule missing one event wait, run end to end on the
emulated device, is caught by the outputs (a consumer reads a buffer its
producer's kernel has not filled) and by the edge checker reading what the
device's streams performed, not what the session says it asked for.

The emulated device lets the host run ahead of every stream, the compute
stream included, so a missing wait of either kind changes outputs: the
FFN reading an A2E buffer not yet filled (edge 3), and an E2A sending an
FFN output not yet computed (edge 4). Holds make the stale read certain,
not likely. The waits are removed in two places: in the session (a
subclass that skips the wait) and in the backend (its ``wait`` drops it
while the session still records that it asked for it).

Every case runs under both timing models of the emulated device
(``WorldSpec.timing``): wall-clock kernels, and modelled ones (the FFN
held to its calibrated duration and publishing its outputs at its modelled
end, the comm kernels held to the link model); a modelled run must have
run modelled kernels of every kind, so it exercises the holds and the
modelled clock, not a wall-clock fallback."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.overlap import Schedule, apply_cpu, assert_same, run_step, serial_results, world, wrap_model

from camp2p_overlap.core.keys import A_DONE, COMPUTE_STREAM, F_DONE, EventKey
from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.observe.trace import ExpectedSchedule
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.core.overlap.streams import make_backend
from camp2p_overlap.core.overlap.streams.backend import StreamBackend
from camp2p_overlap.core.patch_layer import PatchLayer, build_patch_layer
from camp2p_overlap.emulation import device
from camp2p_overlap.verify import edges

LAYERS = (0, 1, 2)
STAGES = (0, 1)
SCHED = Schedule(3, STAGES, (8, 8), step=1)
TIMINGS = pytest.mark.parametrize("timing", ["wall", "model"])
EXPECTED = ExpectedSchedule(LAYERS, STAGES, True, True)
EDGE3 = "edge 3 (FFN waits its A2E)"
EDGE4 = "edge 4 (E2A waits its FFN)"


class SessionSkipsComputeWaitForA2E(StepSession):
    def wait_event(self, stream: Any, key: EventKey) -> None:
        if stream is self.compute and key.kind == A_DONE:
            return
        super().wait_event(stream, key)


class SessionSkipsStageWaitForFFN(StepSession):
    def wait_event(self, stream: Any, key: EventKey) -> None:
        if stream is not self.compute and key.kind == F_DONE:
            return
        super().wait_event(stream, key)


def _backend_dropping(on_compute: bool, kind: str) -> Callable[..., None]:
    """A backend ``wait`` that silently drops waits of the compute stream
    (``on_compute``) or of the side streams on events of ``kind`` (the
    session believes it waited)."""
    original = StreamBackend.wait

    def wait(self: StreamBackend, stream: Any, event: Any) -> None:
        if (stream.name == COMPUTE_STREAM) == on_compute and event.key.kind == kind:
            return
        original(self, stream, event)

    return wait


class _Flags:
    """One flag per (layer, stage), set from a kernel and waited by another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flags: dict[tuple[int, int], threading.Event] = {}

    def __call__(self, key: tuple[int, int]) -> threading.Event:
        with self._lock:
            return self._flags.setdefault(key, threading.Event())


def _hold_a2e_fill_until_its_ffn_ran(w: Any) -> None:
    """Each A2E kernel fills its buffer only once the FFN kernel of its
    (layer, stage) has run (or after 10 s: a correct schedule would wait
    that long, so only broken ones use this)."""
    ran = _Flags()
    current: list[tuple[int, int]] = []

    def before(layer: int, stage: int) -> None:
        current.append((layer, stage))

    def after(_: Any) -> None:
        flag = ran(current.pop())
        device.launch(flag.set)  # on C, right after the FFN's kernel

    def hook(kind: str, layer: int, stage: int) -> None:
        if kind == "a2e":
            ran((layer, stage)).wait(10.0)

    wrap_model(w, after=after, before_with_stage=before)
    w.transport.fault_hook = hook


def _hold_ffn_until_its_e2a_ran(w: Any) -> None:
    """Each FFN kernel starts only once the E2A of its (layer, stage) has
    sent (or after 10 s), so an E2A not ordered after its FFN sends the
    output buffer unfilled."""
    sent = _Flags()
    transport = w.transport
    e2a_kernel = type(transport)._e2a_kernel.__get__(transport)

    def e2a_then_flag(group: str, stage: int, layer: int, *args: Any) -> None:
        try:
            e2a_kernel(group, stage, layer, *args)
        finally:
            sent((layer, stage)).set()

    transport._e2a_kernel = e2a_then_flag  # type: ignore[method-assign]

    def before(layer: int, stage: int) -> None:
        flag = sent((layer, stage))
        device.launch(lambda: flag.wait(10.0))  # on C, right before the FFN's kernel

    wrap_model(w, before_with_stage=before)


def _world(timing: str) -> Any:
    """The test world; ``model``: the FFN calibrated at the schedule's tokens."""
    return world(layers=3, stage_ids=STAGES, tokens=SCHED.tokens[0], timing=timing)


def _assert_timing_ran(timing: str) -> None:
    """What the device counted since the step began: under the model, FFN,
    A2E and E2A kernels held to their modelled durations; else none."""
    kinds = device.take_timing().kinds
    if timing == "wall":
        assert kinds == {}
        return
    assert set(kinds) == {"ffn", "a2e", "e2a"}
    want = len(LAYERS) * len(STAGES)
    assert all(kinds[k].kernels >= want for k in kinds), {k: v.kernels for k, v in kinds.items()}


def _run_broken(
    monkeypatch: pytest.MonkeyPatch,
    timing: str,
    *,
    session: type | None = None,
    wait: Any = None,
    hold: Callable[[Any], None] | None = None,
):
    """One step of a patch layer of its own with the schedule broken as asked."""
    w = _world(timing)
    patch_layer = build_patch_layer()
    (ref,) = serial_results(w, [SCHED], patch_layer)
    apply_cpu(patch_layer=patch_layer)
    if session is not None:
        monkeypatch.setattr(patch_layer.runtime, "session_class", session)
    if wait is not None:
        monkeypatch.setattr(StreamBackend, "wait", wait)
    if hold is not None:
        hold(w)
    device.take_timing()
    try:
        with trace.recording() as rec:
            got = run_step(w, SCHED)
    finally:
        assert patch_layer.engine.unpatch(timeout=10)
    _assert_timing_ran(timing)
    return got, ref, rec.ops(rec.steps()[0])


def _differs(got: dict, ref: dict) -> list[tuple[int, int]]:
    assert sorted(got) == sorted(ref)
    return [k for k in ref if not torch.equal(got[k], ref[k])]


@TIMINGS
def test_control_every_wait_in_place_passes(patch_layer: PatchLayer, timing: str) -> None:
    """Control: the same world and step with every wait in place gives the
    serial outputs and a clean check."""
    w = _world(timing)
    (ref,) = serial_results(w, [SCHED], patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer)
    device.take_timing()
    try:
        with trace.recording() as rec:
            got = run_step(w, SCHED)
    finally:
        patch_layer.engine.unpatch(timeout=10)
    _assert_timing_ran(timing)
    assert_same(got, ref)
    res = edges.check_step(rec.ops(rec.steps()[0]), EXPECTED)
    assert res.ok, str(res)


@TIMINGS
def test_session_without_compute_wait_for_a2e(
    monkeypatch: pytest.MonkeyPatch, patch_layer: PatchLayer, timing: str
) -> None:
    got, ref, ops = _run_broken(
        monkeypatch, timing, session=SessionSkipsComputeWaitForA2E, hold=_hold_a2e_fill_until_its_ffn_ran
    )
    assert _differs(got, ref) == sorted(ref)  # every FFN read an unfilled buffer
    text = str(edges.check_step(ops, EXPECTED))
    for L in LAYERS:
        for s in STAGES:
            assert f"{EDGE3}: nothing orders a2e(L{L},s{s}) on K{s} before ffn(L{L},s{s}) on C" in text
            assert f"ffn(L{L},s{s}) started" in text  # and the kernel times say so


@TIMINGS
def test_backend_dropping_compute_wait_for_a2e(monkeypatch: pytest.MonkeyPatch, timing: str) -> None:
    got, ref, ops = _run_broken(
        monkeypatch, timing, wait=_backend_dropping(True, A_DONE), hold=_hold_a2e_fill_until_its_ffn_ran
    )
    assert _differs(got, ref) == sorted(ref)
    performed = str(edges.check_step(ops, EXPECTED))
    asked = str(edges.check_step(ops, EXPECTED, source="session"))
    assert f"{EDGE3}: nothing orders a2e(L1,s0) on K0 before ffn(L1,s0) on C" in performed
    # The session's own record says it waited: its graph has every edge 3.
    assert any(o.kind == "wait" and o.source == "session" and o.detail == EventKey(A_DONE, 1, 0).label() for o in ops)
    assert EDGE3 not in asked


@TIMINGS
def test_session_without_stage_wait_for_ffn(monkeypatch: pytest.MonkeyPatch, timing: str) -> None:
    got, ref, ops = _run_broken(
        monkeypatch, timing, session=SessionSkipsStageWaitForFFN, hold=_hold_ffn_until_its_e2a_ran
    )
    # The host ran ahead of the compute stream: every E2A sent its FFN's
    # output before the FFN had filled it.
    assert _differs(got, ref) == sorted(ref)
    text = str(edges.check_step(ops, EXPECTED))
    for L in LAYERS:
        for s in STAGES:
            assert f"{EDGE4}: nothing orders ffn(L{L},s{s}) on C before e2a(L{L},s{s}) on K{s}" in text


@TIMINGS
def test_backend_dropping_stage_wait_for_ffn(monkeypatch: pytest.MonkeyPatch, timing: str) -> None:
    got, ref, ops = _run_broken(
        monkeypatch, timing, wait=_backend_dropping(False, F_DONE), hold=_hold_ffn_until_its_e2a_ran
    )
    assert _differs(got, ref) == sorted(ref)
    performed = str(edges.check_step(ops, EXPECTED))
    asked = edges.check_step(ops, EXPECTED, source="session")
    assert f"{EDGE4}: nothing orders ffn(L0,s0) on C before e2a(L0,s0) on K0" in performed
    # The session's own record of its waits has every edge 4; only what the
    # streams performed (the graph, and the kernels' times) shows the gap.
    assert EDGE4 not in str(asked)
    assert "e2a(L0,s0) started" in str(asked) and "before its ffn ended" in str(asked)


def test_a_host_that_reads_without_waiting_reads_stale_data() -> None:
    """The contract under the outputs above: a side-stream op's value is
    out before its kernel has filled it (the host ran ahead); an event
    recorded after the op fires only once the kernel has run, and a host
    read after a wait on it (here: a synchronize of the compute stream)
    sees the filled buffer."""
    b = make_backend("cpu")
    try:
        k = b.new_stream("K0")
        gate = threading.Event()

        def op() -> torch.Tensor:
            out = torch.full((4,), float("nan"))

            def kernel() -> None:
                gate.wait(10)
                out.fill_(1.0)

            device.launch(kernel, writes=(out,))
            return out

        h = b.submit(k, op, label="a2e L0 s0")
        ev = b.record(k, EventKey(A_DONE, 0, 0))
        early = h.result()  # no wait: the value, unfilled
        assert torch.isnan(early).all() and not h.done() and not ev.query()
        c = b.compute_stream()
        b.wait(c, ev)
        assert torch.isnan(early).all()  # the wait is queued on C: the host did not block
        gate.set()
        b.synchronize(c)
        assert h.done() and ev.query() and torch.equal(early, torch.ones(4))
    finally:
        b.close()
