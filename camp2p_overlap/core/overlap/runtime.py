"""What the steps of one patch engine share at run time: one state per runner
(``runner_state.py``), the session active on each thread, the session class
(tests substitute a recording subclass), the adaptive-engage state, and the
counters. What was learned and counted survives an unpatch."""

from __future__ import annotations

import threading
from typing import Any

from camp2p_overlap.core.env_vars import MAX_STAGES
from camp2p_overlap.core.observe.counters import StepCounters
from camp2p_overlap.core.overlap import graphs
from camp2p_overlap.core.overlap.adaptive import AdaptiveEngage
from camp2p_overlap.core.overlap.runner_state import RunnerStates
from camp2p_overlap.core.overlap.session import StepSession


class _ThreadState(threading.local):
    """What one thread's step holds: its session (None between steps)."""

    session: StepSession | None = None


class OverlapRuntime:
    def __init__(self) -> None:
        self.session_class: type[StepSession] = StepSession
        self.adaptive = AdaptiveEngage()
        self.counters = StepCounters()
        #: One state per runner, weakly held.
        self.runners = RunnerStates(range(MAX_STAGES), self)
        #: Per thread: ``session``, the step's session while one runs.
        self.local = _ThreadState()
        self._lock = threading.Lock()
        #: Second captures that failed (the key kept upstream's graph), by reason.
        self._capture_failures: dict[str, int] = {}
        #: Captures that took upstream's graph only (graph variants refused), by reason.
        self._refusals: dict[str, int] = {}

    def runner_name(self, runner: Any) -> str:
        """A short, stable name for a runner in bucket keys and stats."""
        try:
            return self.runners.get(runner).name
        except TypeError:  # not weak-referenceable
            return f"{type(runner).__name__}@{id(runner):x}"

    def graph_capture_failed(self, reason: str) -> None:
        with self._lock:
            self._capture_failures[reason] = self._capture_failures.get(reason, 0) + 1

    def graph_refused(self, reason: str) -> None:
        with self._lock:
            self._refusals[reason] = self._refusals.get(reason, 0) + 1

    def stats(self) -> dict[str, Any]:
        """The counters and every adaptive bucket (the ``stats()`` shape)."""
        states = self.runners.states()
        with self._lock:
            failures, refusals = dict(self._capture_failures), dict(self._refusals)
        return {
            **self.counters.to_dict(),
            "buckets": self.adaptive.snapshot(),
            "graphs": graphs.snapshot(states),
            "graph_capture_failures": failures,
            "graph_variants_refused": refusals,
        }

    def active_session(self) -> StepSession | None:
        """The session of the step running on this thread, if any."""
        return self.local.session

    def close(self) -> None:
        """On unpatch (no step or replay in flight): upstream's graph objects
        back, then every runner's side streams closed and all but its name dropped."""
        graphs.restore_all(self.runners.states())
        self.runners.close_all()
