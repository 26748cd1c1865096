"""Human-readable tables and the Chrome trace file of a benchmark run."""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from camp2p_overlap.core.keys import COMPUTE_STREAM, FFN_STREAM
from camp2p_overlap.core.observe.trace import TraceOp
from camp2p_overlap.tools.bench.runner import BenchRun
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


def _streams(p: Mapping[str, Any]) -> str:
    """Where the policy's (first listed) layout runs A2E, E2A and the FFN, as ``A2E/E2A/FFN`` (a report
    from before the FFN's side stream: the FFN on C)."""
    a2e = "K_s" if p.get("a2e_side_stream") else COMPUTE_STREAM
    e2a = "K_s" if p.get("e2a_side_stream") else COMPUTE_STREAM
    ffn = FFN_STREAM if p.get("ffn_side_stream") else COMPUTE_STREAM
    return f"{a2e}/{e2a}/{ffn}"


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
    for sub in (report.get("contention") or {}).get("reports") or []:
        out += [f"--comm-cores {sub['params']['comm_cores']}: {problem}" for problem in problems(sub)]
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
    return lines


def skipped_lines(report: Mapping[str, Any]) -> list[str]:
    """The policies the run left out, each with why (none: no line)."""
    lines: list[str] = []
    for skip in report.get("skipped_policies", []):
        lines += textwrap.wrap(
            f"not run: {skip['policy']}: {skip['why']}", 110, subsequent_indent="  ", break_on_hyphens=False
        )
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
        paths = ", ".join(f"{n} {path}" for path, n in learn["paths"].items())
        extra = learn["extra_us_per_layer"]
        cost = "" if extra is None else f"; they cost {fmt_time(extra)} per layer in all over the steady state"
        out.append(
            f"{p['policy']}: its row is its steady state, after it decided {learn['decision']}: "
            f"{learn['steps']} learning steps before it (warm-ups included: {paths}; "
            f"median {fmt_time(learn['per_layer_us']['median'])} per layer){cost}."
        )
    for p in report["policies"]:
        ran = p.get("layout_steps") or {}
        if p.get("adaptive") and len(p.get("layouts") or ()) > 1 and ran:
            out.append(
                f"{p['policy']} ({', '.join(p['layouts'])} listed): its timed steps ran "
                + ", ".join(f"{path} {n}" for path, n in sorted(ran.items()))
                + "."
            )
    return out


def layouts_lines(report: Mapping[str, Any]) -> list[str]:
    """The two layouts side by side and each adaptive policy against the better one (``layouts_compared``;
    none where the run lacks a policy of either layout)."""
    lc = report.get("layouts_compared")
    if not lc:
        return []
    parts = [f"{name} {fmt_time(v['per_layer_us'])} ({v['policy']})" for name, v in lc["layouts"].items()]
    text = f"layouts side by side: {', '.join(parts)}; the better is {lc['better']}"
    goal = f"{lc['tolerance'] * 100:g}% of it"
    verdicts = []
    for a in lc["adaptive"]:
        listed = ",".join(a.get("layouts") or ()) or "-"
        verdicts.append(
            f"{a['policy']} ({listed}, adaptive) {a['vs_better']:.2f}x of it "
            f"({'within' if a['within_tolerance'] else 'NOT within'} the goal of {goal})"
        )
    if verdicts:
        text += "; " + "; ".join(verdicts)
    return textwrap.wrap(text + ".", 110, subsequent_indent="  ", break_on_hyphens=False)


def contention_lines(report: Mapping[str, Any]) -> list[str]:
    """``--comm-cores-sweep``: every run side by side, one row per policy (none for one run)."""
    c = report.get("contention")
    if not c:
        return []
    runs = c["runs"]
    lines = ["", *textwrap.wrap(f"Contention model side by side (--comm-cores-sweep; {c['timing']}):", 110)]
    head = f"{'policy':<18} " + " ".join(f"{'--comm-cores ' + str(r['comm_cores']):>40}" for r in runs)
    sub = f"{'':<18} " + " ".join(f"{'per layer   speedup    eta  eta f/d':>40}" for _ in runs)
    lines += [head, sub, "-" * len(head)]
    names = [p["policy"] for p in runs[0]["policies"]]

    def eta(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for name in names:
        cells = []
        for r in runs:
            p = next((q for q in r["policies"] if q["policy"] == name), None)
            if p is None:
                cells.append(f"{'-':>40}")
                continue
            speedup = "-" if p["speedup"] is None else f"{p['speedup']:.2f}x"
            flag = "*" if p.get("noisy") else " "
            cells.append(
                f"{fmt_time(p['per_layer_us']):>12} {speedup:>9} {eta(p['eta']):>6} "
                f"{eta(p['eta_fill_drain']):>7}{flag:>3}"
            )
        lines.append(f"{name:<18} " + " ".join(cells))
    floors = ", ".join(
        f"--comm-cores {r['comm_cores']}: {fmt_time(r['floor_per_layer_us'])} / "
        f"{fmt_time(r['floor_fill_drain_per_layer_us'])} ({r['comm_model']})"
        for r in runs
    )
    lines += textwrap.wrap(f"floors (today's / fill-drain) per run: {floors}. *: noisy.", 110, subsequent_indent="  ")
    return lines


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
        + (f"; --comm-cores {prm.get('comm_cores', 0)}" if prm.get("comm_cores") else "")
        + (
            "; attention coupled (a stage's next A2E waits for every stage's E2A of the layer)"
            if report.get("attention") == "coupled"
            else ""
        ),
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
    fd = m.get("floor_fill_drain_terms")
    if fd:
        lines += textwrap.wrap(
            f"  fill/drain floor per layer = max((a_first + L*S*f + e_last)/L = {fmt_time(fd['compute_us'])}, "
            f"max_s(L*(a_s+f+e_s) + (L-1)*attn)/L = {fmt_time(fd['group_chain_us'])}) = "
            f"{fmt_time(m['floor_fill_drain_per_layer_us'])} (L = {fd['layers']}; the step's first A2E "
            f"{fmt_time(fd['fill_us'])} and last E2A {fmt_time(fd['drain_us'])}, which no layout can hide)",
            110,
            subsequent_indent="    ",
        )
    lines += launch_lines(report)
    lines.append("")
    with_fd = any("eta_fill_drain" in p for p in report["policies"])
    header = (
        f"{'policy':<18} {'A2E/E2A/FFN':<11} {'per-layer median':>16} {'p90':>10} "
        f"{'speedup [95% CI]':>20} {'eta [95% CI]':>19}"
        + (f" {'eta f/d [95% CI]':>19}" if with_fd else "")
        + f"  {'outputs == serial':<20} {'engaged':<14} {'edges'}"
    )
    lines += [header, "-" * len(header)]
    noisy = []
    for p in report["policies"]:
        speedup = "-" if p["speedup"] is None else f"{p['speedup']:.2f}x" + _ci(p.get("speedup_ci95"))
        eta = "-" if p["eta"] is None else f"{p['eta']:.2f}" + _ci(p.get("eta_ci95"))
        eta_fd = (
            "-" if p.get("eta_fill_drain") is None else f"{p['eta_fill_drain']:.2f}" + _ci(p.get("eta_fill_drain_ci95"))
        )
        if p.get("noisy"):
            if with_fd:
                eta_fd += "*"
            else:
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
            f"{p['policy']:<18} {_streams(p):<11} {fmt_time(p['per_layer_us']['median']):>16} "
            f"{fmt_time(p['per_layer_us']['p90']):>10} {speedup:>20} {eta:>19}"
            + (f" {eta_fd:>19}" if with_fd else "")
            + f"  {outputs:<20} {engaged:<14} {_edges(p['edges_ok'])}"
        )
    for p in noisy:
        lines.append(
            f"* {p['policy']}: noisy, not a result: {'; '.join(p['noise'])}. "
            "Run more --steps or --reps on an otherwise idle machine."
        )
    lines += skipped_lines(report)
    lines += learning_lines(report)
    lines += contention_lines(report)
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

    def ratio(slow: str, fast: str) -> float | None:
        a, b = by.get(slow), by.get(fast)
        if a is None or b is None or not a["per_layer_us"]["median"] or not b["per_layer_us"]["median"]:
            return None
        return a["per_layer_us"]["median"] / b["per_layer_us"]["median"]

    for slow, fast, label in (
        ("e2a-only", "overlap", "overlap vs e2a-only"),
        ("overlap-fixed", "overlap", "overlap (adaptive) vs overlap-fixed"),
        ("compute-side-fixed", "overlap", "overlap (adaptive) vs compute-side-fixed"),
        ("comm-side-fixed", "comm-side", "comm-side (adaptive) vs comm-side-fixed"),
    ):
        r = ratio(slow, fast)
        if r is not None:
            lines.append(f"{label}: {r:.2f}x per layer.")
    lines += layouts_lines(report)
    lines.append(
        "eta = (T_serial - T_policy) / (T_serial - T_floor): the share of the hideable time a policy hid "
        "(1.0 = all of it)."
    )
    if with_fd:
        lines.append(
            "eta f/d: the same against the fill/drain floor, which also counts the step's first A2E and last E2A."
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
