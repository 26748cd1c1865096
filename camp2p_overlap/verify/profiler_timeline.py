"""Per-stream device timelines from a profiler trace (Kineto's Chrome
trace-event JSON from ``torch.profiler`` on CUDA), turned into the
:class:`~camp2p_overlap.core.observe.trace.TraceOp` the edge checker reads.
``torch_npu.profiler``'s ``trace_view.json`` is read the same way where its
device tasks carry a ``Stream Id`` and are tied to their launch by a
host-to-device flow event; that reading has not yet met a real NPU trace.

What the trace must hold (the annotating step session writes it, see
``annotated_backend.py``; the profiling tool adds the stream markers and
the step fences):

* host ranges named ``camp2p:<kind> L<layer> s<stage>`` around each op the
  session issued (``a2e``, ``e2a``: the op's ``OpKey.label()``),
  ``camp2p:record <stream> <key>`` and ``camp2p:wait <stream> <key>``
  around each event record and wait (the event's ``EventKey.label()``,
  ``annotated_backend.py``'s ``event_range_name``);
* ``camp2p:stream <name>`` around a marker launched on each stream
  (``C``, ``K0``, ...): its kernels name the device stream ids;
* ``camp2p:step-begin`` / ``camp2p:step-end`` around a marker on C right
  before and right after the step. A fence is every activity launched
  inside its range, from the first one's start to the last one's end (a
  marker may be more than one kernel), and each range is entered once.

Each device activity (kernel, memcpy, memset) is tied to the host call
that launched it (the ``correlation`` id Kineto gives the launch and the
kernel, else a flow event from host to device), and so to the ``camp2p:``
range around that launch. An FFN is the upstream loop's own code, which we
do not annotate: its kernels are those the loop thread launched between
the last ``camp2p:`` range before ``record C f L<L> s<s>`` and that record
(the session records ``f`` on C first thing in each send, and nothing of
the session runs between a receive's return and that send).

Times are device times in ns (Kineto writes µs). Only timings are device
truth here: the event graph of the CPU backend's log has no counterpart in
a kernel trace, so the checker runs its timing checks (``source="device"``).
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from camp2p_overlap.core.keys import COMPUTE_STREAM, F_DONE, FFN_STREAM, OpKey
from camp2p_overlap.core.observe.trace import TraceOp
from camp2p_overlap.verify.annotated_backend import RANGE_PREFIX, parse_event_range
from camp2p_overlap.verify.edges import to_chrome_trace

#: Chrome-trace categories of device activities (Kineto).
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
#: Device-side copies of host ranges (not host ranges themselves).
DEVICE_ANNOTATIONS = frozenset({"gpu_user_annotation"})


class TimelineError(ValueError):
    """The profiler trace cannot be read as a device timeline (says why)."""


@dataclass(frozen=True)
class HostRange:
    """A ``camp2p:`` range on a host thread (the prefix stripped)."""

    name: str
    thread: tuple[Any, Any]
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class DeviceActivity:
    """One kernel (or copy, or memset) on a device stream."""

    name: str
    device_stream: str
    start_ns: int
    end_ns: int
    #: Host thread and time of the call that launched it (None: not linked).
    thread: tuple[Any, Any] | None
    launched_ns: int | None


@dataclass
class DeviceTimeline:
    """A profiler trace read as per-stream device timelines."""

    activities: list[DeviceActivity]
    ranges: list[HostRange]
    #: device stream id -> our name (C, K0, ...), from the stream markers.
    names: dict[str, str] = field(default_factory=dict)
    #: (kind, layer, stage) or a marker name, per activity (same order); None: not ours.
    owner: list[tuple[Any, ...] | None] = field(default_factory=list)

    def stream_name(self, device_stream: str) -> str:
        return self.names.get(device_stream, f"stream {device_stream}")

    def per_stream(self) -> dict[str, list[DeviceActivity]]:
        """Every activity, by our stream name, in device time order."""
        out: dict[str, list[DeviceActivity]] = defaultdict(list)
        for a in sorted(self.activities, key=lambda a: (a.start_ns, a.end_ns)):
            out[self.stream_name(a.device_stream)].append(a)
        return dict(out)

    def trace_ops(self, step: int = 0) -> list[TraceOp]:
        """One :class:`TraceOp` per op and stream it ran on (its first
        activity's start to its last one's end), and the step span (from the
        end of the fence before the step to the start of the fence after it;
        none if either fence is missing)."""
        spans: dict[tuple[Any, ...], list[int]] = {}
        for a, who in zip(self.activities, self.owner, strict=True):
            if who is None or who[0] not in ("a2e", "ffn", "e2a"):
                continue
            key = (*who, self.stream_name(a.device_stream))
            span = spans.setdefault(key, [a.start_ns, a.end_ns])
            span[0], span[1] = min(span[0], a.start_ns), max(span[1], a.end_ns)
        ops = [TraceOp(k, L, s, stream, t0, t1, step) for (k, L, s, stream), (t0, t1) in spans.items()]
        begin = self.fence("step-begin")
        end = self.fence("step-end")
        if begin is not None and end is not None:
            ops.append(TraceOp("step", None, None, COMPUTE_STREAM, begin[1], end[0], step))
        return sorted(ops, key=lambda o: (o.start_ns, o.end_ns))

    def kernel_ops(self, step: int = 0) -> list[TraceOp]:
        """Every activity as a ``kernel`` TraceOp on its named stream (for the
        Chrome trace: the kernels under each op)."""
        return [
            TraceOp(
                "kernel",
                who[1] if who and len(who) == 3 else None,
                who[2] if who and len(who) == 3 else None,
                self.stream_name(a.device_stream),
                a.start_ns,
                a.end_ns,
                step,
                a.name,
            )
            for a, who in zip(self.activities, self.owner, strict=True)
        ]

    def chrome_trace(self, step: int = 0, process: str = "device") -> list[dict]:
        """The ops and their kernels, one track per named stream (Perfetto)."""
        return to_chrome_trace([*self.trace_ops(step), *self.kernel_ops(step)], process=process)

    def fence(self, name: str) -> tuple[int, int] | None:
        """The device span (first start, last end) of every activity launched
        inside the one ``camp2p:<name>`` range; None if that range is not in
        the trace exactly once or launched nothing that reached the device."""
        if sum(1 for r in self.ranges if r.name == name) != 1:
            return None
        found = [a for a, who in zip(self.activities, self.owner, strict=True) if who == ("marker", name)]
        if not found:
            return None
        return min(a.start_ns for a in found), max(a.end_ns for a in found)


# ---------------------------------------------------------------------------
# reading the trace


def _ns(value: Any) -> int:
    return round(float(value) * 1000.0)


def _events(trace: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    if isinstance(trace, Mapping):
        events = trace.get("traceEvents")
        if events is None:
            raise TimelineError("not a Chrome trace: no traceEvents")
        return list(events)
    return list(trace)


def _is_device(ev: Mapping[str, Any]) -> bool:
    if ev.get("ph") != "X":
        return False
    cat = str(ev.get("cat", "")).lower()
    return cat in DEVICE_CATEGORIES or (cat not in DEVICE_ANNOTATIONS and "Task Type" in (ev.get("args") or {}))


def _stream_of(ev: Mapping[str, Any]) -> str:
    args = ev.get("args") or {}
    for key in ("stream", "Stream Id", "stream_id"):
        if key in args:
            return str(args[key])
    return str(ev.get("tid"))


def load(path: str) -> DeviceTimeline:
    """:func:`parse` the Chrome trace JSON at ``path``."""
    with open(path, encoding="utf-8") as f:
        return parse(json.load(f))


def parse(trace: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> DeviceTimeline:
    """Read a profiler trace (a Chrome trace dict, or its event list)."""
    events = _events(trace)
    ranges: list[HostRange] = []
    launches: dict[Any, tuple[tuple[Any, Any], int]] = {}  # correlation -> (thread, host ns)
    device: list[Mapping[str, Any]] = []
    flow_start: dict[Any, tuple[tuple[Any, Any], int]] = {}
    flow_end: dict[tuple[Any, Any, int], Any] = {}  # (pid, tid, device ts) -> flow id
    for ev in events:
        ph = ev.get("ph")
        if ph in ("s", "f"):
            where = (ev.get("pid"), ev.get("tid"))
            if ph == "s":
                flow_start[(ev.get("cat"), ev.get("id"))] = (where, _ns(ev.get("ts", 0)))
            else:
                flow_end[(*where, _ns(ev.get("ts", 0)))] = (ev.get("cat"), ev.get("id"))
            continue
        if ph != "X":
            continue
        if _is_device(ev):
            device.append(ev)
            continue
        if str(ev.get("cat", "")).lower() in DEVICE_ANNOTATIONS:
            continue
        name = str(ev.get("name", ""))
        thread = (ev.get("pid"), ev.get("tid"))
        start = _ns(ev.get("ts", 0))
        end = start + _ns(ev.get("dur", 0))
        if name.startswith(RANGE_PREFIX):
            ranges.append(HostRange(name[len(RANGE_PREFIX) :], thread, start, end))
        corr = (ev.get("args") or {}).get("correlation")
        if corr is not None:
            launches[corr] = (thread, start)
    activities = []
    for ev in device:
        start = _ns(ev.get("ts", 0))
        link = None
        corr = (ev.get("args") or {}).get("correlation")
        if corr is not None and corr in launches:
            link = launches[corr]
        else:
            fid = flow_end.get((ev.get("pid"), ev.get("tid"), start))
            if fid is not None and fid in flow_start:
                link = flow_start[fid]
        activities.append(
            DeviceActivity(
                str(ev.get("name", "")),
                _stream_of(ev),
                start,
                start + _ns(ev.get("dur", 0)),
                link[0] if link else None,
                link[1] if link else None,
            )
        )
    activities.sort(key=lambda a: (a.start_ns, a.end_ns))
    ranges.sort(key=lambda r: (r.start_ns, -r.end_ns))
    timeline = DeviceTimeline(activities, ranges)
    timeline.owner = _attribute(activities, ranges)
    timeline.names = _stream_names(activities, timeline.owner)
    return timeline


def _attribute(activities: Sequence[DeviceActivity], ranges: Sequence[HostRange]) -> list[tuple[Any, ...] | None]:
    """Who launched each activity: an op's range, a marker, or an FFN window."""
    by_thread: dict[tuple[Any, Any], list[HostRange]] = defaultdict(list)
    for r in ranges:
        by_thread[r.thread].append(r)
    # FFN windows per thread: (window start, window end, layer, stage).
    windows: dict[tuple[Any, Any], list[tuple[int, int, int, int]]] = defaultdict(list)
    for thread, rs in by_thread.items():
        for i, r in enumerate(rs):
            f_done = _f_done_on_compute(r.name)
            if f_done is not None and i > 0:
                windows[thread].append((rs[i - 1].end_ns, r.start_ns, *f_done))
    starts = {thread: [r.start_ns for r in rs] for thread, rs in by_thread.items()}
    owner: list[tuple[Any, ...] | None] = []
    for a in activities:
        if a.thread is None or a.launched_ns is None:
            owner.append(None)
            continue
        inner = _innermost(by_thread.get(a.thread, []), starts.get(a.thread, []), a.launched_ns)
        if inner is not None:
            owner.append(_owner_of(inner.name))
            continue
        found = None
        for w0, w1, L, s in windows.get(a.thread, []):
            if w0 <= a.launched_ns <= w1:
                found = ("ffn", L, s)
                break
        owner.append(found)
    return owner


def _innermost(ranges: Sequence[HostRange], starts: Sequence[int], t: int) -> HostRange | None:
    """The latest-starting range that contains ``t`` (ranges sorted by
    start; ``starts``: their start times)."""
    i = bisect.bisect_right(starts, t)
    for r in reversed(ranges[:i]):
        if r.start_ns <= t <= r.end_ns:
            return r
    return None


def _f_done_on_compute(name: str) -> tuple[int, int] | None:
    """(layer, stage) of a range around the record of ``f_done(L, s)`` on the
    FFN's stream (C, or F in ``compute-side``: what ends an FFN window), else None."""
    got = parse_event_range(name)
    if got is None:
        return None
    action, stream, key = got
    if action != "record" or stream not in (COMPUTE_STREAM, FFN_STREAM) or key.kind != F_DONE:
        return None
    if key.layer is None or key.stage is None:
        return None
    return key.layer, key.stage


def _owner_of(name: str) -> tuple[Any, ...] | None:
    op = OpKey.parse(name)
    if op is not None and op.layer is not None and op.stage is not None:
        return tuple(op)
    if name.startswith("stream "):
        return ("stream", name[len("stream ") :])
    if name in ("step-begin", "step-end"):
        return ("marker", name)
    return None


def _stream_names(activities: Iterable[DeviceActivity], owner: Sequence[tuple[Any, ...] | None]) -> dict[str, str]:
    names: dict[str, str] = {}
    for a, who in zip(activities, owner, strict=True):
        if who is not None and who[0] == "stream":
            names.setdefault(a.device_stream, who[1])
    return names
