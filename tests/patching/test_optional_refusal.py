"""An optional target (``optional = "graph_variants"`` in the manifest:
``_capture_graphs``) missing or changed refuses its feature only: its
module's other targets are installed, the engine records why
(``feature_refusal``), ``status()`` and the log say it once; unpatch,
re-apply, a reload and strict mode recompute or act on it. A required
target missing still refuses its module.

Real eager steps and captures with such a runner: tests/overlap/test_optional_targets.py."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest
import wrapt
from support.logs import PackageLogs
from support.patching import (
    CFG,
    CONNECTOR,
    GRAPH_VARIANTS_REFUSED,
    RUNNER,
    RUNNER_VARIANT_PROBLEM,
    RUNNER_VARIANTS,
    variant_module,
)

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.core.patching.lifecycle import PatchRefused
from camp2p_overlap.core.patching.status_report import PatchReport, TargetState
from camp2p_overlap.emulation import standins

CAPTURE = f"{RUNNER}.AFDNPUFFNModelRunner._capture_graphs"
FORWARD = f"{RUNNER}.AFDNPUFFNModelRunner._ffn_forward"


def reason_of(variant: str) -> str:
    return f"{RUNNER_VARIANT_PROBLEM[variant]}: {GRAPH_VARIANTS_REFUSED}"


def by_target(report: PatchReport) -> dict[str, Any]:
    return {t.target: t for t in report.targets}


def feature_warnings(logs: PackageLogs) -> list[str]:
    return logs.texts(GRAPH_VARIANTS_REFUSED, level=logging.WARNING)


def import_connector() -> None:
    import importlib

    importlib.import_module(CONNECTOR)


def assert_feature_refused_alone(patch_layer: PatchLayer, variant: str) -> None:
    """The graph variants are refused with the variant's reason; every other
    target is wrapped or checked; the patch layer is applied and engaged."""
    report = patch_layer.engine.status()
    reason = reason_of(variant)
    assert report.applied and report.reason == "applied" and report.engaged, str(report)
    st = by_target(report)
    assert st[CAPTURE].state is TargetState.REFUSED and st[CAPTURE].reason == reason
    assert st[CAPTURE].feature == "graph_variants"
    others = {t: s.state for t, s in st.items() if t != CAPTURE}
    assert others[FORWARD] is TargetState.WRAPPED
    assert set(others.values()) <= {TargetState.WRAPPED, TargetState.CHECKED}, others
    assert patch_layer.engine.feature_refusal("graph_variants") == reason
    assert patch_layer.engine.features_refused() == {"graph_variants": reason}
    assert report.features_refused == {"graph_variants": reason}
    assert report.to_dict()["features_refused"] == {"graph_variants": reason}
    assert report.to_dict()["engaged"] is True
    assert [t.target for t in report.refused] == [CAPTURE] and report.required_refused == ()
    assert PatchReport.unready_of(report.targets) is None
    assert f"  {CAPTURE}: refused ({reason})" in str(report).splitlines()
    cls = sys.modules[RUNNER].AFDNPUFFNModelRunner
    assert patch_layer.engine.is_ours(vars(cls)["_ffn_forward"])
    assert all(not patch_layer.engine.is_ours(getattr(c, "_capture_graphs", None)) for c in cls.__mro__)


@pytest.mark.parametrize("when", ["imported-before-apply", "imported-after-apply"])
@pytest.mark.parametrize("variant", sorted(RUNNER_VARIANTS))
def test_an_optional_target_missing_or_changed_refuses_its_feature_only(
    variant: str, when: str, patch_layer: PatchLayer, logs: PackageLogs
) -> None:
    if when == "imported-after-apply":
        standins.install()
        assert patch_layer.engine.apply(config=CFG).applied
    module = variant_module(RUNNER, RUNNER_VARIANTS[variant])
    cls = module.AFDNPUFFNModelRunner
    raw = {c: dict(vars(c)) for c in cls.__mro__ if c.__module__ == RUNNER}
    if when == "imported-before-apply":
        patch_layer.engine.apply(config=CFG)
    else:
        wrapt.notify_module_loaded(module)  # what the import system does for a real import
    import_connector()
    assert_feature_refused_alone(patch_layer, variant)
    assert feature_warnings(logs) == [f"camp2p-overlap: {reason_of(variant)}"]
    (outcome,) = logs.matching("pid=")
    assert outcome.levelno == logging.INFO
    assert "AFDNPUFFNModelRunner._capture_graphs=refused (graph_variants only)" in outcome.getMessage()
    assert "AFDNPUFFNModelRunner._ffn_forward=wrapped" in outcome.getMessage()

    # Idempotent: apply() again and the installer handed the module again
    # keep the refusal, and log nothing more.
    patch_layer.engine.apply(config=CFG)
    for mspec in patch_layer.engine.manifest.modules:
        statuses = patch_layer.engine.installer.install(mspec, sys.modules[mspec.name], patch_layer.engine.wrappers)
        if mspec.name == RUNNER:
            assert statuses[CAPTURE].state is TargetState.REFUSED and statuses[CAPTURE].feature == "graph_variants"
    assert_feature_refused_alone(patch_layer, variant)
    assert len(feature_warnings(logs)) == 1

    # unpatch() clears it and restores every entry; a new apply() recomputes
    # it (and logs it again: a new outcome).
    assert patch_layer.engine.unpatch() is True
    assert patch_layer.engine.feature_refusal("graph_variants") is None and patch_layer.engine.features_refused() == {}
    assert patch_layer.engine.status().features_refused == {}
    assert {t.state for t in patch_layer.engine.status().targets} == {TargetState.INACTIVE}
    for c, entries in raw.items():
        assert vars(c).keys() == entries.keys() and all(vars(c)[k] is v for k, v in entries.items()), c
    patch_layer.engine.apply(config=CFG)
    assert_feature_refused_alone(patch_layer, variant)
    assert len(feature_warnings(logs)) == 2


def test_a_required_target_missing_still_refuses_its_module(patch_layer: PatchLayer) -> None:
    """With ``_capture_graphs`` gone and ``_ffn_forward`` changed too, the
    required target refuses the runner module: nothing of it is wrapped, and
    no feature refusal is recorded (the whole module is)."""
    edits = (
        *RUNNER_VARIANTS["capture-graphs-moved"],
        ("update_connector_state=True,\n    ):", "update_connector_state=True,\n        stream_hint=None,\n    ):"),
    )
    module = variant_module(RUNNER, edits)
    snap = dict(vars(module.AFDNPUFFNModelRunner))
    import_connector()
    report = patch_layer.engine.apply(config=CFG)
    st = by_target(report)
    assert report.applied and not report.engaged
    runner_targets = {t for t in st if t.startswith(RUNNER)}
    assert {t.target for t in report.refused} == runner_targets == {t.target for t in report.required_refused}
    assert "signature changed: unexpected parameter(s) stream_hint" in st[FORWARD].reason
    assert st[CAPTURE].feature is None and "module refused because" in st[CAPTURE].reason
    assert "AFDNPUFFNModelRunner._ffn_forward" in st[CAPTURE].reason
    assert patch_layer.engine.feature_refusal("graph_variants") is None and report.features_refused == {}
    now = vars(module.AFDNPUFFNModelRunner)
    assert now.keys() == snap.keys() and all(now[k] is v for k, v in snap.items())
    assert FORWARD in (PatchReport.unready_of(report.targets) or "")


@pytest.mark.parametrize("when", ["imported-before-apply", "imported-after-apply"])
@pytest.mark.parametrize("graph", ["1", "adaptive"])
def test_strict_mode_refuses_the_module_when_the_configuration_asks_for_graph_variants(
    graph: str, when: str, patch_layer: PatchLayer
) -> None:
    cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False, graph=graph)
    if when == "imported-after-apply":
        standins.install()
        assert patch_layer.engine.apply(config=cfg, strict=True).applied
    module = variant_module(RUNNER, RUNNER_VARIANTS["capture-graphs-moved"])
    cls = module.AFDNPUFFNModelRunner
    snap = dict(vars(cls))
    with pytest.raises(PatchRefused, match=r"_capture_graphs.*strict mode the configuration asks for decode graph"):
        if when == "imported-before-apply":
            patch_layer.engine.apply(config=cfg, strict=True)
        else:
            wrapt.notify_module_loaded(module)
    assert vars(cls).keys() == snap.keys() and all(vars(cls)[k] is v for k, v in snap.items())  # nothing wrapped
    assert patch_layer.engine.feature_refusal("graph_variants") is None
    if when == "imported-before-apply":
        assert not patch_layer.engine.is_applied()
    else:  # the hook refused the module (nothing of it installed), as for any refused module
        st = by_target(patch_layer.engine.status())
        assert st[FORWARD].state is TargetState.REFUSED and st[CAPTURE].feature is None


def test_strict_mode_applies_and_logs_when_the_configuration_does_not_ask_for_graph_variants(
    patch_layer: PatchLayer, logs: PackageLogs
) -> None:
    variant_module(RUNNER, RUNNER_VARIANTS["capture-graphs-new-param"])
    import_connector()
    cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False, graph="0", strict=True)
    assert patch_layer.engine.apply(config=cfg).engaged  # strict from the configuration
    assert_feature_refused_alone(patch_layer, "capture-graphs-new-param")
    assert len(feature_warnings(logs)) == 1


def test_a_reload_checks_the_optional_target_again(patch_layer: PatchLayer, logs: PackageLogs) -> None:
    """Reloaded without ``_capture_graphs``, the runner module's new classes
    are wrapped with the graph variants refused; reloaded with it back, the
    refusal is cleared (logged at INFO)."""
    module = variant_module(RUNNER, ())
    import_connector()
    assert patch_layer.engine.apply(config=CFG).engaged
    assert patch_layer.engine.feature_refusal("graph_variants") is None
    old = module.AFDNPUFFNModelRunner
    original = {a: vars(old)[a].__wrapped__ for a in ("_ffn_forward", "_capture_graphs")}

    variant_module(RUNNER, RUNNER_VARIANTS["capture-graphs-moved"], into=module)  # as importlib.reload does
    assert by_target(patch_layer.engine.status())[FORWARD].state is TargetState.NOT_IMPORTED  # until a refresh
    patch_layer.engine.refresh()
    assert_feature_refused_alone(patch_layer, "capture-graphs-moved")
    assert all(vars(old)[a] is f for a, f in original.items())  # the old classes are restored
    assert len(feature_warnings(logs)) == 1
    patch_layer.engine.refresh()
    assert len(feature_warnings(logs)) == 1

    variant_module(RUNNER, (), into=module)
    patch_layer.engine.refresh()
    report = patch_layer.engine.status()
    assert report.engaged and by_target(report)[CAPTURE].state is TargetState.WRAPPED
    assert patch_layer.engine.feature_refusal("graph_variants") is None and report.features_refused == {}
    assert logs.texts("decode graph variants are no longer refused", level=logging.INFO) == [
        "camp2p-overlap: decode graph variants are no longer refused: AFDNPUFFNModelRunner._capture_graphs "
        "installed again"
    ]
