"""Fault injection: a schedule missing one event wait, run end to end on the
emulated device, is caught by the outputs (a consumer reads a buffer its
producer's kernel has not filled) and by the edge checker reading what the
device's streams performed, not what the session says it asked for; in
every layout with side streams: comm-side (A2E and E2A on K_s, the FFN on
the caller's stream C) and compute-side (A2E and E2A on C, the FFN on F).

The emulated device lets the host run ahead of every stream, the compute
stream included, so a missing wait of either kind changes outputs: the
FFN reading an A2E buffer not yet filled (edge 3), and an E2A sending an
FFN output not yet computed (edge 4). Holds make the stale read certain,
not likely. The waits are removed in two places: in the session (a
subclass that skips the wait) and on the device (a stream's ``wait_event``
drops it while the session still records that it asked for it). The fork and the
join (edges 1 and 7) order no output of a step the test reads (the next
step starts after the world synchronizes the device): the edge checker
alone catches their loss.

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

from camp2p_overlap.core.keys import A_DONE, F_DONE, FFN_STREAM, FORK, JOIN, EventKey
from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.observe.trace import ExpectedSchedule
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.core.overlap.streams import make_backend
from camp2p_overlap.core.patch_layer import PatchLayer, build_patch_layer
from camp2p_overlap.emulation import device
from camp2p_overlap.verify import edges

LAYERS = (0, 1, 2)
STAGES = (0, 1)
SCHED = Schedule(3, STAGES, (8, 8), step=1)
TIMINGS = pytest.mark.parametrize("timing", ["wall", "model"])
#: The layouts with side streams on the ladder: what a step of each expects.
EXPECTED = {
    "comm-side": ExpectedSchedule(LAYERS, STAGES, True, True),
    "compute-side": ExpectedSchedule(LAYERS, STAGES, False, False, True),
}
LAYOUTS = pytest.mark.parametrize("layout", list(EXPECTED))
EDGE1 = "edge 1 (fork)"
EDGE3 = "edge 3 (FFN waits its A2E)"
EDGE4 = "edge 4 (E2A waits its FFN)"
EDGE7 = "edge 7 (join)"


def _streams(layout: str, stage: int) -> tuple[str, str, str]:
    """The streams of A2E, FFN and E2A of ``stage`` in ``layout``."""
    e = EXPECTED[layout]
    return e.stream_for("a2e", stage), e.stream_for("ffn", stage), e.stream_for("e2a", stage)


class SessionSkipsFfnWaitForA2E(StepSession):
    """The FFN's stream skips its wait of a_done(L, s) (comm-side: C; compute-side: F)."""

    def wait_event(self, stream: Any, key: EventKey) -> None:
        if key.kind == A_DONE and stream is self.ffn_on[key.stage]:
            return
        super().wait_event(stream, key)


class SessionSkipsE2AWaitForFFN(StepSession):
    """The E2A's stream skips its wait of f_done(L, s) (comm-side: K_s; compute-side: C)."""

    def wait_event(self, stream: Any, key: EventKey) -> None:
        if key.kind == F_DONE and stream is self.e2a_on[key.stage]:
            return
        super().wait_event(stream, key)


class SessionSkipsForkWaitOfF(StepSession):
    """F skips its wait of the fork."""

    def wait_event(self, stream: Any, key: EventKey) -> None:
        if key.kind == FORK and stream is self.side_streams.get(None):
            return
        super().wait_event(stream, key)


class SessionSkipsJoinOfF(StepSession):
    """C skips its wait of F's join (the join is still recorded on F)."""

    def wait_event(self, stream: Any, key: EventKey) -> None:
        if key == EventKey.join(None):
            return
        super().wait_event(stream, key)


class SessionJoinsNoSideStream(StepSession):
    """The join restores the caller's stream but issues no join edge."""

    def join(self) -> None:
        forked, self.forked = self.forked, False
        try:
            super().join()
        finally:
            self.forked = forked


def _device_dropping(kind: str) -> Callable[..., None]:
    """A device stream ``wait_event`` that silently drops every wait on an event of ``kind`` (the session issued
    the wait and logged it): in each layout one stream waits each kind (a_done: the FFN's; f_done: the E2A's;
    fork: each side stream; join: C)."""
    original = device.Stream.wait_event

    def wait_event(self: Any, event: Any) -> None:
        if getattr(event, "key", None) is not None and event.key.kind == kind:
            return
        original(self, event)

    return wait_event


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
        device.launch(flag.set)  # on the FFN's stream, right after the FFN's kernel

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
        device.launch(lambda: flag.wait(10.0))  # on the FFN's stream, right before the FFN's kernel

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
    layout: str,
    *,
    session: type | None = None,
    wait: Any = None,
    hold: Callable[[Any], None] | None = None,
):
    """One step in ``layout`` of a patch layer of its own with the schedule broken as asked."""
    w = _world(timing)
    patch_layer = build_patch_layer()
    (ref,) = serial_results(w, [SCHED], patch_layer)
    apply_cpu(patch_layer=patch_layer, layouts=(layout,))
    if session is not None:
        monkeypatch.setattr(patch_layer.runtime, "session_class", session)
    if wait is not None:
        monkeypatch.setattr(device.Stream, "wait_event", wait)
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


def _checked(ops: Any, layout: str, source: str = "auto") -> str:
    """The edge checker's verdict on the step's trace, as text."""
    return str(edges.check_step(ops, EXPECTED[layout], source=source))


@LAYOUTS
@TIMINGS
def test_control_every_wait_in_place_passes(patch_layer: PatchLayer, timing: str, layout: str) -> None:
    """Control: the same world and step with every wait in place gives the
    serial outputs and a clean check."""
    w = _world(timing)
    (ref,) = serial_results(w, [SCHED], patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer, layouts=(layout,))
    device.take_timing()
    try:
        with trace.recording() as rec:
            got = run_step(w, SCHED)
    finally:
        patch_layer.engine.unpatch(timeout=10)
    _assert_timing_ran(timing)
    assert_same(got, ref)
    ops = rec.ops(rec.steps()[0])
    for source in ("backend", "session"):
        res = edges.check_step(ops, EXPECTED[layout], source=source)
        assert res.ok, f"{source}: {res}"
    assert {o.stream for o in ops if o.kind == "ffn"} == {_streams(layout, 0)[1]}


# ---------------------------------------------------------------------------
# Edge 3: the FFN's stream waits a_done(L, s)


@LAYOUTS
@TIMINGS
def test_session_without_ffn_wait_for_a2e(
    monkeypatch: pytest.MonkeyPatch, patch_layer: PatchLayer, timing: str, layout: str
) -> None:
    got, ref, ops = _run_broken(
        monkeypatch, timing, layout, session=SessionSkipsFfnWaitForA2E, hold=_hold_a2e_fill_until_its_ffn_ran
    )
    assert _differs(got, ref) == sorted(ref)  # every FFN read an unfilled buffer
    assert not any(o.kind == "wait" and o.detail.startswith(f"{A_DONE} ") for o in ops)
    for source in ("backend", "session"):
        text = _checked(ops, layout, source)
        for L in LAYERS:
            for s in STAGES:
                a, f, _ = _streams(layout, s)
                assert f"{EDGE3}: nothing orders a2e(L{L},s{s}) on {a} before ffn(L{L},s{s}) on {f}" in text, source
                assert f"ffn(L{L},s{s}) started" in text  # and the kernel times say so


@LAYOUTS
@TIMINGS
def test_device_dropping_ffn_wait_for_a2e(monkeypatch: pytest.MonkeyPatch, timing: str, layout: str) -> None:
    got, ref, ops = _run_broken(
        monkeypatch, timing, layout, wait=_device_dropping(A_DONE), hold=_hold_a2e_fill_until_its_ffn_ran
    )
    assert _differs(got, ref) == sorted(ref)
    performed = _checked(ops, layout)
    asked = _checked(ops, layout, "session")
    for L in LAYERS:
        for s in STAGES:
            a, f, _ = _streams(layout, s)
            assert f"{EDGE3}: nothing orders a2e(L{L},s{s}) on {a} before ffn(L{L},s{s}) on {f}" in performed
    # The session's own record says it waited: its graph has every edge 3.
    assert any(o.kind == "wait" and o.source == "session" and o.detail == EventKey(A_DONE, 1, 0).label() for o in ops)
    assert EDGE3 not in asked


# ---------------------------------------------------------------------------
# Edge 4: the E2A's stream waits f_done(L, s)


@LAYOUTS
@TIMINGS
def test_session_without_e2a_wait_for_ffn(monkeypatch: pytest.MonkeyPatch, timing: str, layout: str) -> None:
    got, ref, ops = _run_broken(
        monkeypatch, timing, layout, session=SessionSkipsE2AWaitForFFN, hold=_hold_ffn_until_its_e2a_ran
    )
    # The host ran ahead of the FFN's stream: every E2A sent its FFN's
    # output before the FFN had filled it.
    assert _differs(got, ref) == sorted(ref)
    assert not any(o.kind == "wait" and o.detail.startswith(f"{F_DONE} ") for o in ops)
    for source in ("backend", "session"):
        text = _checked(ops, layout, source)
        for L in LAYERS:
            for s in STAGES:
                _, f, e = _streams(layout, s)
                assert f"{EDGE4}: nothing orders ffn(L{L},s{s}) on {f} before e2a(L{L},s{s}) on {e}" in text, source


@LAYOUTS
@TIMINGS
def test_device_dropping_e2a_wait_for_ffn(monkeypatch: pytest.MonkeyPatch, timing: str, layout: str) -> None:
    got, ref, ops = _run_broken(
        monkeypatch, timing, layout, wait=_device_dropping(F_DONE), hold=_hold_ffn_until_its_e2a_ran
    )
    assert _differs(got, ref) == sorted(ref)
    performed = _checked(ops, layout)
    asked = _checked(ops, layout, "session")
    for L in LAYERS:
        for s in STAGES:
            _, f, e = _streams(layout, s)
            assert f"{EDGE4}: nothing orders ffn(L{L},s{s}) on {f} before e2a(L{L},s{s}) on {e}" in performed
    # The session's own record of its waits has every edge 4; only what the
    # streams performed (the graph, and the kernels' times) shows the gap.
    assert EDGE4 not in asked
    assert "e2a(L0,s0) started" in asked and "before its ffn ended" in asked


# ---------------------------------------------------------------------------
# Edges 1 and 7 of F (compute-side): the fork and the join


def _compute_side_step(monkeypatch: pytest.MonkeyPatch, **broken: Any) -> tuple[Any, Any]:
    """One wall-clock compute-side step, broken as asked: its outputs are the serial ones (neither edge orders a
    buffer the step's outputs read); its trace, and the records and waits the session issued on F, in order."""
    got, ref, ops = _run_broken(monkeypatch, "wall", "compute-side", **broken)
    assert_same(got, ref)
    marks = sorted(
        (o for o in ops if o.stream == FFN_STREAM and o.kind in ("wait", "record") and o.source == "session"),
        key=lambda o: o.seq,
    )
    return ops, marks


@pytest.mark.parametrize("where", ["session", "device"])
def test_a_missing_join_of_f_is_caught_by_the_checker(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    broken = {"session": SessionSkipsJoinOfF} if where == "session" else {"wait": _device_dropping(JOIN)}
    ops, _ = _compute_side_step(monkeypatch, **broken)
    performed = _checked(ops, "compute-side")
    assert f"{EDGE7}: the work of F is not waited by C after the step's last op on C" in performed
    asked = _checked(ops, "compute-side", "session")
    if where == "session":
        assert EDGE7 in asked
    else:  # the session's record says C waited it
        assert EDGE7 not in asked


def test_a_join_with_no_edge_is_caught_by_the_checker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The join issues no record and no wait: F's last work is its last f_done, which C waits before its last E2A,
    not after it."""
    ops, f_marks = _compute_side_step(monkeypatch, session=SessionJoinsNoSideStream)
    assert not any(o.detail == EventKey.join(None).label() for o in ops if o.kind in ("record", "wait"))
    assert f_marks and f_marks[0].detail == EventKey.fork().label()  # the fork is there
    for source in ("backend", "session"):
        assert f"{EDGE7}: the work of F is not waited by C" in _checked(ops, "compute-side", source), source


@pytest.mark.parametrize("where", ["session", "device"])
def test_a_missing_fork_wait_of_f_is_caught_by_the_checker(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    broken = {"session": SessionSkipsForkWaitOfF} if where == "session" else {"wait": _device_dropping(FORK)}
    ops, f_marks = _compute_side_step(monkeypatch, **broken)
    # F's first wait is a_done(first layer, first stage), an event of C: only the fork names what it orders.
    assert f_marks[0].detail == (EventKey.fork() if where == "device" else EventKey(A_DONE, 0, 0)).label()
    performed = _checked(ops, "compute-side")
    assert f"{EDGE1}: F starts with" in performed, performed
    asked = _checked(ops, "compute-side", "session")
    if where == "session":
        assert f"{EDGE1}: F starts with" in asked
    else:  # the session's record says F waited it
        assert EDGE1 not in asked


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
        ev = b.event(EventKey(A_DONE, 0, 0))
        ev.record(k)
        early = h.result()  # no wait: the value, unfilled
        assert torch.isnan(early).all() and not h.done() and not ev.query()
        c = b.compute_stream()
        c.wait_event(ev)
        assert torch.isnan(early).all()  # the wait is queued on C: the host did not block
        gate.set()
        b.synchronize(c)
        assert h.done() and ev.query() and torch.equal(early, torch.ones(4))
    finally:
        b.close()
