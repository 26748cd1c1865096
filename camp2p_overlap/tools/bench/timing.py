"""The benchmark's timing model: which one a run uses, why, and what it cost.

On the CPU the emulated device's kernel durations follow a model by default
(``--timing model``, docs/benchmark.md, "Timing model"): the FFN kernel its
duration calibrated once per run, the comm kernels their link model, the
attention peer ``--attn-us``; every kernel runs its real work, then holds
its stream until its modelled end. So the figures follow the model, not the
machine's speed or its thread scheduling, to within :data:`TIMING_ERROR`:
a run whose modelled kernels overran their model by more than that share of
their modelled time is flagged (``timing.noisy``). ``--timing wall`` keeps
wall-clock kernels. A GPU or NPU run times the device itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from camp2p_overlap.emulation.device import TimingCounts

#: ``--timing``: what may be asked for (``auto``: the default for the device).
TIMING_CHOICES = ("auto", "model", "wall")
#: The stated error: a run is flagged when its modelled kernels' overruns add
#: up to more than this share of their modelled time.
TIMING_ERROR = 0.01
MODEL_NEEDS_NO_COMM_CORES = (
    "--timing model excludes --comm-cores: the comm cores' busy-wait takes compute from the FFN, which is what "
    "--comm-cores measures, and a modelled FFN would hide that slowdown under its margin (use --timing wall)"
)
TIMING_IS_FOR_CPU = "--timing is for the CPU's emulated device; a --device cuda or npu run's kernels take device time"


def timing_problems(device: str, timing: str, comm_cores: int) -> list[str]:
    """What is wrong with ``--timing`` for this run (empty: nothing)."""
    if timing not in TIMING_CHOICES:
        return [f"--timing {timing!r} is not one of {', '.join(TIMING_CHOICES)}"]
    if timing != "auto" and device != "cpu":
        return [TIMING_IS_FOR_CPU]
    if timing == "model" and comm_cores:
        return [MODEL_NEEDS_NO_COMM_CORES]
    return []


def timing_mode(device: str, timing: str, comm_cores: int) -> tuple[str, str]:
    """``(model, why)``: ``model`` (kernels on the modelled timeline),
    ``wall`` (wall-clock kernels) or ``device`` (a device's own time)."""
    if device != "cpu":
        return "device", f"--device {device}: the kernels run on the device and take device time"
    if timing == "wall":
        return "wall", "--timing wall: each kernel takes the wall time its work and its sleeps take"
    if comm_cores:
        return "wall", (
            f"--comm-cores {comm_cores}: wall-clock kernels (the busy-wait's cost to the FFN is what is measured; "
            "a modelled FFN would hide it)"
        )
    why = "--timing model" if timing == "model" else "the default on the CPU's emulated device"
    return "model", why


def timing_noise(counts: Mapping[str, Any] | None) -> list[str]:
    """Why modelled kernels' figures are noise (empty: within the error)."""
    if not counts or not counts.get("kernels"):
        return []
    share = counts.get("overrun_time_pct") or 0.0
    if share <= TIMING_ERROR * 100:
        return []
    return [
        f"its modelled kernels overran by {share:.2f} % of their modelled time ({counts['overruns']} of "
        f"{counts['kernels']} kernels), more than the timing model's error of {TIMING_ERROR * 100:g} %"
    ]


def timing_report(
    mode: str,
    why: str,
    *,
    ffn: Any,
    attn_us: float,
    total: TimingCounts,
) -> dict[str, Any]:
    """The report's ``timing`` object (per-policy counts are each policy's own)."""
    counts = total.to_dict() if mode == "model" else None
    noise = timing_noise(counts)
    return {
        "model": mode,
        "why": why,
        "error_pct": TIMING_ERROR * 100,
        "ffn": ffn.to_dict() if (mode == "model" and ffn is not None) else None,
        "ffn_model": ffn.describe() if (mode == "model" and ffn is not None) else None,
        "comm_model": "the link model (latency + bytes / bandwidth), held on the modelled timeline"
        if mode == "model"
        else None,
        "attn_us": attn_us,
        "counts": counts,
        "noisy": bool(noise),
        "noise": noise,
    }


def timing_lines(report: Mapping[str, Any]) -> list[str]:
    """The printed line(s): which timing model the run used and, for the
    modelled one, how often and by how much kernels overran it."""
    t = report.get("timing")
    if not t:
        return []
    if t["model"] == "device":
        return [f"timing model: device time ({t['why']})"]
    if t["model"] == "wall":
        return [f"timing model: wall clock ({t['why']})"]
    c = t["counts"] or {}
    over = c.get("over_us") or {}
    lag = c.get("sync_lag_us") or {}
    line = (
        f"timing model: modelled kernels ({t.get('ffn_model') or 'no FFN model'}; A2E/E2A: the link model; "
        f"attention {t['attn_us']:g} us), overruns {c.get('overruns', 0):,} of {c.get('kernels', 0):,} "
        f"({_pct(c.get('overrun_pct'))}), +{_pct(c.get('overrun_time_pct'))} of modelled time; "
        f"error {t['error_pct']:g} %"
    )
    detail = (
        f"  (an overrun: a kernel running over {c.get('tolerance_us', 0):g} us longer than its model; run time "
        f"past the model {_us(over.get('median'))} median, {_us(over.get('p99'))} p99, {_us(over.get('max'))} at "
        f"most; {c.get('late_starts', 0):,} began over {c.get('tolerance_us', 0):g} us late; a synchronize "
        f"returned {_us(lag.get('median'))} median, {_us(lag.get('p99'))} p99 after the modelled end of the work)"
    )
    out = [line, detail]
    if t["noisy"]:
        out.append(f"* timing: noisy, not a result: {'; '.join(t['noise'])}. Run again on an otherwise idle machine.")
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} %"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:g} us"
