"""``camp2p-overlap doctor`` on the ladder and the layouts: the rung the
environment sets, marked on the ladder (parity -> reorder -> compute-side ->
comm-side (opt-in) -> decode graphs); per layout an engaged step runs, where
it puts A2E, E2A and the FFN and whether a decode graph captures it; the
``comm-side`` decode-graph opt-in, whether it is set, and a one-line pointer
to why (its sources); a ``comm-side`` first layout with graph variants asked
for and no opt-in refuses the decode graphs line; every malformed variable
is its own problem."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.child import run_cli

from camp2p_overlap.core import env_vars
from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.overlap.plan import LADDER
from camp2p_overlap.tools.deployment import read_deployment
from camp2p_overlap.tools.doctor import (
    COMM_SIDE_GRAPH_WHY,
    FULL_LADDER,
    decode_graph_line,
    diagnose,
    doctor_text,
    graph_comm_side,
    ladder_line,
    layout_rows,
)

REPO = Path(__file__).resolve().parents[2]
ON = OverlapConfig(enabled=True)


def _names(rows: list[dict]) -> list[tuple[str, str | None, str]]:
    return [(r["name"], r["listed_as"], r["decode_graph"]) for r in rows]


# ---------------------------------------------------------------------------
# The layouts, one row each


def test_the_default_runs_compute_side_which_a_decode_graph_captures() -> None:
    (row,) = layout_rows(ON)
    assert row["name"] == row["listed_as"] == "compute-side"
    assert (row["a2e"], row["e2a"], row["ffn"], row["order"]) == ("caller", "caller", "side", "overlap")
    assert row["where"] == "A2E/E2A on the caller's stream C in the overlap's order, the FFN on its side stream F"
    assert row["decode_graph"] == "captured"


def test_comm_side_puts_a2e_and_e2a_on_the_stage_streams_and_needs_the_graph_opt_in() -> None:
    (row,) = layout_rows(ON.with_overrides(layouts=("comm-side",)))
    assert (row["name"], row["a2e"], row["e2a"], row["ffn"]) == ("comm-side", "side", "side", "caller")
    assert row["where"] == "A2E/E2A on each stage's side stream K_s in the overlap's order, the FFN on C"
    assert row["decode_graph"] == "needs-opt-in"
    assert env_vars.ENV_GRAPH_COMM_SIDE + "=1" in row["detail"] and "upstream's serial graph" in row["detail"]
    (opted,) = layout_rows(ON.with_overrides(layouts=("comm-side",), graph_comm_side=True))
    assert opted["decode_graph"] == "opted-in"


def test_a_list_is_run_in_order_and_only_the_first_is_captured() -> None:
    both = layout_rows(ON.with_overrides(layouts=("compute-side", "comm-side")))
    assert _names(both) == [("compute-side", "compute-side", "captured"), ("comm-side", "comm-side", "eager-only")]
    assert "captures the first listed layout" in both[1]["detail"]
    reversed_ = layout_rows(ON.with_overrides(layouts=("comm-side", "compute-side")))
    assert _names(reversed_) == [
        ("comm-side", "comm-side", "needs-opt-in"),
        ("compute-side", "compute-side", "eager-only"),
    ]


def test_the_direction_switches_refine_comm_side_only() -> None:
    cfg = ON.with_overrides(layouts=("comm-side", "compute-side"), a2e_on_side_stream=False)
    rows = layout_rows(cfg)
    assert _names(rows) == [("e2a-only", "comm-side", "needs-opt-in"), ("compute-side", "compute-side", "eager-only")]
    assert rows[0]["where"] == (
        "A2E on the caller's stream C, E2A on each stage's side stream K_s in the loop's order, the FFN on C"
    )
    assert layout_rows(ON.with_overrides(a2e_on_side_stream=False, e2a_on_side_stream=False))[0]["name"] == (
        "compute-side"
    )
    assert (
        layout_rows(ON.with_overrides(layouts=("comm-side",), a2e_on_side_stream=False, e2a_on_side_stream=False)) == []
    )


@pytest.mark.parametrize("mode", ["parity", "reorder"])
def test_parity_and_reorder_run_their_own_layout_whatever_is_listed(mode: str) -> None:
    rows = layout_rows(ON.with_overrides(mode=mode, layouts=("comm-side",)))
    assert _names(rows) == [(mode, None, "captured")]
    assert rows[0]["ffn"] == "caller" and (rows[0]["a2e"], rows[0]["e2a"]) == ("caller", "caller")


def test_the_opt_in_says_whether_it_is_set_and_whether_the_first_layout_needs_it() -> None:
    assert graph_comm_side(ON, None) == {
        "name": env_vars.ENV_GRAPH_COMM_SIDE,
        "set": False,
        "raw": None,
        "needed": False,
        "why": COMM_SIDE_GRAPH_WHY,
    }
    g = graph_comm_side(ON.with_overrides(layouts=("comm-side",), graph_comm_side=True), "yes")
    assert (g["set"], g["raw"], g["needed"]) == (True, "yes", True)
    assert graph_comm_side(ON.with_overrides(layouts=("compute-side", "comm-side")), None)["needed"] is False


def test_the_pointer_names_the_sources_and_real_headings() -> None:
    for source in ("p2p_hccl", "DeepSeek-V4 report §2.8.2", "#15500", "#3582"):
        assert source in COMM_SIDE_GRAPH_WHY
    cited = re.findall(r'"([^"]+)"', COMM_SIDE_GRAPH_WHY.split("docs/design.md", 1)[1])
    assert cited == ["Streams", "Decode graphs"]
    headings = [
        line.lstrip("#").strip().replace("`", "")
        for line in (REPO / "docs/design.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("## ")
    ]
    for name in cited:
        assert any(h == name or h.startswith(name + " (") for h in headings), name


# ---------------------------------------------------------------------------
# The ladder


def test_the_ladder_is_the_plans_then_decode_graphs() -> None:
    assert (
        FULL_LADDER
        == (*LADDER, "decode graphs")
        == (
            "parity",
            "reorder",
            "compute-side",
            "comm-side",
            "decode graphs",
        )
    )


@pytest.mark.parametrize(
    ("rung", "graph", "line"),
    [
        ("parity", "0", "ladder: [parity] -> reorder -> compute-side -> comm-side (opt-in) -> decode graphs"),
        ("compute-side", "0", "ladder: parity -> reorder -> [compute-side] -> comm-side (opt-in) -> decode graphs"),
        (
            "compute-side,comm-side",
            "adaptive",
            "ladder: parity -> reorder -> [compute-side] -> [comm-side] (opt-in) -> [decode graphs]",
        ),
        (
            "e2a-only",
            "1",
            "ladder: parity -> reorder -> compute-side -> comm-side (opt-in) -> [decode graphs]; "
            "e2a-only: off the ladder",
        ),
        (
            "off",
            "1",
            "ladder: parity -> reorder -> compute-side -> comm-side (opt-in) -> decode graphs "
            "(VLLM_CAMP2P_MULTISTREAM is off)",
        ),
        ("none", "0", "ladder: parity -> reorder -> compute-side -> comm-side (opt-in) -> decode graphs"),
    ],
)
def test_the_ladder_marks_the_rungs_the_environment_sets(rung: str, graph: str, line: str) -> None:
    assert ladder_line(rung, graph) == line


# ---------------------------------------------------------------------------
# Decode graphs of a comm-side first layout


@pytest.mark.parametrize("graph", ["1", "adaptive"])
def test_graph_variants_of_a_comm_side_first_layout_need_the_opt_in(graph: str) -> None:
    for layouts in (("comm-side",), ("comm-side", "compute-side")):
        cfg = ON.with_overrides(graph=graph, layouts=layouts)
        line = decode_graph_line(cfg, None)
        assert line.status == "refused"
        assert "the first layout, comm-side, puts A2E/E2A on side streams" in line.reason
        assert f"only with {env_vars.ENV_GRAPH_COMM_SIDE}=1" in line.reason
        opted = decode_graph_line(cfg.with_overrides(graph_comm_side=True), None)
        assert opted.status == "ok" and "(layout comm-side)" in opted.reason
    e2a_only = decode_graph_line(ON.with_overrides(graph=graph, layouts=("comm-side",), a2e_on_side_stream=False), None)
    assert e2a_only.status == "refused" and "the first layout, e2a-only," in e2a_only.reason


@pytest.mark.parametrize("layouts", [("compute-side",), ("compute-side", "comm-side")])
def test_graph_variants_of_a_compute_side_first_layout_are_ok(layouts: tuple[str, ...]) -> None:
    line = decode_graph_line(ON.with_overrides(graph="1", layouts=layouts), None)
    assert line.status == "ok" and "(layout compute-side)" in line.reason


def test_graph_0_stays_off_whatever_the_layout() -> None:
    assert decode_graph_line(ON.with_overrides(layouts=("comm-side",)), None).status == "off"


# ---------------------------------------------------------------------------
# diagnose() and the text


def test_diagnose_reports_the_layouts_the_opt_in_and_the_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_vars.ENV_SWITCH, "1")
    monkeypatch.setenv(env_vars.ENV_LAYOUT, "comm-side,compute-side")
    monkeypatch.setenv(env_vars.ENV_GRAPH, "adaptive")
    d = diagnose()
    c = d["config"]
    assert c["rung"] == "comm-side,compute-side" and c["ladder"] == list(FULL_LADDER)
    assert c["layouts_listed"] == ["comm-side", "compute-side"]
    assert _names(c["layouts"]) == [
        ("comm-side", "comm-side", "needs-opt-in"),
        ("compute-side", "compute-side", "eager-only"),
    ]
    assert (c["graph_comm_side"]["set"], c["graph_comm_side"]["needed"]) == (False, True)
    assert d["decode_graphs"]["status"] == "refused"
    assert any(p.startswith("decode graphs: refused") and env_vars.ENV_GRAPH_COMM_SIDE in p for p in d["problems"])
    text = doctor_text(d)
    assert (
        f"  layouts ({env_vars.ENV_LAYOUT}=comm-side,compute-side; adaptive engage measures each per shape and runs"
        " the fastest):" in text
    )
    assert "    comm-side: A2E/E2A on each stage's side stream K_s in the overlap's order, the FFN on C; " in text
    assert "decode graphs: needs-opt-in (" in text and "decode graphs: eager-only (" in text
    assert f"  comm-side decode graphs: only with {env_vars.ENV_GRAPH_COMM_SIDE}=1, not set; why: " in text
    assert "  ladder: parity -> reorder -> [compute-side] -> [comm-side] (opt-in) -> [decode graphs]; " in text

    monkeypatch.setenv(env_vars.ENV_GRAPH_COMM_SIDE, "on")
    d = diagnose()
    assert d["config"]["graph_comm_side"]["set"] is True and d["config"]["graph_comm_side"]["raw"] == "on"
    assert d["config"]["layouts"][0]["decode_graph"] == "opted-in"
    assert not any(p.startswith("decode graphs: refused") and env_vars.ENV_GRAPH_COMM_SIDE in p for p in d["problems"])
    assert f"comm-side decode graphs: only with {env_vars.ENV_GRAPH_COMM_SIDE}=1, set (" in doctor_text(d)


def test_parity_says_the_listed_layouts_wait_for_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_vars.ENV_SWITCH, "1")
    monkeypatch.setenv(env_vars.ENV_MODE, "parity")
    d = diagnose()
    assert d["config"]["rung"] == "parity" and _names(d["config"]["layouts"]) == [("parity", None, "captured")]
    text = doctor_text(d)
    assert f"  layouts: parity (mode parity; {env_vars.ENV_LAYOUT}=compute-side applies to mode overlap)" in text
    assert "  ladder: [parity] -> reorder -> " in text


def test_a_layout_list_leaving_nothing_says_every_step_is_serial(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ((env_vars.ENV_SWITCH, "1"), (env_vars.ENV_LAYOUT, "comm-side"), (env_vars.ENV_A2E, "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(env_vars.ENV_E2A, "0")
    d = diagnose()
    assert d["config"]["rung"] == "none" and d["config"]["layouts"] == []
    assert "leaves none to run: every step runs serially" in doctor_text(d)


def test_every_malformed_variable_is_its_own_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_vars.ENV_LAYOUT, "comm-side,sideways")
    monkeypatch.setenv(env_vars.ENV_GRAPH_COMM_SIDE, "perhaps")
    monkeypatch.setenv(env_vars.ENV_MIN_STAGES, "9")
    d = diagnose()
    config_problems = [p for p in d["problems"] if p.startswith("configuration: ")]
    assert len(config_problems) == 3
    for name, value in ((env_vars.ENV_LAYOUT, "sideways"), (env_vars.ENV_GRAPH_COMM_SIDE, "perhaps")):
        assert any(name in p and value in p for p in config_problems), name
    c = d["config"]
    assert c["ok"] is False and c["layouts"] is None and c["graph_comm_side"] is None and c["rung"] is None
    assert "CONFIGURATION ERROR" in doctor_text(d)


def test_the_deployment_section_reports_the_default_rung() -> None:
    src = json.dumps({"enable_dbo": True, "afd": {"connector": "CAMP2pAFDConnector", "role": "ffn"}})
    assert read_deployment(src, ON)["rung"] == "compute-side"
    assert read_deployment(src, ON.with_overrides(layouts=("compute-side", "comm-side")))["rung"] == (
        "compute-side,comm-side"
    )


def test_the_cli_json_carries_the_layouts_and_the_opt_in() -> None:
    res = run_cli(
        "doctor",
        "--json",
        env={env_vars.ENV_LAYOUT: "compute-side,comm-side", env_vars.ENV_GRAPH_COMM_SIDE: "1"},
        timeout=120,
    )
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    c = json.loads(res.stdout)["config"]
    assert c["layouts_listed"] == ["compute-side", "comm-side"]
    assert [r["name"] for r in c["layouts"]] == ["compute-side", "comm-side"]
    assert c["graph_comm_side"]["set"] is True and c["graph_comm_side"]["raw"] == "1"
    assert c["ladder"] == list(FULL_LADDER)
