"""Human-readable tables and the Chrome trace file of a benchmark run."""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from camp2p_overlap.core.keys import COMPUTE_STREAM
from camp2p_overlap.core.observe.trace import TraceOp
from camp2p_overlap.tools.bench.runner import POLICIES, BenchRun
from camp2p_overlap.tools.bench.timing import timing_lines
from camp2p_overlap.verify.edges import to_chrome_trace

CPU_CAVEAT = (
    "Absolute CPU times say nothing about an NPU: the emulated link and FFN are sized to a ratio. "
    "Only the ratios (speedup, eta) carry over."
)


def fmt_time(us: float | None) -> str:
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "-"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.0f} us"


def _sides(policy: str) -> tuple[str, str]:
    sides = POLICIES[policy] or (False, False)
    return ("K_s" if sides[0] else COMPUTE_STREAM, "K_s" if sides[1] else COMPUTE_STREAM)


def _ci(interval: Sequence[float] | None) -> str:
    return "" if not interval else f" [{interval[0]:.2f}, {interval[1]:.2f}]"


def _edges(ok: bool | None) -> str:
    return "not checked" if ok is None else ("ok" if ok else "VIOLATED")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f} MiB"


def problems(report: Mapping[str, Any]) -> list[str]:
    """What makes a run fail (non-zero exit): outputs that differ from the
    serial run, broken edges, or an overlap policy that did not engage
    where it should have (2 or more stages)."""
    out = []
    for p in report["policies"]:
        if not p["outputs_equal"]:
            out.append(f"{p['policy']}: outputs differ from the serial run ({'; '.join(p['mismatches'][:3])})")
        if p["edges_ok"] is False:
            out.append(f"{p['policy']}: edge check failed ({'; '.join(p['edge_violations'][:3])})")
        if p.get("peer_cycle_ok") is False:
            out.append(
                f"{p['policy']}: the attention peer's cycle was broken ({'; '.join(p['peer_cycle_violations'][:3])})"
            )
        fixed = not p.get("adaptive", False)  # adaptive engage may rightly choose the serial path
        if report.get("graph") and not fixed and p.get("captured_variants", 0) < 2:
            why = "; ".join((p.get("graph_choice") or {}).get("capture_failures", {})) or "no reason recorded"
            out.append(f"{p['policy']}: its decode graph's overlap variant was not captured ({why})")
        if p["policy"] != "serial" and fixed and not p["engaged"] and len(report["stages"]) >= 2:
            out.append(f"{p['policy']}: the overlap did not engage (ran the serial path)")
    pool = report.get("graph_pool")
    if report.get("graph") and pool is not None and not pool.get("one_pool", True):
        out.append(f"the graphs are not in the runner's one graph pool {pool['pool']}: {pool['pools_seen']}")
    prof = report.get("profile")
    if prof is not None:
        if not prof["edges_ok"]:
            out.append(f"profiled step: device-time edge check failed ({'; '.join(prof['edge_violations'][:3])})")
        if prof["outputs_equal"] is False:
            out.append("profiled step: outputs differ from the serial run")
    return out


def graph_lines(report: Mapping[str, Any]) -> list[str]:
    """What a ``--graph`` run did differently (none for an eager run)."""
    if not report.get("graph"):
        return []
    pols = report["policies"]
    graphs = sum(p.get("captured_variants", 0) for p in pols)
    replays = ", ".join(f"{p['policy']} {p.get('replays', 0)}" for p in pols)
    where = "CUDA graphs" if report.get("device") == "cuda" else "the emulated device's graphs"
    pool = report.get("graph_pool") or {}
    seen = ", ".join(pool.get("pools_seen", []))
    pools = "one graph pool" if pool.get("one_pool") else f"NOT one graph pool ({seen})"
    text = (
        f"graph mode (--graph): each policy's step captured once per graph key, adaptive overlap's with both "
        f"variants ({graphs} graphs in all), as {where} in {pools}, then replayed round-robin; per-layer times "
        f"are replays (timed: {replays}), each compared bitwise with the eager serial step of the same step id; "
        f"speedup is against serial's graph. Replays leave no trace: the edge check and the peer cycle run on "
        f"serial's eager traced steps. World: {report.get('world', 'host')}."
    )
    lines = textwrap.wrap(text, 110, subsequent_indent="  ")
    captures = [(p["policy"], p["capture"]) for p in pols if p.get("capture")]
    if captures and any(c.get("pool_bytes") is not None for _, c in captures):
        parts = []
        for name, c in captures:
            part = f"{name} {_mib(c.get('pool_bytes'))}"
            if c.get("second_variant_bytes") is not None:
                part += f" (its second variant {_mib(c['second_variant_bytes'])} by mem_get_info)"
            parts.append(part)
        lines += textwrap.wrap(
            "capture memory (added to the graph pool, torch.cuda.memory_snapshot): " + ", ".join(parts),
            110,
            subsequent_indent="  ",
        )
    elif captures:
        lines.append("capture memory: not measured on the emulated device (it keeps no memory pool)")
    for p in pols:
        choice = p.get("graph_choice")
        if choice:
            timed = choice["timed_replays"]
            lines += textwrap.wrap(
                f"{p['policy']}'s graph (serial and overlap variants, chosen per replay): decision "
                f"{choice['decision'] or 'none (one variant captured)'}; timed replays serial "
                f"{timed.get('serial', 0)}, overlap {timed.get('overlap', 0)}",
                110,
                subsequent_indent="  ",
            )
    for skip in report.get("skipped_policies", []):
        lines += textwrap.wrap(f"not run in graph mode: {skip['policy']}: {skip['why']}", 110, subsequent_indent="  ")
    return lines


def fallback_lines(report: Mapping[str, Any]) -> list[str]:
    """What fell back while the world was built (none: no line)."""
    out = []
    for fb in report.get("fallbacks") or []:
        out += textwrap.wrap(
            f"FALLBACK: {fb['what']} is not used ({fb['reason']}); ran {fb['instead']} instead",
            110,
            subsequent_indent="  ",
        )
    return out


def launch_lines(report: Mapping[str, Any]) -> list[str]:
    """Launch-bound or device-bound (``measured.launch``; no line where it
    is not measured: the host world, or a report from before it was)."""
    m = (report.get("measured") or {}).get("launch")
    if not m:
        return []

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    steps = [
        f"{p['policy']} {share(p['launch']['step_share'])}"
        for p in report["policies"]
        if p.get("launch") and p["launch"].get("step_share") is not None
    ]
    text = (
        f"  launch share (host time to issue / device time, {m['steps']} serial traced steps): an FFN "
        f"{fmt_time(m['ffn_host_us'])} / {fmt_time(m['ffn_device_us'])} = {share(m['ffn_share'])}; a step: "
        + (", ".join(steps) or "-")
        + f" (launch-bound at {m['threshold']:.2f} or more)"
    )
    lines = textwrap.wrap(text, 110, subsequent_indent="    ")
    if m["launch_bound"]:
        verdict = (
            f"  LAUNCH-BOUND: {'; '.join(m['launch_bound_by'])}. The host issues the work about as fast as the "
            "device runs it: these figures measure the host's launch rate more than the overlap on the device."
        )
    else:
        verdict = "  device-bound: the host issues every step's work ahead of the device."
    return lines + textwrap.wrap(verdict, 110, subsequent_indent="    ")


def learning_lines(report: Mapping[str, Any]) -> list[str]:
    """An adaptive policy's row is its steady state (after its decision); its
    learning, apart: the steps it took and what they cost."""
    out = []
    for p in report["policies"]:
        learn = p.get("learning")
        if not learn:
            continue
        if learn["decision"] is None:
            out.append(
                f"{p['policy']}: still learning after {learn['steps']} steps: no steady state in this run "
                "(its row has no figures); run more --steps"
            )
            continue
        paths = learn["paths"]
        extra = learn["extra_us_per_layer"]
        cost = "" if extra is None else f"; they cost {fmt_time(extra)} per layer in all over the steady state"
        out.append(
            f"{p['policy']}: its row is its steady state, after it decided {learn['decision']}: "
            f"{learn['steps']} learning steps before it (warm-ups included: {paths['overlap']} overlap, "
            f"{paths['serial']} serial; median {fmt_time(learn['per_layer_us']['median'])} per layer){cost}."
        )
    return out


def bench_table(report: Mapping[str, Any]) -> str:
    """The benchmark's result as the text printed to stdout."""
    prm = report["params"]
    m = report["measured"]
    S = len(report["stages"])
    lines = [
        f"camp2p-overlap bench: emulated CAMP2P FFN rank on {report['device']} "
        f"(stream backend {report['backend']}, afd-plugin stand-ins at {report['stand_in_root']})",
        f"{'scenario ' + report['scenario'] if report['scenario'] else 'no scenario preset'}: "
        f"{report['ffn_layers']} FFN layers x {S} stage(s), {prm['tokens']} tokens per stage; "
        f"MoE hidden {prm['hidden']}, ffn {prm['ffn']}, {prm['experts']} experts, top-{prm['top_k']}",
        f"link {prm['link_latency_us']:g} us + {prm['link_gbps']:g} Gbit/s, attention {prm['attn_us']:g} us"
        + ("" if report.get("attn_modeled", True) else " (not modeled here)")
        + f"; {prm['reps']} reps x {prm['steps']} timed steps per policy (+{prm['warmup']} warm-up), "
        f"torch threads {prm['threads']}",
        f"comm ops: {report.get('comm_model', '-')}"
        + (f"; --comm-cores {prm.get('comm_cores', 0)}" if prm.get("comm_cores") else ""),
        *fallback_lines(report),
        *timing_lines(report),
        *graph_lines(report),
        "",
        f"Measured on the serial run's trace (medians of {m['samples']} FFN ops; A2E without its attention wait):",
        f"  f  FFN compute per (layer, stage)  {fmt_time(m['f_us'])}",
        "  a  A2E  " + " | ".join(f"stage {s['stage']} {fmt_time(s['a_us'])}" for s in m["stages"]),
        "  e  E2A  " + " | ".join(f"stage {s['stage']} {fmt_time(s['e_us'])}" for s in m["stages"]),
    ]
    ratio = m["comm_over_ffn"]
    verdict = "FFN-bound" if m["ffn_bound"] else "not FFN-bound, which needs"
    lines.append(
        f"  (a+e)/f = {ratio * 100:.0f}%: {verdict} (f > a+e, and S*f >= a+f+e+attn with S >= 2)"
        if ratio is not None
        else "  (a+e)/f = -"
    )
    ft = m["floor_terms"]
    lines.append(
        f"  floor per layer = max(S*f = {fmt_time(ft['stages_x_f_us'])}, "
        f"max_s(a_s+f+e_s+attn) = {fmt_time(ft['group_cycle_us'])}) = {fmt_time(m['floor_per_layer_us'])}"
    )
    lines += launch_lines(report)
    lines.append("")
    header = (
        f"{'policy':<13} {'A2E':<4} {'E2A':<4} {'per-layer median':>16} {'p90':>10} "
        f"{'speedup [95% CI]':>20} {'eta [95% CI]':>19}  {'outputs == serial':<20} {'engaged':<14} {'edges'}"
    )
    lines += [header, "-" * len(header)]
    noisy = []
    for p in report["policies"]:
        a2e, e2a = _sides(p["policy"])
        speedup = f"{p['speedup']:.2f}x" + _ci(p.get("speedup_ci95"))
        eta = "-" if p["eta"] is None else f"{p['eta']:.2f}" + _ci(p.get("eta_ci95"))
        if p.get("noisy"):
            eta += "*"
            noisy.append(p)
        if p["policy"] == "serial" and not report.get("graph"):
            outputs = "reference" + ("" if p["outputs_equal"] else " (reps DIFFER)")
            engaged = "-"
        elif p["policy"] == "serial":  # graph mode: its replays against the eager serial steps
            outputs = f"yes ({p['compared_steps']} steps)" if p["outputs_equal"] else "NO"
            engaged = "-"
        else:
            outputs = f"yes ({p['compared_steps']} steps)" if p["outputs_equal"] else "NO"
            engaged = ("yes" if p["engaged"] else "no") + (" (adaptive)" if p.get("adaptive") else "")
        lines.append(
            f"{p['policy']:<13} {a2e:<4} {e2a:<4} {fmt_time(p['per_layer_us']['median']):>16} "
            f"{fmt_time(p['per_layer_us']['p90']):>10} {speedup:>20} {eta:>19}  {outputs:<20} "
            f"{engaged:<14} {_edges(p['edges_ok'])}"
        )
    for p in noisy:
        lines.append(
            f"* {p['policy']}: noisy, not a result: {'; '.join(p['noise'])}. "
            "Run more --steps or --reps on an otherwise idle machine."
        )
    lines += learning_lines(report)
    by = {p["policy"]: p for p in report["policies"]}
    lines.append("")
    checked = [p for p in report["policies"] if p.get("peer_cycle_checked_steps")]
    if checked:
        held = all(p["peer_cycle_ok"] for p in checked)
        steps = sum(p["peer_cycle_checked_steps"] for p in checked)
        lines.append(
            f"attention peer's cycle (a stage's next A2E completes after its E2A's start + attn): "
            f"{'held' if held else 'BROKEN'} on {steps} traced steps."
        )
    else:
        lines.append("attention peer's cycle: not checked (the peer is not modeled here).")
    if "overlap" in by and "e2a-only" in by:
        ratio_oe = by["e2a-only"]["per_layer_us"]["median"] / by["overlap"]["per_layer_us"]["median"]
        lines.append(f"overlap vs e2a-only: {ratio_oe:.2f}x per layer.")
    if "overlap" in by and "overlap-fixed" in by:
        ratio_af = by["overlap-fixed"]["per_layer_us"]["median"] / by["overlap"]["per_layer_us"]["median"]
        lines.append(f"overlap (adaptive) vs overlap-fixed: {ratio_af:.2f}x per layer.")
    lines.append(
        "eta = (T_serial - T_policy) / (T_serial - T_floor): the share of the hideable time a policy hid "
        "(1.0 = all of it)."
    )
    lines.append(CPU_CAVEAT)
    for problem in problems(report):
        lines.append(f"FAILED: {problem}")
    return "\n".join(lines)


def chrome_trace(timelines: Mapping[str, Sequence[TraceOp]], report: Mapping[str, Any]) -> dict[str, Any]:
    """Chrome trace-event JSON (Perfetto, chrome://tracing): one process per
    policy (pid 1, 2, ... in policy order), one thread per stream (``C``,
    ``K0``, ``K1``, ...) named by ``thread_name`` metadata; one traced step
    per policy, each starting at time 0."""
    events: list[dict[str, Any]] = []
    for pid, (policy, ops) in enumerate(timelines.items(), start=1):
        events.extend(to_chrome_trace(list(ops), process=policy, pid=pid))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schema": report["schema"],
            "device": report["device"],
            "scenario": report["scenario"],
            "policies": list(timelines),
        },
    }


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON, whole or not at all (a temporary file renamed
    over ``path``: a run cut while writing leaves the previous report)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_outputs(run: BenchRun, *, json_path: str | None, trace_path: str | None) -> None:
    if json_path:
        write_json(json_path, run.report)
    if trace_path:
        write_json(trace_path, chrome_trace(run.timelines, run.report))
