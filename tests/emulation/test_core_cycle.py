"""Cores beside collectives, across ranks (docs/design.md, "Cores beside collectives"): two FFN ranks, each the
peer of one attention rank of a TP pair, on emulated devices of 16 vector cores whose MoE collective (MC2's dispatch
and combine) takes all 16 and whose CAM kernels take 8 each, resident.

* With the layer's core rule blind (the device does not report its cores), each layout closes the cycle: on rank 0
  (whose MoE gate, on cube cores, delays its dispatch) a lookahead A2E spins holding 8 cores, so its MC2 dispatch
  cannot be resident; rank 1's dispatch, resident, waits for rank 0's and holds all of rank 1's cores, so rank 1's
  E2A cannot start; its attention peer never receives it, the TP all-reduce stalls, and rank 0's A2E is never
  answered. Every rank's watchdog names the stall
  within its time: the rank, the op each stream is at, the cores held and wanted.
* With the rule seeing the cores, the same world runs every step on upstream's path, and completes.
* Where the budget fits, both layouts engage and every output is bitwise the serial one's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from camp2p_overlap.emulation.ranks import RanksSpec, run_world

WATCHDOG_S = 2.0


def spec(**kw: object) -> RanksSpec:
    base: dict[str, object] = dict(
        attn_ranks=2,
        ffn_ranks=2,
        mapping="equal",  # attention TP peers on different FFN ranks
        stages=2,
        layers=4,
        steps=6,
        timing="model",
        ffn_model_s=4e-3,
        link_model_s=3e-4,
        coll_model_s=3e-4,
        timeout_s=8.0,
        vector_cores=16,
        cam_cores=8,
        moe_cores=16,
        ffn_cores=8,
        layout="compute-side",
        gate_s={0: 1e-3},  # rank 0's MoE gate (cube cores) delays its dispatch: its lookahead A2E gets cores first
        extra_env={r: {"VLLM_CAMP2P_MULTISTREAM_WATCHDOG_S": str(WATCHDOG_S)} for r in (0, 1)},
    )
    base.update(kw)
    return RanksSpec(**base)  # type: ignore[arg-type]


def stall_report(log: str) -> str:
    """The first stall report in a rank's log, its lines without the logger's prefix."""
    start = log.find("FFN step ")
    assert start >= 0, log[-3000:]
    lines = [re.sub(r"^WARNING .*?\] ", "", line) for line in log[start:].splitlines()]
    end = next((i for i, line in enumerate(lines) if line.startswith("  ops not finished:")), len(lines))
    return "\n".join(lines[: end + 1])


LAYOUTS = ["compute-side", pytest.param("comm-side", marks=pytest.mark.slow)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_budget_too_small_closes_the_cycle_and_every_rank_reports_it(tmp_path: Path, layout: str) -> None:
    world = run_world(spec(report_cores=False, layout=layout), tmp_path, timeout_s=60.0, grace_s=3.0)
    assert not world.ok, "the world completed: the cycle did not form"
    reports = {f: stall_report(world.logs[f"ffn{f}"]) for f in (0, 1)}
    for f, text in reports.items():
        assert f"FFN step 0 has not finished after {WATCHDOG_S:.1f} s" in text
        assert f"this is FFN rank {f} of 2" in text  # the rank
        assert re.search(r"compute stream C is (running|at|blocked in) ", text), text  # the op each stream is at
        streams = ("stage 0 (stream K0", "stage 1 (stream K1") if layout == "comm-side" else ("FFN stream: F is",)
        assert all(s in text for s in streams), text
        assert "vector cores: 16 of 16 held, 0 free" in text, text  # the cores held and wanted
        assert re.search(r"running, .* holds \d+ of \d+ \(resident\)", text), text
        assert re.search(r"waiting, .* holds \d+ of \d+ \(resident\)", text), text
    # The cycle: one rank's MC2 holds every core waiting for its peer; the other's spinning A2E holds half of them.
    texts = list(reports.values())
    assert any("running, moe-" in t and "holds 16 of 16" in t for t in texts), texts
    assert any(re.search(r"running, a2e L\d s\d on (C|K\d): holds 8 of 8", t) for t in texts), texts
    assert any(re.search(r"waiting, moe-\S+ on (F|C): holds 8 of 16", t) for t in texts), texts
    assert any(re.search(r"waiting, e2a L\d s\d on (C|K\d): holds 0 of 8", t) for t in texts), texts


@pytest.mark.parametrize("layout", LAYOUTS)
def test_with_the_rule_the_same_world_runs_serially_and_completes(tmp_path: Path, layout: str) -> None:
    world = run_world(spec(layout=layout), tmp_path, timeout_s=90.0)
    assert world.ok and all(world.equal.values()), world.diagnostics()
    for f in (0, 1):
        summary = world.ffn[f]
        assert summary is not None
        overlap = [s["path"] for s in summary["steps"] if s["phase"] == "overlap"]
        assert set(overlap) == {"serial"}, overlap
        reasons = summary["stats"]["serial_reasons"]
        assert any(r.startswith(f"core budget: {layout} with 2 stage(s)") for r in reasons), reasons
        assert "has not finished" not in world.logs[f"ffn{f}"]


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_both_layouts_engage_where_the_budget_fits_and_match_serial(tmp_path: Path, layout: str) -> None:
    # MoE 16, CAM 8: compute-side holds 24 at once, comm-side 32; the device has just that many.
    vector = {"compute-side": 24, "comm-side": 32}[layout]
    world = run_world(spec(vector_cores=vector, layout=layout), tmp_path, timeout_s=90.0)
    assert world.ok and all(world.equal.values()), world.diagnostics()
    for f in (0, 1):
        summary = world.ffn[f]
        assert summary is not None
        overlap = [s["path"] for s in summary["steps"] if s["phase"] == "overlap" and s["stages"] == [0, 1]]
        assert overlap and set(overlap) == {layout}, overlap
        assert summary["cores"]["total"] == vector  # the core model was on
