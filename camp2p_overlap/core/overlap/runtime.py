"""What the steps of one patch engine share at run time: the side streams
of each runner, the session active on each thread, the session class
(tests substitute a recording subclass), the adaptive-engage state, the
step timings not yet read, each runner's last planned shape, and the step
counters. The engine closes the side streams on unpatch through its
on-unpatch hook; what was learned and counted survives an unpatch."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core.config import MAX_STAGES
from camp2p_overlap.core.observe.counters import StepCounters
from camp2p_overlap.core.overlap.adaptive import AdaptiveEngage, BucketKey, Path
from camp2p_overlap.core.overlap.graphs import GraphVariants
from camp2p_overlap.core.overlap.session import OverlapSession
from camp2p_overlap.core.overlap.streams.base import StreamBackend
from camp2p_overlap.core.overlap.streams.streamset import StreamSetRegistry

#: Step timings waiting for their device events, at most (older ones are dropped).
MAX_PENDING_TIMINGS = 64


class _ThreadState(threading.local):
    """What one thread's step holds: its session (None between steps)."""

    session: OverlapSession | None = None
    #: While the layer captures its variant of a decode graph (GRAPH=adaptive):
    #: ``{"engaged": bool, "layers": int}``, filled by the captured step.
    graph_variant: dict[str, Any] | None = None


@dataclass(frozen=True)
class PlannedShape:
    """What a runner's last planned adaptive step showed that its next
    decided-serial steps reuse without planning: the runner's name in bucket
    keys, its layer count and its stream backend (for the step timing)."""

    runner: str
    layers: int
    backend: StreamBackend


class OverlapRuntime:
    def __init__(self) -> None:
        self.streamsets = StreamSetRegistry(range(MAX_STAGES))
        self.session_class: type[OverlapSession] = OverlapSession
        self.adaptive = AdaptiveEngage()
        self.counters = StepCounters()
        #: Decode graph keys captured with both variants (GRAPH=adaptive).
        self.graphs = GraphVariants()
        #: Per thread: ``session``, the step's session while one runs.
        self.local = _ThreadState()
        self._pending: deque[tuple[BucketKey, Path, StreamBackend, Any]] = deque()
        self._pending_lock = threading.Lock()
        self._runner_names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._runner_ids = itertools.count()
        #: Per runner: its last planned adaptive step's shape (cleared on close).
        #: (a weak reference to the runner, its shape), by the runner's id:
        #: read with one dict lookup on every decided-serial step.
        self._planned: dict[int, tuple[weakref.ref[Any], PlannedShape]] = {}

    def runner_name(self, runner: Any) -> str:
        """A short, stable name for a runner in bucket keys and stats."""
        try:
            name = self._runner_names.get(runner)
            if name is None:
                name = self._runner_names[runner] = f"{type(runner).__name__}#{next(self._runner_ids)}"
            return name
        except TypeError:  # not weak-referenceable
            return f"{type(runner).__name__}@{id(runner):x}"

    def remember_planned_shape(self, runner: Any, shape: PlannedShape) -> None:
        """Remember ``shape`` as the runner's last planned one (forgotten
        when the runner is collected)."""
        rid = id(runner)
        entry = self._planned.get(rid)
        if entry is not None and entry[0]() is runner:
            self._planned[rid] = (entry[0], shape)
            return
        planned = self._planned

        def forget(ref: weakref.ref[Any]) -> None:  # the runner was collected
            if planned.get(rid, (None,))[0] is ref:
                del planned[rid]

        try:
            ref = weakref.ref(runner, forget)
        except TypeError:  # not weak-referenceable: every step plans
            return
        planned[rid] = (ref, shape)

    def planned_shape_count(self) -> int:
        """How many runners' planned shapes are remembered (a collected
        runner's is forgotten)."""
        return len(self._planned)

    def planned_shape(self, runner: Any) -> PlannedShape | None:
        """The runner's last planned shape, if any."""
        entry = self._planned.get(id(runner))
        return entry[1] if entry is not None and entry[0]() is runner else None

    def record_step_time(self, key: BucketKey, mode: Path, backend: StreamBackend, token: Any) -> None:
        """A step's timing, to be read when its events have completed: at
        once when it is known now and none older waits, else queued (and
        the older ones read that are ready)."""
        with self._pending_lock:
            older = bool(self._pending)
            seconds = None if older else backend.elapsed(token)
            if seconds is None:
                self._pending.append((key, mode, backend, token))
                while len(self._pending) > MAX_PENDING_TIMINGS:
                    self._pending.popleft()
        if seconds is not None:
            self.adaptive.record(key, mode, seconds)
        elif older:  # with none older, this one is first and not ready: nothing to read
            self.read_ready_step_times()

    def read_ready_step_times(self) -> None:
        """Read every step timing that is ready (never waits) into the
        adaptive state, oldest first; stop at the first not ready."""
        while True:
            with self._pending_lock:
                if not self._pending:
                    return
                key, mode, backend, token = self._pending[0]
                seconds = backend.elapsed(token)
                if seconds is None:
                    return
                self._pending.popleft()
            self.adaptive.record(key, mode, seconds)

    def stats(self) -> dict[str, Any]:
        """The counters and every adaptive bucket (the ``stats()`` shape)."""
        return {
            **self.counters.to_dict(),
            "buckets": self.adaptive.snapshot(),
            "graphs": self.graphs.snapshot(self.adaptive),
            "graph_capture_failures": dict(self.graphs.failures),
        }

    def active_session(self) -> OverlapSession | None:
        """The session of the step running on this thread, if any."""
        return self.local.session

    def set_session(self, session: OverlapSession | None) -> None:
        """Set (or clear, with None) this thread's session."""
        self.local.session = session

    def close(self) -> None:
        """Release every runner's side streams (CPU worker threads) and
        forget the planned shapes that name them."""
        self.graphs.restore_all()  # upstream's graph objects back, before their streams close
        self._planned.clear()
        self.streamsets.close_all()
