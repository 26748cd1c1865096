"""``camp2p-overlap overhead`` times our code alone: a known cost outside
it cancels out, a known cost inside it shows, every step takes the path
the harness says it measures, the wrapped calls of a pass-through step are
counted as installed, and the decided-serial A/B really alternates an
unpatched and an applied arm on the sweep's emulated world. Behaviour only:
no timing goal here (the figures belong to the command's own output)."""

from __future__ import annotations

import inspect
import json
import shlex
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from camp2p_overlap.core.overlap import step as step_module
from camp2p_overlap.core.overlap.session import OverlapSession
from camp2p_overlap.core.patching.manifest import load_manifest
from camp2p_overlap.emulation.noop import busy_wait
from camp2p_overlap.emulation.standin_patch_layer import release_site, standin_site
from camp2p_overlap.tools import overhead
from camp2p_overlap.tools.bench.sweep import DEFAULT_WORK_HIDDEN, DEFAULT_WORK_TOKENS
from camp2p_overlap.tools.cli import main
from camp2p_overlap.tools.overhead import OverheadParams, measure_overhead

DELAY_US = 400.0
FIGURE = {"median", "p90", "samples"}


def _small(**changes: Any) -> OverheadParams:
    values: dict[str, Any] = {"layers": (4,), "stages": (2,), "steps": 20, "warmup": 2, "rounds": 3}
    values.update(ab_rounds=2, ab_steps=5, ab_warmup=1)
    values.update(changes)
    return OverheadParams(**values)


def _connector_wrapped_at_class_level() -> bool:
    """Whether the manifest wraps the connector's methods on their class
    (then every connector call of a pass-through step meets our wrapper)."""
    return any(t.action == "wrap" and t.owner_path == ("CAMP2pAFDConnector",) for t in load_manifest().targets())


@pytest.mark.alone
def test_a_delay_outside_our_code_is_subtracted() -> None:
    result = measure_overhead(_small(delay_us=DELAY_US, ab_rounds=0))
    (shape,) = result["shapes"]
    # The unpatched loop pays the delay in every receive ...
    assert shape["unpatched_us_per_layer_stage"] >= DELAY_US
    # ... and so does every patched step: it is not counted as ours (were it
    # counted, the figures would exceed DELAY_US per (layer, stage), 8 x
    # DELAY_US per pass-through step and DELAY_US * 8 / calls per wrapped
    # call; the margins absorb a busy machine).
    assert result["engaged_us_per_layer_stage"]["median"] < DELAY_US * 0.75
    assert result["passthrough_us_per_step"]["median"] < DELAY_US
    calls = shape["wrapped_calls_per_step"]
    assert result["passthrough_us_per_call"]["median"] < DELAY_US * 8 / calls / 4


@pytest.mark.alone
def test_a_delay_inside_our_code_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    original = OverlapSession.recv

    def slow_recv(self: OverlapSession, *args: Any, **kwargs: Any) -> Any:
        busy_wait(DELAY_US / 1e6)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OverlapSession, "recv", slow_recv)
    result = measure_overhead(_small(ab_rounds=0))
    assert result["engaged_us_per_layer_stage"]["median"] >= DELAY_US * 0.9
    # The pass-through path opens no session: the delay is not there.
    assert result["passthrough_us_per_step"]["median"] < DELAY_US / 4
    assert result["passthrough_us_per_call"]["median"] < DELAY_US / 4


@pytest.mark.alone
def test_a_delay_in_the_step_wrapper_counts_once_per_pass_through_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # The wrapper's entry point: a pass-through step makes no FfnStep, and
    # every step, passed through or not, runs this once.
    original = step_module.run_step

    def slow_run_step(*args: Any) -> Any:
        busy_wait(DELAY_US / 1e6)
        return original(*args)

    monkeypatch.setattr(step_module, "run_step", slow_run_step)
    result = measure_overhead(_small(ab_rounds=0))
    (shape,) = result["shapes"]
    step, call = shape["passthrough_us_per_step"]["median"], shape["passthrough_us_per_call"]["median"]
    assert DELAY_US * 0.9 <= step < DELAY_US * 2.5
    # The per-call figure is the per-step one over the step's wrapped calls.
    assert call == pytest.approx(step / shape["wrapped_calls_per_step"], abs=0.01)


def test_the_paths_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A harness whose pass-through engine engages would time the wrong path: it refuses."""
    monkeypatch.setattr(overhead, "passthrough_config", overhead.engaged_config)
    monkeypatch.setattr(overhead, "decide_serial", lambda layer, world: None)
    with pytest.raises(RuntimeError, match="not taken as planned"):
        measure_overhead(_small())


def _around(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def test_the_wrapped_calls_are_counted_as_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a pass-through step pays per call is divided by the calls that
    meet a frame of ours, as installed at that moment: the step's own
    wrapper, a connector method replaced on its class for the process life
    (once per (layer, stage)), or one set on the instance."""
    site = standin_site()
    try:
        world = overhead.noop_world(3, 2, 0.0, site.root)
        upstream = overhead.resolved_targets(world, site.manifest)
        assert set(upstream["runner"]) == {"_ffn_forward"}
        assert set(upstream["connector"]) == {"recv_attn_output", "send_ffn_output"}
        dp = world.dp_metadata()

        def step() -> None:
            world.runner._ffn_forward(dp_metadata_list=dp)

        with pytest.raises(RuntimeError, match="did not run as planned"):
            overhead.wrapped_calls(world, step, upstream)  # nothing of ours on the runner: not a patched step
        runner_cls, connector_cls = type(world.runner), type(world.connector)
        monkeypatch.setattr(runner_cls, "_ffn_forward", _around(runner_cls._ffn_forward))
        assert overhead.wrapped_calls(world, step, upstream) == 1
        monkeypatch.setattr(connector_cls, "recv_attn_output", _around(connector_cls.recv_attn_output))
        assert overhead.wrapped_calls(world, step, upstream) == 1 + 3 * 2
        monkeypatch.setattr(world.connector, "send_ffn_output", _around(world.connector.send_ffn_output))
        assert overhead.wrapped_calls(world, step, upstream) == 1 + 2 * 3 * 2
    finally:
        release_site(site)


def test_the_decided_serial_ab_alternates_unpatched_and_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round runs both arms, the first arm alternating; the applied arm
    has our wrapper on the runner and the unpatched one has none; the world
    is the sweep's smallest work point, not the no-op world."""
    blocks: list[bool] = []
    real = overhead.time_block

    def spy(step: Callable[[], Any], warmup: int, steps: int) -> list[int]:
        world = getattr(step, "__self__", None)  # the A/B times world.run_step; the shapes a closure
        if world is not None:
            blocks.append(hasattr(inspect.getattr_static(world.runner, "_ffn_forward"), "__wrapped__"))
            # wall-clock kernels (overhead.AB_TIMING_WHY): no modelled FFN, no held comm kernels
            assert world.runner.model.moe.timing is None and world.transport.modelled is False
        return real(step, warmup, steps)

    monkeypatch.setattr(overhead, "time_block", spy)
    result = measure_overhead(_small(ab_rounds=4))
    ab = result["decided_serial_ab"]
    assert ab["timing"] == {"model": "wall", "why": overhead.AB_TIMING_WHY}
    assert blocks == [False, True, True, False, False, True, True, False]
    assert [r["first"] for r in ab["per_round"]] == ["unpatched", "decided-serial"] * 2
    assert (ab["rounds"], ab["steps"], ab["warmup"]) == (4, 5, 1)
    world = ab["world"]
    assert (world["hidden"], world["tokens"]) == (min(DEFAULT_WORK_HIDDEN), min(DEFAULT_WORK_TOKENS))
    assert world["stages"] == 2 and world["link_latency_us"] == 0 and world["attn_us"] == 0
    for r in ab["per_round"]:
        assert r["unpatched_us"] > 0 and r["decided_serial_us"] > 0
        assert r["extra_pct"] == pytest.approx(100 * (r["decided_serial_us"] / r["unpatched_us"] - 1), abs=0.01)
    extra = ab["extra_pct"]
    assert extra["min"] <= extra["median"] <= extra["max"]
    assert extra["min"] <= extra["ci95"][0] <= extra["ci95"][1] <= extra["max"]
    assert extra["median"] == pytest.approx(statistics.median(r["extra_pct"] for r in ab["per_round"]), abs=0.001)


def test_the_ab_refuses_an_applied_arm_that_engaged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(overhead, "passthrough_config", overhead.engaged_config)
    monkeypatch.setattr(overhead, "decide_serial", lambda layer, world: None)
    site = standin_site()
    try:
        with pytest.raises(RuntimeError, match="did not take the serial path"):
            overhead.decided_serial_ab(_small(), site)
    finally:
        release_site(site)


def test_cli_writes_the_documented_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "overhead.json"
    argv = ["overhead", "--layers", "2,3", "--stages", "1,2", "--steps", "6", "--rounds", "1"]
    assert main([*argv, "--ab-rounds", "2", "--ab-steps", "5", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["schema"] == "camp2p-overlap/overhead/v1"
    ran = [*argv, "--ab-rounds", "2", "--ab-steps", "5", "--json", str(path)]
    assert data["run"]["command"] == shlex.join(["camp2p-overlap", *ran])
    assert set(data["run"]) == {"command", "commit", "date"}
    assert {"python", "torch", "torch_threads", "cpu_count", "machine", "switch_interval_s"} == set(data["env"])
    for key in ("engaged_us_per_layer_stage", "passthrough_us_per_step", "passthrough_us_per_call"):
        assert set(data[key]) == FIGURE
        assert data[key]["p90"] >= data[key]["median"]
    assert [(s["layers"], s["stages"]) for s in data["shapes"]] == [(2, 1), (2, 2), (3, 1), (3, 2)]
    for s in data["shapes"]:
        pairs = s["layers"] * s["stages"]
        assert s["wrapped_calls_per_step"] == 1 + 2 * pairs * _connector_wrapped_at_class_level()
        assert set(s["passthrough_us_per_step"]) == set(s["passthrough_us_per_call"]) == FIGURE
        assert s["passthrough_us_per_step"]["samples"] == 6
    assert data["engaged_us_per_layer_stage"]["samples"] == data["passthrough_us_per_step"]["samples"] == 4 * 6
    ab = data["decided_serial_ab"]
    assert set(ab) == {
        "world",
        "timing",
        "rounds",
        "steps",
        "warmup",
        "unpatched_us_per_step",
        "decided_serial_us_per_step",
        "extra_pct",
        "per_round",
    }
    assert set(ab["extra_pct"]) == {"median", "ci95", "min", "max"} and len(ab["per_round"]) == 2
    assert data["params"]["ab_rounds"] == 2 and data["params"]["ab_steps"] == 5
    out = capsys.readouterr().out
    assert "us per (layer, stage)" in out and "us per step" in out and "decided serial vs not applied" in out
    assert "JSON:" in out


def test_cli_skips_the_ab_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "overhead.json"
    argv = ["overhead", "--layers", "2", "--stages", "2", "--steps", "5", "--rounds", "1", "--ab-rounds", "0"]
    assert main([*argv, "--json", str(path)]) == 0
    assert json.loads(path.read_text())["decided_serial_ab"] is None
    assert "decided serial" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "4"], "stage counts must lie in 1..3"),
        (["--layers", "0"], "layer counts must be >= 1"),
        (["--steps", "2"], "need steps >= 5"),
        (["--delay-us", "-1"], "delay_us must be >= 0"),
        (["--ab-rounds", "1"], "the decided-serial A/B needs ab_rounds 0 (skip) or >= 2"),
        (["--ab-steps", "3"], "ab_steps >= 5"),
    ],
)
def test_cli_refuses_bad_values(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["overhead", *argv]) == 2
    assert message in capsys.readouterr().err
