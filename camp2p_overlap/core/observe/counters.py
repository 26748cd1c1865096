"""Per-process step counters: how many FFN steps ran each path, and why
the serial ones did, and how many decode-graph replays ran each captured
variant and how many captures took each. ``camp2p_overlap.stats()`` reports them; their shape is documented
in the README ("Reading stats()") and kept stable for exporters.

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
#: The variants a decode graph replays: upstream's serial step, or the
#: patch layer's (the overlap, or the rollout mode's graph).
GRAPH_VARIANTS = ("serial", "overlap")


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
        self._steps = dict.fromkeys(PATHS, 0)
        self._serial_reasons: dict[str, int] = {}
        self._graph_replays = dict.fromkeys(GRAPH_VARIANTS, 0)
        self._graph_captures = dict.fromkeys(GRAPH_VARIANTS, 0)

    def _first(self) -> None:
        hook, self.on_first_step = self.on_first_step, None
        if hook is not None:
            hook()

    def overlap(self) -> None:
        self.engaged("overlap")

    def engaged(self, mode: str) -> None:
        """An engaged step of rollout ``mode``."""
        if mode not in ENGAGED:
            raise ValueError(f"{mode!r} is not an engaged path ({', '.join(ENGAGED)})")
        lock = self._lock  # as in serial()
        lock.acquire()
        try:
            self._steps[mode] += 1
        finally:
            lock.release()
        if self.on_first_step is not None:
            self._first()

    def serial(self, reason: str) -> None:
        lock = self._lock  # taken by hand (every step counts here): half a with block's cost
        lock.acquire()
        try:
            self._steps["serial"] += 1
            reasons = self._serial_reasons
            reasons[reason] = reasons.get(reason, 0) + 1
        finally:
            lock.release()
        if self.on_first_step is not None:
            self._first()

    def graph_replay(self, variant: str) -> None:
        """A replay of a decode graph's ``variant`` (not an eager step: ``steps`` is not counted)."""
        if variant not in GRAPH_VARIANTS:
            raise ValueError(f"{variant!r} is not a graph variant ({', '.join(GRAPH_VARIANTS)})")
        with self._lock:
            self._graph_replays[variant] += 1
        if self.on_first_step is not None:
            self._first()

    def graph_capture(self, variant: str) -> None:
        """A call of ``_ffn_forward`` inside a graph capture, which captured
        ``variant`` (not an eager step: ``steps`` is not counted)."""
        if variant not in GRAPH_VARIANTS:
            raise ValueError(f"{variant!r} is not a graph variant ({', '.join(GRAPH_VARIANTS)})")
        with self._lock:
            self._graph_captures[variant] += 1

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "steps": dict(self._steps),
                "serial_reasons": dict(self._serial_reasons),
                "graph_replays": dict(self._graph_replays),
                "graph_captures": dict(self._graph_captures),
            }
