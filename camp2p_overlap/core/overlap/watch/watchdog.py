"""The step watchdog: when an engaged step has not finished ``VLLM_CAMP2P_MULTISTREAM_WATCHDOG_S`` after it opened,
log a stall report (``stall_report.py``) naming the peer op that most likely never came; and the replay watch, which
reports a decode graph replay that has not ended. On a device the host runs ahead, so the watchdog outlives the host's
part: it follows a closed step's op handles and events (queries, backing off) until they completed, or reports once at
the deadline.

One watcher per process (:data:`WATCHER`): a daemon thread that the first step handed to it starts, and that ends
after :data:`_LINGER_S` with nothing to follow, at :func:`stop_watchdogs` (before a graph capture) and, not inherited,
in a forked child; the next step starts another. A step hands it a :class:`StepWatch` (step id, deadline, snapshot
callable, group) and sets a flag when the host leaves the step: no thread start, no lock (but when no watcher runs).

Several steps of one runner can be in flight on its device at once. They run there in the order the host issued them:
each step's side streams start after a wait on the compute stream that the previous step's join precedes (the compute
stream waits every side stream's ``join``). So each runner's stream backend is a *lane*, read on the device through its
newest closed step only: its tail, the join of each side stream and its last op's handle (:func:`_session_tail`). Once
that has completed, so has every earlier step of the lane; an earlier step's own events could not be read anyway (the
backend pools one event per key, and a query speaks for the key's latest record). When a runner's next step opens,
its thread reads the previous step's tail and, complete, drops it (its session dies as young as without the
watchdog); a step not complete then stays in the lane's chain. The watcher keeps every step of the chain, and the
newest, with its deadline: the oldest not seen complete by its deadline is reported, once, and the steps handed before
the report, which cannot finish before it, end unreported (a stall that lasts is reported again by a step handed after
the report, at most once per deadline). A step whose snapshot is not a :class:`StepSession`'s is followed alone,
through its snapshot (every handle and event).

Limits of reading a device without a sync: events are pooled per key across steps, so once a later step has
re-recorded one its query speaks for that step (a stall in it may keep an earlier, finished step pending, and be
reported for it); and no event may be queried during a graph capture, so a captured step has no watchdog and
:func:`stop_watchdogs` ends the watcher before a capture.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core.fork import after_fork_in_child
from camp2p_overlap.core.log import logger
from camp2p_overlap.core.overlap.session import JOIN_KEYS, SessionSnapshot, StepSession
from camp2p_overlap.core.overlap.streams.backend import GUARD, StreamBackend
from camp2p_overlap.core.overlap.watch.stall_report import PeerGroup, stall_report

#: The first and the longest pause between two looks at the steps followed (seconds); the pause doubles from one to
#: the other, and starts again at the first when a step is handed.
_FIRST_POLL_S = 0.001
MAX_POLL_S = 0.02
#: How long the watcher waits for a step once it follows none before it ends (the next step starts another).
_LINGER_S = 2.0
#: The watcher thread's name.
WATCHER_THREAD = "camp2p-overlap-watchdog"


class StepWatch:
    """One engaged step handed to the watcher: after :meth:`cancel` (the host's part is over) it is followed on the
    device. ``group``: this rank's FFN rank group (None: one rank), whose peers the report names."""

    __slots__ = (
        "_group",
        "_lane",
        "_snapshot",
        "_tail",
        "deadline",
        "ended",
        "follow",
        "host_done",
        "n",
        "reported",
        "seconds",
        "step_id",
        "stopped",
    )

    def __init__(
        self,
        seconds: float,
        snapshot: Callable[[], SessionSnapshot],
        step_id: int,
        group: PeerGroup | None = None,
        follow: bool = True,
    ) -> None:
        self.seconds = seconds
        self.step_id = step_id
        self.deadline = time.perf_counter() + seconds
        self._snapshot = snapshot
        self._group = group
        #: Whether the closed step is followed on the device (False: it ends when the host leaves it).
        self.follow = follow
        #: What is read of the closed step on the device: (handles, events), made on its first look.
        self._tail: tuple[list[Any], list[Any]] | None = None
        #: The host has left the step; the step is no longer followed; :meth:`stop` was called.
        self.host_done = self.ended = self.stopped = False
        #: Whether the step's stall report was logged.
        self.reported = False
        #: Its runner's lane and its place there (``Watcher.hand``; None: a step of no lane).
        self._lane: _Lane | None = None
        self.n = 0

    def cancel(self) -> None:
        """The host has left the step: only its device work is waited for."""
        self.host_done = True

    def stop(self) -> None:
        """End the watch without a report (and without another query)."""
        self.stopped = True

    def is_alive(self) -> bool:
        """Whether the step is still followed (it has neither completed, nor been reported or stopped, nor was it
        handed before a step reported on its lane)."""
        lane = self._lane
        return not (self.ended or self.stopped or (lane is not None and self.n <= lane.done_upto()))

    def join(self, timeout: float | None = None) -> None:
        """Wait until the step is no longer followed, up to ``timeout`` seconds (tests, diagnostics)."""
        end = None if timeout is None else time.perf_counter() + timeout
        while self.is_alive() and (end is None or time.perf_counter() < end):
            time.sleep(0.001)

    def _release(self) -> None:
        """Ended and forgotten: drop the session and the group."""
        self.ended = True
        self._snapshot = _no_snapshot
        self._group = None
        self._tail = None


def session_of(watch: StepWatch) -> Any:
    """The session whose snapshot a step's watch takes (None once released, or for another snapshot)."""
    return getattr(watch._snapshot, "__self__", None)


def _no_snapshot() -> SessionSnapshot:
    raise RuntimeError("the watchdog has ended")


def _session_tail(session: StepSession) -> tuple[list[Any], list[Any]]:
    """What a closed step's device work ends with: the handle of its last op, and the ``join`` event recorded last on
    each side stream. Every op and record on a side stream precedes its join; every record on the compute stream is
    waited on a side stream before its join (an edge joins two streams); and an op the compute stream runs after its
    last record is the step's last op (an op a side stream runs after an op of the compute stream waits a record made
    between them). Reads the session's own log, final once it is closed."""
    if not session.closed:
        return [], []
    ops, events = session._ops, session._events
    joins = [ev for s in session.side_streams if (ev := events.get(JOIN_KEYS[s])) is not None]
    return ([ops[-1][4]] if ops else []), joins


def _session_done(session: StepSession | None) -> bool:
    """Whether a closed step's tail (:func:`_session_tail`) has completed, read where the runner's next step opens:
    the same reads, nothing kept (None: the watcher has seen it complete and let it go)."""
    if session is None or not session.closed:
        return True  # nothing to follow
    try:
        ops = session._ops
        if ops and not ops[-1][4].done():
            return False
        events = session._events
        for s in session.side_streams:
            event = events.get(JOIN_KEYS[s])
            if event is not None and not GUARD.read(event.query):
                return False
    except Exception:  # noqa: BLE001 - unknown: the watcher keeps following it
        return False
    return True


def _tail_of(watch: StepWatch) -> tuple[list[Any], list[Any]]:
    """What is followed of a closed step: its session's tail, or for another snapshot every handle and event of its
    closed step (nothing when it is not closed, or not to be followed on the device)."""
    if not watch.follow:
        return [], []
    snapshot = watch._snapshot
    session = getattr(snapshot, "__self__", None)
    if isinstance(session, StepSession):
        return _session_tail(session)
    try:
        snap = snapshot()
    except Exception:  # noqa: BLE001 - nothing to follow
        return [], []
    if not getattr(snap, "closed", False):
        return [], []  # not a session that keeps its closed step: nothing to follow
    return [o.handle for o in snap.ops], [ev for _, ev in snap.events]


def _all_complete(events: list[Any]) -> bool:
    """Whether a closed step's events have completed on the device, dropping those seen complete."""
    while events:
        try:
            if not GUARD.read(events[-1].query):  # the latest first: it completes last (None: capturing)
                return False
        except Exception:  # noqa: BLE001 - unknown: keep it, report at the deadline
            return False
        events.pop()
    return True


def _complete(watch: StepWatch, drop: bool = False) -> bool:
    """Whether a closed step's device work has completed: its tail's handles done, then its events. ``drop``: drop
    what is seen complete (only where one thread reads the tail: not a lane's latest step, which its step's thread
    reads too)."""
    tail = watch._tail
    if tail is None:
        tail = watch._tail = _tail_of(watch)
    handles, events = tail
    if drop:
        while handles:
            if not handles[-1].done():
                return False
            handles.pop()
        return _all_complete(events)
    for handle in handles:
        if not handle.done():
            return False
    for event in reversed(events):
        try:
            if not GUARD.read(event.query):
                return False
        except Exception:  # noqa: BLE001 - unknown: keep it, report at the deadline
            return False
    return True


#: The most closed steps a lane keeps while its device is behind (past it, a step is not followed further).
_MAX_CHAIN = 1024


class _Lane:
    """One runner's stream backend: the steps its thread handed, in order. The step's thread appends and drops (``n``
    counts them); the watcher reads, and writes only ``confirmed`` and ``covered``.

    A step is read on the device by its runner's thread when the runner's next step opens (its tail: a few event
    queries); complete, it is dropped then, so its session dies young, as it does without the watchdog. Kept through
    one more step, a session's objects reach the garbage collector's oldest generation and make its full collections
    frequent (8 % more host time per engaged step at 61 layers x 3 stages on ``overhead``'s no-op world)."""

    __slots__ = ("chain", "confirmed", "covered", "dropped", "last", "n")

    def __init__(self) -> None:
        #: The latest step handed (open, or closed and not yet in ``chain``).
        self.last: StepWatch | None = None
        #: The closed steps before it not known complete, oldest first.
        self.chain: deque[StepWatch] = deque()
        self.n = 0
        #: Every step up to this ``n`` has completed: seen by the step's thread (``dropped``), by the watcher
        #: (``confirmed``); or was reported, or handed before a report (``covered``, by the watcher).
        self.dropped = self.confirmed = self.covered = 0

    def done_upto(self) -> int:
        return max(self.dropped, self.confirmed, self.covered)


@dataclass
class _Run:
    """One watcher thread's own state."""

    wake: threading.Event
    thread: threading.Thread | None = None
    stop: bool = False


class Watcher:
    """The process's one step watcher (see the module docstring)."""

    def __init__(self) -> None:
        self._reset()
        after_fork_in_child(self._reset)

    def _reset(self) -> None:
        """No thread and nothing followed (at creation, and in a forked child: the parent's thread is not there)."""
        #: Taken to make a lane, or to start or end the thread; never by a step while one runs and follows its lane.
        self._lock = threading.Lock()
        #: By ``id`` of a runner's stream backend, its lane (never removed: a lane of a backend gone holds ended steps
        #: at most, which a new backend of the same id passes over).
        self._lanes: dict[int, _Lane] = {}
        #: Steps of no lane (a snapshot that is not a session's), until the thread takes them.
        self._handed: deque[StepWatch] = deque()
        self._run: _Run | None = None
        #: True while no thread follows what is handed without being woken (none runs, or it waits to end).
        self._idle = True
        #: Threads started, and steps handed (diagnostics, tests, the overhead tool).
        self.started = 0
        self.handed = 0
        self._following = 0

    def hand(self, watch: StepWatch) -> None:
        """Follow ``watch``, the step that just opened: on its runner's lane the step's thread first reads the
        previous step on the device (its tail: a few event queries, unless the watcher has seen it complete) and
        drops it, and every earlier one, if it has completed; else the watcher follows it further. Then attribute
        writes; no lock (but the watcher's, when it does not run)."""
        self.handed += 1
        session = getattr(watch._snapshot, "__self__", None)
        if not isinstance(session, StepSession):
            self._handed.append(watch)
            if self._idle:
                self._rouse()
            return
        lane = self._lanes.get(id(session.backend)) or self._lane(session.backend)
        prev = lane.last
        if prev is not None:
            chain = lane.chain
            seen = max(lane.confirmed, lane.covered)  # the watcher saw these complete (or reported them)
            if prev.n <= seen:
                lane.dropped = prev.n
                chain.clear()
            elif prev.host_done and not prev.stopped and (not prev.follow or _session_done(session_of(prev))):
                lane.dropped = prev.n  # it has completed: so has every earlier step of the lane (device order)
                chain.clear()
            else:
                while chain and chain[0].n <= seen:
                    chain.popleft()
                if len(chain) < _MAX_CHAIN:
                    chain.append(prev)  # the host ran ahead of the device: the watcher follows it
        lane.n = watch.n = lane.n + 1
        watch._lane = lane
        lane.last = watch
        if self._idle:
            self._rouse()

    def _lane(self, backend: Any) -> _Lane:
        with self._lock:
            lane = self._lanes.get(id(backend))
            if lane is None:
                lane = self._lanes[id(backend)] = _Lane()
            return lane

    def following(self) -> int:
        """How many steps are handed and not ended yet (tests, diagnostics)."""
        alive = sum(1 for lane in list(self._lanes.values()) for w in _steps(lane) if w.is_alive())
        return len(self._handed) + self._following + alive

    def thread(self) -> threading.Thread | None:
        """The watcher thread, while one runs."""
        run = self._run
        return None if run is None else run.thread

    def _rouse(self) -> None:
        with self._lock:
            run = self._run
            if run is not None:
                run.wake.set()
                return
            run = self._run = _Run(threading.Event())
            self._idle = False
            run.thread = threading.Thread(target=self._loop, args=(run,), name=WATCHER_THREAD, daemon=True)
            run.thread.start()  # started before stop() can see it: it joins only started threads
            self.started += 1

    def stop(self, timeout: float) -> bool:
        """End the thread and every step handed, without a report or another query; whether it ended in time."""
        with self._lock:
            run, self._run = self._run, None
            self._idle = True  # the next step starts a new thread
            lanes = list(self._lanes.values())
        for lane in lanes:
            for watch in _steps(lane):
                watch.stopped = True
        if run is not None:
            run.stop = True
            run.wake.set()
            thread = run.thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
        ended = run is None or run.thread is None or not run.thread.is_alive()
        while self._handed:
            watch = self._handed.popleft()
            watch.stopped = True
            watch._release()
        return ended

    # -- the thread ----------------------------------------------------------
    def _loop(self, run: _Run) -> None:
        own: deque[StepWatch] = deque()  # steps of no lane, in the order handed
        pause = _FIRST_POLL_S
        idle_since: float | None = None  # since when nothing is followed
        try:
            while not run.stop:
                took = False
                while self._handed and not run.stop:
                    own.append(self._handed.popleft())
                    took = True
                if took:
                    pause = _FIRST_POLL_S  # a step was handed: it may be short
                now = time.perf_counter()
                wait, following = pause, 0
                for watch in list(own):
                    until = self._guarded(self._look_alone, watch, now, run)
                    if until is None:
                        own.remove(watch)
                        watch._release()
                    else:
                        wait, following = min(wait, until - now), following + 1
                    if run.stop:
                        return
                for lane in list(self._lanes.values()):
                    until = self._guarded(self._look, lane, now, run)
                    if run.stop:
                        return
                    if until is not None:
                        wait, following = min(wait, until - now), following + 1
                self._following = len(own)
                if following:
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since >= _LINGER_S:
                    if self._may_end(run):
                        return
                    idle_since = None
                if run.wake.wait(max(wait, 0.0)):
                    run.wake.clear()
                pause = min(2 * pause, MAX_POLL_S)
        finally:
            for watch in own:
                watch._release()
            self._following = 0
            with self._lock:
                if self._run is run:  # it ended by itself (an error): the next step starts another
                    self._run = None
                    self._idle = True

    def _guarded(self, look: Callable[..., float | None], *args: Any) -> float | None:
        try:
            return look(*args)
        except Exception:  # noqa: BLE001 - a diagnostic must not stop the others
            logger.debug("camp2p-overlap: the watchdog could not read a step", exc_info=True)
            return None

    def _may_end(self, run: _Run) -> bool:
        """Nothing followed for :data:`_LINGER_S`: whether the thread ends (no step was handed meanwhile)."""
        self._idle = True  # from here a step starts another thread (or wakes this one, if it goes on)
        with self._lock:
            if self._anything() and not run.stop:
                self._idle = False
                return False
            if self._run is run:
                self._run = None
            return True

    def _anything(self) -> bool:
        """Whether a step is handed and still followed."""
        lanes = list(self._lanes.values())
        return bool(self._handed) or any(w.is_alive() for lane in lanes for w in _steps(lane))

    def _look(self, lane: _Lane, now: float, run: _Run) -> float | None:
        """Follow one lane: its newest closed step seen complete ends every step up to it; the oldest step still
        followed, past its deadline, is reported once, and every step handed before the report ends unreported (none
        can finish before it); the deadline of the oldest still followed, if any."""
        last = lane.last
        if last is None:
            return None
        chain = list(lane.chain)  # a copy: the step's thread appends and drops meanwhile
        upto = lane.done_upto()
        steps = [w for w in (*chain, last) if w.n > upto and not w.stopped]
        if not steps:
            return None
        newest = steps[-1] if steps[-1].host_done else (steps[-2] if len(steps) > 1 else None)
        if newest is not None and _complete(newest):
            lane.confirmed = max(lane.confirmed, newest.n)  # first: the step's thread then reads it as seen
            if newest is last:
                last._release()  # no next step yet: its session goes now (the next step's thread drops the rest)
            steps = [w for w in steps if w.n > newest.n]
            if not steps:
                return None
        oldest = steps[0]
        if oldest.deadline > now:
            return oldest.deadline
        self._report(oldest, run)
        lane.covered = max(lane.covered, last.n)
        return None

    def _look_alone(self, watch: StepWatch, now: float, run: _Run) -> float | None:
        """Follow a step of no lane through its snapshot: None once it has ended."""
        if watch.stopped or watch.ended:
            return None
        if watch.host_done and _complete(watch, drop=True):
            return None
        if watch.deadline > now:
            return watch.deadline
        self._report(watch, run)
        return None

    def _report(self, watch: StepWatch, run: _Run) -> None:
        snapshot, group = watch._snapshot, watch._group  # held here: the step's thread may drop them meanwhile
        try:
            text = stall_report(snapshot(), group)
        except Exception as exc:  # noqa: BLE001 - diagnostics must not raise
            text = f"stall report failed: {exc!r}"
        if run.stop or watch.stopped:
            return
        watch.reported = True
        logger.warning(
            "camp2p-overlap: FFN step %d has not finished after %.1f s; a peer op may be missing.\n%s",
            watch.step_id,
            watch.seconds,
            text,
        )


def _steps(lane: _Lane) -> list[StepWatch]:
    """A lane's steps, oldest first (a copy)."""
    last = lane.last
    return [*lane.chain, *(() if last is None else (last,))]


#: The process's step watcher.
WATCHER = Watcher()


def start_watchdog(
    seconds: float | None,
    snapshot: Callable[[], SessionSnapshot],
    step_id: int,
    group: PeerGroup | None = None,
    follow: bool = True,
) -> StepWatch | None:
    """Hand the step that just opened to the watcher, or None when the watchdog is off (``seconds`` 0 or None) or a
    capture is in progress; ``group``: this rank's FFN rank group (``OverlapRuntime.group``), whose peers' heartbeats
    its stall report names. ``follow`` False: the step is not followed on the device once the host has left it (where
    upstream's graph capture runs without the capture guard, an event query from the watcher could meet it); it is
    reported only if the host has not left it by the deadline."""
    if not seconds or GUARD.captures:  # a capture on another thread: no thread that reads events may start
        return None
    watch = StepWatch(seconds, snapshot, step_id, group, follow)
    WATCHER.hand(watch)
    return watch


def stop_watchdogs(timeout: float = 1.0) -> bool:
    """End the watcher and every step it follows without a report (before a graph capture: no event may be queried
    during one), waiting up to ``timeout`` for its thread; returns whether it has ended. The next step starts
    another."""
    return WATCHER.stop(timeout)


@dataclass(slots=True)
class _Replay:
    deadline: float
    seconds: float
    label: str
    backend: StreamBackend
    marker: object
    reported: bool = False


#: Replays followed at most (later ones are not followed until the oldest complete).
_MAX_WATCHED_REPLAYS = 1024


class ReplayWatch:
    """Decode graph replays not seen complete yet, followed by one daemon thread
    while there are any. Each replay's end is a marker event recorded after
    it; the thread queries only the oldest (replays complete in order),
    through the capture guard, and reports once a replay past its deadline."""

    def __init__(self) -> None:
        self._reset()
        after_fork_in_child(self._reset)

    def _reset(self) -> None:
        """Nothing followed (at creation, and in a forked child: no watch thread)."""
        self._lock = threading.Lock()
        self._replays: deque[_Replay] = deque()
        self._thread: threading.Thread | None = None
        #: Stall reports logged (tests and diagnostics read it).
        self.reports: list[str] = []

    def __len__(self) -> int:
        return len(self._replays)

    def watch(self, seconds: float, backend: StreamBackend, label: str) -> None:
        """Follow the replay just issued on the current stream."""
        with self._lock:
            if len(self._replays) >= _MAX_WATCHED_REPLAYS:
                return
        marker = backend.end_marker()
        if marker is None:
            return
        replay = _Replay(time.perf_counter() + seconds, seconds, label, backend, marker)
        with self._lock:
            self._replays.append(replay)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="camp2p-overlap-replay-watch", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        pause = _FIRST_POLL_S
        while True:
            with self._lock:
                if not self._replays:
                    self._thread = None
                    return
                head, behind = self._replays[0], len(self._replays) - 1
            try:
                done = GUARD.read(head.marker.query)  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - unknown: keep it, report at the deadline
                done = False
            if done:
                with self._lock:
                    self._replays.popleft()
                head.backend.release_marker(head.marker)
                pause = _FIRST_POLL_S
                continue
            if not head.reported and time.perf_counter() >= head.deadline:
                head.reported = True
                self._report(head, behind, capturing=done is None)
            time.sleep(pause)
            pause = min(2 * pause, MAX_POLL_S)

    def _report(self, replay: _Replay, behind: int, *, capturing: bool) -> None:
        text = (
            f"camp2p-overlap: the replay of {replay.label} has not finished after {replay.seconds:.1f} s "
            f"({behind} later replay(s) queued behind it){'; a graph capture is in progress' if capturing else ''}. "
            "A peer op may be missing: the attention side's send or receive of this step."
        )
        self.reports.append(text)
        logger.warning("%s", text)


#: The process's replay watch.
REPLAY_WATCH = ReplayWatch()
