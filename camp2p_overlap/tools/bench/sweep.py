"""``camp2p-overlap sweep``: per-layer time of each policy against the ratio
of communication to FFN compute, and against the number of stages.

The ratio is set through the modeled link: the FFN time f is measured once
(a short serial run of the same world), then for each target ratio r the
link bandwidth is chosen so that the modeled A2E + E2A of one (layer, stage)
takes r * f. The table reports the ratio measured on each run's serial
trace next to the target.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from camp2p_overlap.tools.bench.report import CPU_CAVEAT, fmt_time
from camp2p_overlap.tools.bench.runner import BenchParams, run_bench

DEFAULT_RATIOS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
DEFAULT_STAGE_COUNTS = (1, 2, 3)
DEFAULT_STAGE_RATIO = 0.5
#: Smaller runs than the benchmark's own, on top of the scenario preset.
SWEEP_DEFAULTS: dict[str, Any] = {"layers": 4, "steps": 5, "warmup": 1, "reps": 2}


def link_for_ratio(params: BenchParams, f_s: float, ratio: float) -> tuple[float, float]:
    """(latency us, Gbit/s) making the modeled A2E + E2A of one (layer,
    stage) take ``ratio * f_s``. A2E moves tokens x hidden; E2A moves the
    routed and the shared expert outputs (twice that)."""
    itemsize = 4 if params.device == "cpu" else 2
    bytes_a = params.tokens * params.hidden * itemsize
    bytes_total = 3 * bytes_a
    target = ratio * f_s
    latency_s = min(params.link_latency_us * 1e-6, 0.2 * target / 2)
    transfer = target - 2 * latency_s
    gbps = bytes_total * 8 / transfer / 1e9
    return latency_s * 1e6, gbps


def _calibrate_f(base: BenchParams) -> float:
    probe = replace(base, policies=("serial",), steps=2, warmup=1, reps=1)
    return run_bench(probe).report["measured"]["f_us"] * 1e-6


def run_sweep(
    base: BenchParams,
    *,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    stage_counts: Sequence[int] = DEFAULT_STAGE_COUNTS,
    stage_ratio: float = DEFAULT_STAGE_RATIO,
    progress: bool = False,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    """Run every point; returns ``{"base", "f_calibration_us", "ratio_points",
    "stage_points", "wall_s"}`` with each point's full benchmark report."""
    t0 = time.perf_counter()
    f_s = _calibrate_f(base)
    total = len(ratios) + len(stage_counts)
    done = 0

    def point(params: BenchParams, label: str) -> dict[str, Any]:
        nonlocal done
        done += 1
        if log is not None and progress and log.isatty():
            print(f"[{done}/{total}] {label}", file=log, flush=True)
        return run_bench(params).report

    ratio_points = []
    for r in ratios:
        lat, gbps = link_for_ratio(base, f_s, r)
        params = replace(base, link_latency_us=round(lat, 3), link_gbps=round(gbps, 6))
        report = point(params, f"(a+e)/f = {r:g}, {base.stages} stages")
        ratio_points.append(
            {
                "target_ratio": r,
                "measured_ratio": report["measured"]["comm_over_ffn"],
                "stages": base.stages,
                "report": report,
            }
        )
    stage_points = []
    for s in stage_counts:
        lat, gbps = link_for_ratio(base, f_s, stage_ratio)
        params = replace(base, stages=s, link_latency_us=round(lat, 3), link_gbps=round(gbps, 6))
        report = point(params, f"{s} stage(s), (a+e)/f = {stage_ratio:g}")
        stage_points.append(
            {
                "target_ratio": stage_ratio,
                "measured_ratio": report["measured"]["comm_over_ffn"],
                "stages": s,
                "report": report,
            }
        )
    return {
        "schema": "camp2p-overlap/sweep/v1",
        "base": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(base).items()},
        "f_calibration_us": round(f_s * 1e6, 3),
        "ratio_points": ratio_points,
        "stage_points": stage_points,
        "wall_s": round(time.perf_counter() - t0, 3),
    }


def _policy(report: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    return next((p for p in report["policies"] if p["policy"] == name), None)


def _cells(report: Mapping[str, Any], policies: Sequence[str]) -> list[str]:
    cells = []
    for name in policies:
        p = _policy(report, name)
        cells.append(fmt_time(p["per_layer_us"]["median"]) if p else "-")
    cells.append(fmt_time(report["measured"]["floor_per_layer_us"]))
    for name in policies:
        if name == "serial":
            continue
        p = _policy(report, name)
        if p is None:
            cells.append("-")
            continue
        eta = "-" if p["eta"] is None else f"{p['eta']:.2f}"
        cells.append(f"{p['speedup']:.2f}x / {eta}")
    cells.append("yes" if report["outputs_equal"] else "NO")
    return cells


def sweep_markdown(sweep: Mapping[str, Any], command: str | None = None) -> str:
    """The sweep as Markdown tables."""
    points = sweep["ratio_points"] or sweep["stage_points"]
    policies = [p["policy"] for p in points[0]["report"]["policies"]] if points else []
    others = [p for p in policies if p != "serial"]
    head = [f"{p} per layer" for p in policies] + ["floor"] + [f"{p} speedup / eta" for p in others] + ["outputs equal"]
    base = sweep["base"]
    lines = []
    if command:
        lines += [f"Command: `{command}`", ""]
    lines.append(
        f"Base: {base['layers']} FFN layers, {base['tokens']} tokens per stage, MoE hidden {base['hidden']}, "
        f"ffn {base['ffn']}, {base['experts']} experts, top-{base['top_k']}, attention {base['attn_us']:g} us, "
        f"{base['reps']} reps x {base['steps']} steps, device {base['device']}, torch threads {base['threads']}; "
        f"f calibrated at {fmt_time(sweep['f_calibration_us'])} per (layer, stage)."
    )
    tables = (
        (
            "ratio_points",
            "(a+e)/f target",
            lambda pt: f"{pt['target_ratio']:g}",
            lambda pts: f"Per-layer time against communication / FFN compute ({pts[0]['stages']} stages):",
        ),
        (
            "stage_points",
            "stages",
            lambda pt: str(pt["stages"]),
            lambda pts: f"Per-layer time against the number of stages ((a+e)/f target {pts[0]['target_ratio']:g}):",
        ),
    )
    for key, first_col, first_cell, title in tables:
        pts = sweep[key]
        if not pts:
            continue
        lines += [
            "",
            title(pts),
            "",
            f"| {first_col} | (a+e)/f measured | " + " | ".join(head) + " |",
            "|" + " --- |" * (len(head) + 2),
        ]
        for pt in pts:
            measured = "-" if pt["measured_ratio"] is None else f"{pt['measured_ratio']:.2f}"
            row = [first_cell(pt), measured, *_cells(pt["report"], policies)]
            lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "With 1 stage there is nothing to overlap with: the patch layer does not engage (minimum 2 stages) "
        "and every policy runs the serial path.",
        CPU_CAVEAT,
    ]
    return "\n".join(lines) + "\n"
