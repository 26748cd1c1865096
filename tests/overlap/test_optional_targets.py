"""A target one feature needs refuses that feature only: a runner whose
``_capture_graphs`` is missing (RFC #388 moves it to a base class) or has a
changed signature (a later line, PR #344) gets the eager overlap, real
steps on the emulated device, while a decode graph captures upstream's
serial graph; ``status()`` and the log say why, once. On both stacks.

The engine side (unpatch, re-apply, strict mode, reloads):
tests/patching/test_optional_refusal.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from support.logs import PackageLogs
from support.overlap import apply_cpu, assert_same, assert_stack, eager_refs, graph_world
from support.patching import GRAPH_VARIANTS_REFUSED, RUNNER, RUNNER_VARIANT_PROBLEM, RUNNER_VARIANTS, variant_module

import camp2p_overlap
from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.overlap.graphs import VariantGraph
from camp2p_overlap.core.overlap.step import GRAPH_OFF, FfnStep
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.core.patching.status_report import TargetState
from camp2p_overlap.emulation.world import World

pytestmark = pytest.mark.usefixtures("standin_stack", "emulated_torch_npu")

CAPTURE = f"{RUNNER}.AFDNPUFFNModelRunner._capture_graphs"


def step(w: World, n: int) -> dict:
    w.steps_run = n - 1
    return w.run_step()


def node_streams(graph: Any) -> set[str]:
    return {name for name, _, _ in graph.nodes()}


def apply_lenient(graph: str) -> None:
    """Apply the process-wide patch layer on the CPU backend, not strict (strict
    mode with the graph variants asked for refuses such a runner module:
    tests/patching/test_optional_refusal.py); it must engage."""
    PATCH_LAYER.engine.unpatch(timeout=10)
    report = PATCH_LAYER.engine.apply(config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, graph=graph))
    assert report.engaged, str(report)
    assert_stack(report)


def decided(w: World, **kwargs: Any) -> Any:
    """The decision for a call of ``w``'s runner's ``_ffn_forward``, as its step takes it."""
    kwargs = {"dp_metadata_list": w.dp_metadata(), **kwargs}
    return FfnStep(PATCH_LAYER.engine, PATCH_LAYER.runtime, None, w.runner, (), kwargs).decision_and_streams()[0]  # type: ignore[arg-type]


@pytest.mark.parametrize("graph", ["1", "adaptive"])
@pytest.mark.parametrize("variant", sorted(RUNNER_VARIANTS))
def test_graph_variants_refused_eager_overlap_engaged(variant: str, graph: str, logs: PackageLogs) -> None:
    variant_module(RUNNER, RUNNER_VARIANTS[variant])
    w = graph_world()
    assert "_capture_graphs" not in vars(type(w.runner)) or variant == "capture-graphs-new-param"
    refs = eager_refs(w, range(1, 9))
    reason = f"{RUNNER_VARIANT_PROBLEM[variant]}: {GRAPH_VARIANTS_REFUSED}"
    apply_lenient(graph)  # the eager overlap applies
    report = camp2p_overlap.status()
    assert report.applied and report.reason == "applied" and report.engaged
    lines = str(report).splitlines()
    assert f"  {CAPTURE}: refused ({reason})" in lines
    assert [t.target for t in report.targets if t.state not in (TargetState.WRAPPED, TargetState.CHECKED)] == [CAPTURE]
    assert PATCH_LAYER.engine.feature_refusal("graph_variants") == reason
    assert decided(w, is_graph_capturing=True).reason == reason  # a capture runs serially
    eager = decided(w)
    assert eager.engages and eager.plan is not None  # an eager step engages

    # An eager step engages the overlap, bitwise equal to the serial step.
    steps = PATCH_LAYER.runtime.stats()["steps"]
    assert_same(step(w, 1), refs[1], "eager step")
    after = PATCH_LAYER.runtime.stats()["steps"]
    assert after["overlap"] == steps["overlap"] + 1 and after["serial"] == steps["serial"]

    # A capture (its eager warm-up engages) runs serially inside the graph:
    # the graph is upstream's own.
    w.steps_run = 1
    captured = w.capture()
    assert not isinstance(captured, VariantGraph)
    assert node_streams(captured) <= {"C", "capture"}
    assert PATCH_LAYER.runtime.stats()["steps"]["overlap"] == after["overlap"] + 1  # the warm-up
    for n in range(4, 9):  # replays of upstream's graph
        assert_same(step(w, n), refs[n], f"replay {n}")

    # Logged once, at WARNING.
    assert logs.texts(GRAPH_VARIANTS_REFUSED, level=logging.WARNING) == [f"camp2p-overlap: {reason}"]


def test_graph_0_captures_serially_for_its_own_reason(logs: PackageLogs) -> None:
    """With the graph variants not asked for, a capture gives the usual
    reason (graph overlap off), not the refusal; the refusal is still logged."""
    variant_module(RUNNER, RUNNER_VARIANTS["capture-graphs-moved"])
    w = graph_world()
    apply_cpu(graph="0")  # strict: the graph variants are not asked for
    assert PATCH_LAYER.engine.feature_refusal("graph_variants") is not None
    assert decided(w, is_graph_capturing=True).reason == GRAPH_OFF
    assert decided(w).engages
    assert node_streams(w.capture()) <= {"C", "capture"}
    assert len(logs.matching(GRAPH_VARIANTS_REFUSED, level=logging.WARNING)) == 1


def test_with_the_target_present_the_graph_variant_is_captured() -> None:
    """The control: the unchanged runner captures the patch layer's variant."""
    w = graph_world()
    apply_cpu(graph="1")
    assert PATCH_LAYER.engine.feature_refusal("graph_variants") is None
    assert "F" in node_streams(w.capture())  # the overlap of the default layout: the FFN forks to F
