"""Errors inside a step (A2E, FFN, E2A at random points) surface to the
caller unchanged, never hang, leave every side stream idle, and the next
step is correct. A deliberately wrong order deadlocks in the emulation."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
from _overlap_util import (
    Schedule,
    apply_cpu,
    assert_same,
    assert_streams_idle,
    bounded,
    captured_log,
    messages,
    run_step,
    serial_results,
    world,
    wrap_model,
)

from camp2p_overlap.core.session import OverlapSession, send_parts
from camp2p_overlap.core.streams import CpuBackend, StreamPoisonedError
from camp2p_overlap.emulation.world import PeerTimeoutError


class InjectedFault(RuntimeError):
    pass


def _fault_points(rng: random.Random, n: int) -> list[dict[str, Any]]:
    points = []
    for i in range(n):
        stages = rng.choice([(0, 1), (0, 2), (1, 2), (0, 1, 2)])
        layers = rng.randint(1, 4)
        where = rng.choice(["a2e", "ffn", "e2a"])
        points.append(
            {
                "sched": Schedule(layers, stages, tuple(rng.randint(1, 16) for _ in stages), step=2 * i + 1),
                "next": Schedule(layers, stages, tuple(rng.randint(1, 16) for _ in stages), step=2 * i + 2),
                "where": where,
                "layer": rng.randrange(layers),
                "stage": rng.choice(stages),
                "dirs": rng.choice([(True, True), (False, True), (True, False)]),
            }
        )
    return points


def test_injected_errors_surface_unchanged_and_the_next_step_is_correct() -> None:
    rng = random.Random(1234)
    points = _fault_points(rng, 36)
    w = world(layers=4, stage_ids=(0, 1, 2), op_timeout_s=5.0)
    refs = serial_results(w, [p["next"] for p in points])
    raised: dict[str, Any] = {}
    target: dict[str, Any] = {}

    def hook(kind: str, layer: int, stage: int) -> None:
        if (kind, layer, stage) == (target.get("where"), target.get("layer"), target.get("stage")):
            raised["exc"] = InjectedFault(f"injected {kind} fault at layer {layer} stage {stage}")
            raise raised["exc"]

    ffn_calls: list[tuple[int, int]] = []

    def before_ffn(layer: int, stage: int) -> None:
        ffn_calls.append((layer, stage))
        hook("ffn", layer, stage)

    wrap_model(w, before_with_stage=before_ffn)
    w.transport.fault_hook = hook
    dirs_seen = set()
    for p in points:
        a2e, e2a = p["dirs"]
        dirs_seen.add(p["dirs"])
        apply_cpu(a2e_on_side_stream=a2e, e2a_on_side_stream=e2a)
        target.clear()
        target.update(where=p["where"], layer=p["layer"], stage=p["stage"])
        raised.clear()
        ffn_calls.clear()
        with pytest.raises(InjectedFault) as info:
            bounded(lambda p=p: run_step(w, p["sched"]), timeout=30)
        assert info.value is raised["exc"], "the caller must get the injected exception object itself"
        assert str(info.value) == f"injected {p['where']} fault at layer {p['layer']} stage {p['stage']}"
        assert_streams_idle(timeout=5)
        if p["where"] == "a2e":
            # Prefetched or not, an A2E error surfaces exactly when the loop
            # asks for that (layer, stage): every FFN before it in loop order
            # ran, that one did not.
            sched = p["sched"]
            order = [(L, s) for L in range(sched.layers) for s in sorted(sched.stages)]
            assert ffn_calls == order[: order.index((p["layer"], p["stage"]))]
        target.clear()
        assert_same(bounded(lambda p=p: run_step(w, p["next"]), timeout=30), refs[points.index(p)])
        assert_streams_idle(timeout=5)
    assert len(dirs_seen) == 3


def test_error_in_first_prefetch_of_another_stage_surfaces_at_its_receive() -> None:
    w = world(layers=3, stage_ids=(0, 1))
    sched = Schedule(3, (0, 1), (8, 8), step=1)
    nxt = Schedule(3, (0, 1), (8, 8), step=2)
    (ref,) = serial_results(w, [nxt])
    apply_cpu()
    ffn_layers: list[int] = []
    wrap_model(w, before=ffn_layers.append)

    def hook(kind: str, layer: int, stage: int) -> None:
        if (kind, layer, stage) == ("a2e", 0, 1):
            raise InjectedFault("prologue a2e of stage 1")

    w.transport.fault_hook = hook
    with pytest.raises(InjectedFault, match=r"^prologue a2e of stage 1$"):
        bounded(lambda: run_step(w, sched))
    assert ffn_layers == [0]  # FFN(0, 0) ran, FFN(0, 1) never did
    w.transport.fault_hook = None
    assert_same(bounded(lambda: run_step(w, nxt)), ref)


def test_model_error_surfaces_and_streams_join() -> None:
    w = world(layers=4, stage_ids=(0, 1, 2))
    sched = Schedule(4, (0, 1, 2), (4, 9, 16), step=5)
    nxt = Schedule(4, (0, 1, 2), (16, 1, 7), step=6)
    (ref,) = serial_results(w, [nxt])
    apply_cpu()
    calls: list[int] = []

    def before(layer: int) -> None:
        calls.append(layer)
        if len(calls) == 8:
            raise ZeroDivisionError("model blew up at its 8th call")

    original = wrap_model(w, before=before)
    with pytest.raises(ZeroDivisionError, match=r"^model blew up at its 8th call$"):
        bounded(lambda: run_step(w, sched))
    assert_streams_idle()
    w.runner.model.compute_ffn_output = original
    assert_same(bounded(lambda: run_step(w, nxt)), ref)


def test_a_silent_peer_is_reported_as_a_stall_then_times_out(caplog: pytest.LogCaptureFixture) -> None:
    w = world(layers=3, stage_ids=(0, 1), op_timeout_s=1.0)
    apply_cpu(watchdog_s=0.2)

    def hook(kind: str, layer: int, stage: int) -> None:
        if (kind, layer, stage) == ("a2e", 1, 1):
            w.transport.stop_peer(1)  # attention rank of stage 1 stops answering

    w.transport.fault_hook = hook
    with captured_log(caplog, logging.WARNING), pytest.raises(PeerTimeoutError, match=r"\(peer stopped\)"):
        bounded(lambda: run_step(w, Schedule(3, (0, 1), (8, 8), step=1)))
    (report,) = messages(caplog, "has not finished after 0.2 s")
    # It names the op that waits for the silent peer, and its pending event.
    assert "a2e(L1,s1) on K1" in report
    assert "event ('a', 1, 1): pending" in report
    assert_streams_idle()


# ---------------------------------------------------------------------------
# The wrong order deadlocks: the emulation models the protocol.


class LookaheadBeforeE2A(OverlapSession):
    """Test-only broken schedule: queues the lookahead A2E of a stage on
    K_s ahead of that stage's E2A."""

    def send(self, wrapped: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        _, ctx = send_parts(args, kwargs)
        key = self._contexts.get(id(ctx))
        if key is not None:
            nxt = self.plan.next_layer(key[0])
            if nxt is not None:
                self._issue_a2e(nxt, key[1])
        return super().send(wrapped, args, kwargs)

    def _issue_a2e(self, layer: int, stage: int) -> None:
        if (layer, stage) in self._a_handle:
            return  # already queued, too early
        super()._issue_a2e(layer, stage)


def test_lookahead_queued_before_its_e2a_deadlocks_until_the_op_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from camp2p_overlap.core import wrappers

    w = world(layers=3, stage_ids=(0, 1), op_timeout_s=0.5)
    apply_cpu()
    # Control: the real order completes with the same short timeout.
    run_step(w, Schedule(3, (0, 1), (8, 8), step=1))
    monkeypatch.setattr(wrappers, "OverlapSession", LookaheadBeforeE2A)
    with pytest.raises(PeerTimeoutError, match=r"a2e\(L1\) on afd: no data from attention after 0.5 s"):
        bounded(lambda: run_step(w, Schedule(3, (0, 1), (8, 8), step=2)), timeout=30)
    assert_streams_idle()


def test_wrong_order_on_one_stream_deadlocks_driving_the_backend_directly() -> None:
    """Same as above without the session: on one CpuBackend side stream,
    A2E(1) queued before E2A(0) of the same group waits for an E2A that
    can only run after it."""
    w = world(layers=2, stage_ids=(0,), op_timeout_s=0.4)
    t = w.transport
    t.begin_step(1, [0, 1], [0])
    backend = CpuBackend()
    try:
        k = backend.new_stream("K0")
        a0 = backend.submit(k, lambda: t.a2e(group="afd", stage=0, layer=0, num_tokens=4), label="a2e L0")
        hidden, bs = a0.result()
        a1 = backend.submit(k, lambda: t.a2e(group="afd", stage=0, layer=1, num_tokens=4), label="a2e L1")
        e0 = backend.submit(
            k,
            lambda: t.e2a(group="afd", stage=0, layer=0, routed=hidden, shared=None, atten_batch_size=bs),
            label="e2a L0",
        )
        assert k.drain(timeout=10)
        with pytest.raises(PeerTimeoutError, match="waiting for this stage's e2a"):
            a1.result()
        with pytest.raises(StreamPoisonedError, match="e2a L0 skipped"):
            e0.result()
        # The right order on the same stream completes.
        t.begin_step(2, [0, 1], [0])
        backend.begin_step([k])
        a0 = backend.submit(k, lambda: t.a2e(group="afd", stage=0, layer=0, num_tokens=4))
        hidden, bs = a0.result()
        backend.submit(k, lambda: t.e2a(group="afd", stage=0, layer=0, routed=hidden, shared=None, atten_batch_size=bs))
        a1 = backend.submit(k, lambda: t.a2e(group="afd", stage=0, layer=1, num_tokens=4))
        assert k.drain(timeout=10)
        assert a1.result()[0].shape == (4, w.spec.shape.hidden)
    finally:
        backend.close()
