"""``camp2p-overlap sweep``: per-layer time of each policy against the ratio
of communication to FFN compute, against the number of stages, and against
the cores each communication op keeps busy (``--comm-cores``: how speedup
and eta fall as communication takes compute), and against the work per
(layer, stage) (tokens per stage, from 1 up to the preset's), where fixed
and adaptive overlap run side by side so the crossover shows. With
``work_graph`` (``sweep --graph``) every work point is measured in graph mode
too (``bench --graph``: each policy's step captured once, adaptive
``overlap``'s with both variants, replays timed), reported as its
``graph_report`` next to the eager ``report``. Every point runs both
layouts (compute-side and comm-side) side by side: the base's policies at
the ratio, stage and contention points (the bench's default set), and
:data:`WORK_POLICIES` at the work points (on ``--device cpu`` a graph
point leaves comm-side out: the emulated device, as ``torch.npu``, refuses
comm captured on side streams; the table says so).

Timing (``--timing``, docs/benchmark.md, "Timing model"): every point runs
with the base's timing model, the ratio and stage points with the FFN held
to the model of the f calibration run (``--ffn-us``), so f is the same at
every point, each work point calibrating its own; except the contention
points, which run with wall-clock kernels unless
``--timing`` says otherwise: ``--comm-cores N`` measures what the comm
cores' busy-wait takes from the FFN, which a modelled FFN would hide, and
the point at 0 runs like the others of its table.

The ratio is set through the modeled link: the FFN time f is measured once
(a short serial run of the same world), then for each target ratio r the
link bandwidth is chosen so that the modeled A2E + E2A of one (layer, stage)
takes r * f. The table reports the ratio measured on each run's serial
trace next to the target.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from camp2p_overlap.core.log import logger
from camp2p_overlap.emulation.ffn_timing import rated_shape_s
from camp2p_overlap.emulation.moe import MoEShape
from camp2p_overlap.tools.bench.runner import BenchParams, link_for_ratio, run_bench
from camp2p_overlap.tools.bench.tables import CPU_CAVEAT, fmt_time
from camp2p_overlap.tools.provenance import report_env

DEFAULT_RATIOS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
DEFAULT_STAGE_COUNTS = (1, 2, 3)
DEFAULT_STAGE_RATIO = 0.5
#: ``--comm-cores`` of the contention points, per device (CPU: busy threads
#: on a 2-core reference machine; CUDA: SMs of 132 on an H200).
DEFAULT_COMM_CORES = {"cpu": (0, 1, 2), "cuda": (0, 8, 32, 96), "npu": ()}
#: Tokens per stage of the work-size points, for each hidden size: the
#: preset's MoE and link bandwidth, with no link latency and no attention
#: time, so that the work per (layer, stage), compute and transfer alike,
#: grows with the tokens and the side streams' fixed costs show at the low end.
DEFAULT_WORK_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_WORK_HIDDEN = (16, 512)
#: What a work-size point sets on the base besides its tokens and hidden size.
WORK_POINT_CHANGES: dict[str, Any] = {"link_latency_us": 0.0, "attn_us": 0.0}
WORK_POLICIES = ("serial", "overlap", "compute-side-fixed", "comm-side-fixed")
#: The work-size points run at least the benchmark's own step counts: adaptive
#: engage learns in a bucket's first 7 steps, which should not dominate.
WORK_MIN_RUN = {"steps": 8, "warmup": 2, "reps": 3}
#: Small work points run more timed steps per policy, about WORK_TIMED_S
#: seconds in all (at a few ms per step, 24 steps leave the medians a few per
#: cent apart by noise alone), in short interleaved blocks: about
#: WORK_BLOCK_S seconds of steps per policy and repetition (at least
#: WORK_MIN_RUN's steps, at most WORK_MAX_STEPS), in up to WORK_MAX_REPS
#: repetitions. On a shared 2-core machine the speed drifts between blocks;
#: many short blocks spread that drift over every policy alike.
WORK_TIMED_S = 0.75
WORK_BLOCK_S = 0.09
WORK_MAX_STEPS = 36
WORK_MAX_REPS = 8
#: The goal for adaptive engage: never below this share of serial's speed.
ADAPTIVE_FLOOR = 0.97
#: The goal for adaptive ``overlap``'s decode graph (both variants, chosen
#: per replay) against serial's graph, at every work point (reported only).
GRAPH_ADAPTIVE_FLOOR = 0.97
#: Why the contention points run wall-clock kernels (unless --timing says otherwise).
CONTENTION_TIMING = (
    "the contention points: --comm-cores measures what the comm cores' busy-wait takes from the FFN, which a "
    "modelled FFN would hide under its margin; the point at 0 runs as the others do"
)
#: Smaller runs than the benchmark's own, on top of the scenario preset.
SWEEP_DEFAULTS: dict[str, Any] = {"layers": 4, "steps": 5, "warmup": 1, "reps": 2}


def modelled_serial_step_s(params: BenchParams) -> float | None:
    """A serial step's time on the modelled timeline, from the FFN's rating
    and the link model (None: the point's kernels are not modelled)."""
    if params.timing_mode()[0] != "model" or params.ffn_us is not None:
        return None
    shape = MoEShape(hidden=params.hidden, ffn=params.ffn, experts=params.experts, top_k=params.top_k)
    f_s = rated_shape_s(shape, params.tokens)
    link = params.link()
    a_s = link.seconds(params.tokens * params.hidden * 4)
    e_s = link.seconds(2 * params.tokens * params.hidden * 4)
    return params.layers * params.stages * (f_s + a_s + e_s) + params.layers * params.attn_us * 1e-6


def work_run(params: BenchParams, timed_s: float) -> tuple[int, int]:
    """(timed steps per block, repetitions) for a work point, from its step
    time: on the modelled timeline the model's (no run needed), else a short
    serial probe's: blocks of about ``WORK_BLOCK_S`` seconds
    (``params.steps``..``WORK_MAX_STEPS`` steps), enough of them for about
    ``timed_s`` seconds per policy (``params.reps``..``WORK_MAX_REPS``)."""
    step_s = modelled_serial_step_s(params)
    if step_s is None:
        probe = replace(params, policies=("serial",), steps=3, warmup=1, reps=1)
        serial = _policy(run_bench(probe).report, "serial")
        assert serial is not None
        step_s = serial["per_layer_us"]["median"] * 1e-6 * params.layers
    if step_s <= 0:
        return WORK_MAX_STEPS, WORK_MAX_REPS
    steps = max(params.steps, min(WORK_MAX_STEPS, math.ceil(WORK_BLOCK_S / step_s)))
    reps = max(params.reps, min(WORK_MAX_REPS, math.ceil(timed_s / (steps * step_s))))
    return steps, reps


def _calibrate(base: BenchParams) -> dict[str, Any]:
    """A short serial run of the base world: its report (f for the ratio points)."""
    probe = replace(base, policies=("serial",), steps=2, warmup=1, reps=1)
    return run_bench(probe).report


def _calibrated_f_s(calibration: Mapping[str, Any]) -> float:
    """f of the base world from its calibration run: with modelled timing,
    the FFN's model (which the ratio and stage points then hold the FFN to,
    so every point has the same f); else its measured f."""
    ffn = (calibration.get("timing") or {}).get("ffn")
    if ffn:
        return ffn["points"][0]["model_us"] * 1e-6
    return calibration["measured"]["f_us"] * 1e-6


def comm_core_capacity(device: str) -> tuple[int | None, str]:
    """How many cores the device holds for the comm ops of one step, and
    where that figure comes from. CUDA: the GPU's SMs (a comm op's block
    holds an SM of its own: ``emulation/comm_kernel.py``); elsewhere None:
    CPU threads time-share their cores, so a point is never capped there."""
    if device != "cuda":
        return None, f"{device}: not capped (busy threads time-share the cores)"
    import torch

    index = torch.cuda.current_device()
    sms = int(torch.cuda.get_device_properties(index).multi_processor_count)
    return sms, f"torch.cuda.get_device_properties({index}).multi_processor_count"


def cap_comm_core_points(
    points: Sequence[int], capacity: int | None, concurrent: int
) -> tuple[list[tuple[int, int]], list[dict[str, Any]], int | None]:
    """The contention points to run, as ``(asked, run at)``, what was capped
    or dropped and why, and the most cores per op. With ``concurrent`` comm
    ops in flight at once (one per stage's side stream in the overlap
    policies), each holding its cores for its whole duration, a device of
    ``capacity`` cores gives each op at most ``(capacity - 1) // concurrent``
    and keeps at least one for the FFN (as the comm kernel does for one op).
    A point above that runs at that most, unless another point already runs
    there (then it is dropped)."""
    if capacity is None:
        return [(n, n) for n in points], [], None
    most = max((capacity - 1) // max(concurrent, 1), 0)
    run: list[tuple[int, int]] = []
    changes: list[dict[str, Any]] = []
    taken = {n for n in points if n <= most}
    for n in points:
        if n <= most:
            run.append((n, n))
            continue
        why = (
            f"--comm-cores {n} x {concurrent} concurrent op(s) needs {n * concurrent} of the device's {capacity} "
            f"cores; at most {most} per op leaves the FFN at least one"
        )
        if most in taken:
            changes.append({"asked": n, "ran": None, "action": "dropped", "why": f"{why}, and {most} runs already"})
            continue
        taken.add(most)
        run.append((n, most))
        changes.append({"asked": n, "ran": most, "action": "capped", "why": why})
    return run, changes, most


def _fallbacks(reports: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Every distinct fallback of the reports, in the order first seen."""
    out: list[dict[str, str]] = []
    for r in reports:
        for fb in r.get("fallbacks") or []:
            if fb not in out:
                out.append(dict(fb))
    return out


def run_sweep(
    base: BenchParams,
    *,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    stage_counts: Sequence[int] = DEFAULT_STAGE_COUNTS,
    stage_ratio: float = DEFAULT_STAGE_RATIO,
    work_tokens: Sequence[int] = DEFAULT_WORK_TOKENS,
    work_hidden: Sequence[int] = DEFAULT_WORK_HIDDEN,
    comm_cores: Sequence[int] | None = None,
    work_timed_s: float = WORK_TIMED_S,
    work_graph: bool = False,
    progress: bool = False,
    log: Any = sys.stderr,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every point; returns ``{"base", "f_calibration_us", "ratio_points",
    "stage_points", "work_points", "graph", "env", "wall_s", ...}`` with each
    point's full benchmark report (a work point's graph-mode one as its
    ``graph_report`` when ``work_graph``). ``on_result``: called with the
    sweep so far (``"partial": true``, ``progress`` saying what is done)
    after the calibration and after each point, so a run cut short leaves
    the points it finished; the returned sweep has ``"partial": false``."""
    t0 = time.perf_counter()
    base = replace(base, comm_ratio=None)  # each point sets its own link (or keeps the preset's)
    if comm_cores is None:
        comm_cores = DEFAULT_COMM_CORES.get(base.device, ())
    capacity, capacity_source = comm_core_capacity(base.device) if comm_cores else (None, "no contention points")
    core_points, core_changes, most = cap_comm_core_points(comm_cores, capacity, base.stages)
    for change in core_changes:
        logger.warning(
            "camp2p-overlap sweep: contention point %s %s: %s", change["asked"], change["action"], change["why"]
        )
    calibration = _calibrate(base) if (ratios or stage_counts or core_points) else None
    f_s = _calibrated_f_s(calibration) if calibration is not None else float("nan")
    total = len(ratios) + len(stage_counts) + len(core_points) + len(work_tokens) * len(work_hidden) * (1 + work_graph)
    done = 0
    result: dict[str, Any] = {
        "schema": "camp2p-overlap/sweep/v1",
        "partial": True,
        "progress": "calibration",
        "base": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(base).items()},
        "f_calibration_us": None if f_s != f_s else round(f_s * 1e6, 3),
        "ratio_points": [],
        "stage_points": [],
        "comm_core_points": [],
        "work_points": [],
        "comm_core_limit": {
            "capacity": capacity,
            "source": capacity_source,
            "concurrent_ops": base.stages,
            "max_per_op": most,
        },
        "comm_core_changes": core_changes,
        "fallbacks": [],
        "graph": bool(work_graph),
        "env": report_env(base.threads),
        "wall_s": 0.0,
    }

    def emit(what: str, *, final: bool = False) -> None:
        reports = [calibration] if calibration is not None else []
        for key in ("ratio_points", "stage_points", "comm_core_points", "work_points"):
            for pt in result[key]:
                reports += [pt[k] for k in ("report", "graph_report") if k in pt]
        result["fallbacks"] = _fallbacks(reports)
        result["partial"] = not final
        result["progress"] = what
        result["wall_s"] = round(time.perf_counter() - t0, 3)
        if on_result is not None and not final:
            on_result(copy.deepcopy(result))

    if calibration is not None:
        emit("calibration")

    def point(params: BenchParams, label: str) -> dict[str, Any]:
        nonlocal done
        done += 1
        if log is not None and progress and log.isatty():
            print(f"[{done}/{total}] {label}", file=log, flush=True)
        return run_bench(params).report

    def linked(ratio: float, label: str, **changes: Any) -> dict[str, Any]:
        """A point with the modeled link set so that (a+e)/f is ``ratio``."""
        lat, gbps = link_for_ratio(base, f_s, ratio)
        params = replace(base, link_latency_us=round(lat, 3), link_gbps=round(gbps, 6), **changes)
        if params.ffn_us is None and params.timing_mode()[0] == "model":  # every point at the same f
            params = replace(params, ffn_us=round(f_s * 1e6, 3))
        report = point(params, label)
        return {
            "target_ratio": ratio,
            "measured_ratio": report["measured"]["comm_over_ffn"],
            "stages": params.stages,
            "report": report,
        }

    # contention points run on wall-clock kernels unless asked: their point
    # is the CPU the comm ops take, which a modelled hold would hide
    contention_timing = "wall" if base.timing == "auto" else base.timing
    for r in ratios:
        result["ratio_points"].append(linked(r, f"(a+e)/f = {r:g}, {base.stages} stages"))
        emit(f"ratio point {len(result['ratio_points'])} of {len(ratios)}")
    for s in stage_counts:
        result["stage_points"].append(linked(stage_ratio, f"{s} stage(s), (a+e)/f = {stage_ratio:g}", stages=s))
        emit(f"stage point {len(result['stage_points'])} of {len(stage_counts)}")
    for asked, n in core_points:
        label = f"--comm-cores {n}" + (f" (asked {asked})" if asked != n else "") + f", (a+e)/f = {stage_ratio:g}"
        pt = {
            "comm_cores": n,
            "asked_comm_cores": asked,
            **linked(stage_ratio, label, comm_cores=n, timing=contention_timing),
        }
        result["comm_core_points"].append(pt)
        emit(f"contention point {len(result['comm_core_points'])} of {len(core_points)}")
    work = [(h, t) for h in work_hidden for t in work_tokens]
    for hidden, tokens in work:
        params = replace(
            base,
            tokens=tokens,
            hidden=hidden,
            **WORK_POINT_CHANGES,
            policies=WORK_POLICIES,
            steps=max(base.steps, WORK_MIN_RUN["steps"]),
            warmup=max(base.warmup, WORK_MIN_RUN["warmup"]),
            reps=max(base.reps, WORK_MIN_RUN["reps"]),
        )
        steps, reps = work_run(params, work_timed_s)
        params = replace(params, steps=steps, reps=reps)
        report = point(params, f"{tokens} tokens per stage, hidden {hidden}")
        work_point = {
            "tokens": tokens,
            "hidden": hidden,
            "measured_ratio": report["measured"]["comm_over_ffn"],
            "stages": base.stages,
            "report": report,
        }
        if work_graph:
            work_point["graph_report"] = point(
                replace(params, graph=True), f"{tokens} tokens per stage, hidden {hidden}, graph replays"
            )
        result["work_points"].append(work_point)
        emit(f"work point {len(result['work_points'])} of {len(work)}")
    emit("done", final=True)
    return result


def _policy(report: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    return next((p for p in report["policies"] if p["policy"] == name), None)


def _cells(report: Mapping[str, Any], policies: Sequence[str], fill_drain: bool = False) -> list[str]:
    cells = []
    for name in policies:
        p = _policy(report, name)
        cells.append(fmt_time(p["per_layer_us"]["median"]) if p else "-")
    cells.append(fmt_time(report["measured"]["floor_per_layer_us"]))
    if fill_drain:
        cells.append(fmt_time(report["measured"].get("floor_fill_drain_per_layer_us")))
    for name in policies:
        if name == "serial":
            continue
        p = _policy(report, name)
        if p is None:
            cells.append("-")
            continue
        eta = "-" if p["eta"] is None else f"{p['eta']:.2f}"
        ci = p.get("speedup_ci95")
        interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
        cell = f"{p['speedup']:.2f}x{interval} / {eta}"
        if fill_drain:
            cell += " / " + ("-" if p.get("eta_fill_drain") is None else f"{p['eta_fill_drain']:.2f}")
        cells.append(cell)
    cells.append("yes" if report["outputs_equal"] else "NO")
    return cells


def _timing_lines(pts: Sequence[Mapping[str, Any]], rkey: str, name: Any, key: str) -> list[str]:
    """Under a table: its points' timing model and the points its overruns
    flagged (nothing for reports written before the timing model)."""
    timings = [pt[rkey].get("timing") for pt in pts]
    if not any(timings):
        return []
    models = sorted({t["model"] for t in timings if t})
    held = {t["ffn_model"] for t in timings if t and t.get("ffn") and t["ffn"].get("fixed")}
    calibrated = [
        name(pt)
        for pt, t in zip(pts, timings, strict=True)
        if t and t.get("ffn") and not t["ffn"].get("fixed") and not t["ffn"].get("rated")
    ]
    if not calibrated:
        each = "each point's FFN rated from its shape"
    else:
        each = (
            "each point's FFN rated from its shape, except at "
            + ", ".join(calibrated)
            + ", where this machine could not hold its rating and it was calibrated in its run"
        )
    text = {
        "model": f"modelled kernels ({next(iter(held))} at every point, the f calibration's model)"
        if len(held) == 1 and all(t and t.get("ffn") and t["ffn"].get("fixed") for t in timings)
        else f"modelled kernels ({each})",
        "wall": "wall-clock kernels",
        "device": "device time",
    }
    flagged = [name(pt) for pt, t in zip(pts, timings, strict=True) if t and t.get("noisy")]
    line = "Timing: " + ", ".join(text.get(m, m) for m in models)
    why = sorted({t["why"] for t in timings if t and t["model"] == "wall"})
    if key == "comm_core_points" and models == ["wall"]:
        why = [CONTENTION_TIMING]
    if why:
        line += f" ({'; '.join(why)})"
    line += (
        f"; overruns above the timing model's error at {len(flagged)} point(s): {', '.join(flagged)}."
        if flagged
        else "; no point's overruns exceed the timing model's error."
        if "model" in models
        else "."
    )
    return ["", line]


def adaptive_worst(sweep: Mapping[str, Any], rkey: str = "report") -> tuple[float, str] | None:
    """The lowest speedup of adaptive ``overlap`` over serial at any point,
    and where; ``rkey="graph_report"``: of its graph over serial's graph."""
    worst = None
    for key in ("ratio_points", "stage_points", "comm_core_points", "work_points"):
        for pt in sweep.get(key, ()):
            if rkey not in pt:
                continue
            p = _policy(pt[rkey], "overlap")
            if p is not None and (worst is None or p["speedup"] < worst[0]):
                if key == "work_points":
                    where = f"{pt['tokens']} tokens, hidden {pt['hidden']}"
                elif key == "comm_core_points":
                    where = f"{pt['comm_cores']} comm cores"
                else:
                    where = f"{pt['stages']} stages"
                worst = (p["speedup"], f"{key.rsplit('_', 1)[0].replace('_', ' ')} point, {where}")
    return worst


def _notes(sweep: Mapping[str, Any]) -> list[str]:
    """What the tables do not show: a partial sweep, contention points
    capped or dropped, fallbacks, launch-bound points (none: no line)."""
    out = []
    if sweep.get("partial"):
        out.append(f"PARTIAL: the sweep did not finish; done: {sweep.get('progress')}.")
    limit = sweep.get("comm_core_limit") or {}
    for change in sweep.get("comm_core_changes") or []:
        where = "dropped" if change["action"] == "dropped" else f"run at {change['ran']}"
        out.append(
            f"Contention point {change['asked']} {where} ({limit.get('source', 'the device')}): {change['why']}."
        )
    for fb in sweep.get("fallbacks") or []:
        out.append(f"FALLBACK: {fb['what']} is not used ({fb['reason']}); ran {fb['instead']} instead.")
    bound = []
    for key in ("ratio_points", "stage_points", "comm_core_points", "work_points"):
        for i, pt in enumerate(sweep.get(key) or []):
            launch = (pt["report"].get("measured") or {}).get("launch")
            if launch and launch.get("launch_bound"):
                bound.append(f"{key.rsplit('_', 1)[0].replace('_', ' ')} point {i + 1}")
    if bound:
        out.append(
            "LAUNCH-BOUND (the host issues work about as fast as the device runs it; see each report's "
            f"measured.launch): {', '.join(bound)}."
        )
    return ["", *out] if out else []


def sweep_markdown(sweep: Mapping[str, Any], command: str | None = None) -> str:
    """The sweep as Markdown tables."""
    base = sweep["base"]
    lines = []
    if command:
        lines += [f"Command: `{command}`", ""]
    lines.append(
        f"Base: {base['layers']} FFN layers, {base['tokens']} tokens per stage, MoE hidden {base['hidden']}, "
        f"ffn {base['ffn']}, {base['experts']} experts, top-{base['top_k']}, attention {base['attn_us']:g} us, "
        f"{base['reps']} reps x {base['steps']} steps, device {base['device']}, torch threads {base['threads']}; "
        + (
            f"f calibrated at {fmt_time(sweep['f_calibration_us'])} per (layer, stage)."
            if sweep.get("f_calibration_us")
            else "no ratio or stage points."
        )
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
        (
            "comm_core_points",
            "comm cores",
            lambda pt: (
                str(pt["comm_cores"])
                + (
                    f" (asked {pt['asked_comm_cores']})"
                    if pt.get("asked_comm_cores", pt["comm_cores"]) != pt["comm_cores"]
                    else ""
                )
            ),
            lambda pts: (
                f"Per-layer time against the cores each communication op keeps busy (--comm-cores; "
                f"{pts[0]['stages']} stages, (a+e)/f target {pts[0]['target_ratio']:g}; 0 = communication "
                "takes no compute):"
            ),
        ),
        (
            "work_points",
            "hidden / tokens per stage",
            lambda pt: f"{pt['hidden']} / {pt['tokens']}",
            lambda pts: (
                f"Per-layer time against the work per (layer, stage), adaptive overlap and each layout fixed side "
                f"by side ({pts[0]['stages']} stages; the preset's MoE and link bandwidth, no link latency, no "
                "attention time):"
            ),
        ),
    )
    rows: list[tuple[str, str, Any, Any, str]] = [(*t, "report") for t in tables]
    if any("graph_report" in pt for pt in sweep.get("work_points") or []):
        rows.append(
            (
                "work_points",
                "hidden / tokens per stage",
                lambda pt: f"{pt['hidden']} / {pt['tokens']}",
                lambda pts: (
                    "The same work points in graph mode (`bench --graph`): each policy's step captured once, "
                    "replays timed; adaptive `overlap` captures both variants (serial and overlap) and chooses "
                    "per replay:"
                ),
                "graph_report",
            )
        )
    for key, first_col, first_cell, title, rkey in rows:
        pts = [pt for pt in sweep.get(key) or [] if rkey in pt]
        if not pts:
            continue
        policies = [p["policy"] for p in pts[0][rkey]["policies"]]
        others = [p for p in policies if p != "serial"]
        fd = any("floor_fill_drain_per_layer_us" in pt[rkey]["measured"] for pt in pts)
        head = [f"{p} per layer" for p in policies] + ["floor"] + (["fill/drain floor"] if fd else [])
        head += [f"{p} speedup [95% CI] / eta" + (" / eta f/d" if fd else "") for p in others]
        head.append("outputs equal")
        lines += [
            "",
            title(pts),
            "",
            f"| {first_col} | (a+e)/f measured | " + " | ".join(head) + " |",
            "|" + " --- |" * (len(head) + 2),
        ]
        for pt in pts:
            ratio = pt["measured_ratio"] if rkey == "report" else pt[rkey]["measured"]["comm_over_ffn"]
            measured = "-" if ratio is None else f"{ratio:.2f}"
            row = [first_cell(pt), measured, *_cells(pt[rkey], policies, fd)]
            lines.append("| " + " | ".join(row) + " |")
        lines += _timing_lines(pts, rkey, lambda pt, f=first_cell, c=first_col: f"{c} {f(pt)}", key)
        skipped: dict[str, str] = {}
        for pt in pts:
            for skip in pt[rkey].get("skipped_policies") or []:
                skipped.setdefault(skip["policy"], skip["why"])
        if skipped:
            lines += ["", "Not run here: " + "; ".join(f"`{name}`: {why}" for name, why in skipped.items()) + "."]
    lines += _notes(sweep)
    worst = adaptive_worst(sweep)
    lines.append("")
    if worst is not None:
        verdict = "meets" if worst[0] >= ADAPTIVE_FLOOR else "MISSES"
        lines.append(
            f"Adaptive `overlap` at its slowest: {worst[0]:.2f}x of serial ({worst[1]}); "
            f"it {verdict} the goal of at least {ADAPTIVE_FLOOR:.2f}x at every point."
        )
    graph_worst = adaptive_worst(sweep, "graph_report")
    if graph_worst is not None:
        verdict = "meets" if graph_worst[0] >= GRAPH_ADAPTIVE_FLOOR else "MISSES"
        lines.append(
            f"Adaptive `overlap`'s graph at its slowest: {graph_worst[0]:.2f}x of serial's graph "
            f"({graph_worst[1]}); it {verdict} the goal of at least {GRAPH_ADAPTIVE_FLOOR:.2f}x at every point."
        )
    lines += [
        "With 1 stage there is nothing to overlap with: the patch layer does not engage (minimum 2 stages) "
        "and every policy runs the serial path.",
        CPU_CAVEAT,
    ]
    return "\n".join(lines) + "\n"
