"""The FFN's timing model on the emulated device: calibrated once per run.

The FFN kernel is real tensor work, so on the CPU its wall time follows the
machine (other processes, frequency, thread scheduling). Its *modelled*
duration is fixed for a run instead: for each token count the run uses, a
few isolated timed runs of the real kernel body on an idle device, the
:data:`QUANTILE` of their times times :data:`MARGIN`, so that the kernel
overruns the model only when the machine gets markedly slower than it was
while calibrating (the device counts and the benchmark reports each overrun).
The kernel then runs its real work and holds its stream until the modelled
duration has passed (``camp2p_overlap.emulation.device.launch(model_s=)``).

Isolated runs miss what the run itself costs the kernel: on the CPU the
host and the side streams' worker threads share the cores and the
interpreter with it, more so when the comm ops are overlapped. So the run
can refine the model from its own steps (:func:`refine_in_run`): a few
steps of each schedule it measures with the FFN kernel unheld (a model of
0 s, :func:`measuring`), the device counting each FFN kernel's work; the
model is then the margin times the largest quantile of the isolated runs
and of each schedule's kernels. It stays one duration for every policy, as
a device's FFN takes the same time whether or not communication overlaps
it.

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
from dataclasses import dataclass, field
from typing import Any

import torch

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

    def describe(self) -> str:
        """``FFN calibrated: 412 us at 8 tokens, q0.5 x1.6``."""
        at = ", ".join(f"{p.model_s * 1e6:,.0f} us at {t} tokens" for t, p in sorted(self.points.items()))
        if self.fixed:
            return f"FFN fixed: {at} (--ffn-us)"
        runs = sorted({name for p in self.points.values() for name in p.in_run_s})
        of = f" of isolated runs and the run's {'/'.join(runs)} steps" if runs else " of isolated runs"
        return f"FFN calibrated: {at or 'no token count'}, q{self.quantile:g}{of} x{self.margin:g}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "fixed": self.fixed,
            "quantile": self.quantile,
            "margin": self.margin,
            "points": [
                {
                    "tokens": t,
                    "runs": p.runs,
                    "median_us": round(p.median_s * 1e6, 1),
                    "quantile_us": round(p.quantile_s * 1e6, 1),
                    "model_us": round(p.model_s * 1e6, 1),
                    "in_run_quantile_us": {k: round(v * 1e6, 1) for k, v in sorted(p.in_run_s.items())},
                }
                for t, p in sorted(self.points.items())
            ],
        }


def _quantile(values: list[float], q: float) -> float:
    data = sorted(values)
    return data[min(len(data) - 1, round(q * (len(data) - 1)))]


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
    return Calibrated(tokens, len(times), statistics.median(times), q, q * margin)


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
    """``base`` with its point at ``tokens`` set to the margin times the
    largest quantile of its isolated runs and of each schedule's FFN kernel
    work in ``work_ns`` (schedule name -> ns per kernel; one with no sample
    is left out)."""
    point = base.points[int(tokens)]
    samples = {name: [w / 1e9 for w in ws] for name, ws in work_ns.items()}
    in_run = {name: _quantile(ws, base.quantile) for name, ws in samples.items() if ws}
    slowest = max([point.quantile_s, *in_run.values()])
    refined = Calibrated(point.tokens, point.runs, point.median_s, point.quantile_s, slowest * base.margin, in_run)
    return FFNTiming(base.quantile, base.margin, {**base.points, int(tokens): refined})


def fixed(tokens: int, seconds: float) -> FFNTiming:
    """A model given, not calibrated: ``seconds`` per kernel at ``tokens``
    (a run made comparable to another one: its ``model_us``)."""
    if not seconds > 0:
        raise ValueError(f"a fixed FFN model must be a positive duration, got {seconds!r} s")
    point = Calibrated(int(tokens), 0, seconds, seconds, seconds)
    return FFNTiming(points={int(tokens): point}, fixed=True)
