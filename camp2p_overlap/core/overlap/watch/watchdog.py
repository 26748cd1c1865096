"""The step watchdog: when an engaged step has not finished ``VLLM_CAMP2P_MULTISTREAM_WATCHDOG_S`` after it opened,
log a stall report (``stall_report.py``) naming the peer op that most likely never came; and the replay watch, which
reports a decode graph replay that has not ended. On a device the host runs ahead, so the watchdog outlives the host's
part: it follows a closed step's op handles and events (queries, backing off) until all completed, or reports once at
the deadline.

Limits of reading a device without a sync: events are pooled per key across
steps, so once a later step has re-recorded one its query speaks for that
step (its stall may be reported for the earlier one too); and no event may
be queried during a graph capture, so a captured step has no watchdog and
:func:`stop_watchdogs` ends the others before a capture.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core.fork import after_fork_in_child
from camp2p_overlap.core.log import logger
from camp2p_overlap.core.overlap.session import SessionSnapshot
from camp2p_overlap.core.overlap.streams.backend import GUARD, StreamBackend
from camp2p_overlap.core.overlap.watch.stall_report import PeerGroup, stall_report

#: The first and the longest pause between two looks at a closed step's
#: device work (seconds); the pause doubles from one to the other.
_FIRST_POLL_S = 0.001
_MAX_POLL_S = 0.02

#: The watchdogs running (:func:`stop_watchdogs` ends them).
_watching: weakref.WeakSet[StepWatchdog] = weakref.WeakSet()
_watching_lock = threading.Lock()


class StepWatchdog(threading.Thread):
    """The watchdog of one step (a daemon thread): after :meth:`cancel` (the
    host's part is over) it follows the step on the device. ``group``: this rank's FFN rank group (None: one rank),
    whose peers the report names."""

    def __init__(
        self,
        seconds: float,
        snapshot: Callable[[], SessionSnapshot],
        step_id: int,
        group: PeerGroup | None = None,
    ) -> None:
        super().__init__(name="camp2p-overlap-watchdog", daemon=True)
        self.seconds = seconds
        self.step_id = step_id
        self._snapshot = snapshot
        self._group = group
        self._deadline = time.perf_counter() + seconds
        self._host_done = threading.Event()
        self._stopped = threading.Event()
        #: Whether this watchdog logged its report.
        self.reported = False

    def cancel(self) -> None:
        """The host has left the step: only its device work is waited for."""
        self._host_done.set()

    def stop(self) -> None:
        """End the watchdog without a report (and without another query)."""
        self._stopped.set()
        self._host_done.set()

    def run(self) -> None:
        try:
            self._watch()
        finally:
            with _watching_lock:
                _watching.discard(self)
            self._snapshot = _no_snapshot  # drop the session
            self._group = None

    def _watch(self) -> None:
        if not self._host_done.wait(max(self._deadline - time.perf_counter(), 0.0)):
            self._report(self._snapshot)  # the host is still issuing the step
            return
        if self._stopped.is_set():
            return
        try:
            snap = self._snapshot()
        except Exception:  # noqa: BLE001 - nothing to follow
            return
        if not snap.closed:
            return  # not a session that keeps its closed step: nothing to follow
        handles, events = [o.handle for o in snap.ops], [ev for _, ev in snap.events]
        pause = _FIRST_POLL_S
        while not self._stopped.is_set():
            handles = [h for h in handles if not h.done()]
            if not handles and _all_complete(events):
                return
            left = self._deadline - time.perf_counter()
            if left <= 0:
                self._report(lambda: snap)
                return
            self._stopped.wait(min(pause, left))
            pause = min(2 * pause, _MAX_POLL_S)

    def _report(self, snapshot: Callable[[], SessionSnapshot]) -> None:
        if self._stopped.is_set():
            return
        try:
            text = stall_report(snapshot(), self._group)
        except Exception as exc:  # noqa: BLE001 - diagnostics must not raise
            text = f"stall report failed: {exc!r}"
        self.reported = True
        logger.warning(
            "camp2p-overlap: FFN step %d has not finished after %.1f s; a peer op may be missing.\n%s",
            self.step_id,
            self.seconds,
            text,
        )


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


def _no_snapshot() -> SessionSnapshot:
    raise RuntimeError("the watchdog has ended")


def start_watchdog(
    seconds: float | None,
    snapshot: Callable[[], SessionSnapshot],
    step_id: int,
    group: PeerGroup | None = None,
) -> StepWatchdog | None:
    """The watchdog of a step that just opened, or None when none is configured; ``group``: this rank's FFN rank
    group (``OverlapRuntime.group``), whose peers' heartbeats its stall report names."""
    if not seconds or GUARD.captures:  # a capture on another thread: no new thread that reads events
        return None
    watchdog = StepWatchdog(seconds, snapshot, step_id, group)
    with _watching_lock:  # started before it is listed: stop_watchdogs() joins only started threads
        watchdog.start()
        _watching.add(watchdog)
    return watchdog


def stop_watchdogs(timeout: float = 1.0) -> bool:
    """End every running watchdog without a report (before a graph capture:
    no event may be queried during one), waiting up to ``timeout`` for each;
    returns whether all have ended."""
    with _watching_lock:
        running = list(_watching)
    for w in running:
        w.stop()
    for w in running:
        if w is not threading.current_thread():
            w.join(timeout)
    return not any(w.is_alive() for w in running)


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
            pause = min(2 * pause, _MAX_POLL_S)

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
