"""The step counters of ``camp2p_overlap.stats()`` as Prometheus metrics, named as vLLM names its own, plus a
periodic one-line summary in the log. How they reach a scrape: docs/design.md, "Metrics".

They are synced from the runtime's counters, never on the step's path, and read host-side counts only (no device
event), so a scrape is safe during a graph capture. A forked child rebuilds them empty, so vLLM's multi-process
``/metrics`` never sums a parent's counts twice.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from camp2p_overlap.core.env_vars import DEFAULT_METRICS_ADDR, DEFAULTS
from camp2p_overlap.core.fork import after_fork_in_child
from camp2p_overlap.core.log import logger
from camp2p_overlap.core.observe.counters import GRAPH_CAPTURE_VARIANTS, PATHS
from camp2p_overlap.core.observe.decode_graphs import summary_note

PREFIX = "vllm:camp2p_overlap_"
STEPS = PREFIX + "steps"
SERIAL_STEPS = PREFIX + "serial_steps"
GRAPH_REPLAYS = PREFIX + "graph_replays"
#: Engaged steps by the layout they ran (``stats()["layout_steps"]``).
LAYOUT_STEPS = PREFIX + "layout_steps"
#: Replays of the patch layer's graph variant by the layout it captured (``stats()["graph_replay_layouts"]``).
LAYOUT_GRAPH_REPLAYS = PREFIX + "layout_graph_replays"
MODE_INFO = PREFIX + "mode_info"
#: The FFN rank group (``stats()["group"]``): its size, this rank's place, the channel, the state.
GROUP_INFO = PREFIX + "group_info"
#: The layouts an engaged step runs by default (VLLM_CAMP2P_MULTISTREAM_LAYOUT's default under ``overlap``).
DEFAULT_LAYOUTS: tuple[str, ...] = tuple(DEFAULTS["layouts"])
DEFAULT_RUNG = ",".join(DEFAULT_LAYOUTS)
#: ``stats()`` key -> the counter (attribute of :class:`StepMetrics`) synced from it, counted by label.
SYNCED = {
    "steps": "steps",
    "graph_replays": "graph_replays",
    "layout_steps": "layout_steps",
    "graph_replay_layouts": "layout_graph_replays",
}
#: Distinct serial reasons exported as their own label value; later ones
#: are counted under ``other`` (bounded label cardinality).
MAX_REASONS = 32
OTHER_REASON = "other"
#: Seconds between syncs into PROMETHEUS_MULTIPROC_DIR.
MULTIPROC_SYNC_S = 5.0

StatsFn = Callable[[], Mapping[str, Any]]


def multiproc_dir() -> str | None:
    """The directory vLLM's ``/metrics`` gathers multi-process metrics from, if set."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class StepMetrics:
    """Prometheus counters mirroring one runtime's step counters, in a
    registry of their own (served by the per-process endpoint; written to
    the multi-process directory as well when one is set)."""

    def __init__(
        self,
        stats: StatsFn,
        *,
        mode: str = "overlap",
        rung: str = DEFAULT_RUNG,
        layouts: Sequence[str] = DEFAULT_LAYOUTS,
    ) -> None:
        self._stats = stats
        self._build(mode, rung, tuple(layouts))
        after_fork_in_child(self._forget_in_child)

    def _build(self, mode: str, rung: str, layouts: tuple[str, ...]) -> None:
        """Fresh counters at zero in a registry of their own."""
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self._lock = threading.Lock()
        #: Per synced stats() key: the count each label had at the last sync.
        self._seen: dict[str, dict[str, int]] = {key: {} for key in SYNCED}
        self._seen_reasons: dict[str, int] = {}
        #: The reasons that have a label of their own (at most MAX_REASONS, for good).
        self._exported: set[str] = set()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)  # registered first: collected first (see collect)
        self.steps = Counter(
            STEPS,
            "FFN steps by the path they took: overlap, parity, reorder (engaged, by rollout mode) or serial.",
            labelnames=["path"],
            registry=self.registry,
        )
        self.serial_steps = Counter(
            SERIAL_STEPS,
            f"FFN steps that ran the serial path, by reason (after {MAX_REASONS} distinct reasons: '{OTHER_REASON}').",
            labelnames=["reason"],
            registry=self.registry,
        )
        self.graph_replays = Counter(
            GRAPH_REPLAYS,
            "Decode graph replays by the variant replayed: serial (upstream's graph) or overlap (the layer's).",
            labelnames=["variant"],
            registry=self.registry,
        )
        self.layout_steps = Counter(
            LAYOUT_STEPS,
            "Engaged FFN steps by the stream layout they ran: compute-side, comm-side (e2a-only, a2e-only with a"
            " direction switched off), parity or reorder.",
            labelnames=["layout"],
            registry=self.registry,
        )
        self.layout_graph_replays = Counter(
            LAYOUT_GRAPH_REPLAYS,
            "Decode graph replays of the layer's variant by the stream layout it captured.",
            labelnames=["layout"],
            registry=self.registry,
        )
        self.mode_info = Gauge(
            MODE_INFO,
            "1 for the rollout mode, ladder rung and stream layouts (comma-joined) this process runs with.",
            labelnames=["mode", "rung", "layouts"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.group_info = Gauge(
            GROUP_INFO,
            "1 for the FFN rank group this process is in (stats()['group']): its size, this rank's place in it, the"
            " channel its exchanges take ('none': one FFN rank) and its state (ok, broken, one FFN rank, ...).",
            labelnames=["size", "rank", "channel", "state"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self._group: tuple[str, str, str, str] | None = None
        self._mode: tuple[str, str, str] | None = None
        self._layouts: tuple[str, ...] = ()
        self.set_mode(mode, rung, layouts)
        for path in PATHS:
            self.steps.labels(path=path)  # every path exported, 0 until used
        for variant in GRAPH_CAPTURE_VARIANTS:
            self.graph_replays.labels(variant=variant)

    def _forget_in_child(self) -> None:
        """In a forked child: the same mode, nothing counted (the parent's counts are the parent's)."""
        mode, rung, _ = self._mode  # type: ignore[misc]  # set by the _build that made self
        self._build(mode, rung, self._layouts)

    def set_mode(self, mode: str, rung: str, layouts: Sequence[str] = DEFAULT_LAYOUTS) -> None:
        """The mode gauge: 1 for ``(mode, rung, layouts)`` (comma-joined, ``none`` when empty); the one before is set
        to 0 (what a multi-process directory keeps) and removed. Each layout is exported by the per-layout counters."""
        layouts = tuple(layouts)
        for layout in layouts:
            self.layout_steps.labels(layout=layout)
            self.layout_graph_replays.labels(layout=layout)
        self._layouts = layouts
        labels = (mode, rung, ",".join(layouts) or "none")
        if self._mode == labels:
            return
        if self._mode is not None:
            self.mode_info.labels(*self._mode).set(0)
            self.mode_info.remove(*self._mode)
        self.mode_info.labels(*labels).set(1)
        self._mode = labels

    def set_group(self, group: Mapping[str, Any]) -> None:
        """The group gauge: 1 for ``group``'s (size, rank, channel, state) (``stats()["group"]``; a missing channel
        is ``none``); the label set before is set to 0 and removed when it changes."""
        labels = (
            str(group.get("size", 1)),
            str(group.get("rank", 0)),
            str(group.get("channel") or "none"),
            str(group.get("state") or "none"),
        )
        if self._group == labels:
            return
        if self._group is not None:
            self.group_info.labels(*self._group).set(0)
            self.group_info.remove(*self._group)
        self.group_info.labels(*labels).set(1)
        self._group = labels

    def sync(self) -> None:
        """Add to each counter what the runtime counted since the last sync, and show the group it is in now."""
        snap = self._stats()
        with self._lock:
            group = snap.get("group")
            if isinstance(group, Mapping):
                self.set_group(group)
            for key, attr in SYNCED.items():
                counter, seen = getattr(self, attr), self._seen[key]
                for label, count in snap.get(key, {}).items():
                    delta = int(count) - seen.get(label, 0)
                    if delta > 0:
                        counter.labels(label).inc(delta)
                        seen[label] = int(count)
            exported = self._exported
            for reason, count in snap.get("serial_reasons", {}).items():
                delta = int(count) - self._seen_reasons.get(reason, 0)
                if delta <= 0:
                    continue
                self._seen_reasons[reason] = int(count)
                if reason not in exported and len(exported) >= MAX_REASONS:
                    label = OTHER_REASON
                else:
                    label = reason
                    exported.add(reason)
                self.serial_steps.labels(reason=label).inc(delta)

    def collect(self) -> list[Any]:
        """As the registry's first collector, with no metrics of its own: sync when a scrape starts, so the
        endpoint serves what ``stats()`` says now."""
        try:
            self.sync()
        except Exception:  # noqa: BLE001 - a scrape must not fail on our account
            logger.exception("camp2p-overlap: could not sync the step metrics")
        return []

    def describe(self) -> list[Any]:
        return []


def _counts(
    snap: Mapping[str, Any], previous: Mapping[str, Any] | None, key: str, names: Sequence[str], sep: str
) -> str:
    """``<name><sep><n>`` of each of ``names`` in ``snap[key]``, with ``(+<grown>)`` since ``previous`` when it grew;
    joined by blanks (``sep`` ``=``) or commas."""
    counts, before = snap.get(key, {}), None if previous is None else previous.get(key, {})
    out = []
    for name in names:
        n = int(counts.get(name, 0))
        grew = n - int((before or {}).get(name, 0))
        out.append(f"{name}{sep}{n}" + (f" (+{grew})" if before is not None and grew else ""))
    return (" " if sep == "=" else ", ").join(out)


def summary_line(snap: Mapping[str, Any], previous: Mapping[str, Any] | None = None, graph: str | None = None) -> str:
    """One line of counts (each with its change since ``previous``): steps per path; once there are any, steps
    per layout (a layout named as its path, ``parity`` or ``reorder``, is left out) and graph replays per variant
    and captured layout; whether decode replays upstream's graph (``decode_graphs.summary_note``; ``graph``: the
    VLLM_CAMP2P_MULTISTREAM_GRAPH setting); the most frequent serial reason."""
    text = "camp2p-overlap steps: " + _counts(snap, previous, "steps", PATHS, "=")
    layouts = sorted(k for k in snap.get("layout_steps", {}) if k not in PATHS)
    if layouts:
        text += "; by layout: " + _counts(snap, previous, "layout_steps", layouts, "=")
    replays = snap.get("graph_replays", {})
    if any(int(replays.get(v, 0)) for v in GRAPH_CAPTURE_VARIANTS):
        text += "; graph replays: " + _counts(snap, previous, "graph_replays", GRAPH_CAPTURE_VARIANTS, " ")
        captured = sorted(snap.get("graph_replay_layouts", {}))
        if captured:
            text += f" (by layout: {_counts(snap, previous, 'graph_replay_layouts', captured, ' ')})"
    reasons = snap.get("serial_reasons", {})
    note = summary_note(snap, graph)
    if note is not None:
        text += f"; {note}"
    if reasons:
        top = max(reasons.items(), key=lambda kv: kv[1])
        text += f"; top serial reason ({top[1]}): {top[0]}"
    return text


class Reporter:
    """The per-process reporting: the metrics, the opt-in endpoint and the
    daemon thread that syncs them into the multi-process directory and logs
    the one-line summary when the counts changed. Its endpoint (``port`` not
    None) listens on ``addr``; ``graph``: the VLLM_CAMP2P_MULTISTREAM_GRAPH
    setting (for the summary); ``layouts``: those an engaged step runs (the
    mode gauge's label)."""

    def __init__(
        self,
        stats: StatsFn,
        *,
        port: int | None,
        summary_s: float,
        mode: str = "overlap",
        rung: str = DEFAULT_RUNG,
        addr: str = DEFAULT_METRICS_ADDR,  # loopback unless VLLM_CAMP2P_MULTISTREAM_METRICS_ADDR says otherwise
        metrics: StepMetrics | None = None,
        graph: str | None = None,
        layouts: Sequence[str] = DEFAULT_LAYOUTS,
    ) -> None:
        self._stats = stats
        self.graph = graph
        self.metrics = metrics if metrics is not None else StepMetrics(stats, mode=mode, rung=rung, layouts=layouts)
        self.metrics.set_mode(mode, rung, layouts)
        self.summary_s = summary_s
        self.server: Any = None
        self.port: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: dict[str, dict[str, int]] | None = None
        if port is not None:
            self._serve(port, addr)
        tick = self._tick_s()
        if tick is not None:
            self._thread = threading.Thread(target=self._run, args=(tick,), name="camp2p-overlap-reporter", daemon=True)
            self._thread.start()

    def _tick_s(self) -> float | None:
        ticks = [t for t in (self.summary_s, MULTIPROC_SYNC_S if multiproc_dir() else 0.0) if t > 0]
        return min(ticks) if ticks else None

    def _serve(self, port: int, addr: str) -> None:
        from prometheus_client import start_http_server

        try:
            self.server, _ = start_http_server(port, addr=addr, registry=self.metrics.registry)
        except OSError as exc:
            logger.warning("camp2p-overlap: metrics endpoint not started: cannot listen on %s:%d (%s)", addr, port, exc)
            return
        self.port = int(self.server.server_port)
        logger.info("camp2p-overlap: serving this process's step metrics on http://%s:%d/metrics", addr, self.port)

    def _run(self, tick: float) -> None:
        since_summary = 0.0
        while not self._stop.wait(tick):
            since_summary += tick
            try:
                if multiproc_dir():
                    self.metrics.sync()
                if self.summary_s > 0 and since_summary >= self.summary_s:
                    since_summary = 0.0
                    self.log_summary()
            except Exception:  # noqa: BLE001 - reporting never breaks the worker
                logger.exception("camp2p-overlap: step reporting failed")

    def log_summary(self) -> bool:
        """Log the one-line summary if the counts (steps or graph replays, by
        path, variant or layout) changed since the last one."""
        snap = self._stats()
        counts = {key: {k: int(v) for k, v in snap.get(key, {}).items()} for key in SYNCED}
        if counts == self._last:
            return False
        logger.log(logging.INFO, "%s", summary_line(snap, self._last, self.graph))
        self._last = counts
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


_lock = threading.Lock()
_reporter: Reporter | None = None
#: The process's counters, made once: they outlive a reporter (a second set
#: in one process would count twice into PROMETHEUS_MULTIPROC_DIR).
_metrics: StepMetrics | None = None


def start_reporting(stats: StatsFn, **options: Any) -> Reporter | None:
    """The process's reporter, started once (later calls return it until
    :func:`stop_reporting`) with :class:`Reporter`'s ``options`` (``port``,
    ``summary_s``, ``mode`` and ``rung`` required; ``addr``, ``graph``,
    ``layouts``). Never raises: a reporter that cannot start is logged and
    skipped."""
    global _reporter, _metrics
    with _lock:
        if _reporter is not None:
            return _reporter
        try:
            if _metrics is None:
                modes = {"layouts": DEFAULT_LAYOUTS, **options}
                _metrics = StepMetrics(stats, mode=modes["mode"], rung=modes["rung"], layouts=modes["layouts"])
            _reporter = Reporter(stats, metrics=_metrics, **options)
        except Exception:  # noqa: BLE001 - never break a step
            logger.exception("camp2p-overlap: step metrics not started")
            return None
        return _reporter


def current_reporter() -> Reporter | None:
    """The process's running reporter, or None while none runs."""
    return _reporter


def stop_reporting() -> None:
    """Stop the process's reporter thread and endpoint (on unpatch); the
    counters stay, and a later start serves them again."""
    global _reporter
    with _lock:
        reporter, _reporter = _reporter, None
    if reporter is not None:
        reporter.close()


def _forget_in_child() -> None:
    """A forked child has none of the parent's threads or endpoint: no
    reporter there until its own first step. The process's metrics stay
    (they start from zero in the child: ``StepMetrics._forget_in_child``)."""
    global _reporter, _lock
    _lock = threading.Lock()
    _reporter = None


after_fork_in_child(_forget_in_child)
