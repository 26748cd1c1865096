"""PNG plots of a benchmark run and of a sweep (matplotlib, from the
``bench`` extra; imported only when a plot is asked for). Uses matplotlib's
object API with the Agg canvas, so the process-wide pyplot backend is left
alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from camp2p_overlap.core.keys import COMPUTE_STREAM
from camp2p_overlap.core.observe.trace import TraceOp

KIND_COLORS = {"a2e": "#4C72B0", "ffn": "#DD8452", "e2a": "#55A868", "wait": "#C7C7C7"}
POLICY_COLORS = {
    "serial": "#8C8C8C",
    "e2a-only": "#4C72B0",
    "overlap": "#DD8452",
    "compute-side-fixed": "#55A868",
    "comm-side": "#937860",
    "comm-side-fixed": "#DA8BC3",
    "both": "#CCB974",
    "overlap-fixed": "#55A868",  # a report from before the layouts were named
}
#: The work panel's series of graph replays (sweep --graph): fixed overlap's,
#: and adaptive overlap's (both variants, chosen per replay).
GRAPH_COLOR = "#8172B3"
GRAPH_ADAPTIVE_COLOR = "#C44E52"
#: ``graph_report`` policy -> (label, marker, color) of its work-panel series.
GRAPH_SERIES = {
    "compute-side-fixed": ("compute-side-fixed, graph replays", "s", GRAPH_COLOR),
    "comm-side-fixed": ("comm-side-fixed, graph replays", "D", "#64B5CD"),
    "overlap-fixed": ("overlap-fixed, graph replays", "s", GRAPH_COLOR),
    "overlap": ("overlap (adaptive), graph replays", "^", GRAPH_ADAPTIVE_COLOR),
}
#: The work panel's eager series.
WORK_SERIES = ("overlap", "compute-side-fixed", "comm-side-fixed", "overlap-fixed")


class PlotUnavailable(RuntimeError):
    """matplotlib is missing."""


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed: pip install 'camp2p-overlap[bench]'"
        ) from exc
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _stream_order(name: str) -> tuple[int, str]:
    return (0 if name == COMPUTE_STREAM else 1, name)


def bench_plot(timelines: Mapping[str, Sequence[TraceOp]], report: Mapping[str, Any], path: str | Path) -> None:
    """Top: one traced step per policy, one row per stream (A2E, FFN, E2A as
    bars). Bottom: per-layer time per policy (median, p90 whisker) against
    the floor."""
    rows: list[tuple[str, str]] = []
    for policy, ops in timelines.items():
        streams = sorted({o.stream for o in ops if o.kind in ("a2e", "ffn", "e2a")}, key=_stream_order)
        rows.extend((policy, s) for s in streams)
    fig = _figure(11, 2.2 + 0.42 * max(len(rows), 1) + 3.0)
    top, bottom = fig.subplots(2, 1, height_ratios=[max(len(rows), 1) * 0.42 + 0.8, 3.0])

    ylabels = []
    for y, (policy, stream) in enumerate(reversed(rows)):
        ops = timelines[policy]
        steps = [o for o in ops if o.kind == "step"]
        origin = steps[0].start_ns if steps else min((o.start_ns for o in ops), default=0)
        for kind in ("a2e", "ffn", "e2a"):
            spans = [
                ((o.start_ns - origin) / 1e6, max(o.duration_ns, 1) / 1e6)
                for o in ops
                if o.kind == kind and o.stream == stream
            ]
            if spans:
                top.broken_barh(spans, (y - 0.35, 0.7), facecolors=KIND_COLORS[kind], edgecolors="white", linewidth=0.4)
        ylabels.append(f"{policy}  {stream}")
    top.set_yticks(range(len(ylabels)), ylabels)
    top.set_xlabel("time since the step started (ms)")
    top.set_title("one traced step per policy (rows: streams; C = caller's, F = FFN, K_s = stage s)")
    handles = [
        top.bar(0, 0, color=color, label=kind.upper() if kind != "ffn" else "FFN")
        for kind, color in KIND_COLORS.items()
        if kind != "wait"
    ]
    top.legend(handles=handles, loc="upper right", fontsize="small")
    top.set_ylim(-0.7, max(len(rows), 1) - 0.3)

    names = [p["policy"] for p in report["policies"]]
    med = [p["per_layer_us"]["median"] / 1000 for p in report["policies"]]
    p90 = [p["per_layer_us"]["p90"] / 1000 for p in report["policies"]]
    err = [[0] * len(med), [max(b - a, 0) for a, b in zip(med, p90, strict=True)]]
    bars = bottom.bar(
        names, med, yerr=err, capsize=4, color=[POLICY_COLORS.get(n, "#999999") for n in names], width=0.55
    )
    for bar, p, top_y in zip(bars, report["policies"], p90, strict=True):
        label = f"{p['speedup']:.2f}x" + (f"\neta {p['eta']:.2f}" if p["eta"] is not None else "")
        bottom.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, max(bar.get_height(), top_y)),
            ha="center",
            va="bottom",
            xytext=(0, 3),
            textcoords="offset points",
            fontsize="small",
        )
    floor = report["measured"]["floor_per_layer_us"] / 1000
    bottom.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"floor {floor:.2f} ms")
    fd_us = report["measured"].get("floor_fill_drain_per_layer_us")
    if fd_us is not None:
        bottom.axhline(
            fd_us / 1000, color="black", linestyle=":", linewidth=1, label=f"fill/drain floor {fd_us / 1000:.2f} ms"
        )
    bottom.set_ylabel("per-layer time (ms), median; whisker p90")
    bottom.legend(loc="upper right", fontsize="small")
    bottom.set_ylim(0, max([*p90, floor]) * 1.3)
    title = f"camp2p-overlap bench ({report['device']}, {report['scenario'] or 'custom'})"
    fig.suptitle(title)
    fig.savefig(str(path), format="png", dpi=110)


def sweep_plot(sweep: Mapping[str, Any], path: str | Path) -> None:
    """Per-layer time against (a+e)/f, the number of stages and the comm
    cores; speedup against the work size."""
    work = sweep.get("work_points") or []
    specs = [
        ("ratio_points", "measured_ratio", "measured (a+e)/f (communication / FFN compute)"),
        ("stage_points", "stages", "stages (micro-batches) per step"),
        ("comm_core_points", "comm_cores", "cores each comm op keeps busy (--comm-cores)"),
    ]
    specs = [spec for spec in specs if sweep.get(spec[0])]
    panels = max(len(specs) + bool(work), 1)
    fig = _figure(5.5 * panels, 4.2)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    for ax, (key, xkey, xlabel) in zip(axes, specs, strict=False):
        points: Sequence[Mapping[str, Any]] = sweep[key]
        xs = [pt[xkey] for pt in points]
        policies = [p["policy"] for p in points[0]["report"]["policies"]]
        for policy in policies:
            ys = [
                next(p for p in pt["report"]["policies"] if p["policy"] == policy)["per_layer_us"]["median"] / 1000
                for pt in points
            ]
            ax.plot(xs, ys, marker="o", label=policy, color=POLICY_COLORS.get(policy))
        floors = [pt["report"]["measured"]["floor_per_layer_us"] / 1000 for pt in points]
        ax.plot(xs, floors, linestyle="--", color="black", linewidth=1, label="floor")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("per-layer time (ms), median")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        if xkey != "measured_ratio":
            ax.set_xticks(sorted(set(xs)))
    if work:
        _work_panel(axes[-1], work)
    fig.suptitle("camp2p-overlap sweep")
    fig.savefig(str(path), format="png", dpi=110)


def _work_panel(ax: Any, points: Sequence[Mapping[str, Any]]) -> None:
    """Speedup over serial against tokens per stage: fixed and adaptive overlap
    (and with ``sweep --graph`` their graphs' replays over serial's)."""
    from camp2p_overlap.tools.bench.sweep import ADAPTIVE_FLOOR, GRAPH_ADAPTIVE_FLOOR

    any_graphed = False
    for hidden, style in zip(sorted({pt["hidden"] for pt in points}), ("-", "--", ":", "-."), strict=False):
        series = [pt for pt in points if pt["hidden"] == hidden]
        xs = [pt["tokens"] for pt in series]
        for policy in WORK_SERIES:
            ys = [
                next((p["speedup"] for p in pt["report"]["policies"] if p["policy"] == policy), None) for pt in series
            ]
            if any(y is not None for y in ys):
                label = f"{'overlap (adaptive)' if policy == 'overlap' else policy}, hidden {hidden}"
                ax.plot(xs, ys, marker="o", linestyle=style, label=label, color=POLICY_COLORS.get(policy))
        graphed = [pt for pt in series if "graph_report" in pt]
        for policy, (label, marker, color) in GRAPH_SERIES.items():
            # sweep --graph: the policy's replays over serial's replays
            ys = [
                next((p["speedup"] for p in pt["graph_report"]["policies"] if p["policy"] == policy), None)
                for pt in graphed
            ]
            if any(y is not None for y in ys):
                any_graphed = True
                ax.plot(
                    [pt["tokens"] for pt in graphed],
                    ys,
                    marker=marker,
                    linestyle=style,
                    label=f"{label}, hidden {hidden}",
                    color=color,
                )
    ax.axhline(1.0, color="black", linewidth=1, label="serial")
    ax.axhline(
        ADAPTIVE_FLOOR, color="grey", linewidth=1, linestyle=":", label=f"{ADAPTIVE_FLOOR:g}x (goal for adaptive)"
    )
    if any_graphed:
        ax.axhline(
            GRAPH_ADAPTIVE_FLOOR,
            color=GRAPH_ADAPTIVE_COLOR,
            linewidth=1,
            linestyle=":",
            label=f"{GRAPH_ADAPTIVE_FLOOR:g}x (goal for its graph)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per stage (work per layer and stage)")
    ax.set_ylabel("speedup over serial (median per-layer time)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
