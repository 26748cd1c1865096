"""Launch-bound or device-bound: what the host took to issue a step's work
against what the device took to run it, from the device world's traced
steps (timing events for the device, the host clock between each op's two
event records for the host: :class:`~camp2p_overlap.emulation.kernel_world.DeviceTiming`).

An op is launch-bound when issuing it takes the host about as long as (or
longer than) running it takes the device: the device then waits for the
host between kernels, and an eager benchmark measures how fast Python
issues kernels rather than how the streams overlap on the device. Its
*share* is host issue time / device time; at or above
:data:`LAUNCH_BOUND_SHARE` the report flags the run.

* FFN share: per FFN of a traced step, the host time between its start and
  end events' records (issuing its kernels) over its device time (the
  events' elapsed time). Above 1 the compute stream, once it has the FFNs
  back to back (the overlap), idles between them.
* step share: the host time from the step's start event to the last op's
  end record (everything the step issues, without the synchronize that
  reads its results) over the step's device time (its start and end events
  on the compute stream).

The host world (``--device cpu`` without ``--device-world``) runs the FFN
on the calling thread: there is no such split, and the figures are null.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from camp2p_overlap.core.observe.trace import TraceOp

#: At or above this host/device share an FFN or a step is launch-bound.
LAUNCH_BOUND_SHARE = 0.8

LAUNCH_SOURCE = (
    "traced steps: device time from timing events around each op, host time from the host clock between each op's "
    "two event records (the time its work took to issue); a step's host time runs from its start event to the last "
    "op's end record"
)

#: One traced step: ``{"ffn": [(host ns, device ns), ...], "step": (host ns, device ns) or None}``.
LaunchSample = dict[str, Any]


def launch_sample(ops: Sequence[TraceOp], spans: Sequence[tuple[int, int]]) -> LaunchSample | None:
    """One traced step's host and device times, from its ops and their host
    spans (the same order); None when the spans do not belong to the ops."""
    if len(spans) != len(ops) or not ops:
        return None
    ffn = [(h1 - h0, o.duration_ns) for o, (h0, h1) in zip(ops, spans, strict=True) if o.kind == "ffn"]
    step = None
    steps = [(o, h0) for o, (h0, _) in zip(ops, spans, strict=True) if o.kind == "step"]
    if steps:
        op, start = steps[0]
        issued = max((h1 for o, (_, h1) in zip(ops, spans, strict=True) if o.kind != "step"), default=start)
        step = (max(issued - start, 0), op.duration_ns)
    return {"ffn": ffn, "step": step}


def _share(host_ns: float | None, device_ns: float | None) -> float | None:
    if host_ns is None or not device_ns or device_ns <= 0:
        return None
    return round(host_ns / device_ns, 4)


def _us(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1e3, 3)


def launch_summary(samples: Sequence[LaunchSample]) -> dict[str, Any] | None:
    """Medians over traced steps: an FFN's host and device time and their
    share, a step's and theirs; None without a sample (the host world)."""
    if not samples:
        return None
    ffn = [pair for s in samples for pair in s["ffn"]]
    steps = [s["step"] for s in samples if s["step"] is not None]
    ffn_host = statistics.median(h for h, _ in ffn) if ffn else None
    ffn_device = statistics.median(d for _, d in ffn) if ffn else None
    step_host = statistics.median(h for h, _ in steps) if steps else None
    step_device = statistics.median(d for _, d in steps) if steps else None
    return {
        "steps": len(samples),
        "ffn_samples": len(ffn),
        "ffn_host_us": _us(ffn_host),
        "ffn_device_us": _us(ffn_device),
        "ffn_share": _share(ffn_host, ffn_device),
        "step_host_us": _us(step_host),
        "step_device_us": _us(step_device),
        "step_share": _share(step_host, step_device),
    }


def launch_verdict(
    serial: Mapping[str, Any] | None, policies: Mapping[str, Mapping[str, Any] | None]
) -> dict[str, Any] | None:
    """The run's verdict: serial's figures (its traced pass-through steps,
    the loop upstream runs), the threshold, and whether the run is
    launch-bound: serial's FFN share, or any policy's step share, at or
    above :data:`LAUNCH_BOUND_SHARE`; ``launch_bound_by`` says which."""
    if serial is None:
        return None
    by = []
    share = serial.get("ffn_share")
    if share is not None and share >= LAUNCH_BOUND_SHARE:
        by.append(
            f"an FFN takes {serial['ffn_host_us']:.0f} us to issue and {serial['ffn_device_us']:.0f} us on the device "
            f"(share {share:.2f})"
        )
    for name, p in policies.items():
        share = None if p is None else p.get("step_share")
        if share is not None and share >= LAUNCH_BOUND_SHARE:
            by.append(f"{name}'s step: share {share:.2f}")
    return {
        "source": LAUNCH_SOURCE,
        **serial,
        "threshold": LAUNCH_BOUND_SHARE,
        "launch_bound": bool(by),
        "launch_bound_by": by,
    }
