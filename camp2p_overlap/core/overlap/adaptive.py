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
from camp2p_overlap.core.overlap.streams.backend import GUARD, StreamBackend

#: A path a step of a bucket can take (not the rollout modes of ``config.Mode``): upstream's serial step, or an
#: overlap path (a layout's name for an eager step; ``overlap`` for a decode graph key's variant).
Path = str
SERIAL: Path = "serial"
#: The one overlap path where a bucket has no other (a decode graph key's overlap variant).
OVERLAP: Path = "overlap"


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

    def __post_init__(self) -> None:
        self.times = {m: deque(maxlen=self.window) for m in self.paths}
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
    """Per-bucket overlap-or-serial decisions of one runtime. Thread-safe."""

    def __init__(self, settings: AdaptiveSettings | None = None) -> None:
        #: Read at every call; replace it to change the settings.
        self.settings = settings or AdaptiveSettings()
        self._lock = threading.Lock()
        self._buckets: dict[BucketKey, _Bucket] = {}

    def choose(self, key: BucketKey, overlaps: tuple[Path, ...] = (OVERLAP,)) -> tuple[Path, bool, bool]:
        """The path this step of ``key`` takes, among ``overlaps`` (the overlap paths, in the order listed) and
        serial; whether it is a probe (run to measure, not the decision); and whether it is timed (a decided-serial
        step only one in ``serial_time_every``). A bucket whose paths change starts learning again."""
        cfg = self.settings
        with self._lock:
            b = self._buckets.get(key)
            if b is None or b.paths[:-1] != overlaps:
                b = self._buckets[key] = _Bucket(key, cfg.window, (*overlaps, SERIAL))
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
            b.issued[path] += 1
            every = cfg.serial_time_every
            timed = probe or path != SERIAL or b.since_probe % every == 1 % every
            return path, probe, timed

    def record(self, key: BucketKey, path: Path, seconds: float) -> None:
        """The measured time of one step of ``key`` that ran ``path``."""
        cfg = self.settings
        with self._lock:
            b = self._buckets.get(key)
            if b is None or path not in b.recorded:
                return  # a bucket started again since (its paths changed)
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

#: A timing not read yet: bucket, path, backend, its (start, end) events, the adaptive engage it feeds.
Pending = tuple[BucketKey, Path, StreamBackend, Any, "AdaptiveEngage | None"]


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
    ) -> Any:
        """``run()`` timed on the compute stream (a pooled pair of timing events), queued for ``key`` and the adaptive
        engage ``into`` (None: the runtime's); a run that raised is not recorded. Not timed during a capture on any
        thread (the timing could not be read before it ends, and a pair the pool lacks would be made in it)."""
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
            self._pending.append((key, path, backend, pair, into))
            while len(self._pending) > MAX_PENDING_TIMINGS:
                dropped = self._pending.popleft()
                dropped[2].timing_events.append(dropped[3])
        self.read_ready()
        return result

    def read_ready(self) -> None:
        """Read every ready timing into its adaptive engage, oldest first (never waits); stop at the first not
        ready, and at once during a capture."""
        while self._pending:
            with self._lock:
                if not self._pending:
                    return
                key, path, backend, (start, end), into = self._pending[0]
                # Two guarded device reads: the end event's query(), then the time between the events (a capture
                # that begins between them: read again later).
                ms = GUARD.read(partial(start.elapsed_time, end)) if GUARD.read(end.query) else None
                if ms is None:
                    return
                seconds = ms / 1e3
                self._pending.popleft()
                backend.timing_events.append((start, end))
            (into or self._owner.adaptive).record(key, path, seconds)
