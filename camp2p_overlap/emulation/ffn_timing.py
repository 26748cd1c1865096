"""The FFN's timing model on the emulated device: rated from its shape.

The FFN kernel is real tensor work, so on the CPU its wall time follows the
machine (other processes, frequency, thread scheduling, and this machine's
speed, which drifts by tens of per cent in stretches of a second). Its
*modelled* duration is fixed instead, so that a run's times hold still:

* **Rated** (the default): the emulated device's cost of the kernel's shape
  (:func:`rated_s`: a fixed cost per kernel, its weights and activations
  read, its arithmetic; :data:`RATE`), the same on every run and every
  machine. A rating is an emulated device's speed, not this CPU's: it is
  set 1.6-2.5 times what the reference 2-core machine takes, so that the
  real work fits under it with room for the in-run slowdowns and the CPU's
  slower stretches.
* **Calibrated**, where this machine cannot hold the rating: a few
  isolated timed runs of the real kernel body, the :data:`QUANTILE` of
  their times times :data:`MARGIN`. A point is calibrated when its
  isolated runs' median, or a schedule's in the run (:func:`refine_in_run`),
  times :data:`HOLD` exceeds its rating; the benchmark says so, as such a
  run's times follow this machine's speed.

The kernel then runs its real work and holds its stream until the modelled
duration has passed (``camp2p_overlap.emulation.device.launch(model_s=)``);
a kernel that overruns is counted and the benchmark reports it.

Isolated runs miss what the run itself costs the kernel: on the CPU the
host and the side streams' worker threads share the cores and the
interpreter with it, more so when the comm ops are overlapped. So the run
checks the model against its own steps (:func:`refine_in_run`): a few
steps of each schedule it measures with the FFN kernel unheld (a model of
0 s, :func:`measuring`), the device counting each FFN kernel's work. It
stays one duration for every policy, as a device's FFN takes the same time
whether or not communication overlaps it.

Each timed run follows an idle gap as long as the run before it (at least
:data:`MIN_GAP_S`): in a step the FFN kernel runs after its stream held or
waited, on a core that went idle, and such a run is measurably slower (on
the reference 2-core machine 20-40 % at small work) than one of a
back-to-back loop, which would set the model too short.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch


@dataclass(frozen=True)
class Rate:
    """The emulated device's FFN cost (microseconds): its dispatch terms, per
    kernel and per routed expert its tokens may pick (each one's own ops),
    times :attr:`dispatch_scale`; its data terms, per MB of weights read
    (the router's, each routed expert's a token may pick, the shared
    expert's), per MB of activations (each routed and shared row's gate/up,
    product and output) and per MFLOP, times :attr:`data_scale`."""

    kernel_us: float = 200.0
    picked_expert_us: float = 40.0
    weights_us_per_mb: float = 150.0
    activations_us_per_mb: float = 470.0
    us_per_mflop: float = 16.0
    #: Dispatch is what the side streams' threads slow most on the CPU (the
    #: interpreter and the cores are shared): the larger room.
    dispatch_scale: float = 2.5
    data_scale: float = 1.6


#: The rating: its terms are a fit of the kernel body's median times on the
#: reference 2-core machine (20 shapes, 1-128 tokens, hidden 16-512, ffn
#: 128-1024, 4-8 experts, top-2; within 0.6-1.3x of each, the per-expert
#: term raised to what small shapes cost beside the side streams' threads),
#: with room for the tail and for the CPU's slower stretches.
RATE = Rate()
#: A point keeps its rating while its medians (isolated, and each
#: schedule's in the run) times HOLD stay within it.
HOLD = 1.25
#: The quantile of the calibration runs the model starts from: the median,
#: the statistic that holds still from run to run (on the reference 2-core
#: machine the FFN's median moved 2 % between an idle and a loaded run, its
#: 0.9-quantile 29 %), so that a run's modelled times do too ...
QUANTILE = 0.5
#: ... and the factor it is multiplied by: room for the tail (an idle
#: machine's 0.9-quantile runs 1.1-1.2x its median) and for the slower
#: stretches of a CPU, which overrun the model and are reported.
MARGIN = 1.6
#: Calibration runs per token count: at least MIN_RUNS, more while under
#: CALIBRATION_S seconds, at most MAX_RUNS; WARMUP runs before, not timed.
MIN_RUNS = 20
MAX_RUNS = 200
CALIBRATION_S = 0.3
WARMUP = 3
#: The idle gap before each timed run: as long as the run before, at least
#: this and at most MAX_GAP_S (seconds).
MIN_GAP_S = 200e-6
MAX_GAP_S = 5e-3


@dataclass(frozen=True)
class Calibrated:
    """One token count's calibration: its runs' times and the model (s)."""

    tokens: int
    runs: int
    median_s: float
    quantile_s: float
    model_s: float
    #: The point's rating (seconds; None: not rated, a device tensor's FFN) ...
    rated_s: float | None = None
    #: ... and why the model is not it (empty: it is).
    calibrated_why: str = ""
    #: The quantile of the FFN kernels' work in the run's own steps, per
    #: schedule (seconds; empty: not refined in the run).
    in_run_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class FFNTiming:
    """The modelled duration of the FFN kernel per token count."""

    quantile: float = QUANTILE
    margin: float = MARGIN
    points: Mapping[int, Calibrated] = field(default_factory=dict)
    #: Given, not calibrated (:func:`fixed`: ``bench --ffn-us``).
    fixed: bool = False

    def model_s(self, tokens: int) -> float | None:
        """The modelled seconds of a kernel over ``tokens`` rows (None: not
        calibrated for it; the kernel then runs on the wall clock)."""
        point = self.points.get(int(tokens))
        return None if point is None else point.model_s

    @property
    def rated(self) -> bool:
        """Every point takes its rating (the run's times hold still)."""
        return (
            bool(self.points)
            and not self.fixed
            and all(p.rated_s is not None and not p.calibrated_why for p in self.points.values())
        )

    def describe(self) -> str:
        """``FFN rated: 908 us at 8 tokens (its kernel's median here: 430 us)``,
        or ``FFN calibrated: ...`` and why."""
        if self.fixed:
            at = ", ".join(f"{p.model_s * 1e6:,.0f} us at {t} tokens" for t, p in sorted(self.points.items()))
            return f"FFN fixed: {at} (--ffn-us)"
        parts = []
        for t, p in sorted(self.points.items()):
            checked = "/".join(sorted(p.in_run_s))
            if p.rated_s is not None and not p.calibrated_why:
                held = f"; held in the run's {checked} steps" if checked else ""
                here = f"its kernel's median here: {p.median_s * 1e6:,.0f} us{held}"
                parts.append(f"rated {p.model_s * 1e6:,.0f} us at {t} tokens ({here})")
            else:
                of = f" of isolated runs and the run's {checked} steps" if checked else " of isolated runs"
                why = f" ({p.calibrated_why})" if p.calibrated_why else ""
                parts.append(
                    f"calibrated {p.model_s * 1e6:,.0f} us at {t} tokens, q{self.quantile:g}{of} x{self.margin:g}{why}"
                )
        return "FFN " + ("; ".join(parts) or "no token count")

    def to_dict(self) -> dict[str, Any]:
        return {
            "fixed": self.fixed,
            "rated": self.rated,
            "rate": asdict(RATE),
            "hold": HOLD,
            "quantile": self.quantile,
            "margin": self.margin,
            "points": [
                {
                    "tokens": t,
                    "runs": p.runs,
                    "median_us": round(p.median_s * 1e6, 1),
                    "quantile_us": round(p.quantile_s * 1e6, 1),
                    "model_us": round(p.model_s * 1e6, 1),
                    "rated_us": None if p.rated_s is None else round(p.rated_s * 1e6, 1),
                    "calibrated_why": p.calibrated_why,
                    "in_run_quantile_us": {k: round(v * 1e6, 1) for k, v in sorted(p.in_run_s.items())},
                }
                for t, p in sorted(self.points.items())
            ],
        }


def _quantile(values: list[float], q: float) -> float:
    data = sorted(values)
    return data[min(len(data) - 1, round(q * (len(data) - 1)))]


def rated_s(moe: Any, tokens: int, rate: Rate = RATE) -> float | None:
    """The emulated device's duration of ``moe``'s kernel over ``tokens``
    rows (seconds; None for weights off the CPU: a device times its own)."""
    ref = moe.groups[0]["router"]
    if ref.device.type != "cpu":
        return None
    return rated_shape_s(moe.shape, tokens, ref.element_size(), rate)


def rated_shape_s(shape: Any, tokens: int, itemsize: int = 4, rate: Rate = RATE) -> float:
    """:func:`rated_s` of a ``MoEShape`` (``itemsize`` bytes per element)."""
    s = shape
    t, h, f = int(tokens), s.hidden, s.ffn
    expert = h * 2 * f + f * h  # gate/up and down, elements
    picked = min(s.experts, t * s.top_k)
    weights = h * s.experts + picked * expert + (expert if s.shared_expert else 0)
    rows = t * s.top_k + (t if s.shared_expert else 0)
    activations = rows * (2 * f + f + h)
    flops = 2 * t * h * s.experts + 2 * rows * expert
    dispatch = rate.kernel_us + rate.picked_expert_us * picked
    data = (
        rate.weights_us_per_mb * weights * itemsize / 1e6
        + rate.activations_us_per_mb * activations * itemsize / 1e6
        + rate.us_per_mflop * flops / 1e6
    )
    return (rate.dispatch_scale * dispatch + rate.data_scale * data) * 1e-6


def _held_why(rated: float, median_s: float, what: str) -> str:
    """Why a rating is not held (empty: it is): ``what``'s median times HOLD over it."""
    if median_s * HOLD <= rated:
        return ""
    return (
        f"its rating of {rated * 1e6:,.0f} us is not held on this machine ({what} median {median_s * 1e6:,.0f} us "
        f"x{HOLD:g}); its times follow this machine's speed"
    )


def calibrate_point(moe: Any, tokens: int, *, quantile: float = QUANTILE, margin: float = MARGIN) -> Calibrated:
    """Time ``moe``'s kernel body (its arithmetic and the copies into its
    outputs, :meth:`MoEFFN.kernel_body`) on the calling thread over ``tokens``
    rows of seeded inputs, cycling through its layer groups, each run after
    an idle gap (module docstring)."""
    hidden = moe.shape.hidden
    ref = moe.groups[0]["router"]
    g = torch.Generator().manual_seed(1_000_003 + tokens)
    inputs = [torch.randn(tokens, hidden, generator=g).to(device=ref.device, dtype=ref.dtype) for _ in range(4)]
    outputs = [torch.empty_like(inputs[0]), torch.empty_like(inputs[0])]
    groups = len(moe.groups)
    times: list[float] = []
    spent = 0.0
    dt = 0.0
    i = 0
    while i < WARMUP + MAX_RUNS and (i < WARMUP + MIN_RUNS or spent < CALIBRATION_S):
        x = inputs[i % len(inputs)]
        time.sleep(min(MAX_GAP_S, max(MIN_GAP_S, dt)))
        t0 = time.perf_counter()
        moe.kernel_body(x, i % groups, outputs[0], outputs[1] if moe.shape.shared_expert else None)
        dt = time.perf_counter() - t0
        if i >= WARMUP:
            times.append(dt)
            spent += dt
        i += 1
    q = _quantile(times, quantile)
    median = statistics.median(times)
    rated = rated_s(moe, tokens)
    if rated is None:
        return Calibrated(tokens, len(times), median, q, q * margin)
    why = _held_why(rated, median, "the isolated runs'")
    return Calibrated(tokens, len(times), median, q, q * margin if why else rated, rated, why)


def calibrate_ffn(
    moe: Any,
    tokens: Iterable[int],
    *,
    quantile: float = QUANTILE,
    margin: float = MARGIN,
    base: FFNTiming | None = None,
) -> FFNTiming:
    """The FFN's model for every token count in ``tokens`` (those ``base``
    already has are kept). Call it with the device idle."""
    if base is not None:  # one model per run: the base's quantile and margin
        quantile, margin = base.quantile, base.margin
    if not 0 < quantile <= 1 or not margin >= 1:
        raise ValueError(f"quantile must be in (0, 1] and margin at least 1, got {quantile}, {margin}")
    points = dict(base.points) if base is not None else {}
    for n in sorted({int(t) for t in tokens}):
        if n < 1:
            raise ValueError(f"token counts must be at least 1, got {n}")
        if n not in points:
            points[n] = calibrate_point(moe, n, quantile=quantile, margin=margin)
    return FFNTiming(quantile, margin, points)


def measuring(tokens: Iterable[int]) -> FFNTiming:
    """A model of 0 s at each of ``tokens``: the kernel is counted by the
    device (its work, ``take_timing().kinds["ffn"].work_ns``) but never held."""
    return FFNTiming(points={int(t): Calibrated(int(t), 0, 0.0, 0.0, 0.0) for t in tokens})


def refine_in_run(base: FFNTiming, tokens: int, work_ns: Mapping[str, Iterable[int]]) -> FFNTiming:
    """``base`` with its point at ``tokens`` checked against each schedule's
    FFN kernel work in ``work_ns`` (schedule name -> ns per kernel; one with
    no sample is left out): a rated point keeps its rating while each
    schedule's median times :data:`HOLD` is within it; otherwise the model
    is the margin times the largest quantile of its isolated runs and of
    each schedule's kernels."""
    point = base.points[int(tokens)]
    samples = {name: [w / 1e9 for w in ws] for name, ws in work_ns.items()}
    in_run = {name: _quantile(ws, base.quantile) for name, ws in samples.items() if ws}
    why = point.calibrated_why
    if point.rated_s is not None and not why:
        for name, ws in sorted(samples.items()):
            why = why or (_held_why(point.rated_s, statistics.median(ws), f"the run's {name} kernels'") if ws else "")
    if point.rated_s is not None and not why:
        model = point.rated_s
    else:
        model = max([point.quantile_s, *in_run.values()]) * base.margin
    refined = replace(point, model_s=model, calibrated_why=why, in_run_s=in_run)
    return FFNTiming(base.quantile, base.margin, {**base.points, int(tokens): refined})


def fixed(tokens: int, seconds: float) -> FFNTiming:
    """A model given, not calibrated: ``seconds`` per kernel at ``tokens``
    (a run made comparable to another one: its ``model_us``)."""
    if not seconds > 0:
        raise ValueError(f"a fixed FFN model must be a positive duration, got {seconds!r} s")
    point = Calibrated(int(tokens), 0, seconds, seconds, seconds)
    return FFNTiming(points={int(tokens): point}, fixed=True)
