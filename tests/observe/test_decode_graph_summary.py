"""The step summary says, in its one line, that decode replays upstream's
graph once captures show it, and at ``VLLM_CAMP2P_MULTISTREAM_GRAPH=0``
which Roll-out rung switches it; the process layer hands the reporter its
GRAPH setting."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from support.logs import PackageLogs
from support.overlap import bounded, run_step, world

from camp2p_overlap.core import patch_layer as process
from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.observe import metrics
from camp2p_overlap.core.observe.decode_graphs import GRAPH_OFF_WORDS, summary_note, upstream_graph_only
from camp2p_overlap.core.overlap.step import GRAPH_OFF
from camp2p_overlap.core.patch_layer import PATCH_LAYER

RUNG_NOTE = "decode replays upstream's graph (Roll out rung 6: VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive)"
NOT_CAPTURED = "decode replays upstream's graph (graph variants not captured: the log says why)"
STEPS = {"overlap": 5, "parity": 0, "reorder": 0, "serial": 2}


def snap(**extra: Any) -> dict[str, Any]:
    return {"steps": dict(STEPS), "serial_reasons": {}, "graph_replays": {"serial": 0, "overlap": 0}, **extra}


def test_the_words_of_a_graph_0_capture_are_the_steps_reason() -> None:
    assert GRAPH_OFF_WORDS in GRAPH_OFF


def test_a_capture_counted_under_graph_off_names_the_rung() -> None:
    s = snap(serial_reasons={GRAPH_OFF: 2})
    line = metrics.summary_line(s)
    assert line == (
        f"camp2p-overlap steps: overlap=5 parity=0 reorder=0 serial=2; {RUNG_NOTE}; top serial reason (2): {GRAPH_OFF}"
    )
    assert "\n" not in line
    assert metrics.summary_line(s, graph="0") == line


@pytest.mark.parametrize(
    ("graph", "note"), [("0", RUNG_NOTE), ("adaptive", NOT_CAPTURED), ("1", NOT_CAPTURED), (None, NOT_CAPTURED)]
)
def test_serial_captures_only_say_upstreams_graph(graph: str | None, note: str) -> None:
    s = snap(graph_captures={"serial": 3, "overlap": 0})
    assert upstream_graph_only(s)
    assert summary_note(s, graph) == note
    assert metrics.summary_line(s, graph=graph).endswith(f"; {note}")


@pytest.mark.parametrize(
    "s",
    [
        snap(),  # eager steps only: nothing to say about decode graphs
        snap(serial_reasons={"switched off": 2}),
        snap(graph_captures={"serial": 0, "overlap": 0}),
        snap(graph_captures={"serial": 3, "overlap": 3}),  # adaptive: both variants
        snap(graph_captures={"serial": 0, "overlap": 3}),  # GRAPH=1
        snap(serial_reasons={GRAPH_OFF: 1}, graph_replays={"serial": 0, "overlap": 4}),
    ],
)
def test_no_note_unless_every_graph_is_upstreams(s: dict[str, Any]) -> None:
    assert summary_note(s, "0") is None
    assert "decode replays" not in metrics.summary_line(s, graph="0")


def test_the_reporter_logs_the_note_with_its_graph_setting(logs: PackageLogs) -> None:
    counts = snap(graph_captures={"serial": 2, "overlap": 0})
    r = metrics.Reporter(lambda: counts, port=None, summary_s=0, graph="0")
    try:
        assert r.log_summary()
    finally:
        r.close()
    assert logs.texts("camp2p-overlap steps:", logging.INFO) == [
        f"camp2p-overlap steps: overlap=5 parity=0 reorder=0 serial=2; {RUNG_NOTE}"
    ]


@pytest.fixture
def fresh_reporting() -> Iterator[None]:
    process.reset_reporting()
    yield
    process.reset_reporting()


@pytest.mark.parametrize("graph", ["0", "adaptive"])
def test_the_process_layer_hands_the_reporter_its_graph_setting(fresh_reporting: None, graph: str) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False, summary_s=0, graph=graph)
    PATCH_LAYER.engine.apply(strict=True, config=cfg)
    bounded(lambda: run_step(w))  # the first step starts the reporter
    reporter = metrics.current_reporter()
    assert reporter is not None and reporter.graph == graph
