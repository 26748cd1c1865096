"""The step metrics per stream layout: ``stats()["layout_steps"]`` as
``vllm:camp2p_overlap_layout_steps_total{layout}`` and
``stats()["graph_replay_layouts"]`` as
``vllm:camp2p_overlap_layout_graph_replays_total{layout}``, each layout an
engaged step may run exported at 0 until counted; the mode gauge's
``layouts`` label next to ``mode`` and ``rung``; the one-line summary's
steps and graph replays per layout; and the endpoint of the process-wide
patch layer serving what ``stats()`` says for a listed pair of layouts."""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.logs import PackageLogs
from support.overlap import bounded, run_step, world

import camp2p_overlap
from camp2p_overlap.core import patch_layer as process
from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.observe import metrics
from camp2p_overlap.core.observe.counters import StepCounters
from camp2p_overlap.core.patch_layer import PATCH_LAYER

BOTH = ("compute-side", "comm-side")


def families(registry: Any) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def totals(family: Any, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for s in family.samples if s.name.endswith("_total")}


def mode_info(fams: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    return {(s.labels["mode"], s.labels["rung"], s.labels["layouts"]): s.value for s in fams[metrics.MODE_INFO].samples}


def test_the_names_follow_vllms_and_the_stats_keys() -> None:
    assert metrics.LAYOUT_STEPS == "vllm:camp2p_overlap_layout_steps"
    assert metrics.LAYOUT_GRAPH_REPLAYS == "vllm:camp2p_overlap_layout_graph_replays"
    assert set(metrics.SYNCED) == {"steps", "graph_replays", "layout_steps", "graph_replay_layouts"}
    assert set(metrics.SYNCED) <= set(StepCounters().to_dict())


def test_steps_and_graph_replays_are_counted_per_layout() -> None:
    c = StepCounters()
    m = metrics.StepMetrics(c.to_dict, mode="overlap", rung="compute-side,comm-side", layouts=BOTH)
    fams = families(m.registry)
    assert totals(fams[metrics.LAYOUT_STEPS], "layout") == {"compute-side": 0.0, "comm-side": 0.0}
    assert totals(fams[metrics.LAYOUT_GRAPH_REPLAYS], "layout") == {"compute-side": 0.0, "comm-side": 0.0}
    assert fams[metrics.LAYOUT_STEPS].type == fams[metrics.LAYOUT_GRAPH_REPLAYS].type == "counter"
    for layout in ("compute-side", "compute-side", "compute-side", "comm-side"):
        c.engaged("overlap", layout)
    c.graph_replay("overlap", "compute-side")
    c.graph_replay("overlap", "compute-side")
    c.graph_replay("serial")
    fams = families(m.registry)  # a scrape syncs first
    assert totals(fams[metrics.LAYOUT_STEPS], "layout") == {"compute-side": 3.0, "comm-side": 1.0}
    assert totals(fams[metrics.LAYOUT_GRAPH_REPLAYS], "layout") == {"compute-side": 2.0, "comm-side": 0.0}
    assert totals(fams[metrics.STEPS], "path")["overlap"] == 4.0
    assert totals(fams[metrics.GRAPH_REPLAYS], "variant") == {"serial": 1.0, "overlap": 2.0}
    # Later syncs add what was counted since, once.
    c.engaged("overlap", "comm-side")
    c.engaged("overlap", "e2a-only")  # a layout not announced gets its label when first counted
    m.sync()
    fams = families(m.registry)
    assert totals(fams[metrics.LAYOUT_STEPS], "layout") == {"compute-side": 3.0, "comm-side": 2.0, "e2a-only": 1.0}
    assert totals(fams[metrics.LAYOUT_STEPS], "layout") == {k: float(v) for k, v in c.to_dict()["layout_steps"].items()}


def test_the_mode_gauge_names_the_layouts_next_to_mode_and_rung() -> None:
    m = metrics.StepMetrics(lambda: {}, mode="overlap", rung="compute-side,comm-side", layouts=BOTH)
    assert mode_info(families(m.registry)) == {("overlap", "compute-side,comm-side", "compute-side,comm-side"): 1.0}
    m.set_mode("parity", "parity", ("parity",))
    assert mode_info(families(m.registry)) == {("parity", "parity", "parity"): 1.0}
    assert totals(families(m.registry)[metrics.LAYOUT_STEPS], "layout")["parity"] == 0.0
    m.set_mode("overlap", "none", ())
    assert mode_info(families(m.registry)) == {("overlap", "none", "none"): 1.0}
    default = metrics.StepMetrics(lambda: {})
    assert mode_info(families(default.registry)) == {("overlap", "compute-side", "compute-side"): 1.0}


def test_a_forked_child_keeps_the_layouts_and_counts_from_zero() -> None:
    c = StepCounters()
    m = metrics.StepMetrics(c.to_dict, mode="overlap", rung="comm-side", layouts=("comm-side",))
    c.engaged("overlap", "comm-side")
    assert totals(families(m.registry)[metrics.LAYOUT_STEPS], "layout") == {"comm-side": 1.0}
    c._zero()  # what the fork hooks run in a child: the counters' ...
    m._forget_in_child()  # ... and the metrics'
    fams = families(m.registry)
    assert mode_info(fams) == {("overlap", "comm-side", "comm-side"): 1.0}
    assert totals(fams[metrics.LAYOUT_STEPS], "layout") == {"comm-side": 0.0}
    assert totals(fams[metrics.LAYOUT_GRAPH_REPLAYS], "layout") == {"comm-side": 0.0}


def _snap(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "steps": {"overlap": 0, "parity": 0, "reorder": 0, "serial": 0},
        "serial_reasons": {},
        "layout_steps": {},
        "graph_replays": {"serial": 0, "overlap": 0},
        "graph_replay_layouts": {},
    }
    base.update(kw)
    return base


def test_the_summary_gives_the_overlaps_steps_per_layout() -> None:
    snap = _snap(
        steps={"overlap": 4, "parity": 0, "reorder": 0, "serial": 1},
        layout_steps={"compute-side": 3, "comm-side": 1},
    )
    assert metrics.summary_line(snap) == (
        "camp2p-overlap steps: overlap=4 parity=0 reorder=0 serial=1; by layout: comm-side=1 compute-side=3"
    )
    later = _snap(
        steps={"overlap": 6, "parity": 0, "reorder": 0, "serial": 1},
        layout_steps={"compute-side": 5, "comm-side": 1},
    )
    assert metrics.summary_line(later, snap) == (
        "camp2p-overlap steps: overlap=6 (+2) parity=0 reorder=0 serial=1; by layout: comm-side=1 compute-side=5 (+2)"
    )
    # parity and reorder run the layout of their own name: the path already says it.
    parity = _snap(steps={"overlap": 0, "parity": 2, "reorder": 0, "serial": 0}, layout_steps={"parity": 2})
    assert metrics.summary_line(parity) == "camp2p-overlap steps: overlap=0 parity=2 reorder=0 serial=0"


def test_the_summary_gives_the_layers_graph_replays_per_captured_layout() -> None:
    snap = _snap(graph_replays={"serial": 3, "overlap": 7}, graph_replay_layouts={"compute-side": 7})
    before = _snap(graph_replays={"serial": 3, "overlap": 4}, graph_replay_layouts={"compute-side": 4})
    assert metrics.summary_line(snap, before) == (
        "camp2p-overlap steps: overlap=0 parity=0 reorder=0 serial=0; graph replays: serial 3, overlap 7 (+3)"
        " (by layout: compute-side 7 (+3))"
    )


def test_the_reporter_logs_the_layouts_change(logs: PackageLogs) -> None:
    counts = _snap(steps={"overlap": 2, "parity": 0, "reorder": 0, "serial": 0}, layout_steps={"compute-side": 2})
    r = metrics.Reporter(lambda: counts, port=None, summary_s=0, layouts=BOTH)
    try:
        assert r.log_summary()
        assert not r.log_summary()
        counts["steps"] = {**counts["steps"], "overlap": 3}
        counts["layout_steps"] = {"compute-side": 2, "comm-side": 1}
        assert r.log_summary()
        assert mode_info(families(r.metrics.registry)) == {("overlap", "compute-side", "compute-side,comm-side"): 1.0}
    finally:
        r.close()
    assert logs.texts("camp2p-overlap steps:", logging.INFO) == [
        "camp2p-overlap steps: overlap=2 parity=0 reorder=0 serial=0; by layout: compute-side=2",
        "camp2p-overlap steps: overlap=3 (+1) parity=0 reorder=0 serial=0; by layout: comm-side=1 (+1) compute-side=2",
    ]


@pytest.fixture
def fresh_process_metrics(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No reporter running and no process metrics yet: the process layer
    makes both, from its own stats, on its next step."""
    process.reset_reporting()
    monkeypatch.setattr(metrics, "_metrics", None)
    yield
    process.reset_reporting()


def test_the_process_endpoint_serves_the_layouts_stats_counts(fresh_process_metrics: None) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False, metrics_port=0, summary_s=0, layouts=BOTH)
    PATCH_LAYER.engine.apply(strict=True, config=cfg)
    try:
        before = dict(camp2p_overlap.stats()["layout_steps"])
        bounded(lambda: run_step(w))  # the first step starts the reporter
        bounded(lambda: run_step(w))
        reporter = metrics.current_reporter()
        assert reporter is not None and reporter.port, "no endpoint started"
        with urllib.request.urlopen(f"http://127.0.0.1:{reporter.port}/metrics", timeout=10) as resp:
            fams = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
        stats = camp2p_overlap.stats()
        assert stats["layout_steps"]["compute-side"] == before.get("compute-side", 0) + 2  # adaptive off: the first
        served = totals(fams[metrics.LAYOUT_STEPS], "layout")
        assert served == {"comm-side": 0.0, **{k: float(v) for k, v in stats["layout_steps"].items()}}
        assert mode_info(fams) == {("overlap", "compute-side,comm-side", "compute-side,comm-side"): 1.0}
    finally:
        PATCH_LAYER.engine.unpatch()
