"""Per-process step counters: how many FFN steps ran each path, and why
the serial ones did, and how many decode-graph replays and captures each
variant had. ``camp2p_overlap.stats()`` reports them; their shape is
documented in the README ("Reading stats()") and kept stable for exporters.

A forked child starts from zero: what its parent counted is the parent's
(vLLM's multi-process metrics directory sums the processes, so a child
reporting its parent's counts would count them twice)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from camp2p_overlap.core.fork import after_fork_in_child

#: The paths a step can take: an engaged step counts under its rollout mode
#: (``overlap``, ``parity``, ``reorder``; see VLLM_CAMP2P_MULTISTREAM_MODE),
#: any other under ``serial`` with its reason.
PATHS = ("overlap", "parity", "reorder", "serial")
ENGAGED = ("overlap", "parity", "reorder")
#: The variants a decode graph captures and replays: upstream's serial
#: step, or the patch layer's (the overlap, or the rollout mode's graph).
GRAPH_CAPTURE_VARIANTS = ("serial", "overlap")


class _ThreadTally(threading.local):
    """One thread's step counts (written by that thread only, so without a
    lock), listed in ``tallies`` when the thread first counts a step."""

    def __init__(
        self, tallies: list[tuple[dict[str, int], dict[str, int], dict[str, int]]], lock: threading.Lock
    ) -> None:
        self.steps = dict.fromkeys(PATHS, 0)
        self.reasons: dict[str, int] = {}
        #: Engaged steps by the layout they ran.
        self.layouts: dict[str, int] = {}
        with lock:
            tallies.append((self.steps, self.reasons, self.layouts))


class StepCounters:
    def __init__(self) -> None:
        self._zero()
        #: Called once, after the first step or replay is counted (the
        #: process-wide patch layer starts its metrics and summary there: only
        #: processes that run FFN steps report).
        self.on_first_step: Callable[[], None] | None = None
        after_fork_in_child(self._zero)

    def _zero(self) -> None:
        """Nothing counted (at creation, and in a forked child: a new lock
        too, as a thread of the parent may have held the old one)."""
        self._lock = threading.Lock()
        #: Every thread's (steps, serial reasons), kept after the thread ends.
        self._tallies: list[tuple[dict[str, int], dict[str, int], dict[str, int]]] = []
        #: This thread's: steps are counted per thread, each by its own
        #: thread, so counting one takes no lock; to_dict() sums them.
        self._here = _ThreadTally(self._tallies, self._lock)
        self._graph_replays = dict.fromkeys(GRAPH_CAPTURE_VARIANTS, 0)
        self._graph_captures = dict.fromkeys(GRAPH_CAPTURE_VARIANTS, 0)
        #: Replays of the patch layer's variant, by the layout it captured.
        self._graph_replay_layouts: dict[str, int] = {}

    def _first(self) -> None:
        """Run the first-step hook once (callers read ``on_first_step`` first: steps after the first never call
        this, and never write it)."""
        hook, self.on_first_step = self.on_first_step, None
        if hook is not None:
            hook()

    def engaged(self, mode: str, layout: str) -> None:
        """An engaged step of rollout ``mode``, run in ``layout``."""
        if mode not in ENGAGED:
            raise ValueError(f"{mode!r} is not an engaged path ({', '.join(ENGAGED)})")
        here = self._here  # this thread's own counts: no lock
        here.steps[mode] += 1
        here.layouts[layout] = here.layouts.get(layout, 0) + 1
        if self.on_first_step is not None:
            self._first()

    def serial(self, reason: str) -> None:
        # this thread's own counts, no lock; to_dict adds its reasons up into steps["serial"]
        reasons = self._here.reasons
        reasons[reason] = reasons.get(reason, 0) + 1
        if self.on_first_step is not None:
            self._first()

    def graph_replay(self, variant: str, layout: str = "") -> None:
        """A replay of a decode graph's ``variant`` (not an eager step: ``steps`` is not counted); the patch
        layer's variant names the ``layout`` it captured."""
        self._count_graph(self._graph_replays, variant)
        if layout:
            with self._lock:
                self._graph_replay_layouts[layout] = self._graph_replay_layouts.get(layout, 0) + 1
        if self.on_first_step is not None:
            self._first()

    def graph_capture(self, variant: str) -> None:
        """A call of ``_ffn_forward`` inside a graph capture, which captured
        ``variant`` (not an eager step: ``steps`` is not counted)."""
        self._count_graph(self._graph_captures, variant)

    def _count_graph(self, counts: dict[str, int], variant: str) -> None:
        if variant not in GRAPH_CAPTURE_VARIANTS:
            raise ValueError(f"{variant!r} is not a graph variant ({', '.join(GRAPH_CAPTURE_VARIANTS)})")
        with self._lock:
            counts[variant] += 1

    def to_dict(self) -> dict[str, Any]:
        steps = dict.fromkeys(PATHS, 0)
        reasons: dict[str, int] = {}
        layouts: dict[str, int] = {}
        with self._lock:
            # dict() copies a thread's counts in one step under the GIL, while
            # that thread may go on counting.
            tallies = [(dict(s), dict(r), dict(la)) for s, r, la in self._tallies]
            replays, captures = dict(self._graph_replays), dict(self._graph_captures)
            replay_layouts = dict(self._graph_replay_layouts)
        for thread_steps, thread_reasons, thread_layouts in tallies:
            for path, n in thread_steps.items():
                steps[path] += n
            for layout, n in thread_layouts.items():
                layouts[layout] = layouts.get(layout, 0) + n
            for reason, n in thread_reasons.items():
                reasons[reason] = reasons.get(reason, 0) + n
                steps["serial"] += n  # a serial step is counted under its reason only
        return {
            "steps": steps,
            "serial_reasons": reasons,
            "layout_steps": layouts,
            "graph_replays": replays,
            "graph_replay_layouts": replay_layouts,
            "graph_captures": captures,
        }
