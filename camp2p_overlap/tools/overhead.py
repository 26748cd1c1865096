"""``camp2p-overlap overhead``: the host cost of the project's own code alone.

The stand-in runner's loop runs over a no-op transport (receives hand back
one prebuilt tensor, sends return), a no-op FFN (hands its input back) and,
when engaged, the real device backend over a device module whose streams
and events do nothing. What is left is the cost of our wrappers, gate,
adaptive bookkeeping, session and backend, plus the loop's own Python,
which the unpatched runs measure and which is subtracted.

Per shape (layers x stages), in every round, three blocks run back to back
in a rotating order: ``unpatched`` (no engine applied), ``engaged`` (the
overlap on every step, adaptive engage off) and ``pass-through`` (applied,
adaptive engage decided for serial: the original path under whatever of
ours is installed). Each timed step of a block, minus the median unpatched
step time of the same round, gives one sample: per (layer, stage)
(engaged), per whole step (pass-through: the wrapped ``_ffn_forward`` and
every connector call of the step), and per wrapped call (that per-step
figure over the step's calls that meet a frame of ours). Those calls are
counted on one probe step, not assumed: each manifest target on the
runner's class counts once a step, each on the connector's class once per
(layer, stage), wherever the instance resolves it, at that moment, to
something other than upstream's attribute. Figures are medians and 90th
percentiles of the samples; the garbage collector stays on, so its pauses
count where our allocations cause them.

The engaged blocks run the watchdog at its default, as a user's steps do.
Per shape, the watchdog's own cost is paired too (``wd_pairs``): with one
engine applied, each pair runs a block of engaged steps with the watchdog at
its default and a block with it off (``watchdog_s`` 0), back to back,
alternating which runs first; a block lasts about :data:`WD_BLOCK_S`, so
that the watcher thread's looks (one each :data:`MAX_POLL_S` at most while
it follows steps) fall inside the block whose steps they follow. Each pair
gives the extra host time per engaged step, in µs and in % of the block with
the watchdog off; reported are the median over the pairs, a bootstrap 95 %
interval of it, and its min and max.

The decided-serial A/B runs on the emulated world of the sweep's smallest
work point (``camp2p-overlap sweep``: the ``ffn-bound`` preset with the
sweep's defaults, the smallest hidden size and tokens per stage), not on
the no-op world. Two identical copies of the stand-ins are imported at two
module roots, the run's own and :data:`AB_SECOND_ROOT`, and one world is
built on each. The A/B has two halves: the engine is applied to the second
copy for the first half and to the first copy for the second, with every
runner's adaptive bucket decided serial, the other copy unpatched. Two
copies of the same code still run a little apart in one process (where
their objects lie in memory), by a few tenths of a percent either way; the
crossover cancels that. In each half, after a few warm-up steps of each
world, each timed pair runs one step of each world back to back,
alternating which runs first; each pair gives one figure, the applied step
over the unpatched step as extra step time in %. Both steps of a pair fall
on one stretch of the machine's speed (on a shared CPU it moves in
stretches of a tenth of a second and more), and there is no apply or
unpatch between the timed steps of a half. Before the engine is applied,
an A/A control of the same design and size (its halves, its ratios) times
the two copies both unpatched: its figure is the method's own bias. Reported for each are the median over the pairs, a
bootstrap 95 % interval of that median, and its min and max. The A/B's
kernels take wall-clock time, not the benchmark's default modelled
durations (:data:`AB_TIMING_WHY`).
"""

from __future__ import annotations

import contextlib
import inspect
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.env_vars import DEFAULT_WATCHDOG_S, MAX_REPROBE, MAX_STAGES
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.adaptive import SERIAL
from camp2p_overlap.core.overlap.plan import layouts_of
from camp2p_overlap.core.overlap.step import bucket_of, make_wrappers
from camp2p_overlap.core.overlap.watch.watchdog import MAX_POLL_S, WATCHER
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.core.patching.installer import method_wrapper
from camp2p_overlap.emulation import standins
from camp2p_overlap.emulation.moe import MoEShape
from camp2p_overlap.emulation.noop import NoopModel, NoopTransport, noop_backend
from camp2p_overlap.emulation.standin_patch_layer import StandinSite, emulated_patch_layer, release_site, standin_site
from camp2p_overlap.emulation.world import World, WorldSpec, build_world
from camp2p_overlap.tools.bench.runner import BenchParams, percentile, resolve_params
from camp2p_overlap.tools.bench.sweep import (
    DEFAULT_WORK_HIDDEN,
    DEFAULT_WORK_TOKENS,
    SWEEP_DEFAULTS,
    WORK_POINT_CHANGES,
)
from camp2p_overlap.tools.provenance import report_env

PATHS = ("engaged", "pass-through")
SCHEMA = "camp2p-overlap/overhead/v1"
#: The arms of the decided-serial A/B, in the order of its even pairs.
AB_ARMS = ("unpatched", "decided-serial")
#: Where the A/B installs its second copy of the stand-ins (the first is the
#: run's own site): the applied copy of its first half.
AB_SECOND_ROOT = "camp2p_overlap_ab_second_afd_plugin"
#: The fewest timed pairs of a run that does not skip the A/B.
AB_MIN_PAIRS = 20
#: The sweep's preset, whose smallest work point the A/B runs on.
AB_SCENARIO = "ffn-bound"
AB_BOOTSTRAP = 1000
#: The A/B runs wall-clock kernels (``bench --timing wall``), and why.
AB_TIMING = "wall"
AB_TIMING_WHY = (
    "wall-clock kernels: the A/B measures what the host's own code adds to a step; with modelled kernels the "
    "device's time is fixed and host time hides under it (under the FFN model's margin more than under a device's "
    "kernels), so the A/B would read about 0 whatever the cost; the no-op blocks run no kernels at all"
)
#: The benchmark parameters the A/B reports as its world.
AB_WORLD_KEYS = (
    "layers",
    "stages",
    "tokens",
    "hidden",
    "ffn",
    "experts",
    "top_k",
    "link_gbps",
    "link_latency_us",
    "attn_us",
    "comm_cores",
    "threads",
)


@dataclass(frozen=True)
class OverheadParams:
    layers: tuple[int, ...] = (4, 16, 61)
    stages: tuple[int, ...] = (1, 2, 3)
    #: Timed steps per block (each shape and path, per round).
    steps: int = 100
    warmup: int = 10
    rounds: int = 10
    #: Busy wait added to every no-op receive (a cost outside our code).
    delay_us: float = 0.0
    #: The decided-serial A/B and its A/A control: timed pairs of steps each
    #: (0 skips both), after ``ab_warmup`` warm-up steps per world and phase.
    #: A pair is two steps back to back (about 12 ms at the A/B's point), so
    #: both fall on one stretch of this machine's speed (it moves in
    #: stretches of 0.1-1 s); many pairs make the median's interval narrow.
    ab_pairs: int = 3000
    ab_warmup: int = 5
    #: The paired pass-through figure, per shape: timed pairs of one wrapped
    #: and one original step (0 skips it), and as many A/A pairs.
    pt_pairs: int = 1000
    #: The watchdog's paired figure, per shape: timed pairs of two blocks of
    #: engaged steps, the watchdog at its default and off (0 skips it).
    wd_pairs: int = 30

    def validate(self) -> None:
        if not self.layers or any(n < 1 for n in self.layers):
            raise ValueError(f"layer counts must be >= 1, got {self.layers}")
        if not self.stages or any(not 1 <= n <= MAX_STAGES for n in self.stages):
            raise ValueError(f"stage counts must lie in 1..{MAX_STAGES}, got {self.stages}")
        if self.steps < 5 or self.rounds < 1 or self.warmup < 0:
            raise ValueError("need steps >= 5, rounds >= 1 and warmup >= 0")
        if self.delay_us < 0:
            raise ValueError(f"delay_us must be >= 0, got {self.delay_us}")
        if self.ab_pairs != 0 and (self.ab_pairs < AB_MIN_PAIRS or self.ab_warmup < 0):
            raise ValueError(f"the decided-serial A/B needs ab_pairs 0 (skip) or >= {AB_MIN_PAIRS}, ab_warmup >= 0")
        if self.pt_pairs != 0 and self.pt_pairs < AB_MIN_PAIRS:
            raise ValueError(f"the paired pass-through figure needs pt_pairs 0 (skip) or >= {AB_MIN_PAIRS}")
        if self.wd_pairs != 0 and self.wd_pairs < AB_MIN_PAIRS:
            raise ValueError(f"the watchdog's paired figure needs wd_pairs 0 (skip) or >= {AB_MIN_PAIRS}")


def _figure(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"median": round(statistics.median(ordered), 3), "p90": round(p90, 3), "samples": len(ordered)}


def noop_world(layers: int, stages: int, delay_us: float, root: str) -> World:
    world = build_world(
        WorldSpec(layers=layers, stage_ids=tuple(range(stages)), tokens=1, shape=MoEShape(hidden=16)), root=root
    )
    world.connector.transport = world.transport = NoopTransport(delay_s=delay_us / 1e6)  # type: ignore[assignment]
    world.runner.model = NoopModel()
    return world


def engaged_config() -> OverlapConfig:
    return OverlapConfig(enabled=True, backend="cpu", min_stages=1, adaptive=False)


def passthrough_config() -> OverlapConfig:
    return OverlapConfig(enabled=True, backend="cpu", min_stages=1, adaptive=True, reprobe_every=MAX_REPROBE)


#: The decided-serial pass-through kind (adaptive engage decided for serial).
PASSTHROUGH_KIND = "decided serial"

#: The static-serial pass-through kinds (their step is decided serial by the
#: decision, not by adaptive engage) whose paired figure is taken too, each
#: with the serial reason its steps must be counted under.
STATIC_SERIAL_KINDS = {
    "fewer stages": "fewer than the minimum",
    "other connector": "connector is OtherConnector",
}


class OtherConnector:
    """A connector of another class than the routed one, without CAMP2P's
    communicator names (the loop's calls reach the stand-in's own connector
    through it): a step on it runs serially, "not our connector"."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.control_plane = inner.control_plane

    def recv_attn_output(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.recv_attn_output(*args, **kwargs)

    def send_ffn_output(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.send_ffn_output(*args, **kwargs)


def static_serial_config(kind: str, stages: int) -> OverlapConfig:
    """The configuration of a static-serial kind's patch layer (adaptive
    engage on, as a user's default): ``fewer stages`` asks one stage more
    than the step has."""
    min_stages = stages + 1 if kind == "fewer stages" else 1
    return OverlapConfig(enabled=True, backend="cpu", min_stages=min_stages)


@contextlib.contextmanager
def static_serial_world(kind: str, world: World) -> Any:
    """The world as a static-serial ``kind`` needs it for the block: for
    ``other connector``, its runner's connector behind :class:`OtherConnector`."""
    if kind != "other connector":
        yield
        return
    connector = world.runner.connector
    world.runner.connector = OtherConnector(connector)
    try:
        yield
    finally:
        world.runner.connector = connector


def decide_serial(patch_layer: PatchLayer, world: World) -> None:
    """Teach the patch layer's adaptive engage that serial is faster for this
    shape, so that every step takes the pass-through path (no probe runs:
    the re-probe interval is the largest allowed)."""
    runtime = patch_layer.runtime
    dp = world.dp_metadata()
    key = bucket_of(runtime.runner_name(world.runner), camp2p.stage_count(dp), len(world.layer_list()), dp)
    overlaps = tuple(layout.name for layout in layouts_of(patch_layer.engine.config))
    for _ in range(4 * runtime.adaptive.settings.min_samples + 4):
        if runtime.adaptive.decision(key) is not None:
            break
        path = runtime.adaptive.choose(key, overlaps).path
        runtime.adaptive.record(key, path, 0.5 if path == SERIAL else 1.0)
    if runtime.adaptive.decision(key) != "serial":
        raise RuntimeError("the overhead harness could not set the pass-through decision")


def time_block(step: Callable[[], Any], warmup: int, steps: int) -> list[int]:
    for _ in range(warmup):
        step()
    clock = time.perf_counter_ns
    times = []
    for _ in range(steps):
        t0 = clock()
        step()
        times.append(clock() - t0)
    return times


# ---------------------------------------------------------------------------
# the calls of a pass-through step that meet a frame of ours


#: Wrapped targets an eager step never calls (decode graph capture only).
_NOT_ON_AN_EAGER_STEP = frozenset({"capture_graphs"})


def _target_names(manifest: Any, obj: Any) -> list[str]:
    """The manifest's targets that are attributes of ``obj``'s class and
    that an eager step can call."""
    cls = type(obj).__name__
    return [
        t.attribute
        for t in manifest.targets()
        if t.owner_path[-1:] == (cls,) and getattr(t, "wrapper", None) not in _NOT_ON_AN_EAGER_STEP
    ]


def _resolved(obj: Any, names: Sequence[str]) -> dict[str, Any]:
    """What ``obj`` resolves each name to, without calling a descriptor."""
    return {name: inspect.getattr_static(obj, name, None) for name in names}


class _ProbeModel(NoopModel):
    """The no-op FFN, calling ``probe`` on each (layer, stage): between that
    pair's receive and its send, inside the step."""

    def __init__(self, probe: Callable[[], None]) -> None:
        self.probe = probe

    def compute_ffn_output(self, *, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.probe()
        return hidden_states


def resolved_targets(world: World, manifest: Any) -> dict[str, dict[str, Any]]:
    """What the runner and the connector resolve each of their manifest
    targets to now (before any engine is applied: upstream's)."""
    return {
        "runner": _resolved(world.runner, _target_names(manifest, world.runner)),
        "connector": _resolved(world.connector, _target_names(manifest, world.connector)),
    }


def wrapped_calls(world: World, step: Callable[[], Any], upstream: dict[str, dict[str, Any]]) -> int:
    """Run ``step`` once and count its calls that meet a frame of ours (see
    the module docstring); ``upstream`` is :func:`resolved_targets` taken
    before any engine was applied."""
    runner_names, connector_names = list(upstream["runner"]), list(upstream["connector"])
    if not runner_names or not connector_names:
        raise RuntimeError(f"the manifest names no target on the runner's or the connector's class: {upstream}")
    ours = {"runner": 0, "connector": 0, "pairs": 0}

    def probe() -> None:
        now = _resolved(world.connector, connector_names)
        ours["connector"] += sum(now[n] is not upstream["connector"][n] for n in connector_names)
        ours["pairs"] += 1

    now = _resolved(world.runner, runner_names)
    ours["runner"] = sum(now[n] is not upstream["runner"][n] for n in runner_names)
    model = world.runner.model
    world.runner.model = _ProbeModel(probe)
    try:
        step()
    finally:
        world.runner.model = model
    pairs = len(world.layer_list()) * len(world.spec.stage_ids)
    if ours["pairs"] != pairs or not ours["runner"]:
        raise RuntimeError(f"the probe step did not run as planned: {ours}, expected {pairs} (layer, stage) pairs")
    return ours["runner"] + ours["connector"]


# ---------------------------------------------------------------------------
# per shape: unpatched, engaged, pass-through


def _measure_shape(params: OverheadParams, layers: int, stages: int, root: str, manifest: Any) -> dict[str, Any]:
    world = noop_world(layers, stages, params.delay_us, root)
    dp = world.dp_metadata()

    def step() -> None:
        world.runner._ffn_forward(dp_metadata_list=dp)

    pairs = layers * stages
    upstream = resolved_targets(world, manifest)
    samples: dict[str, list[float]] = {"engaged": [], "pass-through": [], "pass-through-step": []}
    base_medians: list[float] = []
    engines = {"engaged": emulated_patch_layer(), "pass-through": emulated_patch_layer()}
    for patch_layer in engines.values():
        patch_layer.runtime.runners.make_backend = noop_backend
    decide_serial(engines["pass-through"], world)
    configs = {"engaged": engaged_config(), "pass-through": passthrough_config()}
    engines["pass-through"].engine.apply(config=configs["pass-through"], manifest=manifest, strict=True)
    try:
        calls = wrapped_calls(world, step, upstream)
    finally:
        if not engines["pass-through"].engine.unpatch(timeout=30.0):
            raise RuntimeError("the overhead harness could not unpatch its engine")
    order = ["unpatched", *PATHS]
    engaged_ns: list[int] = []
    for r in range(params.rounds):
        times: dict[str, list[int]] = {}
        for name in order[r % 3 :] + order[: r % 3]:
            patch_layer = engines.get(name)
            if patch_layer is not None:
                patch_layer.engine.apply(config=configs[name], manifest=manifest, strict=True)
            try:
                times[name] = time_block(step, params.warmup, params.steps)
            finally:
                if patch_layer is not None and not patch_layer.engine.unpatch(timeout=30.0):
                    raise RuntimeError("the overhead harness could not unpatch its engine")
        base = statistics.median(times["unpatched"])
        base_medians.append(base)
        engaged_ns += times["engaged"]
        samples["engaged"] += [(t - base) / 1e3 / pairs for t in times["engaged"]]
        samples["pass-through-step"] += [(t - base) / 1e3 for t in times["pass-through"]]
        samples["pass-through"] += [(t - base) / 1e3 / calls for t in times["pass-through"]]
    paired, frames = passthrough_pairs(
        params, world, step, upstream, (engines["pass-through"], configs["pass-through"], manifest), calls
    )
    # the steps one passthrough_pairs() call runs wrapped: the paired figure's and the frames' alone
    taken = paired.get("median") is not None
    paired_steps = 2 * PT_WARMUP + (1 + FRAMES_PAIRS_PER_PAIR) * params.pt_pairs if taken else 0
    static: dict[str, Any] = {}
    own = {PASSTHROUGH_KIND: frames}
    for kind, reason in STATIC_SERIAL_KINDS.items():
        static_layer = emulated_patch_layer()
        static_layer.runtime.runners.make_backend = noop_backend
        with static_serial_world(kind, world):
            static[kind], own[kind] = passthrough_pairs(
                params, world, step, upstream, (static_layer, static_serial_config(kind, stages), manifest), calls
            )
        counts = static_layer.runtime.counters.to_dict()
        counted = sum(n for r, n in counts["serial_reasons"].items() if reason in r)
        if counted != paired_steps or counts["steps"]["overlap"]:
            raise RuntimeError(f"the {kind!r} pass-through steps were not taken as planned: {counts}")
    watchdog = watchdog_pairs(params, step, manifest, statistics.median(engaged_ns))
    counters = engines["engaged"].runtime.counters.to_dict()["steps"]
    passed = engines["pass-through"].runtime.counters.to_dict()["steps"]
    expected = params.rounds * (params.warmup + params.steps)
    if counters["overlap"] != expected or passed["serial"] != expected + 1 + paired_steps or passed["overlap"]:
        raise RuntimeError(f"the paths were not taken as planned: engaged {counters}, pass-through {passed}")
    return {
        "layers": layers,
        "stages": stages,
        "wrapped_calls_per_step": calls,
        "unpatched_us_per_layer_stage": round(statistics.median(base_medians) / 1e3 / pairs, 3),
        "engaged_us_per_layer_stage": _figure(samples["engaged"]),
        "passthrough_us_per_step": _figure(samples["pass-through-step"]),
        "passthrough_us_per_call": _figure(samples["pass-through"]),
        "passthrough_paired_us_per_step": paired,
        "static_serial_paired_us_per_step": static,
        "passthrough_frames_us_per_step": own,
        "watchdog_paired_us_per_step": watchdog,
        "_samples": samples,
    }


#: About how long one block of the watchdog's paired figure lasts (s): two of the watcher's longest pauses, so that
#: its looks at a block's steps mostly fall inside that block.
WD_BLOCK_S = 2 * MAX_POLL_S
#: The fewest and the most engaged steps in one block of the watchdog's paired figure.
WD_MIN_BLOCK, WD_MAX_BLOCK = 5, 5000


def watchdog_pairs(params: OverheadParams, step: Callable[[], Any], manifest: Any, step_ns: float) -> dict[str, Any]:
    """The watchdog's added host cost per engaged step (see the module docstring): one engine, engaged on every step,
    applied to the shape's world; each pair runs one block of steps with the engine's configuration at the
    watchdog's default and one with ``watchdog_s`` 0 (the two configurations differ in nothing else; the engine's
    ``config`` is swapped before each block, a step reads it as it starts), back to back, alternating which runs
    first (:func:`time_pairs`). ``step_ns``: the shape's engaged step time, which sizes a block."""
    if not params.wd_pairs:
        return {"median": None, "why": "skipped (wd_pairs 0)"}
    on = engaged_config()
    off = replace(on, watchdog_s=0.0)
    if on.watchdog_s != DEFAULT_WATCHDOG_S:
        raise RuntimeError(f"the overhead harness's engaged steps run the watchdog at {on.watchdog_s}, not its default")
    block = max(WD_MIN_BLOCK, min(WD_MAX_BLOCK, round(WD_BLOCK_S * 1e9 / max(step_ns, 1.0))))
    patch_layer = emulated_patch_layer()
    patch_layer.runtime.runners.make_backend = noop_backend
    engine = patch_layer.engine

    def blocks(cfg: OverlapConfig) -> Callable[[], None]:
        def run() -> None:
            engine.config = cfg
            for _ in range(block):
                step()

        return run

    watched, unwatched = blocks(on), blocks(off)
    _settle_watcher()
    handed = WATCHER.handed
    engine.apply(config=on, manifest=manifest, strict=True)
    try:
        watched()
        unwatched()
        on_ns, off_ns = time_pairs(watched, unwatched, params.wd_pairs)
    finally:
        engine.config = on
        _unpatch(patch_layer)
    counted = patch_layer.runtime.counters.to_dict()["steps"]
    steps = 2 * (params.wd_pairs + 1) * block
    if counted["overlap"] != steps or WATCHER.handed - handed != steps // 2:
        raise RuntimeError(
            f"the watchdog's arms did not run as planned: {counted['overlap']} engaged steps of {steps}, "
            f"{WATCHER.handed - handed} handed to the watcher of {steps // 2}"
        )
    extra = [(a - b) / 1e3 / block for a, b in zip(on_ns, off_ns, strict=True)]
    pct = [100.0 * (a / b - 1.0) for a, b in zip(on_ns, off_ns, strict=True)]
    return {
        **_extra_figure(extra),
        "pct": _extra_figure(pct),
        "pairs": params.wd_pairs,
        "block_steps": block,
        "off_us_per_step": round(statistics.median(off_ns) / 1e3 / block, 3),
        "watchdog_s": on.watchdog_s,
    }


def _settle_watcher(timeout: float = 5.0) -> None:
    """Wait until the step watcher follows no step (it has taken every step handed)."""
    deadline = time.perf_counter() + timeout
    while WATCHER.following() and time.perf_counter() < deadline:
        time.sleep(0.005)


#: Steps of each kind run before the paired pass-through figure's pairs.
PT_WARMUP = 20
#: Pairs of the frames-alone figure per pair of the paired figure: a pair
#: of it takes a few µs, so as many as the paired figure's would all fall in
#: a few ms, where one hiccup of the machine moves the median.
FRAMES_PAIRS_PER_PAIR = 10


def passthrough_pairs(
    params: OverheadParams,
    world: World,
    step: Callable[[], Any],
    upstream: dict[str, dict[str, Any]],
    applied: tuple[PatchLayer, OverlapConfig, Any],
    calls: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The paired figure and the frames-alone figure of a passed-through
    step. The passed-through step's extra time, paired (µs per step): with the
    pass-through engine applied, each pair runs one step through the
    wrapped ``_ffn_forward`` and one of upstream's own function called on
    the same runner with the same arguments, back to back, alternating
    which runs first (:func:`time_pairs`); the figure is the median over the
    pairs of their difference, with a bootstrap 95 % interval, and an A/A
    control (upstream's function in both places of each pair). Both steps
    of a pair run the same loop on the same objects on one stretch of the
    machine's speed, so the block design's noise between blocks is gone;
    the interval is one process's, and at large shapes the figure still
    moves by a few µs from process to process (the arms run different code
    before the same loop), which the A/A control cannot show
    (docs/benchmark.md). It covers every frame of ours only while the
    step's one wrapped call is ``_ffn_forward`` (``calls``, counted on the
    probe step); else it is not taken, and says why (both figures). Our
    frames alone, in the same apply: the wrapper the engine installs around
    a no-op, paired against the no-op (:data:`FRAMES_PAIRS_PER_PAIR` pairs
    per pair). ``applied``: the pass-through patch layer, its configuration
    and the manifest."""
    patch_layer, config, manifest = applied
    if not params.pt_pairs:
        skipped = {"median": None, "why": "skipped (pt_pairs 0)"}
        return skipped, skipped
    if calls != 1:
        refused = {"median": None, "why": f"{calls} calls of a passed-through step meet a frame of ours, not 1"}
        return refused, refused
    original = upstream["runner"]["_ffn_forward"]
    runner, kwargs = world.runner, {"dp_metadata_list": world.dp_metadata()}

    def original_step() -> None:
        original(runner, **kwargs)

    def nothing(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    # our frames around a no-op: the wrapper the engine installs, of the kind
    # the installer makes for a class's function, bound to the same engine
    ours = method_wrapper(nothing, make_wrappers(patch_layer.engine, runtime=patch_layer.runtime)["ffn_forward"])

    def frames_step() -> None:
        ours(runner, **kwargs)

    def nothing_step() -> None:
        nothing(runner, **kwargs)

    patch_layer.engine.apply(config=config, manifest=manifest, strict=True)
    try:
        if inspect.getattr_static(runner, "_ffn_forward") is original:
            raise RuntimeError("the paired pass-through figure's wrapped arm is not wrapped")
        for _ in range(PT_WARMUP):
            step()
            original_step()
        wrapped_times, original_times = time_pairs(step, original_step, params.pt_pairs)
        control = time_pairs(original_step, original_step, params.pt_pairs)
        for _ in range(PT_WARMUP):
            frames_step()
        frames = time_pairs(frames_step, nothing_step, FRAMES_PAIRS_PER_PAIR * params.pt_pairs)
    finally:
        _unpatch(patch_layer)
    extra = [(w - o) / 1e3 for w, o in zip(wrapped_times, original_times, strict=True)]
    aa = [(b - a) / 1e3 for a, b in zip(*control, strict=True)]
    own = [(w - o) / 1e3 for w, o in zip(*frames, strict=True)]
    paired = {**_extra_figure(extra), "pairs": params.pt_pairs, "control": _extra_figure(aa)}
    return paired, {**_extra_figure(own), "pairs": FRAMES_PAIRS_PER_PAIR * params.pt_pairs}


# ---------------------------------------------------------------------------
# the decided-serial A/B


def smallest_work_point() -> BenchParams:
    """The benchmark parameters of the sweep's smallest work point (its
    default run: the ``ffn-bound`` preset with the sweep's defaults)."""
    base = resolve_params(SWEEP_DEFAULTS, AB_SCENARIO)
    return replace(
        base,
        tokens=min(DEFAULT_WORK_TOKENS),
        hidden=min(DEFAULT_WORK_HIDDEN),
        timing=AB_TIMING,
        **WORK_POINT_CHANGES,
    )


def _ab_interval(extra: Sequence[float]) -> list[float]:
    """A bootstrap 95 % interval of the median of the pairs' figures."""
    rng = random.Random(0)
    medians = [statistics.median(rng.choices(extra, k=len(extra))) for _ in range(AB_BOOTSTRAP)]
    return [round(percentile(medians, 2.5), 3), round(percentile(medians, 97.5), 3)]


def _extra_figure(extra: Sequence[float]) -> dict[str, Any]:
    """Median, bootstrap 95 % interval of the median, min and max of the pairs' figures (%)."""
    return {
        "median": round(statistics.median(extra), 3),
        "ci95": _ab_interval(extra),
        "min": round(min(extra), 3),
        "max": round(max(extra), 3),
    }


def time_pairs(first: Callable[[], Any], second: Callable[[], Any], pairs: int) -> tuple[list[int], list[int]]:
    """Time ``pairs`` pairs of one ``first`` and one ``second`` step, back to
    back: even pairs run ``first`` first, odd pairs ``second`` first. The
    step times (ns) of each, in pair order."""
    clock = time.perf_counter_ns
    steps = (first, second)
    times: tuple[list[int], list[int]] = ([], [])
    for i in range(pairs):
        lead, follow = (0, 1) if i % 2 == 0 else (1, 0)
        t0 = clock()
        steps[lead]()
        t1 = clock()
        steps[follow]()
        t2 = clock()
        times[lead].append(t1 - t0)
        times[follow].append(t2 - t1)
    return times


def _paired_extra(times: tuple[list[int], list[int]]) -> list[float]:
    """Per pair, the second world's step over the first's, as extra step time in %."""
    return [100.0 * (b / a - 1.0) for a, b in zip(*times, strict=True)]


def _check_arms(worlds: Sequence[World], upstream: Sequence[Any], applied: int, phase: str) -> None:
    """Refuse a world whose runner is (not) wrapped against the plan: the
    copy ``applied`` is (in the A/B) or is to be (in its control) the
    decided-serial arm, the other the unpatched arm; ``phase`` says which."""
    for i, (world, original) in enumerate(zip(worlds, upstream, strict=True)):
        wrapped = inspect.getattr_static(world.runner, "_ffn_forward") is not original
        planned = phase == "A/B" and i == applied
        arm = AB_ARMS[1] if i == applied else AB_ARMS[0]
        if wrapped != planned:
            raise RuntimeError(
                f"the {phase}'s {arm!r} arm did not run as planned (layer applied: {wrapped}, planned: {planned})"
            )


def _unpatch(patch_layer: PatchLayer) -> None:
    if not patch_layer.engine.unpatch(timeout=30.0):
        raise RuntimeError("the overhead harness could not unpatch its engine")


def _ab_halves(pairs: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(copy applied, pairs) of the A/B's two halves: the second copy first."""
    return ((1, pairs - pairs // 2), (0, pairs // 2))


def decided_serial_ab(params: OverheadParams, site: StandinSite) -> dict[str, Any]:
    """The decided-serial A/B and its A/A control (see the module docstring);
    the stand-ins at :data:`AB_SECOND_ROOT` are installed for it and gone
    after it, on every exit path."""
    point = smallest_work_point()
    if standins.installed_stack(AB_SECOND_ROOT) is not None or any(
        n == AB_SECOND_ROOT or n.startswith(AB_SECOND_ROOT + ".") for n in sys.modules
    ):
        raise RuntimeError(f"the A/B's own stand-in root {AB_SECOND_ROOT!r} is already in use in this process")
    roots = (site.root, AB_SECOND_ROOT)
    manifests = (site.manifest, site.manifest.rebased(site.root, AB_SECOND_ROOT))
    halves = _ab_halves(params.ab_pairs)
    with contextlib.ExitStack() as undo:
        undo.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(point.threads)
        undo.callback(standins.uninstall, AB_SECOND_ROOT)
        standins.install(AB_SECOND_ROOT, stack=standins.installed_stack(site.root))
        worlds = []
        for root in roots:
            worlds.append(build_world(point.world_spec(), root=root))
            undo.callback(worlds[-1].close)
        upstream = [inspect.getattr_static(w.runner, "_ffn_forward") for w in worlds]
        steps = [w.run_step for w in worlds]

        def timed_half(copy: int, pairs: int, phase: str) -> tuple[list[int], list[int]]:
            """(the other copy's step times, copy ``copy``'s), in pair order."""
            _check_arms(worlds, upstream, copy, phase)
            for step in steps:
                time_block(step, params.ab_warmup, 0)
            times = time_pairs(steps[1 - copy], steps[copy], pairs)
            _check_arms(worlds, upstream, copy, phase)
            return times

        # the A/A control: both copies unpatched, in the A/B's halves and figures
        control = [x for copy, pairs in halves for x in _paired_extra(timed_half(copy, pairs, "control"))]

        # the A/B: one copy applied per half, every runner's bucket decided serial
        patch_layer = emulated_patch_layer()
        for world in worlds:
            decide_serial(patch_layer, world)
        unpatched: list[int] = []
        decided: list[int] = []
        extra: list[float] = []
        by_copy = []
        for copy, pairs in halves:
            patch_layer.engine.apply(config=passthrough_config(), manifest=manifests[copy], strict=True)
            try:
                times = timed_half(copy, pairs, "A/B")
            finally:
                _unpatch(patch_layer)
            half_extra = _paired_extra(times)
            unpatched += times[0]
            decided += times[1]
            extra += half_extra
            by_copy.append(
                {"applied_root": roots[copy], "pairs": pairs, "median": round(statistics.median(half_extra), 3)}
            )
        counted = patch_layer.runtime.counters.to_dict()["steps"]
        if counted.get("serial") != 2 * params.ab_warmup + params.ab_pairs or counted.get("overlap"):
            raise RuntimeError(f"the decided-serial arm did not take the serial path on every step: {counted}")
    return {
        "world": {k: getattr(point, k) for k in AB_WORLD_KEYS},
        "timing": {"model": point.timing_mode()[0], "why": AB_TIMING_WHY},
        "pairs": params.ab_pairs,
        "warmup": params.ab_warmup,
        "unpatched_us_per_step": round(statistics.median(unpatched) / 1e3, 3),
        "decided_serial_us_per_step": round(statistics.median(decided) / 1e3, 3),
        "extra_pct": _extra_figure(extra),
        "by_copy": by_copy,
        "control": _extra_figure(control),
    }


# ---------------------------------------------------------------------------
# the run


def measure_overhead(params: OverheadParams) -> dict[str, Any]:
    """Run the harness; the result is JSON-able (see the module docstring)."""
    params.validate()
    wall0 = time.perf_counter()
    site = standin_site()
    try:
        shapes = [
            _measure_shape(params, layers, stages, site.root, site.manifest)
            for layers in params.layers
            for stages in params.stages
        ]
        ab = decided_serial_ab(params, site) if params.ab_pairs else None
    finally:
        release_site(site)
    shape_samples = [s.pop("_samples") for s in shapes]
    pooled = {p: [x for samples in shape_samples for x in samples[p]] for p in shape_samples[0]}
    return {
        "schema": SCHEMA,
        "engaged_us_per_layer_stage": _figure(pooled["engaged"]),
        "passthrough_us_per_step": _figure(pooled["pass-through-step"]),
        "passthrough_us_per_call": _figure(pooled["pass-through"]),
        "watchdog": _watchdog_summary(shapes),
        "shapes": shapes,
        "decided_serial_ab": ab,
        "params": asdict(params),
        "env": report_env(),
        "wall_s": round(time.perf_counter() - wall0, 2),
    }


#: The goal for the watchdog's added host cost, in % of an engaged step's (docs/design.md, "The watchdog's default").
WD_GOAL_PCT = 2.0


def _watchdog_summary(shapes: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The shape whose watchdog figure has the largest median (in % of its engaged step), against the goal."""
    taken = [s for s in shapes if (s.get("watchdog_paired_us_per_step") or {}).get("median") is not None]
    if not taken:
        return None
    worst = max(taken, key=lambda s: s["watchdog_paired_us_per_step"]["pct"]["median"])
    pct = worst["watchdog_paired_us_per_step"]["pct"]
    return {
        "watchdog_s": worst["watchdog_paired_us_per_step"]["watchdog_s"],
        "largest_median_pct": pct["median"],
        "ci95": pct["ci95"],
        "layers": worst["layers"],
        "stages": worst["stages"],
        "goal_pct": WD_GOAL_PCT,
    }


def _interval_cell(figure: dict[str, Any]) -> str:
    return f"{figure['median']:+.2f} [{figure['ci95'][0]:+.2f},{figure['ci95'][1]:+.2f}]"


def _watchdog_table(result: dict[str, Any]) -> list[str]:
    """Per shape, the watchdog's paired figure: µs per engaged step and % of it, median [95 % interval], min, max."""
    shapes = [s for s in result["shapes"] if (s.get("watchdog_paired_us_per_step") or {}).get("median") is not None]
    if not shapes:
        return []
    first = shapes[0]["watchdog_paired_us_per_step"]
    lines = [
        "",
        f"watchdog at its default ({first['watchdog_s']:g} s) vs off, engaged steps: {first['pairs']} pairs of blocks "
        "per shape, alternating which runs first",
        f"{'layers':>6} {'stages':>6} {'block':>6} {'off us/step':>12} {'extra us/step':>22} {'extra %':>22} "
        f"{'min %':>7} {'max %':>7}",
    ]
    for s in shapes:
        w = s["watchdog_paired_us_per_step"]
        pct = w["pct"]
        lines.append(
            f"{s['layers']:>6} {s['stages']:>6} {w['block_steps']:>6} {w['off_us_per_step']:>12.2f} "
            f"{_interval_cell(w):>22} {_interval_cell(pct):>22} {pct['min']:>+7.2f} {pct['max']:>+7.2f}"
        )
    summary = result.get("watchdog")
    if summary:
        lines.append(
            f"  largest median: {summary['largest_median_pct']:+.2f} % of the engaged step "
            f"(95 % interval [{summary['ci95'][0]:+.2f}, {summary['ci95'][1]:+.2f}], {summary['layers']} x "
            f"{summary['stages']}); goal: at most {summary['goal_pct']:g} %"
        )
    return lines


def _paired_cell(shape: dict[str, Any]) -> str:
    """The paired pass-through figure's cells: median [95 % interval], and its A/A control's median."""
    paired = shape.get("passthrough_paired_us_per_step") or {}
    if paired.get("median") is None:
        return f"{'-':>15} {'-':>6}"
    lo, hi = paired["ci95"]
    return f"{paired['median']:>5.2f} [{lo:.2f},{hi:.2f}] {paired['control']['median']:>+6.2f}"


def _median_cell(figure: Any, width: int) -> str:
    median = (figure or {}).get("median")
    return f"{median:>{width}.2f}" if median is not None else f"{'-':>{width}}"


def _passthrough_kinds_table(shapes: Sequence[dict[str, Any]]) -> list[str]:
    """Per shape, each pass-through kind's frames alone (a no-op original)
    and the static-serial kinds' paired figures: medians, µs per step."""
    kinds = [PASSTHROUGH_KIND, *STATIC_SERIAL_KINDS]
    if not any((s.get("passthrough_frames_us_per_step") or {}).get(PASSTHROUGH_KIND) for s in shapes):
        return []
    lines = [
        "",
        "pass-through steps by kind, us per step: our frames alone (around a no-op original), and paired",
        f"{'layers':>6} {'stages':>6} "
        + " ".join(f"{'frames ' + k:>{len(k) + 7}}" for k in kinds)
        + " "
        + " ".join(f"{'paired ' + k:>{len(k) + 7}}" for k in STATIC_SERIAL_KINDS),
    ]
    for s in shapes:
        own = s.get("passthrough_frames_us_per_step") or {}
        static = s.get("static_serial_paired_us_per_step") or {}
        lines.append(
            f"{s['layers']:>6} {s['stages']:>6} "
            + " ".join(_median_cell(own.get(k), len(k) + 7) for k in kinds)
            + " "
            + " ".join(_median_cell(static.get(k), len(k) + 7) for k in STATIC_SERIAL_KINDS)
        )
    return lines


def format_overhead(result: dict[str, Any]) -> str:
    """The result as the table ``camp2p-overlap overhead`` prints."""
    e, p = result["engaged_us_per_layer_stage"], result["passthrough_us_per_call"]
    ps = result["passthrough_us_per_step"]
    lines = [
        "host cost of camp2p-overlap's own code (no-op device, transport and FFN)",
        f"  engaged:      {e['median']:.2f} us per (layer, stage), p90 {e['p90']:.2f}",
        f"  pass-through: {ps['median']:.2f} us per step, p90 {ps['p90']:.2f}; "
        f"{p['median']:.2f} us per wrapped call, p90 {p['p90']:.2f}",
        "",
        f"{'layers':>6} {'stages':>6} {'loop us/(L,s)':>14} {'engaged med':>12} {'p90':>8} "
        f"{'pass us/step':>12} {'p90':>8} {'calls':>6} {'us/call':>8} {'p90':>8} {'paired us/step':>15} {'A/A':>6}",
    ]
    for s in result["shapes"]:
        se, sps, sp = s["engaged_us_per_layer_stage"], s["passthrough_us_per_step"], s["passthrough_us_per_call"]
        lines.append(
            f"{s['layers']:>6} {s['stages']:>6} {s['unpatched_us_per_layer_stage']:>14.2f} "
            f"{se['median']:>12.2f} {se['p90']:>8.2f} {sps['median']:>12.2f} {sps['p90']:>8.2f} "
            f"{s['wrapped_calls_per_step']:>6} {sp['median']:>8.2f} {sp['p90']:>8.2f} {_paired_cell(s)}"
        )
    lines += _passthrough_kinds_table(result["shapes"])
    lines += _watchdog_table(result)
    ab = result.get("decided_serial_ab")
    if ab:
        w, x = ab["world"], ab["extra_pct"]
        # reports of the block design (rounds x steps per arm, no control) still read
        size = f"{ab['pairs']} pairs" if "pairs" in ab else f"{ab['rounds']} rounds x {ab['steps']} steps per arm"
        lines += [
            "",
            f"decided serial vs not applied, on the sweep's smallest work point ({w['layers']} layers x "
            f"{w['stages']} stages, hidden {w['hidden']}, {w['tokens']} token(s) per stage; emulated world"
            + (f", {ab['timing']['model']}-clock kernels" if ab.get("timing") else "")
            + "):",
            f"  {ab['unpatched_us_per_step']:.1f} us unpatched, {ab['decided_serial_us_per_step']:.1f} us applied "
            f"per step; extra {x['median']:+.2f} % median, 95 % interval [{x['ci95'][0]:+.2f}, {x['ci95'][1]:+.2f}], "
            f"min {x['min']:+.2f}, max {x['max']:+.2f} over {size}",
        ]
        c = ab.get("control")
        if c:
            lines.append(
                f"  A/A control (both copies unpatched): {c['median']:+.2f} % median, 95 % interval "
                f"[{c['ci95'][0]:+.2f}, {c['ci95'][1]:+.2f}], min {c['min']:+.2f}, max {c['max']:+.2f} over {size}"
            )
    return "\n".join(lines)
