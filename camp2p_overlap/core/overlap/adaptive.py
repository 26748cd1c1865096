"""Adaptive engage: per runner and shape bucket, measure each overlap path (a layout listed in
``VLLM_CAMP2P_MULTISTREAM_LAYOUT``; for a decode graph key, its overlap variant) and the serial path, and run the
fastest (docs/design.md, "Adaptive engage"). Pure logic, fed step times (``record``) and asked which path a step takes
(``choose``); deterministic for given times. Per bucket:

* learning: each overlap path's steps in the order listed, then serial steps (upstream's path, bitwise equal), each
  path back to back (an overlap step right after a serial one finds its side streams cold); each overlap path's
  first time is dropped (first-use costs). Once each path has ``min_samples`` kept times the bucket decides for the
  fastest median (an overlap path must beat serial by ``engage_margin``, 0 by default: a serial step's time already
  holds what the patch layer costs it): with one overlap path, at the bucket's 7th step on the CPU backend, its 8th
  on a device (times read a step later).
* decided: every ``reprobe_every`` steps a probe round runs another path (the paths not decided, in turn): one
  warm-up step (its time dropped), then probes; the decision switches once ``confirm`` probes' median still beats
  the decided path's recent median by ``switch_margin`` (hysteresis), and the round ends as soon as it does not.
  A path not listed is never probed.
* a close first decision (medians within ``close_call``) gets its first probe round ``close_recheck`` steps after
  it, switching on ``close_switch_margin`` instead: 3 times each cannot tell two paths a few per cent apart, and the
  hysteresis would otherwise keep a first decision a few per cent slower (later rounds keep the full margin, so it
  cannot flap).
* back-off: a round that loses by more than ``backoff_above`` doubles the bucket's interval, up to ``max_backoff``
  times ``reprobe_every``; a closer loss, or a change of decision, sets it back (a clearly slower path's probes cost
  their whole loss and tell little).
* a decided-serial step that is not a probe is timed one in ``serial_time_every``.

Each decision is logged once, when it changes, with its figures. The times come from :class:`StepTimings`.

With a group of FFN ranks (``AdaptiveEngage.group``: the ranks that share the MoE's collectives) the same rules run
on the group's times, at decision points every rank derives alike (:meth:`AdaptiveEngage._choose_in_group`;
docs/design.md, "Many FFN ranks"), so every rank takes the same path at every step.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from camp2p_overlap.core.log import logger
from camp2p_overlap.core.overlap.rank_group import ExchangeFailed, RankGroup, merge_times
from camp2p_overlap.core.overlap.streams.backend import GUARD, StreamBackend

#: A path a step of a bucket can take (not the rollout modes of ``config.Mode``): upstream's serial step, or an
#: overlap path (a layout's name for an eager step; ``overlap`` for a decode graph key's variant).
Path = str
SERIAL: Path = "serial"
#: The one overlap path where a bucket has no other (a decode graph key's overlap variant).
OVERLAP: Path = "overlap"


class Choice(NamedTuple):
    """What :meth:`AdaptiveEngage.choose` gives a step: its path, whether it is a probe, whether it is timed, and its
    index among the bucket's steps (its time is recorded under it)."""

    path: Path
    probe: bool
    timed: bool
    step: int


class BucketKey(NamedTuple):
    """A runner and a step shape, whose steps take comparable time. ``tokens``: the largest stage token count rounded
    up to a power of two (0: unknown). A tuple, so that the per-step dict lookups hash and compare it in C."""

    runner: str
    stages: int
    layers: int
    tokens: int

    def label(self) -> str:
        return f"{self.runner}/stages={self.stages}/layers={self.layers}/tokens<={self.tokens}"


@dataclass(frozen=True)
class AdaptiveSettings:
    reprobe_every: int = 64
    min_samples: int = 3
    window: int = 16
    engage_margin: float = 0.0
    switch_margin: float = 0.05
    confirm: int = 3
    backoff_above: float = 0.10
    max_backoff: int = 8
    close_call: float = 0.10
    close_recheck: int = 16
    close_switch_margin: float = 0.01
    #: A decided-serial step (not a probe) is timed one in this many (timing costs host time).
    serial_time_every: int = 8


@dataclass
class _Bucket:
    key: BucketKey
    window: int
    #: The overlap paths in the order listed, then ``serial``.
    paths: tuple[Path, ...]
    decision: Path | None = None
    steps: int = 0
    since_probe: int = 0
    issued: dict[str, int] = field(default_factory=dict)
    recorded: dict[str, int] = field(default_factory=dict)
    times: dict[str, deque[float]] = field(default_factory=dict)
    #: The path the probe round in progress runs, and how many rounds have started (which path is next).
    probing: Path | None = None
    rounds: int = 0
    probe_times: list[float] = field(default_factory=list)
    probes_left: int = 0
    #: Probe warm-up steps issued whose times are still to be dropped.
    warmups: int = 0
    #: The bucket's probe interval, in units of ``reprobe_every`` (back-off).
    backoff: int = 1
    changes: int = 0
    #: The first decision was a close call: its recheck switches on ``close_switch_margin``.
    close_recheck: bool = False
    # -- in a group of ranks (docs/design.md, "Many FFN ranks"): times by step, decided at decision points
    #: This rank's times by path, as (step, seconds).
    stamped: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)
    #: Steps whose times are dropped: each overlap path's first, and each probe round's warm-up.
    drop: set[int] = field(default_factory=set)
    #: The step at which the next decision is taken (every rank derives it alike), and decisions taken so far.
    decide_at: int = 0
    points: int = 0
    #: The measured probe steps of the round in progress, and the step its warm-up ran.
    round_steps: list[int] = field(default_factory=list)
    round_start: int = 0

    def __post_init__(self) -> None:
        self.times = {m: deque(maxlen=self.window) for m in self.paths}
        self.stamped = {m: deque(maxlen=4 * self.window) for m in self.paths}
        self.issued = dict.fromkeys(self.paths, 0)
        self.recorded = dict.fromkeys(self.paths, 0)

    def median(self, path: str) -> float | None:
        return statistics.median(self.times[path]) if self.times[path] else None

    def next_probe(self) -> Path:
        """The path the next probe round runs: the paths not decided, in turn."""
        others = [m for m in self.paths if m != self.decision]
        self.rounds += 1
        return others[(self.rounds - 1) % len(others)]


class AdaptiveEngage:
    """Per-bucket overlap-or-serial decisions of one runtime. Thread-safe. With a ``group`` of ranks (more than one
    FFN rank sharing the MoE's collectives), every rank takes the same path at every step: see :meth:`choose`."""

    def __init__(self, settings: AdaptiveSettings | None = None, group: RankGroup | None = None) -> None:
        #: Read at every call; replace it to change the settings.
        self.settings = settings or AdaptiveSettings()
        #: The FFN ranks this rank decides with (None: it decides alone).
        self.group = group
        self._lock = threading.Lock()
        self._buckets: dict[BucketKey, _Bucket] = {}

    def _bucket(self, key: BucketKey, overlaps: tuple[Path, ...]) -> _Bucket:
        b = self._buckets.get(key)
        if b is None or b.paths[:-1] != overlaps:
            b = self._buckets[key] = _Bucket(key, self.settings.window, (*overlaps, SERIAL))
        return b

    def choose(
        self, key: BucketKey, overlaps: tuple[Path, ...] = (OVERLAP,), settle: Callable[[], object] | None = None
    ) -> Choice:
        """The path this step of ``key`` takes, among ``overlaps`` (the overlap paths, in the order listed) and
        serial; whether it is a probe (run to measure, not the decision); whether it is timed (a decided-serial
        step only one in ``serial_time_every``); and its step index in the bucket. A bucket whose paths change
        starts learning again. In a group, ``settle`` (reads every time still pending) runs before a decision."""
        if self.group is not None:
            return self._choose_in_group(key, overlaps, settle, self.group)
        cfg = self.settings
        with self._lock:
            b = self._bucket(key, overlaps)
            b.steps += 1
            if b.decision is None:
                path: Path = _learning_path(b, cfg)
                probe = True
            elif b.probes_left > 0:
                b.probes_left -= 1
                path, probe = b.probing or b.next_probe(), True
            elif b.since_probe + 1 >= cfg.reprobe_every * b.backoff:  # a probe round starts
                b.since_probe = 0
                b.warmups += 1  # this step warms the probed path up; a measured probe follows
                b.probes_left = 1
                path = b.probing = b.next_probe()
                probe = True
            else:
                b.since_probe += 1
                path, probe = b.decision, False
            return _issued(b, path, probe, cfg)

    def record(self, key: BucketKey, path: Path, seconds: float, step: int = 0) -> None:
        """The measured time of one step of ``key`` that ran ``path`` (``step``: its :attr:`Choice.step`)."""
        cfg = self.settings
        with self._lock:
            b = self._buckets.get(key)
            if b is None or path not in b.recorded:
                return  # a bucket started again since (its paths changed)
            if self.group is not None:
                if step in b.drop:
                    b.drop.discard(step)
                else:
                    b.stamped[path].append((step, seconds))
                return
            b.recorded[path] += 1
            if path != SERIAL and b.recorded[path] == 1:
                return  # an overlap path's first step pays first-use costs
            if b.decision is None:
                b.times[path].append(seconds)
                if all(len(b.times[m]) >= cfg.min_samples for m in b.paths):
                    self._first_decision(b, cfg)
                return
            if path == b.decision:
                b.times[path].append(seconds)
                return
            if b.warmups > 0:
                b.warmups -= 1  # a probe round's warm-up step
                return
            self._judge_probe(b, path, seconds, cfg)

    def _first_decision(self, b: _Bucket, cfg: AdaptiveSettings) -> None:
        """The fastest median, an overlap path only when it beats serial by ``engage_margin``; a close call (the
        runner-up within ``close_call``) is checked again soon."""
        medians = {m: b.median(m) for m in b.paths}
        s = medians[SERIAL]
        assert s is not None
        ranked = sorted(b.paths, key=lambda m: medians[m])  # type: ignore[arg-type, return-value]
        best = next((m for m in ranked if m != SERIAL), SERIAL)
        if medians[best] >= s * (1 - cfg.engage_margin):  # type: ignore[operator]
            best = SERIAL
        self._set_decision(b, best, "first decision")
        first, second = (medians[m] for m in ranked[:2])
        if second - first < cfg.close_call * first:  # type: ignore[operator]
            # a close call on 3 times each: check it again soon
            b.since_probe = max(cfg.reprobe_every - cfg.close_recheck, 0)
            b.close_recheck = True

    def _judge_probe(self, b: _Bucket, path: Path, seconds: float, cfg: AdaptiveSettings) -> None:
        b.probe_times.append(seconds)
        current = b.median(b.decision)  # type: ignore[arg-type]
        probe = statistics.median(b.probe_times)
        margin = cfg.close_switch_margin if b.close_recheck else cfg.switch_margin
        if current is None or probe > current * (1 - margin):
            b.close_recheck = False
            b.probe_times.clear()  # not better: the probe round ends, the decision stays
            b.probes_left = 0
            b.times[path].append(seconds)
            clear_loss = current is not None and probe > current * (1 + cfg.backoff_above)
            b.backoff = min(b.backoff * 2, cfg.max_backoff) if clear_loss else 1
            return
        if len(b.probe_times) < cfg.confirm:
            b.probes_left = max(b.probes_left, 1)  # confirm before switching
            return
        b.times[path].clear()
        b.times[path].extend(b.probe_times)
        b.probe_times.clear()
        b.probes_left = 0
        b.close_recheck = False
        self._set_decision(b, path, f"{cfg.confirm} probes beat it by more than {margin:.0%}")

    # -- in a group of ranks -----------------------------------------------------------
    def _choose_in_group(
        self, key: BucketKey, overlaps: tuple[Path, ...], settle: Callable[[], object] | None, group: RankGroup
    ) -> Choice:
        """The path of a step when the ranks decide together. Which path a step takes is a function of the bucket's
        step index and of decisions only, and a decision is taken only at a step index that every rank derives
        alike (the step after learning, the step after a probe round), from the group's times: every rank posts
        what it measured (after ``settle``, so no decision depends on whether an event has completed yet), and
        every rank merges the same posts (:func:`rank_group.merge_times`: the slowest rank's time per step). A
        probe round runs its warm-up and ``confirm`` probes, then is judged. A failed exchange breaks the group:
        the step runs serially (the caller gives the reason)."""
        cfg = self.settings
        with self._lock:
            b = self._bucket(key, overlaps)
            b.steps += 1
            point = b.decide_at == b.steps
        if point:
            if settle is not None:
                settle()  # outside the lock: it records
            self._decide_in_group(b, group, cfg)
        with self._lock:
            if group.broken is not None:
                return Choice(SERIAL, False, False, b.steps)
            step = b.steps
            if b.decision is None:
                path: Path = _learning_path(b, cfg)
                if path != SERIAL and b.issued[path] == 0:
                    b.drop.add(step)  # first-use costs
                probe = True
                if all(b.issued[m] + (m == path) >= cfg.min_samples + (m != SERIAL) for m in b.paths):
                    b.decide_at = step + 1
            elif b.probes_left > 0:
                b.probes_left -= 1
                b.round_steps.append(step)
                path, probe = b.probing, True  # type: ignore[assignment]
                if b.probes_left == 0:
                    b.decide_at = step + 1
            elif b.since_probe + 1 >= cfg.reprobe_every * b.backoff:  # a probe round starts: its warm-up
                b.since_probe = 0
                path = b.probing = b.next_probe()
                b.drop.add(step)
                b.round_start, b.round_steps, b.probes_left = step, [], cfg.confirm
                probe = True
            else:
                b.since_probe += 1
                path, probe = b.decision, False
            return _issued(b, path, probe, cfg)

    def _decide_in_group(self, b: _Bucket, group: RankGroup, cfg: AdaptiveSettings) -> None:
        """One decision point of ``b``: exchange, merge, decide (the same on every rank)."""
        with self._lock:
            label = b.key.label()
            post = {"bucket": label, "point": b.points, "times": {m: list(b.stamped[m]) for m in b.paths}}
        try:
            posts = group.exchange(f"adaptive/{b.points}", post)
        except ExchangeFailed:
            return  # the group is broken: every step runs serially from now on
        labels = sorted({p["bucket"] for p in posts})
        if labels != [label]:
            group.fail(f"the FFN ranks' buckets differ at a decision point: {labels}")
            return
        merged = merge_times([p["times"] for p in posts])
        with self._lock:
            b.points += 1
            b.decide_at = 0
            if b.decision is None:
                self._first_in_group(b, merged, cfg)
            else:
                self._round_in_group(b, merged, cfg)

    def _first_in_group(self, b: _Bucket, merged: dict[str, list[tuple[int, float]]], cfg: AdaptiveSettings) -> None:
        for m in b.paths:
            b.times[m].clear()
            b.times[m].extend(t for _, t in merged[m])
        short = [m for m in b.paths if len(b.times[m]) < cfg.min_samples]
        if short:  # some rank could not time them: the safe choice, probed again in time
            self._set_decision(b, SERIAL, f"too few times every FFN rank measured for {', '.join(short)}")
            return
        self._first_decision(b, cfg)

    def _round_in_group(self, b: _Bucket, merged: dict[str, list[tuple[int, float]]], cfg: AdaptiveSettings) -> None:
        path, decided = b.probing, b.decision
        assert path is not None and decided is not None
        probes = [t for s, t in merged[path] if s in b.round_steps]
        b.times[decided].clear()
        b.times[decided].extend(t for s, t in merged[decided] if s < b.round_start)
        b.probing, b.round_steps = None, []
        current = b.median(decided)
        margin = cfg.close_switch_margin if b.close_recheck else cfg.switch_margin
        b.close_recheck = False
        if not probes or current is None:
            return
        probe = statistics.median(probes)
        if len(probes) >= cfg.confirm and probe <= current * (1 - margin):
            b.times[path].clear()
            b.times[path].extend(probes)
            self._set_decision(b, path, f"{len(probes)} probes of the FFN group beat it by more than {margin:.0%}")
            return
        b.backoff = min(b.backoff * 2, cfg.max_backoff) if probe > current * (1 + cfg.backoff_above) else 1

    def _set_decision(self, b: _Bucket, path: Path, why: str) -> None:
        if path == b.decision:
            return
        previous, b.decision = b.decision, path
        b.changes += 1
        b.since_probe = 0
        b.backoff = 1
        b.rounds = 0
        logger.info(
            "camp2p-overlap: adaptive: %s -> %s (%s; was %s): %s",
            b.key.label(),
            path,
            why,
            previous or "learning",
            ", ".join(f"{m} median {_ms(b.median(m))} over {len(b.times[m])} steps" for m in b.paths),
        )

    def decision(self, key: BucketKey) -> Path | None:
        with self._lock:
            b = self._buckets.get(key)
            return None if b is None else b.decision

    def snapshot(self) -> list[dict[str, Any]]:
        """Every bucket: key, decision, medians in ms and sample counts."""
        with self._lock:
            out = []
            for b in self._buckets.values():
                medians = {m: b.median(m) for m in b.paths}
                # "overlap": the fastest overlap path so far (the first listed while none has a time)
                overlaps = [m for m in b.paths if m != SERIAL]
                fastest = min(overlaps, key=lambda m: (medians[m] is None, medians[m] or 0.0))
                o, s = medians[fastest], medians[SERIAL]
                out.append(
                    {
                        "key": b.key._asdict(),
                        "label": b.key.label(),
                        "decision": b.decision or "learning",
                        "overlap_median_ms": None if o is None else round(o * 1e3, 4),
                        "serial_median_ms": None if s is None else round(s * 1e3, 4),
                        "overlap_samples": len(b.times[fastest]),
                        "serial_samples": len(b.times[SERIAL]),
                        "medians_ms": {m: None if v is None else round(v * 1e3, 4) for m, v in medians.items()},
                        "samples": {m: len(b.times[m]) for m in b.paths},
                        "steps": b.steps,
                        "changes": b.changes,
                        "reprobe_every": None if b.decision is None else b.backoff * self.settings.reprobe_every,
                    }
                )
            return out


def _issued(b: _Bucket, path: Path, probe: bool, cfg: AdaptiveSettings) -> Choice:
    b.issued[path] += 1
    every = cfg.serial_time_every
    return Choice(path, probe, probe or path != SERIAL or b.since_probe % every == 1 % every, b.steps)


def _learning_path(b: _Bucket, cfg: AdaptiveSettings) -> Path:
    """The path of a learning step: each overlap path in turn until it has issued its dropped first step and
    ``min_samples`` more, then serial for ``min_samples``; then (times still to come, as on a device) the path with
    the fewest kept."""
    for m in b.paths:
        if b.issued[m] < cfg.min_samples + (m != SERIAL):
            return m
    return min(reversed(b.paths), key=lambda m: len(b.times[m]))  # a tie: serial, then the later listed


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


#: Timings waiting for their device events, at most (older ones are dropped).
MAX_PENDING_TIMINGS = 64

#: A timing not read yet: bucket, path, backend, its (start, end) events, the adaptive engage it feeds, the step index.
Pending = tuple[BucketKey, Path, StreamBackend, Any, "AdaptiveEngage | None", int]


class StepTimings:
    """One runner's step and replay timings not read yet, in issue order: each is read once its end event has
    completed (``query()``, never a synchronize), oldest first, and never while a graph capture is in progress."""

    def __init__(self, owner: Any) -> None:
        #: Holds the adaptive engage the timings feed (``owner.adaptive``, read at each timing: tests replace it).
        self._owner = owner
        self._pending: deque[Pending] = deque()
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Drop every timing not read (on unpatch, and in a forked child: a new lock too, as a parent thread may have
        held the old one)."""
        self._lock = threading.Lock()
        self._pending = deque()

    def timed(
        self,
        key: BucketKey,
        path: Path,
        backend: StreamBackend,
        run: Callable[[], Any],
        into: AdaptiveEngage | None = None,
        step: int = 0,
    ) -> Any:
        """``run()`` timed on the compute stream (a pooled pair of timing events), queued for ``key``, its ``step``
        index and the adaptive engage ``into`` (None: the runtime's); a run that raised is not recorded. Not timed
        during a capture on any thread (the timing could not be read before it ends, and a pair the pool lacks would
        be made in it)."""
        if GUARD.captures:
            return run()
        pair = backend.timing_events.pop() if backend.timing_events else backend.timing_pair()
        pair[0].record(backend.mod.current_stream())
        try:
            result = run()
        except BaseException:
            backend.timing_events.append(pair)  # unread: a pair not yet completed may be recorded again
            raise
        pair[1].record(backend.mod.current_stream())
        with self._lock:
            self._pending.append((key, path, backend, pair, into, step))
            while len(self._pending) > MAX_PENDING_TIMINGS:
                dropped = self._pending.popleft()
                dropped[2].timing_events.append(dropped[3])
        self.read_ready()
        return result

    def read_ready(self, wait: bool = False) -> None:
        """Read every ready timing into its adaptive engage, oldest first; stop at the first not ready, and at once
        during a capture. ``wait`` (a decision point of a group of ranks, never inside a capture): wait for each
        end event first (``synchronize()``), so every timing is read."""
        while self._pending:
            with self._lock:
                if not self._pending:
                    return
                key, path, backend, (start, end), into, step = self._pending[0]
                if wait and GUARD.read(end.synchronize) is None:
                    return  # a capture began: read later
                # Two guarded device reads: the end event's query(), then the time between the events (a capture
                # that begins between them: read again later).
                ms = GUARD.read(partial(start.elapsed_time, end)) if GUARD.read(end.query) else None
                if ms is None:
                    return
                seconds = ms / 1e3
                self._pending.popleft()
                backend.timing_events.append((start, end))
            (into or self._owner.adaptive).record(key, path, seconds, step)

    def settle(self) -> None:
        """Read every timing still pending, waiting for each (a group's decision point)."""
        self.read_ready(wait=True)
