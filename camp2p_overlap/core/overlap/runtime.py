"""What the steps of one patch engine share at run time: one state per runner
(``runner_state.py``), the session active on each thread, the session class
(tests substitute a recording subclass), the adaptive-engage state, and the
counters. What was learned and counted survives an unpatch."""

from __future__ import annotations

import logging
import threading
from typing import Any

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.env_vars import MAX_STAGES
from camp2p_overlap.core.fork import after_fork_in_child
from camp2p_overlap.core.log import log_once, logger
from camp2p_overlap.core.observe.counters import StepCounters
from camp2p_overlap.core.overlap import graphs
from camp2p_overlap.core.overlap.adaptive import AdaptiveEngage
from camp2p_overlap.core.overlap.rank_group import (
    ExchangeFailed,
    Membership,
    RankGroup,
    configuration,
    disagreement,
    discover,
)
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
        self._leave_group()
        after_fork_in_child(self._leave_group)

    # -- the FFN ranks this rank decides with (docs/design.md, "Many FFN ranks") ---------------
    def _leave_group(self) -> None:
        """Not joined (at creation, and in a forked child: the group is the parent's)."""
        #: The group (None: one FFN rank, or not joined yet: ``group_joined``).
        self.group: RankGroup | None = None
        self.group_joined = False
        #: Why adaptive engage is off on this rank (its ranks cannot be told apart or reached), or None.
        self.adaptive_off: str | None = None
        self.adaptive.group = None

    def join_group(self, config: OverlapConfig, stack: str | None, found: Membership | None = None) -> None:
        """At the first engaged step: find the FFN ranks that share the MoE's collectives (``found``, else
        :func:`discover`; one: nothing changes), compare the configuration with them (a difference, or no answer in
        time, breaks the group: every rank runs upstream's path), then decide with them and start the heartbeat."""
        self.group_joined = True
        if found is None:
            found = discover()
        if found.problem is not None:
            self.adaptive_off = f"the FFN ranks cannot be told apart or reached: {found.problem}"
            log_once(logging.WARNING, "group", "camp2p-overlap: adaptive engage is off: %s", self.adaptive_off)
            return
        if found.size == 1:
            return
        group = self.group = RankGroup(found, timeout_s=config.group_timeout_s)
        self.adaptive.group = group
        try:
            posts = group.exchange("configuration", configuration(config, stack))
        except ExchangeFailed:
            return  # broken (logged): upstream's path on every step
        differs = disagreement(posts)
        if differs is not None:
            group.fail(f"the FFN ranks' configurations differ ({differs})")
            return
        group.start_heartbeat()
        logger.info(
            "camp2p-overlap: FFN rank %d of a group of %d (%s %s), deciding together over the %s",
            group.rank,
            group.size,
            group.source,
            list(group.members),
            group.channel,
        )

    def group_stats(self) -> dict[str, Any]:
        """The group as ``stats()["group"]`` shows it."""
        if self.group is not None:
            return self.group.describe()
        state = "not joined yet" if not self.group_joined else (self.adaptive_off or "one FFN rank")
        return {
            "size": 1,
            "rank": 0,
            "members": [0],
            "source": None,
            "channel": None,
            "timeout_s": None,
            "exchanges": 0,
            "state": state,
            "broken": None,
        }

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
            "group": self.group_stats(),
        }

    def active_session(self) -> StepSession | None:
        """The session of the step running on this thread, if any."""
        return self.local.session

    def close(self) -> None:
        """On unpatch (no step or replay in flight): upstream's graph objects
        back, then every runner's side streams closed and all but its name dropped."""
        graphs.restore_all(self.runners.states())
        self.runners.close_all()
        if self.group is not None:
            self.group.stop()
