"""A stream set keeps its last engaged step's session and routers: the next
step of the same decision reopens that session and binds the routers again.
A kept session holds nothing of a closed step, no router holds the
connector between steps, and a step that must not share its session (a
watchdog thread reads it, a session class of its own, another decision)
makes its own."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator
from types import MethodType
from typing import Any

import pytest
from support.overlap import (
    Schedule,
    apply_cpu,
    assert_same,
    run_step,
    serial_results,
    stream_sets,
    world,
    wrap_model,
)

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.overlap.connector_routes import ROUTER_MARK
from camp2p_overlap.core.overlap.session import OverlapSession, SessionError
from camp2p_overlap.core.overlap.session_routers import KeptSession
from camp2p_overlap.core.overlap.streams.streamset import StreamSet
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.emulation.noop import noop_backend
from camp2p_overlap.emulation.standin_patch_layer import emulated_patch_layer, release_site, standin_site
from camp2p_overlap.emulation.world import World
from camp2p_overlap.tools.overhead import engaged_config, noop_world

SCHEDS = [Schedule(3, (0, 1), (16, 9), step=i + 1) for i in range(3)]


def _kept(w: World) -> KeptSession | None:
    (sset,) = stream_sets()
    return sset.kept_session


def _steps(w: World, scheds: list[Schedule]) -> list[Any]:
    kept = []
    for sched in scheds:
        run_step(w, sched)
        kept.append(_kept(w))
    return kept


def test_steps_of_one_decision_share_a_session_and_give_the_serial_results() -> None:
    w = world(layers=3, stage_ids=(0, 1))
    refs = serial_results(w, SCHEDS)
    apply_cpu()
    engaged_before = PATCH_LAYER.runtime.counters.to_dict()["steps"]["overlap"]
    got = []
    sessions = []
    for sched in SCHEDS:
        got.append(run_step(w, sched))
        kept = _kept(w)
        assert kept is not None
        sessions.append(kept.session)
    for g, ref in zip(got, refs, strict=True):
        assert_same(g, ref)
    assert sessions[0] is sessions[1] is sessions[2]
    assert PATCH_LAYER.runtime.counters.to_dict()["steps"]["overlap"] - engaged_before == len(SCHEDS)


def _after_one_step() -> tuple[World, KeptSession]:
    """A world of 3 layers x 2 stages after one engaged step, and its kept session."""
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu()
    run_step(w, SCHEDS[0])
    kept = _kept(w)
    assert kept is not None
    return w, kept


def test_a_kept_session_and_its_routers_hold_nothing_between_steps() -> None:
    w, kept = _after_one_step()
    session = kept.session
    assert session.closed and session.connector is None
    assert set(session.held().values()) == {0}
    for binding in kept.bindings:
        assert binding.thread == 0
        assert getattr(binding.callee, "__self__", None) is not w.connector
    # the routes are gone from the instance: its calls are its class's again
    for attribute, _ in kept.routers:
        assert getattr(w.connector, attribute).__func__ is getattr(type(w.connector), attribute)


def test_a_route_taken_during_a_step_and_called_after_it_refuses() -> None:
    w = world(layers=2, stage_ids=(0, 1))
    apply_cpu()
    taken: list[Any] = []
    model = w.runner.model
    compute = model.compute_ffn_output

    def take(**kw: Any) -> Any:
        if not taken:
            taken.append(w.connector.recv_attn_output)
        return compute(**kw)

    model.compute_ffn_output = take
    run_step(w, Schedule(2, (0, 1), (8, 4), step=1))
    assert taken and getattr(taken[0], "__self__", None) is not w.connector  # a router, not the method
    with pytest.raises(RuntimeError, match="after its step ended"):
        taken[0](layer_idx=0, ubatch_idx=0)


@contextlib.contextmanager
def _direct_backend_world(config: OverlapConfig) -> Iterator[tuple[World, Any, StreamSet]]:
    """A 3 x 2 no-op world under a patch layer of its own on the overhead
    tool's device (ops run in scope on the host, as on a real device's
    backend), after three steps: the world, its ``dp_metadata_list`` and
    the runner's stream set."""
    site = standin_site()
    patch_layer = emulated_patch_layer()
    patch_layer.runtime.runners.make_backend = noop_backend
    try:
        w = noop_world(3, 2, 0.0, site.root)
        dp = w.dp_metadata()
        patch_layer.engine.apply(config=config, manifest=site.manifest, strict=True)
        for _ in range(3):
            w.runner._ffn_forward(dp_metadata_list=dp)
        (sset,) = patch_layer.runtime.runners.stream_sets()
        yield w, dp, sset
    finally:
        patch_layer.engine.unpatch(timeout=10)
        release_site(site)


@pytest.mark.parametrize(
    ("failing", "layer"),
    [("send_ffn_output", 1), ("recv_attn_output", 1), ("recv_attn_output", 0)],
    ids=["send", "lookahead-receive", "prologue-receive"],
)
def test_a_kept_session_on_a_direct_backend_lists_no_steady_op_and_still_raises_a_failure(
    failing: str, layer: int
) -> None:
    """The overhead tool's device (its ops run in scope on the host, as on a
    real device's backend): the steady path keeps no op, and a failed send,
    lookahead receive or prologue receive still raises from the step, as
    upstream's would."""
    with _direct_backend_world(engaged_config()) as (w, dp, sset):
        kept = sset.kept_session
        assert kept is not None and kept.session._run_here and kept.session.issued() == []
        original = getattr(type(w.connector), failing)

        def fails(self: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("ubatch_idx") == 1 and kwargs.get("layer_idx", layer) == layer:
                raise RuntimeError(f"{failing} failed")
            return original(self, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(w.connector), failing, fails)
            with pytest.raises(RuntimeError, match=f"{failing} failed"):
                w.runner._ffn_forward(dp_metadata_list=dp)
        assert kept.session.closed and set(kept.session.held().values()) == {0}
        w.runner._ffn_forward(dp_metadata_list=dp)
        assert sset.kept_session is kept


def test_a_reopened_session_starts_afresh() -> None:
    w, kept = _after_one_step()
    session = kept.session
    session.reopen(w.connector)
    assert not session.closed and session.next_recv == 0 and not session.forked
    assert session.connector is w.connector and session.issued() == []
    with pytest.raises(SessionError, match="closed session"):
        session.reopen(w.connector)  # open: not reopened twice
    session.close(raising=True)


def test_another_decision_makes_another_session() -> None:
    w = world(layers=4, stage_ids=(0, 1))
    apply_cpu()
    first, second = _steps(w, [Schedule(4, (0, 1), (16, 9), step=1), Schedule(3, (0, 1), (16, 9), step=2)])
    assert first is not None and second is not None
    assert first.session is not second.session
    assert first.decision is not second.decision


def test_a_step_with_a_watchdog_makes_its_own_session() -> None:
    w = world(layers=3, stage_ids=(0, 1))
    refs = serial_results(w, SCHEDS[:2])
    made: list[OverlapSession] = []
    original_init = OverlapSession.__init__

    def counted(self: OverlapSession, **kw: Any) -> None:
        original_init(self, **kw)
        made.append(self)

    apply_cpu(watchdog_s=30.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(OverlapSession, "__init__", counted)
        got = [run_step(w, s) for s in SCHEDS[:2]]
    for g, ref in zip(got, refs, strict=True):
        assert_same(g, ref)
    assert len(made) == 2 and made[0] is not made[1]
    assert _kept(w) is None


def test_a_session_class_of_its_own_is_made_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    w = world(layers=3, stage_ids=(0, 1))
    made: list[int] = []

    class Counted(OverlapSession):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            made.append(id(self))

    monkeypatch.setattr(PATCH_LAYER.runtime, "session_class", Counted)
    apply_cpu()
    _steps(w, SCHEDS)
    assert len(made) == len(SCHEDS)
    assert _kept(w) is None


def test_a_step_that_raised_leaves_a_session_the_next_step_reopens() -> None:
    w = world(layers=3, stage_ids=(0, 1))
    refs = serial_results(w, SCHEDS[1:])
    apply_cpu()
    model = w.runner.model
    compute = model.compute_ffn_output

    def fails(**kw: Any) -> Any:
        raise RuntimeError("ffn failed")

    run_step(w, SCHEDS[0])
    kept = _kept(w)
    model.compute_ffn_output = fails
    with pytest.raises(RuntimeError, match="ffn failed"):
        run_step(w, SCHEDS[1])
    model.compute_ffn_output = compute
    assert kept is not None and kept.session.closed and set(kept.session.held().values()) == {0}
    got = [run_step(w, s) for s in SCHEDS[1:]]
    for g, ref in zip(got, refs, strict=True):
        assert_same(g, ref)
    assert _kept(w) is kept


def test_a_refused_route_leaves_no_router_holding_the_connector() -> None:
    """Another thread's step has routed the connector's send since the
    decision (a marked callable on the instance): the step runs serially,
    and the kept routers bound before the refusal drop the connector."""
    w, kept = _after_one_step()
    send = type(w.connector).send_ffn_output

    def foreign(*args: Any, **kwargs: Any) -> Any:
        return send(w.connector, *args, **kwargs)

    setattr(foreign, ROUTER_MARK, True)
    w.connector.send_ffn_output = foreign
    try:
        serial_before = PATCH_LAYER.runtime.counters.to_dict()["steps"]["serial"]
        run_step(w, SCHEDS[1])
        assert PATCH_LAYER.runtime.counters.to_dict()["steps"]["serial"] == serial_before + 1
    finally:
        del w.connector.send_ffn_output
    assert _kept(w) is kept
    for binding in kept.bindings:
        assert binding.thread == 0
        assert getattr(binding.callee, "__self__", None) is not w.connector


def test_an_instance_holding_another_bound_method_keeps_it_and_the_step_calls_it() -> None:
    """The instance holds a method of its own bound to itself (not its
    class's function): the step routes it as the callee and puts the very
    same object back, instead of taking it for the class's and deleting it."""
    w = world(layers=3, stage_ids=(0, 1))
    (reference,) = serial_results(w, SCHEDS[1:2])
    apply_cpu()
    run_step(w, SCHEDS[0])
    kept = _kept(w)
    calls: list[int] = []
    send = type(w.connector).send_ffn_output

    def own_send(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return send(self, *args, **kwargs)

    bound = MethodType(own_send, w.connector)
    w.connector.send_ffn_output = bound
    engaged_before = PATCH_LAYER.runtime.counters.to_dict()["steps"]["overlap"]
    assert_same(run_step(w, SCHEDS[1]), reference)
    assert PATCH_LAYER.runtime.counters.to_dict()["steps"]["overlap"] == engaged_before + 1
    assert len(calls) == 3 * 2  # every send of the step reached the instance's own method
    assert vars(w.connector)["send_ffn_output"] is bound
    assert _kept(w) is kept


def test_a_route_replaced_during_a_kept_step_is_left_as_it_was_set() -> None:
    w, kept = _after_one_step()
    replacement = type(w.connector).recv_attn_output.__get__(w.connector)
    computed: list[int] = []

    def replace_recv(layer: int) -> None:  # at the step's last FFN: no receive follows
        computed.append(layer)
        if len(computed) == 3 * 2:
            w.connector.recv_attn_output = replacement

    wrap_model(w, before=replace_recv)
    run_step(w, SCHEDS[1])
    assert len(computed) == 3 * 2 and vars(w.connector)["recv_attn_output"] is replacement
    assert "send_ffn_output" not in vars(w.connector)
    for binding in kept.bindings:
        assert binding.thread == 0


def test_a_connector_class_that_hides_instance_attributes_runs_serially_and_keeps_nothing() -> None:
    """Setting the router on the instance is not enough: a class whose
    ``__getattribute__`` hides instance attributes would never call it. The
    step checks what the instance resolves each name to, refuses with the
    reason and takes back what it set."""
    w, kept = _after_one_step()
    cls = type(w.connector)

    def hiding(self: Any, name: str) -> Any:
        if name == "send_ffn_output":
            return cls.send_ffn_output.__get__(self)
        return object.__getattribute__(self, name)

    hides = type("HidingConnector", (cls,), {"__getattribute__": hiding})
    w.connector.__class__ = hides
    try:
        counts = PATCH_LAYER.runtime.counters.to_dict()
        run_step(w, SCHEDS[1])
        after = PATCH_LAYER.runtime.counters.to_dict()
        assert after["steps"]["overlap"] == counts["steps"]["overlap"]
        refused = [r for r in after["serial_reasons"] if "cannot be routed per instance" in r]
        assert refused, after["serial_reasons"]
        assert not {"recv_attn_output", "send_ffn_output"} & set(object.__getattribute__(w.connector, "__dict__"))
    finally:
        w.connector.__class__ = cls
    for binding in kept.bindings:
        assert binding.thread == 0


@pytest.mark.parametrize("watchdog_s", [None, 30.0], ids=["kept", "with-op-log"])
def test_a_kept_step_records_no_e2a_done_event_that_no_wait_reads(watchdog_s: float | None) -> None:
    """With both directions on the side streams nothing waits ``e_done``
    (the next ``a_done``, or the join, orders what follows an E2A): a kept
    session's steady path records it not at all; a session that lists its
    ops (a watchdog's step here) records it for its stall reports. Every
    other event of the schedule is recorded by both."""
    config = dataclasses.replace(engaged_config(), watchdog_s=watchdog_s)
    with _direct_backend_world(config) as (w, dp, sset):
        assert (sset.kept_session is not None) is (watchdog_s is None)
        recorded: collections.Counter[str] = collections.Counter()
        for key, event in sset.backend.direct_events().items():
            event.record = lambda stream=None, kind=key.kind: recorded.update([kind])
        w.runner._ffn_forward(dp_metadata_list=dp)
        pairs = 3 * 2
        assert recorded["a"] == recorded["f"] == pairs
        assert recorded["fork"] == 1 and recorded["join"] == 2
        assert recorded["e"] == (0 if watchdog_s is None else pairs)
