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
adaptive engage decided for serial: the original path under our
wrappers). Each timed step of a block gives one sample: its time minus the
median unpatched step time of the same round, divided by the (layer,
stage) count (engaged) or by the wrapped calls of the step (pass-through:
``_ffn_forward`` once plus a receive and a send per (layer, stage)).
Figures are medians and 90th percentiles of those samples; the garbage
collector stays on, so its pauses count where our allocations cause them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from camp2p_overlap.core.config import MAX_REPROBE, MAX_STAGES, OverlapConfig
from camp2p_overlap.core.layer import Layer
from camp2p_overlap.core.overlap.step import bucket_of
from camp2p_overlap.core.overlap.streams.streamset import StreamSetRegistry
from camp2p_overlap.emulation.moe import MoEShape
from camp2p_overlap.emulation.noop import NoopModel, NoopTransport, noop_backend
from camp2p_overlap.emulation.standin_layer import emulated_layer, release_site, standin_site
from camp2p_overlap.emulation.world import World, WorldSpec, build_world

PATHS = ("engaged", "pass-through")
SCHEMA = "camp2p-overlap/overhead/v1"


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

    def validate(self) -> None:
        if not self.layers or any(n < 1 for n in self.layers):
            raise ValueError(f"layer counts must be >= 1, got {self.layers}")
        if not self.stages or any(not 1 <= n <= MAX_STAGES for n in self.stages):
            raise ValueError(f"stage counts must lie in 1..{MAX_STAGES}, got {self.stages}")
        if self.steps < 5 or self.rounds < 1 or self.warmup < 0:
            raise ValueError("need steps >= 5, rounds >= 1 and warmup >= 0")
        if self.delay_us < 0:
            raise ValueError(f"delay_us must be >= 0, got {self.delay_us}")


def _figure(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"median": round(statistics.median(ordered), 3), "p90": round(p90, 3), "samples": len(ordered)}


def _noop_world(layers: int, stages: int, delay_us: float, root: str) -> World:
    world = build_world(
        WorldSpec(layers=layers, stage_ids=tuple(range(stages)), tokens=1, shape=MoEShape(hidden=16)), root=root
    )
    world.connector.transport = world.transport = NoopTransport(delay_s=delay_us / 1e6)  # type: ignore[assignment]
    world.runner.model = NoopModel()
    return world


def _engaged_config() -> OverlapConfig:
    return OverlapConfig(enabled=True, backend="cpu", min_stages=1, adaptive=False)


def _passthrough_config() -> OverlapConfig:
    return OverlapConfig(enabled=True, backend="cpu", min_stages=1, adaptive=True, reprobe_every=MAX_REPROBE)


def _decide_serial(layer: Layer, world: World) -> None:
    """Teach the layer's adaptive engage that serial is faster for this
    shape, so that every step takes the pass-through path (no probe runs:
    the re-probe interval is the largest allowed)."""
    runtime = layer.runtime
    key = bucket_of(runtime.runner_name(world.runner), len(world.layer_list()), world.dp_metadata())
    for _ in range(4 * runtime.adaptive.settings.min_samples + 4):
        if runtime.adaptive.decision(key) is not None:
            break
        mode, _ = runtime.adaptive.choose(key)
        runtime.adaptive.record(key, mode, 1.0 if mode == "overlap" else 0.5)
    if runtime.adaptive.decision(key) != "serial":
        raise RuntimeError("the overhead harness could not set the pass-through decision")


def _time_block(step: Callable[[], Any], warmup: int, steps: int) -> list[int]:
    for _ in range(warmup):
        step()
    clock = time.perf_counter_ns
    times = []
    for _ in range(steps):
        t0 = clock()
        step()
        times.append(clock() - t0)
    return times


def _measure_shape(params: OverheadParams, layers: int, stages: int, root: str, manifest: Any) -> dict[str, Any]:
    world = _noop_world(layers, stages, params.delay_us, root)
    dp = world.dp_metadata()

    def step() -> None:
        world.runner._ffn_forward(dp_metadata_list=dp)

    pairs = layers * stages
    calls = 1 + 2 * pairs
    samples: dict[str, list[float]] = {p: [] for p in PATHS}
    base_medians: list[float] = []
    engines = {"engaged": emulated_layer(), "pass-through": emulated_layer()}
    for layer in engines.values():
        layer.runtime.streamsets = StreamSetRegistry(range(MAX_STAGES), make=noop_backend)
    _decide_serial(engines["pass-through"], world)
    configs = {"engaged": _engaged_config(), "pass-through": _passthrough_config()}
    order = ["unpatched", *PATHS]
    for r in range(params.rounds):
        times: dict[str, list[int]] = {}
        for name in order[r % 3 :] + order[: r % 3]:
            layer = engines.get(name)
            if layer is not None:
                layer.engine.apply(config=configs[name], manifest=manifest, strict=True)
            try:
                times[name] = _time_block(step, params.warmup, params.steps)
            finally:
                if layer is not None and not layer.engine.unpatch(timeout=30.0):
                    raise RuntimeError("the overhead harness could not unpatch its engine")
        base = statistics.median(times["unpatched"])
        base_medians.append(base)
        samples["engaged"] += [(t - base) / 1e3 / pairs for t in times["engaged"]]
        samples["pass-through"] += [(t - base) / 1e3 / calls for t in times["pass-through"]]
    counters = engines["engaged"].runtime.counters.to_dict()["steps"]
    passed = engines["pass-through"].runtime.counters.to_dict()["steps"]
    expected = params.rounds * (params.warmup + params.steps)
    if counters["overlap"] != expected or passed["serial"] != expected or passed["overlap"]:
        raise RuntimeError(f"the paths were not taken as planned: engaged {counters}, pass-through {passed}")
    return {
        "layers": layers,
        "stages": stages,
        "wrapped_calls_per_step": calls,
        "unpatched_us_per_layer_stage": round(statistics.median(base_medians) / 1e3 / pairs, 3),
        "engaged_us_per_layer_stage": _figure(samples["engaged"]),
        "passthrough_us_per_call": _figure(samples["pass-through"]),
        "_samples": samples,
    }


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
    finally:
        release_site(site)
    shape_samples = [s.pop("_samples") for s in shapes]
    pooled = {p: [x for samples in shape_samples for x in samples[p]] for p in PATHS}
    return {
        "schema": SCHEMA,
        "engaged_us_per_layer_stage": _figure(pooled["engaged"]),
        "passthrough_us_per_call": _figure(pooled["pass-through"]),
        "shapes": shapes,
        "params": asdict(params),
        "wall_s": round(time.perf_counter() - wall0, 2),
    }


def format_overhead(result: dict[str, Any]) -> str:
    """The result as the table ``camp2p-overlap overhead`` prints."""
    e, p = result["engaged_us_per_layer_stage"], result["passthrough_us_per_call"]
    lines = [
        "host cost of camp2p-overlap's own code (no-op device, transport and FFN)",
        f"  engaged:      {e['median']:.2f} us per (layer, stage), p90 {e['p90']:.2f}",
        f"  pass-through: {p['median']:.2f} us per wrapped call, p90 {p['p90']:.2f}",
        "",
        f"{'layers':>6} {'stages':>6} {'loop us/(L,s)':>14} {'engaged med':>12} {'p90':>8} {'pass med':>9} {'p90':>8}",
    ]
    for s in result["shapes"]:
        se, sp = s["engaged_us_per_layer_stage"], s["passthrough_us_per_call"]
        lines.append(
            f"{s['layers']:>6} {s['stages']:>6} {s['unpatched_us_per_layer_stage']:>14.2f} "
            f"{se['median']:>12.2f} {se['p90']:>8.2f} {sp['median']:>9.2f} {sp['p90']:>8.2f}"
        )
    return "\n".join(lines)
