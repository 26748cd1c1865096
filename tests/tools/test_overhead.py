"""``camp2p-overlap overhead`` times our code alone: a known cost outside
it cancels out, a known cost inside it shows, every step takes the path
the harness says it measures, the wrapped calls of a pass-through step are
counted as installed, and the decided-serial A/B really pairs an unpatched
and an applied copy of the stand-ins on the sweep's emulated world, after an
A/A control of both copies unpatched, and the watchdog's figure pairs blocks
of engaged steps with it at its default and off. Behaviour only:
no timing goal here (the figures belong to the command's own output)."""

from __future__ import annotations

import contextlib
import inspect
import json
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from camp2p_overlap.core.overlap import step as step_module
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.core.patching.lifecycle import PatchEngine
from camp2p_overlap.core.patching.manifest import StackManifest, load_manifest
from camp2p_overlap.emulation import standins
from camp2p_overlap.emulation.noop import busy_wait
from camp2p_overlap.emulation.standin_patch_layer import StandinSite, emulated_patch_layer, release_site, standin_site
from camp2p_overlap.emulation.world import World
from camp2p_overlap.tools import overhead
from camp2p_overlap.tools.bench.sweep import DEFAULT_WORK_HIDDEN, DEFAULT_WORK_TOKENS
from camp2p_overlap.tools.cli import main
from camp2p_overlap.tools.overhead import OverheadParams, measure_overhead

DELAY_US = 400.0
FIGURE = {"median", "p90", "samples"}


def _small(**changes: Any) -> OverheadParams:
    values: dict[str, Any] = {"layers": (4,), "stages": (2,), "steps": 20, "warmup": 2, "rounds": 3}
    values.update(ab_pairs=20, ab_warmup=1, pt_pairs=20, wd_pairs=0)
    values.update(changes)
    return OverheadParams(**values)


def _connector_wrapped_at_class_level() -> bool:
    """Whether the manifest wraps the connector's methods on their class
    (then every connector call of a pass-through step meets our wrapper)."""
    return any(t.action == "wrap" and t.owner_path == ("CAMP2pAFDConnector",) for t in load_manifest().targets())


@pytest.mark.alone
def test_a_delay_outside_our_code_is_subtracted() -> None:
    result = measure_overhead(_small(delay_us=DELAY_US, ab_pairs=0))
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
    original = StepSession.recv

    def slow_recv(self: StepSession, *args: Any, **kwargs: Any) -> Any:
        busy_wait(DELAY_US / 1e6)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StepSession, "recv", slow_recv)
    result = measure_overhead(_small(ab_pairs=0))
    assert result["engaged_us_per_layer_stage"]["median"] >= DELAY_US * 0.9
    # The pass-through path opens no session: the delay is not there.
    assert result["passthrough_us_per_step"]["median"] < DELAY_US / 4
    assert result["passthrough_us_per_call"]["median"] < DELAY_US / 4


@pytest.mark.alone
def test_a_delay_in_the_step_wrapper_counts_once_per_pass_through_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # The step's entry point: every step, passed through or not, runs this once.
    original = step_module.FfnStep.run

    def slow_run(self: Any) -> Any:
        busy_wait(DELAY_US / 1e6)
        return original(self)

    monkeypatch.setattr(step_module.FfnStep, "run", slow_run)
    result = measure_overhead(_small(ab_pairs=0))
    (shape,) = result["shapes"]
    step, call = shape["passthrough_us_per_step"]["median"], shape["passthrough_us_per_call"]["median"]
    assert DELAY_US * 0.9 <= step < DELAY_US * 2.5
    # The per-call figure is the per-step one over the step's wrapped calls.
    assert call == pytest.approx(step / shape["wrapped_calls_per_step"], abs=0.01)


@pytest.mark.alone
def test_the_paired_passthrough_figure_finds_a_cost_in_our_frame_and_not_in_its_control(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A busy wait added to every passed-through step, inside our wrapper,
    shows in the paired figure (wrapped step against upstream's function on
    the same runner) and not in its A/A control."""
    from camp2p_overlap.core.overlap import step as step_module

    inner = step_module.FfnStep.decision_and_streams

    def slower(*args: Any, **kwargs: Any) -> Any:
        busy_wait(100e-6)
        return inner(*args, **kwargs)

    monkeypatch.setattr(step_module.FfnStep, "decision_and_streams", slower)
    result = measure_overhead(_small(ab_pairs=0, pt_pairs=40, rounds=1))
    (shape,) = result["shapes"]
    paired = shape["passthrough_paired_us_per_step"]
    assert paired["pairs"] == 40 and set(paired) >= {"median", "ci95", "min", "max", "control"}
    assert 80.0 <= paired["median"] <= 400.0, paired
    assert abs(paired["control"]["median"]) < 40.0, paired["control"]
    frames = shape["passthrough_frames_us_per_step"][overhead.PASSTHROUGH_KIND]
    assert 80.0 <= frames["median"] <= 400.0, frames


def test_the_paired_passthrough_figure_is_not_taken_when_it_cannot_cover_our_frames() -> None:
    site = standin_site()
    try:
        world = overhead.noop_world(2, 1, 0.0, site.root)
        params = _small(pt_pairs=20)
        refused = overhead.passthrough_pairs(params, world, lambda: None, {}, (None, None, None), 2)  # type: ignore[arg-type]
        for skipped in refused:
            assert skipped["median"] is None and "2 calls" in skipped["why"]
        off = overhead.passthrough_pairs(_small(pt_pairs=0), world, lambda: None, {}, (None, None, None), 1)  # type: ignore[arg-type]
        for skipped in off:
            assert skipped["median"] is None and "skipped" in skipped["why"]
    finally:
        release_site(site)
    with pytest.raises(ValueError, match="pt_pairs"):
        _small(pt_pairs=3).validate()


@pytest.mark.alone
def test_the_static_serial_kinds_are_paired_on_their_own_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each static-serial kind (too few stages, a connector of another
    class) gets its paired figure, its steps counted serial under its
    reason; a busy wait in the decision shows in both kinds' figures."""
    from camp2p_overlap.core.overlap import step as decision_module

    result = measure_overhead(_small(ab_pairs=0, pt_pairs=20, rounds=1))
    (shape,) = result["shapes"]
    static = shape["static_serial_paired_us_per_step"]
    assert set(static) == set(overhead.STATIC_SERIAL_KINDS)
    for figure in static.values():
        assert figure["pairs"] == 20 and set(figure) >= {"median", "ci95", "min", "max", "control"}
    inner = decision_module.decide

    def slower(*args: Any, **kwargs: Any) -> Any:
        busy_wait(100e-6)
        return inner(*args, **kwargs)

    monkeypatch.setattr(step_module, "decide", slower)
    (slow,) = measure_overhead(_small(ab_pairs=0, pt_pairs=40, rounds=1))["shapes"]
    for kind, figure in slow["static_serial_paired_us_per_step"].items():
        assert 80.0 <= figure["median"] <= 400.0, (kind, figure)
        assert abs(figure["control"]["median"]) < 40.0, (kind, figure["control"])
        own = slow["passthrough_frames_us_per_step"][kind]
        assert 80.0 <= own["median"] <= 400.0, (kind, own)
    # the decided-serial kind decides too: every step takes the one path
    assert 80.0 <= slow["passthrough_frames_us_per_step"][overhead.PASSTHROUGH_KIND]["median"] <= 400.0


@pytest.mark.parametrize("kind", list(overhead.STATIC_SERIAL_KINDS))
def test_a_static_serial_kind_that_engages_is_refused(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind whose steps engage (or run serially for another reason) would
    time the wrong path: the harness refuses."""
    monkeypatch.setattr(overhead, "STATIC_SERIAL_KINDS", {kind: overhead.STATIC_SERIAL_KINDS[kind]})
    monkeypatch.setattr(overhead, "static_serial_config", lambda kind, stages: overhead.engaged_config())
    monkeypatch.setattr(overhead, "static_serial_world", lambda kind, world: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match=f"{kind!r} pass-through steps were not taken as planned"):
        measure_overhead(_small(ab_pairs=0, rounds=1))


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


def _no_second_root_left() -> None:
    """The A/B's second copy of the stand-ins is gone: no module under its
    root, no finder for it."""
    root = overhead.AB_SECOND_ROOT
    assert not [n for n in sys.modules if n == root or n.startswith(root + ".")]
    assert not [f for f in sys.meta_path if getattr(f, "root", None) == root]


def _pairs(n: int, first: Any, second: Any) -> list[Any]:
    return [x for i in range(n) for x in ((first, second) if i % 2 == 0 else (second, first))]


def test_the_decided_serial_ab_pairs_an_unpatched_and_an_applied_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The A/A control first (both copies unpatched), then the A/B (the
    second copy applied): each warms both worlds, then runs pairs of one
    step of each, the first alternating. The figures are the applied (or
    second) world's step over the unpatched (first) one's, per pair; the
    world is the sweep's smallest work point, not the no-op world."""
    ran: list[tuple[str, bool]] = []
    run_step = World.run_step

    def spy(self: World, *args: Any, **kwargs: Any) -> Any:
        runner = self.runner
        wrapped = hasattr(inspect.getattr_static(runner, "_ffn_forward"), "__wrapped__")
        ran.append((type(runner).__module__.split(".")[0], wrapped))
        # wall-clock kernels (overhead.AB_TIMING_WHY): no modelled FFN, no held comm kernels
        assert runner.model.moe.timing is None and self.transport.modelled is False
        return run_step(self, *args, **kwargs)

    timed: list[tuple[list[int], list[int]]] = []
    time_pairs = overhead.time_pairs

    def keep(*args: Any) -> tuple[list[int], list[int]]:
        timed.append(time_pairs(*args))
        return timed[-1]

    layers: list[Any] = []
    make_layer = overhead.emulated_patch_layer

    def new_layer() -> Any:
        layers.append(make_layer())
        return layers[-1]

    monkeypatch.setattr(World, "run_step", spy)
    monkeypatch.setattr(overhead, "time_pairs", keep)
    monkeypatch.setattr(overhead, "emulated_patch_layer", new_layer)
    threads = torch.get_num_threads()
    site = standin_site()
    try:
        ab = overhead.decided_serial_ab(_small(ab_pairs=20, ab_warmup=2), site)
    finally:
        release_site(site)
    _no_second_root_left()
    assert torch.get_num_threads() == threads
    (layer,) = layers  # one engine, applied once per half and unpatched at the end
    assert not layer.engine.is_applied()
    first, second = (site.root, False), (overhead.AB_SECOND_ROOT, False)
    first_applied, second_applied = (site.root, True), (overhead.AB_SECOND_ROOT, True)
    warm = [first] * 2 + [second] * 2
    control = warm + _pairs(10, first, second) + warm + _pairs(10, second, first)
    ab_first_half = [first] * 2 + [second_applied] * 2 + _pairs(10, first, second_applied)
    ab_second_half = [first_applied] * 2 + [second] * 2 + _pairs(10, second, first_applied)
    assert ran == control + ab_first_half + ab_second_half
    assert ab["timing"] == {"model": "wall", "why": overhead.AB_TIMING_WHY}
    assert (ab["pairs"], ab["warmup"]) == (20, 2)
    world = ab["world"]
    assert (world["hidden"], world["tokens"]) == (min(DEFAULT_WORK_HIDDEN), min(DEFAULT_WORK_TOKENS))
    assert world["stages"] == 2 and world["link_latency_us"] == 0 and world["attn_us"] == 0
    # each timed half: (the other copy's step times, the applied or to-be-applied copy's)
    (c1_other, c1_copy), (c2_other, c2_copy), (u1, d1), (u2, d2) = timed
    unpatched, decided = u1 + u2, d1 + d2
    assert ab["unpatched_us_per_step"] == pytest.approx(statistics.median(unpatched) / 1e3, abs=0.001)
    assert ab["decided_serial_us_per_step"] == pytest.approx(statistics.median(decided) / 1e3, abs=0.001)

    def extra(a: list[int], b: list[int]) -> list[float]:
        return [100 * (y / x - 1) for x, y in zip(a, b, strict=True)]

    halves = [extra(u1, d1), extra(u2, d2)]
    assert ab["by_copy"] == [
        {"applied_root": root, "pairs": 10, "median": pytest.approx(statistics.median(h), abs=0.001)}
        for root, h in zip((overhead.AB_SECOND_ROOT, site.root), halves, strict=True)
    ]
    for key, figures in (
        ("extra_pct", halves[0] + halves[1]),
        ("control", extra(c1_other, c1_copy) + extra(c2_other, c2_copy)),
    ):
        figure = ab[key]
        assert set(figure) == {"median", "ci95", "min", "max"}
        assert figure["median"] == pytest.approx(statistics.median(figures), abs=0.001)
        assert (figure["min"], figure["max"]) == pytest.approx((min(figures), max(figures)), abs=0.001)
        assert figure["min"] <= figure["ci95"][0] <= figure["median"] <= figure["ci95"][1] <= figure["max"]


def test_the_ab_refuses_an_applied_arm_that_engaged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(overhead, "passthrough_config", overhead.engaged_config)
    monkeypatch.setattr(overhead, "decide_serial", lambda layer, world: None)
    site = standin_site()
    try:
        with pytest.raises(RuntimeError, match="did not take the serial path"):
            overhead.decided_serial_ab(_small(), site)
    finally:
        release_site(site)
    _no_second_root_left()


def _engine_applies_nothing(monkeypatch: pytest.MonkeyPatch, site: StandinSite) -> Callable[[], None]:
    """The applied arm would time upstream's code."""
    monkeypatch.setattr(PatchEngine, "apply", lambda self, **kwargs: None)
    return lambda: None


def _manifest_not_rebased(monkeypatch: pytest.MonkeyPatch, site: StandinSite) -> Callable[[], None]:
    """The engine would land on the unpatched copy."""
    monkeypatch.setattr(StackManifest, "rebased", lambda self, old, new: self)
    return lambda: None


def _applied_during_the_control(monkeypatch: pytest.MonkeyPatch, site: StandinSite) -> Callable[[], None]:
    """An engine applied to the second copy as the control warms up: its
    pairs would time an applied world."""
    engines: list[Any] = []
    time_block = overhead.time_block

    def warm(step: Callable[[], Any], warmup: int, steps: int) -> list[int]:
        if not engines:
            engines.append(emulated_patch_layer().engine)
            manifest = site.manifest.rebased(site.root, overhead.AB_SECOND_ROOT)
            engines[0].apply(config=overhead.passthrough_config(), manifest=manifest, strict=True)
        return time_block(step, warmup, steps)

    monkeypatch.setattr(overhead, "time_block", warm)

    def cleanup() -> None:
        for engine in engines:
            engine.unpatch(timeout=30.0)

    return cleanup


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (_engine_applies_nothing, "A/B's 'decided-serial' arm"),
        (_manifest_not_rebased, "A/B's 'unpatched' arm"),
        (_applied_during_the_control, "control's 'decided-serial' arm"),
    ],
)
def test_the_ab_refuses_an_arm_against_the_plan(
    monkeypatch: pytest.MonkeyPatch,
    break_it: Callable[[pytest.MonkeyPatch, StandinSite], Callable[[], None]],
    message: str,
) -> None:
    """Each phase checks, before and after its pairs, that each copy's runner
    is wrapped or upstream's as planned; a refused run leaves no second root."""
    site = standin_site()
    try:
        cleanup = break_it(monkeypatch, site)
        try:
            with pytest.raises(RuntimeError, match=f"the {message} did not run as planned"):
                overhead.decided_serial_ab(_small(), site)
        finally:
            cleanup()
    finally:
        monkeypatch.undo()
        release_site(site)
    _no_second_root_left()


def test_the_ab_refuses_a_second_root_in_use() -> None:
    site = standin_site()
    standins.install(overhead.AB_SECOND_ROOT)
    try:
        with pytest.raises(RuntimeError, match="already in use"):
            overhead.decided_serial_ab(_small(), site)
    finally:
        standins.uninstall(overhead.AB_SECOND_ROOT)
        release_site(site)


def test_a_report_of_the_block_design_still_prints() -> None:
    """A report written before the paired design (rounds x steps per arm, no
    control) still renders: docs/ quotes such reports."""
    figure = {"median": 0.5, "ci95": [-0.8, 1.7], "min": -29.3, "max": 73.2}
    world = {"layers": 4, "stages": 2, "hidden": 16, "tokens": 1}
    old = {"world": world, "rounds": 300, "steps": 5, "extra_pct": figure}
    old |= {"unpatched_us_per_step": 6191.5, "decided_serial_us_per_step": 6315.0}
    keys = ("engaged_us_per_layer_stage", "passthrough_us_per_step", "passthrough_us_per_call")
    result = {key: {"median": 1.0, "p90": 2.0} for key in keys}
    out = overhead.format_overhead({**result, "shapes": [], "decided_serial_ab": old})
    assert "over 300 rounds x 5 steps per arm" in out and "A/A control" not in out
    paired = {**old, "pairs": 3000, "control": figure}
    out = overhead.format_overhead({**result, "shapes": [], "decided_serial_ab": paired})
    assert "over 3000 pairs" in out and "A/A control (both copies unpatched): +0.50 % median" in out


def test_cli_writes_the_documented_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(overhead, "WD_BLOCK_S", 0.004)  # short blocks: the keys are what is checked here
    path = tmp_path / "overhead.json"
    argv = ["overhead", "--layers", "2,3", "--stages", "1,2", "--steps", "6", "--rounds", "1", "--wd-pairs", "20"]
    assert main([*argv, "--ab-pairs", "20", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["schema"] == "camp2p-overlap/overhead/v1"
    ran = [*argv, "--ab-pairs", "20", "--json", str(path)]
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
        assert set(s["static_serial_paired_us_per_step"]) == set(overhead.STATIC_SERIAL_KINDS)
        frames = s["passthrough_frames_us_per_step"]
        assert set(frames) == {overhead.PASSTHROUGH_KIND, *overhead.STATIC_SERIAL_KINDS}
        assert {f["pairs"] for f in frames.values()} == {overhead.FRAMES_PAIRS_PER_PAIR * data["params"]["pt_pairs"]}
        wd = s["watchdog_paired_us_per_step"]
        assert set(wd) == {
            "median",
            "ci95",
            "min",
            "max",
            "pct",
            "pairs",
            "block_steps",
            "off_us_per_step",
            "watchdog_s",
        }
        assert set(wd["pct"]) == {"median", "ci95", "min", "max"}
        assert (wd["pairs"], wd["watchdog_s"]) == (20, 60.0) and wd["block_steps"] >= overhead.WD_MIN_BLOCK
    assert data["params"]["wd_pairs"] == 20
    assert set(data["watchdog"]) == {"watchdog_s", "largest_median_pct", "ci95", "layers", "stages", "goal_pct"}
    assert data["watchdog"]["goal_pct"] == 2.0
    assert data["engaged_us_per_layer_stage"]["samples"] == data["passthrough_us_per_step"]["samples"] == 4 * 6
    ab = data["decided_serial_ab"]
    assert set(ab) == {
        "world",
        "timing",
        "pairs",
        "warmup",
        "unpatched_us_per_step",
        "decided_serial_us_per_step",
        "extra_pct",
        "by_copy",
        "control",
    }
    (second_half, first_half) = ab["by_copy"]  # the second copy applied first
    assert (second_half["applied_root"], second_half["pairs"], first_half["pairs"]) == (overhead.AB_SECOND_ROOT, 10, 10)
    assert first_half["applied_root"] != overhead.AB_SECOND_ROOT
    assert set(ab["extra_pct"]) == set(ab["control"]) == {"median", "ci95", "min", "max"}
    assert (ab["pairs"], ab["warmup"]) == (20, overhead.OverheadParams.ab_warmup)
    assert data["params"]["ab_pairs"] == 20 and "ab_rounds" not in data["params"]
    _no_second_root_left()
    out = capsys.readouterr().out
    assert "us per (layer, stage)" in out and "us per step" in out and "decided serial vs not applied" in out
    assert "over 20 pairs" in out and "A/A control (both copies unpatched)" in out
    assert "watchdog at its default (60 s) vs off, engaged steps: 20 pairs of blocks" in out
    assert "largest median:" in out and "goal: at most 2 %" in out
    assert "JSON:" in out


def test_the_watchdog_figure_pairs_its_default_against_off_and_finds_a_cost_in_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each pair times one block of engaged steps with the engine's watchdog at its default and one with it off
    (the first of each pair alternating); a cost put into the watchdog's hand-off shows in the figure, per engaged
    step, and nothing of it in the blocks with the watchdog off."""
    from camp2p_overlap.core.overlap.watch.watchdog import WATCHER

    monkeypatch.setattr(overhead, "WD_BLOCK_S", 0.005)
    arms: list[float | None] = []
    time_pairs = overhead.time_pairs

    def spy(first: Callable[[], Any], second: Callable[[], Any], pairs: int) -> Any:
        def arm(block: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> None:
                block()
                arms.append(engine_config().watchdog_s)

            return run

        return time_pairs(arm(first), arm(second), pairs)

    engines: list[PatchEngine] = []
    real_apply = PatchEngine.apply

    def apply(self: PatchEngine, **kwargs: Any) -> Any:
        engines.append(self)
        return real_apply(self, **kwargs)

    def engine_config() -> Any:
        return engines[-1].config

    monkeypatch.setattr(overhead, "time_pairs", spy)
    monkeypatch.setattr(PatchEngine, "apply", apply)
    real_hand = WATCHER.hand

    def slow_hand(watch: Any) -> None:
        busy_wait(DELAY_US / 1e6)
        real_hand(watch)

    monkeypatch.setattr(WATCHER, "hand", slow_hand)
    result = measure_overhead(_small(ab_pairs=0, pt_pairs=0, rounds=1, wd_pairs=20))
    (shape,) = result["shapes"]
    wd = shape["watchdog_paired_us_per_step"]
    assert wd["pairs"] == 20 and wd["watchdog_s"] == 60.0
    assert arms == [60.0, 0.0, 0.0, 60.0] * 10  # even pairs: the watchdog's block first
    assert 0.8 * DELAY_US <= wd["median"] <= 3 * DELAY_US  # per engaged step
    assert wd["ci95"][0] <= wd["median"] <= wd["ci95"][1] and wd["pct"]["median"] > 50
    assert result["watchdog"]["largest_median_pct"] == wd["pct"]["median"]
    out = overhead.format_overhead(result)
    assert "watchdog at its default (60 s) vs off, engaged steps: 20 pairs of blocks per shape" in out


def test_cli_skips_the_ab_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "overhead.json"
    argv = ["overhead", "--layers", "2", "--stages", "2", "--steps", "5", "--rounds", "1", "--ab-pairs", "0"]
    assert main([*argv, "--wd-pairs", "0", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["decided_serial_ab"] is None and data["watchdog"] is None
    assert data["shapes"][0]["watchdog_paired_us_per_step"] == {"median": None, "why": "skipped (wd_pairs 0)"}
    out = capsys.readouterr().out
    assert "decided serial vs not applied" not in out and "watchdog at its default" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "4"], "stage counts must lie in 1..3"),
        (["--layers", "0"], "layer counts must be >= 1"),
        (["--steps", "2"], "need steps >= 5"),
        (["--delay-us", "-1"], "delay_us must be >= 0"),
        (["--ab-pairs", "19"], "the decided-serial A/B needs ab_pairs 0 (skip) or >= 20, ab_warmup >= 0"),
        (["--ab-pairs", "-1"], "the decided-serial A/B needs ab_pairs 0 (skip) or >= 20"),
        (["--wd-pairs", "19"], "the watchdog's paired figure needs wd_pairs 0 (skip) or >= 20"),
    ],
)
def test_cli_refuses_bad_values(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["overhead", *argv]) == 2
    assert message in capsys.readouterr().err
