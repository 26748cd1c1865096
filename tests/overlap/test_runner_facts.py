"""What a runner's steps share (``decision.RunnerFacts``) is read once per
engine generation and connector; what changes per step (stage ids, the
layer list, ``max_num_tokens``) is read on every step, and a reason that
may pass (another thread's routes) is asked again on every step."""

from __future__ import annotations

from typing import Any

import pytest
from support.overlap import apply_cpu, assert_same, run_step, serial_results, world

from camp2p_overlap.core.overlap import step as decision_module
from camp2p_overlap.core.overlap.routes import ROUTER_MARK
from camp2p_overlap.core.overlap.step import decide
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.emulation.world import World


@pytest.fixture
def facts_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the reads of a runner's facts."""
    calls: list[int] = []
    inner = decision_module.runner_facts

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(decision_module, "runner_facts", counted)
    return calls


def _decided(w: World) -> Any:
    state = PATCH_LAYER.runtime.runners.get(w.runner)
    return decide(PATCH_LAYER.engine, w.runner, {"dp_metadata_list": w.dp_metadata()}, state)


def test_a_runners_facts_are_read_once_per_generation(facts_read: list[int]) -> None:
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu()
    first = _decided(w)
    assert first.engages and first.plan is not None and first.plan.layers == (0, 1, 2)
    assert _decided(w) is first and _decided(w) is first  # one decision per plan
    assert facts_read == [1]
    # the role is a fact: an engine generation later (unpatch, apply) it is read again
    w.runner.afd_config.role = "attention"
    assert _decided(w).engages and facts_read == [1]
    PATCH_LAYER.engine.unpatch(timeout=10)
    apply_cpu()
    again = _decided(w)
    assert not again.engages and "AFD role is 'attention'" in again.reason and facts_read == [1, 1]


def test_another_connector_reads_the_facts_again(facts_read: list[int]) -> None:
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu()
    assert _decided(w).engages
    connector = w.runner.connector
    w.runner.connector = object()
    made = _decided(w)
    assert not made.engages and "connector is object" in made.reason and facts_read == [1, 1]
    w.runner.connector = connector
    assert _decided(w).engages and facts_read == [1, 1, 1]


def _fewer_layers(w: World) -> None:
    w.runner.num_layers = 2


def _max_tokens(w: World) -> None:
    w.runner.max_num_tokens = (w.runner.max_num_tokens or 0) + 1


def _stages(w: World) -> None:
    w.dp_metadata = lambda: {0: None}  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("change", "check"),
    [
        (_fewer_layers, lambda d: d.engages and d.plan.layers == (0, 1)),
        (_max_tokens, lambda d: d.engages and d.plan.recv_extra["max_num_tokens"] is not None),
        (_stages, lambda d: d.engages and d.plan.stages == (0,)),
    ],
    ids=["layers", "max_num_tokens", "stage ids"],
)
def test_what_changes_per_step_is_read_every_step(facts_read: list[int], change: Any, check: Any) -> None:
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu(min_stages=1)
    first = _decided(w)
    change(w)
    again = _decided(w)
    assert again is not first and check(again), again
    assert facts_read == [1]


def test_a_layer_list_changed_in_place_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu()
    layers = [0, 1, 1]
    monkeypatch.setattr(w.modules[0], "_ffn_layer_indices", lambda runner: layers)
    made = _decided(w)
    assert not made.engages and "repeats a layer" in made.reason
    layers[2] = 2
    assert _decided(w).plan.layers == (0, 1, 2)
    layers.pop()
    assert _decided(w).plan.layers == (0, 1)


def test_a_route_of_another_threads_step_is_asked_every_step(facts_read: list[int]) -> None:
    """Another thread's step holds the connector's routes: the step runs
    serially for that reason; on the next step, routes free, it engages
    (the facts are not read again: the reason may pass)."""
    w = world(layers=3, stage_ids=(0, 1))
    (ref,) = serial_results(w, [None])
    apply_cpu()
    routed = type(w.connector).send_ffn_output.__get__(w.connector)

    def foreign(*args: Any, **kwargs: Any) -> Any:
        return routed(*args, **kwargs)

    setattr(foreign, ROUTER_MARK, True)
    w.connector.send_ffn_output = foreign
    steps = PATCH_LAYER.runtime.counters.to_dict()["steps"]
    w.steps_run = 0
    assert_same(run_step(w), ref)
    after = PATCH_LAYER.runtime.counters.to_dict()
    assert after["steps"]["overlap"] == steps["overlap"]
    assert any("another thread" in reason for reason in after["serial_reasons"]), after["serial_reasons"]
    del w.connector.send_ffn_output
    w.steps_run = 0
    assert_same(run_step(w), ref)
    assert PATCH_LAYER.runtime.counters.to_dict()["steps"]["overlap"] == steps["overlap"] + 1
    assert facts_read == [1]


def test_a_step_runs_on_the_streams_of_the_backend_its_decision_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner keeps the side streams of one backend: a step whose decision names another (the facts read
    again, say after the runner's device moved) gets that backend's streams, and the old ones are closed."""
    from camp2p_overlap.core.overlap.streams import registered_device_module
    from camp2p_overlap.core.overlap.streams.backend import StreamBackend

    w = world(layers=2, stage_ids=(0, 1))
    (ref,) = serial_results(w, [None])
    apply_cpu()
    w.steps_run = 0
    assert_same(run_step(w), ref)
    state = PATCH_LAYER.runtime.runners.get(w.runner)
    first = state.streamset
    assert first is not None and first.backend.name == "cpu"
    module = registered_device_module("cpu")
    monkeypatch.setattr(PATCH_LAYER.runtime.runners, "make_backend", lambda name, device: StreamBackend(name, module))
    monkeypatch.setattr(decision_module, "resolve_backend_name", lambda requested, device: "moved")
    state.facts = None  # the facts are read again on the next decision
    w.steps_run = 0
    assert_same(run_step(w), ref)
    assert state.streamset is not first and state.streamset.backend.name == "moved"
    assert first.streams[0]._w.stopped  # the first backend's streams were closed
