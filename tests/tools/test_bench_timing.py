"""The benchmark's timing model (``tools/bench/timing.py``, docs/benchmark.md
"Timing model"): modelled kernels by default on the CPU, wall-clock ones
with ``--timing wall`` or ``--comm-cores``, refused where they make no
sense; the FFN held to the model the run calibrated; a run whose kernels
are made to overrun is reported and flagged; the sweep's contention points
and the overhead A/B run wall-clock kernels, and say so."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from camp2p_overlap.emulation import device
from camp2p_overlap.emulation.device import timing as device_timing
from camp2p_overlap.tools import cli
from camp2p_overlap.tools.bench import runner
from camp2p_overlap.tools.bench.runner import BenchParams, run_bench
from camp2p_overlap.tools.bench.tables import bench_table, problems
from camp2p_overlap.tools.bench.timing import MODEL_NEEDS_NO_COMM_CORES, TIMING_ERROR, TIMING_IS_FOR_CPU

TINY = BenchParams(
    layers=2,
    tokens=16,
    hidden=64,
    ffn=128,
    experts=4,
    top_k=2,
    link_latency_us=100.0,
    link_gbps=8.0,
    attn_us=100.0,
    steps=2,
    warmup=1,
    reps=2,
)
TINY_ARGS = [
    "--layers", "2", "--tokens", "16", "--hidden", "64", "--ffn", "128", "--experts", "4", "--top-k", "2",
    "--link-latency-us", "100", "--link-gbps", "8", "--attn-us", "100",
    "--steps", "2", "--warmup", "1", "--reps", "1", "--no-progress",
]  # fmt: skip


def _kernels_counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every modelled kernel the device counts from now on, by kind."""
    seen: list[str] = []
    real = device_timing.LEDGER.kernel

    def kernel(kind: str, *args: Any) -> None:
        seen.append(kind)
        real(kind, *args)

    monkeypatch.setattr(device_timing.LEDGER, "kernel", kernel)
    return seen


def test_the_default_on_the_cpu_holds_every_kernel_to_its_model(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _kernels_counted(monkeypatch)
    r = run_bench(TINY).report
    t = r["timing"]
    assert t["model"] == "model" and r["params"]["timing"] == "auto"
    (point,) = t["ffn"]["points"]
    assert point["model_us"] > 0
    assert {"ffn", "a2e", "e2a"} == set(seen)
    for p in r["policies"]:
        ffn = p["timing"]["by_kind"]["ffn"]
        # 2 reps x (1 warm-up + 2 timed + traced) steps x 2 layers x 2 stages, each FFN held to one model
        assert ffn["kernels"] == 2 * (1 + 2 + (2 if p["policy"] == "serial" else 1)) * 2 * 2, p["policy"]
        assert ffn["modelled_us"] == pytest.approx(ffn["kernels"] * point["model_us"], rel=1e-3)
    assert t["counts"]["kernels"] < len(seen), "the calibration's steps ran modelled comm kernels, not counted"
    text = bench_table(r)
    if point["calibrated_why"]:  # this machine could not hold the rating: said, and why
        assert point["model_us"] != point["rated_us"]
        assert "timing model: modelled kernels (FFN calibrated " in text
        assert (
            f"at 16 tokens, q0.5 of isolated runs and the run's comm-side/compute-side/e2a-only/serial steps "
            f"x{t['ffn']['margin']:g}" in text
        )
        assert point["calibrated_why"] in text
    else:
        assert point["model_us"] == point["rated_us"] and t["ffn"]["rated"] is True
        assert f"timing model: modelled kernels (FFN rated {point['model_us']:,.0f} us at 16 tokens" in text
        assert "held in the run's comm-side/compute-side/e2a-only/serial steps" in text
    assert f"error {TIMING_ERROR * 100:g} %" in text


def test_timing_wall_runs_wall_clock_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _kernels_counted(monkeypatch)
    r = run_bench(replace(TINY, timing="wall")).report
    assert seen == []
    t = r["timing"]
    assert (t["model"], t["ffn"], t["counts"], t["noisy"]) == ("wall", None, None, False)
    assert t["why"].startswith("--timing wall")
    assert all(p["timing"] is None for p in r["policies"])
    assert "timing model: wall clock (--timing wall: " in bench_table(r)


def test_comm_cores_run_wall_clock_kernels_and_refuse_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_bench(replace(TINY, comm_cores=1, policies=("serial", "compute-side-fixed"))).report
    assert r["timing"]["model"] == "wall" and r["timing"]["why"].startswith("--comm-cores 1: wall-clock kernels")
    assert cli.main(["bench", *TINY_ARGS, "--timing", "model", "--comm-cores", "1"]) == 2
    assert MODEL_NEEDS_NO_COMM_CORES in capsys.readouterr().err


def test_a_comm_cores_sweep_runs_every_value_on_the_same_timing(capsys: pytest.CaptureFixture[str]) -> None:
    """--comm-cores-sweep: one run per value, every one on wall-clock kernels once a value is above 0 (the run
    at 0 too, so the runs compare), the link the flags' (no FFN model to set it from); a preset's comm_ratio
    goes; all values at 0 keep the model."""
    sweep = replace(TINY, comm_cores_sweep=(0, 2))
    assert sweep.timing_mode()[0] == "wall" and sweep.most_comm_cores() == 2
    runs = runner.contention_runs(sweep)
    assert [(p.comm_cores, p.comm_cores_sweep, p.timing) for p in runs] == [(0, (), "wall"), (2, (), "wall")]
    assert all(p.timing_mode()[0] == "wall" for p in runs)
    preset = runner.resolve_params({"comm_cores_sweep": [0, 1]}, "ffn-bound")
    assert preset.comm_ratio is None and all(p.comm_ratio is None for p in runner.contention_runs(preset))
    off = runner.contention_runs(replace(TINY, comm_cores_sweep=(0,)))
    assert [(p.comm_cores, p.timing, p.timing_mode()[0]) for p in off] == [(0, "auto", "model")]
    assert cli.main(["bench", *TINY_ARGS, "--comm-cores-sweep", "0,1", "--comm-ratio", "0.5"]) == 2
    assert "--comm-ratio sets the link from the FFN's modelled duration" in capsys.readouterr().err


def test_a_device_run_times_the_device_and_refuses_timing(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", *TINY_ARGS, "--device", "cuda", "--timing", "wall"]) == 2
    assert TIMING_IS_FOR_CPU in capsys.readouterr().err
    cuda = replace(TINY, device="cuda")
    assert cuda.timing_mode()[0] == "device" and cuda.world_spec().timing == "wall"


def test_kernels_made_to_overrun_are_reported_and_flag_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the calibration every FFN kernel sleeps twice its model on top
    of its work: every one overruns, every policy and the run are flagged,
    and the table says so. Noisy is not failed: the exit status stays 0."""
    real = runner.refine_ffn_in_run

    def refine_then_slow_down(world: Any, *args: Any, **kw: Any) -> Any:
        model = real(world, *args, **kw)
        moe = world.runner.model.moe
        extra = 2 * model.model_s(world.spec.tokens)
        compute = moe.compute
        moe.compute = lambda x, layer: (time.sleep(extra), compute(x, layer))[1]
        return model

    monkeypatch.setattr(runner, "refine_ffn_in_run", refine_then_slow_down)
    r = run_bench(replace(TINY, policies=("serial", "compute-side-fixed"))).report
    t = r["timing"]
    assert t["noisy"] is True and t["counts"]["overrun_time_pct"] > TIMING_ERROR * 100
    ffn = t["counts"]["by_kind"]["ffn"]
    assert ffn["overruns"] == ffn["kernels"] > 0
    assert ffn["overrun_us"] >= ffn["modelled_us"], "each ran at least its model past it"
    assert any(f"more than the timing model's error of {TIMING_ERROR * 100:g} %" in n for n in t["noise"])
    for p in r["policies"]:
        assert p["noisy"] is True and any("overran" in n for n in p["noise"]), p["policy"]
    text = bench_table(r)
    assert "* timing: noisy, not a result: its modelled kernels overran by " in text
    assert "* serial: noisy, not a result: its modelled kernels overran" in text
    assert problems(r) == [] and r["outputs_equal"] is True


def test_sweep_contention_points_run_wall_clock_kernels(tmp_path: Path) -> None:
    """The contention table's points (0 included) run wall-clock kernels;
    the ratio table's the model; the Markdown says which, under each table."""
    md, js = tmp_path / "s.md", tmp_path / "s.json"
    args = ["sweep", *TINY_ARGS, "--policies", "serial,compute-side-fixed", "--ratios", "1", "--stage-counts", ""]
    rc = cli.main([*args, "--comm-core-points", "0,1", "--work-tokens", "none", "--md", str(md), "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert [pt["report"]["timing"]["model"] for pt in data["comm_core_points"]] == ["wall", "wall"]
    (ratio_point,) = data["ratio_points"]
    t = ratio_point["report"]["timing"]
    assert t["model"] == "model" and t["ffn"]["fixed"] is True, "a ratio point holds the FFN to the sweep's f"
    assert t["ffn"]["points"][0]["model_us"] == pytest.approx(data["f_calibration_us"], abs=0.1)
    text = md.read_text()
    assert f"Timing: modelled kernels ({t['ffn_model']} at every point, the f calibration's model)" in text
    assert "Timing: wall-clock kernels (the contention points: --comm-cores measures" in text


def test_ffn_us_holds_the_ffn_to_a_given_duration(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """No calibration in the run: every FFN kernel is modelled at the given
    duration, and the report says it was given."""
    real = runner.refine_ffn_in_run
    refined: list[Any] = []
    monkeypatch.setattr(runner, "refine_ffn_in_run", lambda *a, **k: refined.append(1) or real(*a, **k))
    r = run_bench(replace(TINY, ffn_us=1500.0, policies=("serial", "compute-side-fixed"))).report
    assert refined == []
    t = r["timing"]
    assert t["ffn"]["fixed"] is True and t["ffn_model"] == "FFN fixed: 1,500 us at 16 tokens (--ffn-us)"
    assert t["ffn"]["points"][0]["model_us"] == 1500.0
    for p in r["policies"]:
        ffn = p["timing"]["by_kind"]["ffn"]
        assert ffn["modelled_us"] == pytest.approx(1500.0 * ffn["kernels"])
    assert cli.main(["bench", *TINY_ARGS, "--timing", "wall", "--ffn-us", "1500"]) == 2
    assert "--ffn-us sets the FFN's modelled duration: it needs modelled timing" in capsys.readouterr().err
    assert cli.main(["bench", *TINY_ARGS, "--ffn-us", "0"]) == 2
    assert "--ffn-us must be a positive number" in capsys.readouterr().err


def test_the_sweep_refuses_the_model_with_contention_points(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sweep", *TINY_ARGS, "--timing", "model", "--ratios", "", "--stage-counts", "", "--work-tokens", "none"]
    assert cli.main([*args, "--comm-core-points", "0,1"]) == 2
    assert MODEL_NEEDS_NO_COMM_CORES in capsys.readouterr().err


def test_the_timing_counts_start_with_the_policies() -> None:
    """What ran before a run (here: a modelled kernel) is not its count
    (``--ffn-us``: no calibration steps in between)."""
    s = device.Stream()
    try:
        with device.stream(s):
            device.launch(lambda: None, model_s=0.001, kind="stray")
        device.synchronize()
        r = run_bench(replace(TINY, policies=("serial",), reps=1, ffn_us=500.0)).report
        assert "stray" not in r["timing"]["counts"]["by_kind"]
    finally:
        s.close()


def test_comm_ratio_sets_the_link_from_the_ffn_model(capsys: Any) -> None:
    """With modelled timing, ``comm_ratio`` sets the link once the FFN's model
    is known: the modelled A2E + E2A of one (layer, stage) take that share
    of the FFN's model, the report's link is the one that ran, and the
    measured ratio follows. It needs the model; explicit link flags (or the
    wall clock) take it out of a preset."""
    r = run_bench(replace(TINY, ffn_us=4000.0, comm_ratio=0.5, policies=("serial",))).report
    lat, gbps = runner.link_for_ratio(replace(TINY, ffn_us=4000.0), 4000e-6, 0.5)
    assert r["params"]["link_latency_us"] == pytest.approx(lat, abs=1e-3)
    assert r["params"]["link_gbps"] == pytest.approx(gbps, rel=1e-5)
    assert r["params"]["link_gbps"] != TINY.link_gbps
    assert r["measured"]["comm_over_ffn"] == pytest.approx(0.5, abs=0.1)
    assert cli.main(["bench", *TINY_ARGS, "--timing", "wall", "--comm-ratio", "0.5"]) == 2
    assert "--comm-ratio sets the link from the FFN's modelled duration" in capsys.readouterr().err
    preset = runner.resolve_params({}, "ffn-bound")
    assert preset.comm_ratio == 0.5
    assert runner.resolve_params({"link_gbps": 2.0}, "ffn-bound").comm_ratio is None
    assert runner.resolve_params({"timing": "wall"}, "ffn-bound").comm_ratio is None


def test_a_sweep_table_names_the_points_whose_ffn_was_calibrated() -> None:
    """Under a work table: the FFN rated at each point, or the points where
    this machine could not hold the rating and it was calibrated."""
    from camp2p_overlap.tools.bench.sweep import _timing_lines

    def point(tokens: int, rated: bool) -> dict[str, Any]:
        ffn = {"fixed": False, "rated": rated}
        return {"tokens": tokens, "report": {"timing": {"model": "model", "ffn": ffn, "noisy": False}}}

    def name(pt: dict[str, Any]) -> str:
        return f"{pt['tokens']} tokens"

    line = "".join(_timing_lines([point(1, True), point(2, True)], "report", name, "work"))
    assert "modelled kernels (each point's FFN rated from its shape)" in line
    line = "".join(_timing_lines([point(1, True), point(2, False)], "report", name, "work"))
    assert "rated from its shape, except at 2 tokens, where this machine could not hold its rating" in line
