"""The overlap schedule on the CPU backend: the overlap itself, stream
selection, the serial path, the lookahead bound, ownership, reuse across
steps and what happens when the loop does not follow the plan."""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support.logs import PackageLogs
from support.overlap import (
    Schedule,
    SessionSpy,
    apply_cpu,
    assert_same,
    assert_streams_idle,
    bounded,
    by_key,
    run_step,
    serial_results,
    spy_forward,
    stream_sets,
    world,
    wrap_model,
)

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.plan import A2E_ONLY, COMM_SIDE, COMPUTE_SIDE, E2A_ONLY, StepPlan
from camp2p_overlap.core.overlap.session import ScheduleMismatchError, StepSession
from camp2p_overlap.core.overlap.streams import make_backend
from camp2p_overlap.core.overlap.streams.streamset import StreamSet
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.emulation import device as emulated_device
from camp2p_overlap.emulation.noop import noop_backend
from camp2p_overlap.emulation.world import LinkModel, ProtocolError
from camp2p_overlap.verify import edges

#: The layouts of the overlap mode: (A2E, E2A on K_s), FFN on F, and the layout.
DIRECTIONS = {
    "compute-side": (False, False, True, COMPUTE_SIDE),
    "both": (True, True, False, COMM_SIDE),
    "A2E=0": (False, True, False, E2A_ONLY),
    "E2A=0": (True, False, False, A2E_ONLY),
}
#: The layouts on the ladder (the default first): what a test that holds for every layout runs on.
LAYOUTS = {"compute-side": COMPUTE_SIDE, "comm-side": COMM_SIDE}
each_layout = pytest.mark.parametrize("layout", list(LAYOUTS))


def layout_config(direction: str) -> dict[str, Any]:
    """The configuration that selects ``direction`` (a key of :data:`DIRECTIONS` or :data:`LAYOUTS`)."""
    if direction in LAYOUTS:
        return {"layouts": (direction,)}
    a2e, e2a, ffn, _ = DIRECTIONS[direction]
    if ffn:
        return {"layouts": ("compute-side",)}
    return {"layouts": ("comm-side",), "a2e_on_side_stream": a2e, "e2a_on_side_stream": e2a}


# ---------------------------------------------------------------------------
# The overlap itself


@each_layout
def test_two_stages_eight_layers_overlap_in_the_trace(patch_layer: PatchLayer, layout: str) -> None:
    """Comm ops of 14 ms (link latency), FFN of 30 ms (real MoE compute padded
    with a sleep): per stage, E2A + attention + A2E = 28 ms <= FFN, so in the
    steady state A2E(L,1) runs under FFN(L,0) and E2A(L,0) under FFN(L,1):
    in comm-side with at least 14 ms of margin on each side of each pair (the
    comm ops on K_s, the FFN on C); in compute-side the comm ops on C, one
    after the other in the overlap's order, and the FFN on F. Every step must
    be correct and pass the edge checker; the overlap must show in one of
    three steps (a busy 2-core box may deschedule a thread for a few ms; a
    schedule that serializes communication and compute never shows it)."""
    w = world(layers=8, stage_ids=(0, 1), link=LinkModel(latency_s=14e-3, bandwidth_Bps=1e15), attn_s=0.0)
    scheds = [Schedule(8, (0, 1), (16, 16), step=i + 1) for i in range(3)]
    link, w.transport.link = w.transport.link, LinkModel(latency_s=0.0)  # outputs do not depend on timing
    refs = serial_results(w, scheds, patch_layer=patch_layer)
    w.transport.link = link
    wrap_model(w, after=lambda _out: emulated_device.launch(lambda: time.sleep(0.030)))  # FFN time, its stream
    apply_cpu(patch_layer=patch_layer, **layout_config(layout))
    side = layout == "comm-side"
    expected = trace.ExpectedSchedule(tuple(range(8)), (0, 1), side, side, not side)
    missed: list[str] = []
    for sched, ref in zip(scheds, refs, strict=True):
        with trace.recording() as rec:
            got = bounded(lambda sched=sched: run_step(w, sched))
        assert_same(got, ref)
        ops = rec.ops(rec.steps()[0])
        res = edges.check_step(ops, expected)
        assert res.ok, str(res)
        op = by_key(ops)
        for L in range(8):
            if side:
                assert op["a2e", L, 1].stream == "K1" and op["e2a", L, 0].stream == "K0"
                assert op["ffn", L, 0].stream == op["ffn", L, 1].stream == "C"
            else:
                assert op["a2e", L, 1].stream == op["e2a", L, 0].stream == "C"
                assert op["ffn", L, 0].stream == op["ffn", L, 1].stream == "F"
        missed = [
            f"A2E({L},1)/FFN({L},0)" for L in range(1, 8) if not edges.overlaps(op["a2e", L, 1], op["ffn", L, 0])
        ] + [f"E2A({L},0)/FFN({L},1)" for L in range(1, 8) if not edges.overlaps(op["e2a", L, 0], op["ffn", L, 1])]
        if not missed:
            break
    assert not missed, f"no overlap in the last of three steps for {missed}"


# ---------------------------------------------------------------------------
# Stream selection

CASES = {
    "S1": ({"stage_ids": (0,), "layers": 3}, (0,), 1, (0, 1, 2)),
    "S2": ({"stage_ids": (0, 1), "layers": 3}, (0, 1), 2, (0, 1, 2)),
    "S3": ({"stage_ids": (0, 1, 2), "layers": 3}, (0, 1, 2), 2, (0, 1, 2)),
    "stages-0-2": ({"stage_ids": (0, 2), "layers": 3}, (0, 2), 2, (0, 1, 2)),
    "skip-layers": (
        {
            "stage_ids": (0, 1),
            "layers": 8,
            "compute_gate_on_attention": True,
            "first_k_dense_replace": 2,
            "moe_layer_freq": 2,
        },
        (0, 1),
        2,
        (2, 4, 6),
    ),
}


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_stream_selection(monkeypatch: pytest.MonkeyPatch, case: str, direction: str, patch_layer: PatchLayer) -> None:
    spec, stages, min_stages, layers = CASES[case]
    a2e, e2a, ffn, layout = DIRECTIONS[direction]
    w = world(**spec)
    assert tuple(w.layer_list()) == layers
    sched = Schedule(spec["layers"], stages, tuple(5 + 3 * s for s in stages), step=4)
    (ref,) = serial_results(w, [sched], patch_layer=patch_layer)
    switches = {"a2e_on_side_stream": a2e, "e2a_on_side_stream": e2a} if not ffn else {}
    listed = ("compute-side",) if ffn else ("comm-side",)
    apply_cpu(patch_layer=patch_layer, layouts=listed, min_stages=min_stages, **switches)
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer, keep=True)
    with trace.recording() as rec:
        got = bounded(lambda: run_step(w, sched))
    assert_same(got, ref)
    assert sessions.count == 1
    session = sessions.kept[0]
    assert session.plan.layers == layers and session.plan.stages == stages
    expected = session.expected_schedule()
    assert session.layout is layout
    assert (expected.a2e_side, expected.e2a_side, expected.ffn_side) == (a2e, e2a, ffn)
    ops = rec.ops(rec.steps()[0])
    res = edges.check_step(ops, expected)
    assert res.ok, str(res)
    for o in ops:
        if o.kind == "a2e":
            assert o.stream == (f"K{o.stage}" if a2e else "C"), o
        elif o.kind == "e2a":
            assert o.stream == (f"K{o.stage}" if e2a else "C"), o
        elif o.kind == "ffn":
            assert o.stream == ("F" if ffn else "C")
    # The lookahead follows the step's layer list, stage by stage.
    for s in stages:
        assert [L for (k, L, st) in session.issued_ops if k == "a2e" and st == s] == list(layers)
        assert [L for (k, L, st) in session.issued_ops if k == "e2a" and st == s] == list(layers)
    side = {o.stream for o in ops if o.kind in ("wait", "record")} - {"C"}
    assert side == ({"F"} if ffn else {f"K{s}" for s in stages})  # no stream of an absent stage is touched


# ---------------------------------------------------------------------------
# The serial path


def _serial_c_order(layers: tuple[int, ...], stages: tuple[int, ...]) -> list[tuple[str, int, int]]:
    return [(k, L, s) for L in layers for s in stages for k in ("a2e", "ffn", "e2a")]


@pytest.mark.parametrize("why", ["one-stage", "switched-off-at-runtime"])
def test_serial_path_calls_the_original_with_every_op_on_c(
    monkeypatch: pytest.MonkeyPatch, why: str, patch_layer: PatchLayer
) -> None:
    stages = (0,) if why == "one-stage" else (0, 1)
    w = world(layers=3, stage_ids=stages)
    sched = Schedule(3, stages, (7,) * len(stages), step=2)
    (ref,) = serial_results(w, [sched], patch_layer=patch_layer)
    calls = spy_forward(type(w.runner), patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer)
    if why == "switched-off-at-runtime":
        monkeypatch.setattr(patch_layer.engine, "config", patch_layer.engine.config.with_overrides(enabled=False))
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer)
    with trace.recording() as rec:
        got = run_step(w, sched)
    assert_same(got, ref)
    assert sessions.count == 0
    assert len(calls) == 1 and calls[0]["session"] is None
    ops = rec.ops(rec.steps()[0])
    assert edges.check_step(ops, trace.ExpectedSchedule.serial((0, 1, 2), stages)).ok
    assert [(o.kind, o.layer, o.stage) for o in ops if o.kind in ("a2e", "ffn", "e2a")] == _serial_c_order(
        (0, 1, 2), stages
    )
    assert {o.stream for o in ops} == {"C"}


def test_switched_off_at_apply_leaves_the_original_in_place(patch_layer: PatchLayer) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    cls = type(w.runner)
    raw = vars(cls)["_ffn_forward"]
    report = patch_layer.engine.apply(config=OverlapConfig(enabled=False, backend="cpu"))
    assert not report.applied
    assert vars(cls)["_ffn_forward"] is raw
    with trace.recording() as rec:
        run_step(w, Schedule(2, (0, 1), (4, 4), step=1))
    assert rec.ops() == []  # nothing of ours ran


# ---------------------------------------------------------------------------
# The caller's stream: current again once the step returns, however it ends


class _FfnFailed(RuntimeError):
    pass


#: How the step ends: planned, raising inside an FFN, falling back (the loop runs past the plan), or falling back
#: and then raising (the loop skips a planned layer: schedule mismatch).
ENDINGS = ["returns", "raises-in-ffn", "falls-back", "falls-back-and-raises"]


@pytest.mark.parametrize("ending", ENDINGS)
@each_layout
def test_the_callers_stream_is_current_again_after_the_step(
    monkeypatch: pytest.MonkeyPatch, patch_layer: PatchLayer, layout: str, ending: str
) -> None:
    """The caller runs the step on a stream of its own (not the default
    stream). While the loop computes an engaged FFN, the current stream is
    the layout's FFN stream (compute-side: the runner's F; comm-side: the
    caller's); after a fallback the rest of the step computes on the
    caller's stream; and once the step returns or raises, the caller's
    stream is current again."""
    w = world(layers=4, stage_ids=(0, 1))
    sched = Schedule(4, (0, 1), (8, 8), step=1)
    (ref,) = serial_results(w, [sched], patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer, **layout_config(layout))
    if ending == "falls-back":
        _layer_lists(monkeypatch, w, loop=[0, 1, 2, 3], plan=[0, 1, 2])
    elif ending == "falls-back-and-raises":
        _layer_lists(monkeypatch, w, loop=[0, 2, 3], plan=[0, 1, 2, 3])
    during: list[tuple[int, int, Any]] = []

    def before(layer: int, stage: int) -> None:
        during.append((layer, stage, emulated_device.current_stream()))
        if ending == "raises-in-ffn" and (layer, stage) == (2, 1):
            raise _FfnFailed("FFN(2, 1) failed")

    wrap_model(w, before_with_stage=before)
    caller = emulated_device.Stream()
    try:

        def step() -> tuple[Any, BaseException | None, Any]:
            with emulated_device.stream(caller):
                assert emulated_device.current_stream() is caller
                try:
                    got, raised = run_step(w, sched), None
                except (_FfnFailed, ScheduleMismatchError) as exc:
                    got, raised = None, exc
                return got, raised, emulated_device.current_stream()

        got, raised, after = bounded(step)
        assert after is caller, f"after the step ({ending}) the current stream is {getattr(after, 'name', after)}"
        if ending in ("raises-in-ffn", "falls-back-and-raises"):
            assert isinstance(raised, _FfnFailed if ending == "raises-in-ffn" else ScheduleMismatchError), raised
        else:
            assert raised is None
            assert_same(got, ref)
        (sset,) = stream_sets(patch_layer=patch_layer)
        engaged = {"falls-back": {0, 1, 2}, "falls-back-and-raises": {0}}.get(ending, {0, 1, 2, 3})
        assert during, "no FFN ran"
        for L, st, current in during:
            want = sset.ffn if layout == "compute-side" and L in engaged else caller
            assert current is want, f"FFN({L}, {st}) ran with {current.name} current, not {want.name}"
        if ending == "falls-back":
            assert {L for L, _, _ in during} == {0, 1, 2, 3}
    finally:
        caller.close()


# ---------------------------------------------------------------------------
# Never an A2E past the step's last layer


def test_transport_rejects_an_a2e_past_the_last_layer() -> None:
    w = world(layers=2, stage_ids=(0,))
    t = w.transport
    t.begin_step(1, [0, 1], [0])
    for L in (0, 1):
        hidden, bs = t.a2e(group="afd", stage=0, layer=L, num_tokens=4)
        t.e2a(group="afd", stage=0, layer=L, routed=hidden, shared=None, atten_batch_size=bs)
    emulated_device.synchronize()
    t.a2e(group="afd", stage=0, layer=2, num_tokens=4)
    # The custom op's kernel refuses it; a device reports it at the next synchronize.
    with pytest.raises(ProtocolError, match="a2e for layer 2, attention sends layer None"):
        emulated_device.synchronize()


class LookaheadPastTheEnd(StepSession):
    """Test-only broken schedule: issues an A2E after the last layer."""

    def send(self, call: Any, output: Any, context: Any, stage: int | None) -> Any:
        out = super().send(call, output, context, stage)
        L, s = max(self.snapshot().sent)
        if L == self.plan.layers[-1] and s == self.plan.stages[-1]:
            self.issue_a2e(L + 1, s)
        return out


@each_layout
def test_no_a2e_is_issued_past_the_last_layer(
    monkeypatch: pytest.MonkeyPatch, patch_layer: PatchLayer, layout: str
) -> None:
    w = world(layers=4, stage_ids=(0, 2))
    apply_cpu(patch_layer=patch_layer, **layout_config(layout))
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer, keep=True)
    with trace.recording() as rec:
        bounded(lambda: run_step(w, Schedule(4, (0, 2), (8, 8), step=1)))
    a2e_layers = sorted(o.layer for o in rec.ops() if o.kind == "a2e")
    assert a2e_layers == [0, 0, 1, 1, 2, 2, 3, 3]
    assert max(L for k, L, _ in sessions.kept[0].issued_ops if k == "a2e") == 3
    # The guard matters: a session that does issue one fails the step.
    monkeypatch.setattr(patch_layer.runtime, "session_class", LookaheadPastTheEnd)
    with pytest.raises(ProtocolError, match="stage 2: a2e for layer 4, attention sends layer None"):
        bounded(lambda: run_step(w, Schedule(4, (0, 2), (8, 8), step=2)))


# ---------------------------------------------------------------------------
# Ownership: nothing stays referenced after the step


def _tracked_model(w: Any, refs: list[weakref.ref[Any]]) -> None:
    model = w.runner.model
    original = type(model).compute_ffn_output.__get__(model)

    def compute_ffn_output(*, hidden_states: torch.Tensor, layer_idx: int) -> Any:
        refs.append(weakref.ref(hidden_states))
        out = original(hidden_states=hidden_states, layer_idx=layer_idx)
        refs.append(weakref.ref(out.routed_output))
        refs.append(weakref.ref(out.shared_output))
        return out

    model.compute_ffn_output = compute_ffn_output


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_nothing_the_step_allocated_stays_referenced(
    monkeypatch: pytest.MonkeyPatch, direction: str, patch_layer: PatchLayer
) -> None:
    w = world(layers=3, stage_ids=(0, 1, 2))
    refs: list[weakref.ref[Any]] = []
    _tracked_model(w, refs)
    # The original keeps nothing: the control for what follows.
    run_step(w, Schedule(3, (0, 1, 2), (8, 8, 8), step=1))
    gc.collect()
    assert refs and all(r() is None for r in refs)
    refs.clear()

    apply_cpu(patch_layer=patch_layer, **layout_config(direction))
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer)
    bounded(lambda: run_step(w, Schedule(3, (0, 1, 2), (8, 8, 8), step=2)))
    gc.collect()
    assert len(refs) == 3 * 9
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} tensors of the step are still referenced"
    assert patch_layer.runtime.active_session() is None
    # The watchdog (on by default) follows the closed step until its device work has completed, then lets it go.
    deadline = time.monotonic() + 5.0
    while sessions.refs[0]() is not None and time.monotonic() < deadline:
        time.sleep(0.005)
        gc.collect()
    assert sessions.count == 1 and sessions.refs[0]() is None, "the session outlived its step"


@each_layout
def test_session_releases_everything_at_close(
    monkeypatch: pytest.MonkeyPatch, patch_layer: PatchLayer, layout: str
) -> None:
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu(patch_layer=patch_layer, **layout_config(layout))
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer, keep=True)
    run_step(w, Schedule(3, (0, 1), (8, 8), step=1))
    (s,) = sessions.kept
    assert s.closed and s.connector is None
    held = s.held()
    assert set(held) >= {"recv_fn", "a2e_handles", "contexts", "received_buffers", "sent_outputs"}
    assert not any(held.values()), held


@contextlib.contextmanager
def _stream_set(stages: list[int], *, host_ops: bool = False) -> Iterator[StreamSet]:
    """A stream set of its own for sessions driven on this thread; closed at the end, and the thread's current
    stream set back to the caller's (a compute-side session that a failing check left open keeps F current)."""
    backend = noop_backend() if host_ops else make_backend("cpu")
    caller = backend.compute_stream()
    sset = StreamSet(backend, stages)
    try:
        yield sset
    finally:
        backend.mod.set_stream(caller)
        sset.close()


class _Ctx:
    def __init__(self, layer: int, stage: int) -> None:
        self.layer, self.stage = layer, stage


class _Payload:
    def __init__(self, hidden: torch.Tensor, ctx: _Ctx) -> None:
        self.hidden_states = hidden
        self.context = ctx


def _fake_connector() -> tuple[Any, Any, list[tuple[str, int, int]]]:
    log: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def recv(ubatch_idx: int = 0, **kw: Any) -> _Payload:
        with lock:
            log.append(("a2e", kw["layer_idx"], ubatch_idx))
        return _Payload(torch.full((4, 8), float(kw["layer_idx"] * 10 + ubatch_idx)), _Ctx(kw["layer_idx"], ubatch_idx))

    def send(ffn_output: torch.Tensor, context: _Ctx, **kw: Any) -> None:
        with lock:
            log.append(("e2a", context.layer, kw["ubatch_idx"]))

    return recv, send, log


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_ownership_inside_the_step(direction: str) -> None:
    """A2E outputs are released at their send once the A2E's stream has
    waited their FFN's f_done or is the FFN's (comm-side: K_s waits it;
    compute-side: C, which sends, waits F's), else once it has waited their
    E2A (the next layer's receive; a2e-only keeps the last layer's until the
    close). FFN outputs whose E2A runs on another stream than their FFN
    (comm-side: K_s and C; compute-side: C and F) are held until the FFN's
    stream has waited an event recorded after their E2A (the next receive
    of the stage), no longer. Two steps on one stream set: the first records
    the plan's events through the backend, the second takes the steady
    path's slots."""
    _, e2a, ffn, layout = DIRECTIONS[direction]
    recv, send, _ = _fake_connector()
    layers, stages = (0, 1, 2), (0, 1)
    plan = StepPlan(layers, stages, {"max_num_tokens": 4})
    with _stream_set([0, 1]) as sset:
        for _ in range(2):
            session = StepSession(
                connector=object(),
                plan=plan,
                streamset=sset,
                layout=layout,
                context_of=camp2p.context_of,
            )
            held_out: dict[int, weakref.ref[Any]] = {}
            for L in layers:
                for s in stages:
                    p = session.recv(recv, {"ubatch_idx": s, "layer_idx": L, "max_num_tokens": 4})
                    if s in held_out:  # (plain reference counting: no gc pass needed)
                        assert held_out.pop(s)() is None, "FFN output held past the next receive of its stage"
                    hidden = weakref.ref(p.hidden_states)
                    out = p.hidden_states * 2.0
                    session.send(lambda o=out, c=p.context, s=s: send(o, c, ubatch_idx=s), out, p.context, s)
                    wo = weakref.ref(out)
                    del p, out
                    if L != layers[-1] or e2a or ffn:
                        assert hidden() is None, f"A2E output of ({L}, {s}) held after its send"
                    if e2a or ffn:
                        assert wo() is not None, f"FFN output of ({L}, {s}) freed while its E2A may read it"
                        held_out[s] = wo
                    else:
                        assert wo() is None, f"FFN output of ({L}, {s}) held after its send on its own stream"
            session.close()
            gc.collect()
            assert all(r() is None for r in held_out.values())


# ---------------------------------------------------------------------------
# Many steps: streams, threads and events reused


@each_layout
def test_fifty_steps_reuse_streams_and_threads(patch_layer: PatchLayer, layout: str) -> None:
    w = world(layers=3, stage_ids=(0, 1, 2))
    scheds = [
        Schedule(3, (0, 1, 2) if i % 3 else (0, 2), (1 + i % 16, 16 - i % 16, 8)[: 3 if i % 3 else 2], i + 1)
        for i in range(50)
    ]
    refs = serial_results(w, scheds, patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer, **layout_config(layout))
    assert_same(run_step(w, scheds[0]), refs[0])
    (sset,) = stream_sets(patch_layer=patch_layer)
    count = threading.active_count()

    def ours() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("camp2p-overlap-stream-")}

    threads = ours()
    # one worker per stage group and one for the FFN stream, made once
    assert sorted(t.name.removeprefix("camp2p-overlap-stream-") for t in threads) == ["F", "K0", "K1", "K2"]
    for sched, ref in zip(scheds[1:], refs[1:], strict=True):
        assert_same(run_step(w, sched), ref)
        assert ours() == threads
        assert threading.active_count() <= count
    assert stream_sets(patch_layer=patch_layer) == [sset]
    assert all(s.alive for s in [*sset.streams.values(), sset.ffn])
    assert_streams_idle(patch_layer=patch_layer)


# ---------------------------------------------------------------------------
# The loop does not follow the plan


def _layer_lists(monkeypatch: pytest.MonkeyPatch, w: Any, loop: list[int], plan: list[int]) -> None:
    """``_ffn_layer_indices`` answers, per step, the loop's list to the world
    (for the attention peers), the plan's list to the session, then the
    loop's list to the loop."""
    mod = w.modules[0]
    calls = {"n": 0}

    def _ffn_layer_indices(runner: Any) -> list[int]:
        calls["n"] += 1
        return list(plan if calls["n"] % 3 == 2 else loop)

    monkeypatch.setattr(mod, "_ffn_layer_indices", _ffn_layer_indices)


@each_layout
def test_loop_runs_past_the_plan_falls_back_with_correct_outputs(
    monkeypatch: pytest.MonkeyPatch,
    logs: PackageLogs,
    patch_layer: PatchLayer,
    layout: str,
) -> None:
    w = world(layers=4, stage_ids=(0, 1))
    sched = Schedule(4, (0, 1), (8, 8), step=1)
    (ref,) = serial_results(w, [sched], patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer, **layout_config(layout))
    _layer_lists(monkeypatch, w, loop=[0, 1, 2, 3], plan=[0, 1, 2])
    got = bounded(lambda: run_step(w, sched))
    assert_same(got, ref)
    (msg,) = logs.texts("the session planned", logging.WARNING)
    assert "asked for (3, 0)" in msg and "planned None" in msg
    assert_streams_idle(patch_layer=patch_layer)


@each_layout
def test_loop_skips_a_planned_layer_raises_schedule_mismatch(
    monkeypatch: pytest.MonkeyPatch,
    logs: PackageLogs,
    patch_layer: PatchLayer,
    layout: str,
) -> None:
    w = world(layers=4, stage_ids=(0, 1))
    nxt = Schedule(4, (0, 1), (8, 8), step=2)
    (ref,) = serial_results(w, [nxt], patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer, **layout_config(layout))
    _layer_lists(monkeypatch, w, loop=[0, 2, 3], plan=[0, 1, 2, 3])
    with pytest.raises(ScheduleMismatchError) as info:
        bounded(lambda: run_step(w, Schedule(4, (0, 1), (8, 8), step=1)))
    assert "receive for (layer 2, stage 0)" in str(info.value) and "[(1, 0)]" in str(info.value)
    (msg,) = logs.texts("the session planned", logging.WARNING)
    assert "asked for (2, 0)" in msg and "planned (1, 0)" in msg
    assert_streams_idle(patch_layer=patch_layer)
    monkeypatch.undo()
    assert_same(bounded(lambda: run_step(w, nxt)), ref)


@each_layout
def test_max_num_tokens_changed_before_the_first_receive_falls_back(
    monkeypatch: pytest.MonkeyPatch,
    logs: PackageLogs,
    patch_layer: PatchLayer,
    layout: str,
) -> None:
    w = world(layers=3, stage_ids=(0, 1))
    sched = Schedule(3, (0, 1), (8, 8), step=1)
    (ref,) = serial_results(w, [sched], patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer, **layout_config(layout))
    plane = w.connector.control_plane
    original = type(plane).update_state_from_dp_metadata.__get__(plane)

    def update(dp: Any) -> None:
        original(dp)
        w.runner.max_num_tokens = 12  # after the plan was made

    monkeypatch.setattr(plane, "update_state_from_dp_metadata", update)
    got = bounded(lambda: run_step(w, sched))
    assert_same(got, ref)
    (msg,) = logs.texts("the session planned", logging.WARNING)
    assert "'max_num_tokens': 12" in msg and "planned (0, 0)" in msg


@each_layout
def test_max_num_tokens_changed_mid_step_is_a_schedule_mismatch(
    logs: PackageLogs, patch_layer: PatchLayer, layout: str
) -> None:
    w = world(layers=3, stage_ids=(0, 1))
    nxt = Schedule(3, (0, 1), (8, 8), step=2)
    (ref,) = serial_results(w, [nxt], patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer, **layout_config(layout))
    n = {"calls": 0}

    def after(_out: Any) -> None:
        n["calls"] += 1
        if n["calls"] == 3:  # FFN(1, 0)
            w.runner.max_num_tokens = 12

    wrap_model(w, after=after)
    with pytest.raises(ScheduleMismatchError, match=r"\(layer 1, stage 1\)"):
        bounded(lambda: run_step(w, Schedule(3, (0, 1), (8, 8), step=1)))
    assert logs.texts("the session planned", logging.WARNING)
    assert_streams_idle(patch_layer=patch_layer)
    w.runner.max_num_tokens = 16
    n["calls"] = -(10**6)
    assert_same(bounded(lambda: run_step(w, nxt)), ref)


@pytest.mark.parametrize("host_ops", [False, True], ids=["cpu-backend", "host-ops-backend"])
@each_layout
def test_stage_order_change_mid_step_hands_over_the_prefetched_data(
    logs: PackageLogs, host_ops: bool, layout: str
) -> None:
    """Session-level: the loop swaps the stage order of layer 1. The session
    falls back after draining and hands each (layer, stage) its own data;
    also on a backend whose ops run in scope on the host."""
    recv, send, log = _fake_connector()
    with _stream_set([0, 1], host_ops=host_ops) as sset:
        session = StepSession(
            connector=object(),
            plan=StepPlan((0, 1, 2), (0, 1), {"max_num_tokens": 4}),
            streamset=sset,
            context_of=camp2p.context_of,
            layout=LAYOUTS[layout],
        )
        order = [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]
        for L, s in order:
            p = session.recv(recv, {"ubatch_idx": s, "layer_idx": L, "max_num_tokens": 4})
            assert torch.equal(p.hidden_states, torch.full((4, 8), float(L * 10 + s)))
            session.send(
                lambda o=p.hidden_states, c=p.context, s=s: send(o, c, ubatch_idx=s), p.hidden_states, p.context, s
            )
        session.close()
        assert session.fallen_back
        assert logs.texts("asked for (1, 1)", logging.WARNING)
        # Each group kept the protocol order a2e, e2a, a2e, e2a ...
        for s in (0, 1):
            mine = [(k, L) for k, L, st in log if st == s]
            assert mine == [("a2e", 0), ("e2a", 0), ("a2e", 1), ("e2a", 1), ("a2e", 2), ("e2a", 2)]


@pytest.mark.parametrize("host_ops", [False, True], ids=["cpu-backend", "host-ops-backend"])
@each_layout
def test_a_second_send_of_one_received_payload_falls_back(logs: PackageLogs, host_ops: bool, layout: str) -> None:
    """The loop sends one received payload twice: the session issues the
    planned E2A once; the second send is not the plan's, so the session
    falls back (logged) and runs it on the compute stream, and the rest of
    the step still hands each (layer, stage) its own data."""
    recv, send, log = _fake_connector()
    plan = StepPlan((0, 1), (0,), {"max_num_tokens": 4})
    with _stream_set([0], host_ops=host_ops) as sset:
        for step in range(2):
            session = StepSession(
                connector=object(), plan=plan, streamset=sset, context_of=camp2p.context_of, layout=LAYOUTS[layout]
            )
            for L in plan.layers:
                p = session.recv(recv, {"ubatch_idx": 0, "layer_idx": L, "max_num_tokens": 4})
                assert torch.equal(p.hidden_states, torch.full((4, 8), float(L * 10)))
                sends = 2 if (step, L) == (1, 0) else 1
                for _ in range(sends):
                    session.send(
                        lambda o=p.hidden_states, c=p.context: send(o, c, ubatch_idx=0), p.hidden_states, p.context, 0
                    )
            session.close()
            assert session.fallen_back is (step == 1)
        assert logs.texts("send for a received", logging.WARNING)
        assert [entry for entry in log[4:] if entry[0] == "e2a"] == [("e2a", 0, 0), ("e2a", 0, 0), ("e2a", 1, 0)]


@pytest.mark.parametrize("host_ops", [False, True], ids=["cpu-backend", "host-ops-backend"])
@each_layout
def test_a_step_that_ends_early_logs_what_was_prefetched_and_never_consumed(
    logs: PackageLogs, host_ops: bool, layout: str
) -> None:
    """The loop stops after the first layer of a two-layer plan: closing the
    session says how many planned receives ran and names the receive the
    lookahead prefetched for the layer the loop never asked; a step that
    fell back, or one already raising, does not say it."""
    recv, send, _ = _fake_connector()
    plan = StepPlan((0, 1), (0,), {"max_num_tokens": 4})
    with _stream_set([0], host_ops=host_ops) as sset:
        for _ in range(2):
            session = StepSession(
                connector=object(), plan=plan, streamset=sset, context_of=camp2p.context_of, layout=LAYOUTS[layout]
            )
            p = session.recv(recv, {"ubatch_idx": 0, "layer_idx": 0, "max_num_tokens": 4})
            session.send(lambda o=p.hidden_states, c=p.context: send(o, c, ubatch_idx=0), p.hidden_states, p.context, 0)
            session.close()
            assert set(session.held().values()) == {0}
        warned = logs.texts("planned receives", logging.WARNING)
        assert len(warned) == 2 and all("after 1 of 2" in w and "[(1, 0)]" in w for w in warned), warned
        session = StepSession(
            connector=object(), plan=plan, streamset=sset, context_of=camp2p.context_of, layout=LAYOUTS[layout]
        )
        session.recv(recv, {"ubatch_idx": 0, "layer_idx": 0, "max_num_tokens": 4})
        session.close(raising=True)
        assert len(logs.texts("planned receives", logging.WARNING)) == 2


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_a_session_takes_its_side_streams_errors_of_an_earlier_step_when_it_opens(layout: str) -> None:
    """A side stream's asynchronous error that no synchronize took (an earlier step's kernel) is not the new step's:
    the session takes its side streams' errors when it opens, so its close raises nothing."""
    boom = RuntimeError("an earlier step's kernel failed")

    def fail() -> None:
        raise boom

    with _stream_set([0, 1]) as sset:
        side = sset.ffn if layout == "compute-side" else sset.streams[1]
        sset.backend.submit(side, lambda: emulated_device.launch(fail))
        assert side.drain(timeout=10)
        assert sset.backend.peek_errors([side]) == [boom]
        session = StepSession(
            connector=object(),
            plan=StepPlan((0,), (0, 1), {"max_num_tokens": 4}),
            streamset=sset,
            layout=LAYOUTS[layout],
        )
        assert sset.backend.peek_errors([side]) == []
        session.close()  # nothing of this step failed: nothing raised
