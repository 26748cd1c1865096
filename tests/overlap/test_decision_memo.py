"""The decision memo: a runner's engaging decision is taken again only while
every input it was made from compares equal; any input that changes, an
apply or an unpatch makes the next step decide afresh."""

from __future__ import annotations

from typing import Any

import pytest
from support.overlap import apply_cpu, world

from camp2p_overlap.core.overlap import decision as decision_module
from camp2p_overlap.core.overlap.connector_routes import ROUTER_MARK
from camp2p_overlap.core.overlap.decision import DecisionMemo, decide
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.emulation.world import World


@pytest.fixture
def fresh_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the decisions made afresh (not taken from a memo)."""
    calls: list[int] = []
    inner = decision_module._decide

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(decision_module, "_decide", counted)
    return calls


def _decided(w: World, memo: DecisionMemo, **kwargs: Any) -> Any:
    return decide(PATCH_LAYER.engine, w.runner, {"dp_metadata_list": w.dp_metadata(), **kwargs}, memo)


def test_equal_inputs_take_the_kept_decision(fresh_calls: list[int]) -> None:
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu()
    memo = DecisionMemo()
    first = _decided(w, memo)
    assert first.engages and first.plan is not None and first.plan.layers == (0, 1, 2)
    assert fresh_calls == [1]
    # a new dp_metadata_list each step (as vLLM builds one), with the same stage ids
    assert _decided(w, memo) is first
    assert _decided(w, memo) is first
    assert fresh_calls == [1]
    # a capture is never memoised
    _decided(w, memo, is_graph_capturing=True)
    assert fresh_calls == [1, 1]


def _fewer_layers(w: World) -> None:
    w.runner.num_layers = 2


def _role(w: World) -> None:
    w.runner.afd_config.role = "attention"


def _shared_group(w: World) -> None:
    w.connector.hccl_comm_name2 = w.connector.hccl_comm_name


def _max_tokens(w: World) -> None:
    w.runner.max_num_tokens = (w.runner.max_num_tokens or 0) + 1


def _stages(w: World) -> None:
    w.dp_metadata = lambda: {0: None}  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("change", "check"),
    [
        (_fewer_layers, lambda d: d.engages and d.plan.layers == (0, 1)),
        (_role, lambda d: not d.engages and "AFD role is 'attention'" in d.reason),
        (_shared_group, lambda d: not d.engages and "share HCCL group" in d.reason),
        (_max_tokens, lambda d: d.engages and d.plan.recv_extra["max_num_tokens"] is not None),
        (_stages, lambda d: d.engages and d.plan.stages == (0,)),
    ],
    ids=["layers", "role", "groups", "max_num_tokens", "stage ids"],
)
def test_a_changed_input_decides_afresh(fresh_calls: list[int], change: Any, check: Any) -> None:
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu(min_stages=1)
    memo = DecisionMemo()
    first = _decided(w, memo)
    assert first.engages
    change(w)
    again = _decided(w, memo)
    assert fresh_calls == [1, 1]
    assert again is not first
    assert check(again), again


def test_a_layer_list_changed_in_place_decides_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_ffn_layer_indices`` handing back the same list object, changed in
    place between steps, is compared by value."""
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu()
    layers = [0, 1, 2]
    monkeypatch.setattr(w.modules[0], "_ffn_layer_indices", lambda runner: layers)
    memo = DecisionMemo()
    assert _decided(w, memo).plan.layers == (0, 1, 2)
    layers.pop()
    assert _decided(w, memo).plan.layers == (0, 1)


def test_apply_and_unpatch_empty_the_runtime_memo() -> None:
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu()
    runtime = PATCH_LAYER.runtime
    w.run_step()
    assert len(runtime.decisions) == 1
    PATCH_LAYER.engine.unpatch(timeout=10)
    assert len(runtime.decisions) == 0
    apply_cpu()
    assert len(runtime.decisions) == 0
    w.run_step()
    assert len(runtime.decisions) == 1


def _other_connector(w: World) -> None:
    w.runner.connector = object()


def _one_stage(w: World) -> None:
    w.dp_metadata = lambda: {0: None}  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_role, "AFD role is 'attention'"),
        (_other_connector, "connector is object"),
        (_one_stage, "fewer than the minimum"),
    ],
    ids=["role", "connector class", "stages"],
)
def test_a_serial_decision_the_inputs_hold_is_kept(fresh_calls: list[int], change: Any, reason: str) -> None:
    """A step that runs serially for a reason its inputs hold (a pass-through
    step on every call of such a runner) takes the kept decision instead of
    deciding again; changing the input back engages."""
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu()
    memo = DecisionMemo()
    connector, dp_metadata = w.runner.connector, w.dp_metadata
    change(w)
    first = _decided(w, memo)
    assert not first.engages and reason in first.reason and len(memo) == 1
    # made before the layer list is read: the kept one is taken without reading it
    listed: list[int] = []
    layer_indices = w.modules[0]._ffn_layer_indices
    w.modules[0]._ffn_layer_indices = lambda runner: listed.append(1) or layer_indices(runner)
    try:
        assert _decided(w, memo) is first and _decided(w, memo) is first
        assert fresh_calls == [1] and listed == []
    finally:
        w.modules[0]._ffn_layer_indices = layer_indices
    w.runner.afd_config.role, w.runner.connector, w.dp_metadata = "ffn", connector, dp_metadata
    assert _decided(w, memo).engages and fresh_calls == [1, 1]


def test_a_serial_reason_that_may_pass_is_not_kept(fresh_calls: list[int]) -> None:
    """Another thread's step has routed the connector: the same inputs may
    engage on the next step, so that decision is made again each step."""
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu()
    memo = DecisionMemo()
    routed = type(w.connector).send_ffn_output.__get__(w.connector)

    def foreign(*args: Any, **kwargs: Any) -> Any:
        return routed(*args, **kwargs)

    setattr(foreign, ROUTER_MARK, True)
    w.connector.send_ffn_output = foreign
    first = _decided(w, memo)
    assert not first.engages and first.passing and "another thread" in first.reason
    assert len(memo) == 0
    del w.connector.send_ffn_output
    assert _decided(w, memo).engages and fresh_calls == [1, 1]


def test_a_runner_the_layer_list_fails_on_gets_the_reason_of_its_first_failed_check() -> None:
    """The memo calls ``_ffn_layer_indices`` before the checks that come
    first in a decision: where it fails, the decision is made in order, so
    a runner of the attention role is told so, not that planning failed."""
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu()
    memo = DecisionMemo()
    w.runner.afd_config.role = "attention"
    w.runner.num_layers = "not a number"
    made = _decided(w, memo)
    assert not made.engages and "AFD role is 'attention'" in made.reason


def test_a_serial_decision_about_the_layer_list_reads_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A serial decision made from the layer list (a repeated layer) is
    kept with the list: a fixed list engages on the next step."""
    w = world(layers=3, stage_ids=(0, 1))
    apply_cpu()
    layers = [0, 1, 1]
    monkeypatch.setattr(w.modules[0], "_ffn_layer_indices", lambda runner: layers)
    memo = DecisionMemo()
    first = _decided(w, memo)
    assert not first.engages and "repeats a layer" in first.reason and _decided(w, memo) is first
    layers[2] = 2
    assert _decided(w, memo).engages
