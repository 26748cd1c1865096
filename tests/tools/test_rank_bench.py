"""``camp2p-overlap bench --ffn-ranks N`` (``tools/bench/ranks.py``): the group's step is its slowest FFN rank's,
over the multi-stage steps after the warm-up; the floor is the fill/drain floor of the modelled times; parted steps
are the steps on which the FFN ranks' paths differ. The end-to-end run is in the slow tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from camp2p_overlap.emulation.ranks import RanksSpec, WorldResult
from camp2p_overlap.tools.bench.ranks import RankBenchParams, group_times, parted_steps

REPO = Path(__file__).resolve().parents[2]


def result(times: dict[int, list[float]], paths: dict[int, list[str]], spec: RanksSpec) -> WorldResult:
    ffn = {
        r: {
            "steps": [
                {"phase": phase, "seconds": t, "path": p}
                for phase in ("overlap", "serial")
                for t, p in zip(times[r], paths[r], strict=True)
            ]
        }
        for r in times
    }
    return WorldResult(spec, {0: {"equal": True}}, ffn, {"ffn0": 0}, {}, False)


def test_the_group_step_is_the_slowest_ranks_over_the_multi_stage_steps_after_the_warmup() -> None:
    spec = RanksSpec(ffn_ranks=2, attn_ranks=2, mapping="equal", steps=8, stages=2)
    multi = [len(spec.stage_ids(s)) > 1 for s in range(8)]
    assert multi == [True, True, False, True] * 2  # the stage cycle has a one-stage step
    times = {0: [1.0, 2.0, 9.0, 4.0, 5.0, 6.0, 9.0, 8.0], 1: [1.5, 1.0, 0.0, 4.5, 4.0, 7.0, 0.0, 7.0]}
    paths = {r: ["serial"] * 8 for r in times}
    assert group_times(result(times, paths, spec), "overlap", warmup=1) == [2.0, 4.5, 5.0, 7.0, 8.0]


def test_parted_steps_are_the_entries_whose_paths_differ() -> None:
    spec = RanksSpec(ffn_ranks=2, attn_ranks=2, mapping="equal", steps=4)
    paths = {0: ["serial", "compute-side", "serial", "compute-side"], 1: ["serial", "serial", "serial", "compute-side"]}
    assert parted_steps(result({0: [1.0] * 4, 1: [1.0] * 4}, paths, spec)) == [1]


def test_the_floor_is_the_first_a2e_every_ffn_with_its_collective_and_the_last_e2a() -> None:
    p = RankBenchParams(layers=6, stages=2, ffn_ms=6.0, comm_ratio=0.5, collective_ms=0.2)
    link = 1.5e-3
    assert p.floor_s(1.0) == pytest.approx(link + 6 * 2 * 6.2e-3 + link)
    assert p.floor_s(1.3) == pytest.approx(link + 6 * 2 * (7.8e-3 + 0.2e-3) + link)
    spec = p.spec(seed=0, straggler=True)
    assert spec.link_model_s == pytest.approx(link) and spec.straggler == {1: 1.3} and spec.adaptive


def test_bad_rank_counts_are_refused_with_the_reason() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "camp2p_overlap.tools.cli", "bench", "--ffn-ranks", "3", "--attn-ranks", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode != 0 and "attention" in (out.stdout + out.stderr).lower()


@pytest.mark.slow
def test_the_multi_rank_main_job_runs_end_to_end(tmp_path: Path) -> None:
    report_path = tmp_path / "ranks.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "camp2p_overlap.tools.cli",
            "bench",
            "--ffn-ranks",
            "2",
            "--rank-steps",
            "40",
            "--rank-ffn-ms",
            "4",
            "--rank-reps",
            "1",
            "--no-progress",
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(report_path.read_text())
    assert report["schema"] == "camp2p-overlap/bench-ranks/v1" and report["run"]["command"].startswith("camp2p")
    for name in ("adaptive", "straggler"):
        s = report["summary"][name]
        assert s["outputs_equal"] and s["parted_steps"] == 0 and s["steps"] == 40
        assert s["speedup"]["median"] > 1.0  # FFN-bound: the overlap gains
    assert "multi-rank main job: 2 FFN ranks" in out.stdout and "FFN 4.0 ms" in out.stdout


def test_rank_cores_give_each_ffn_rank_a_budget_compute_side_fits_exactly() -> None:
    spec = RankBenchParams(vector_cores=24).spec(0, straggler=False)
    assert (spec.vector_cores, spec.cam_cores, spec.moe_cores, spec.ffn_cores) == (24, 8, 16, 16)
    assert spec.report_cores and not spec.moe_dispatch  # the rule sees the count; one collective, as without cores
    assert RankBenchParams().spec(0, straggler=False).vector_cores is None
    with pytest.raises(ValueError, match="more than CAM's 8 cores"):
        RankBenchParams(vector_cores=8).spec(0, straggler=False)
