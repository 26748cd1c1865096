"""Modelled kernel durations on the emulated device, and what they cost.

A kernel may carry a modelled duration (:class:`Model`, given at launch) or
name its modelled end while it runs (:func:`hold_until`, for a kernel whose
duration depends on what it waits for, as the comm kernels' does). Its
worker runs the computation, then *holds* the stream until the modelled
end has passed, so the outputs are real and the time follows the model.

Each stream keeps a modelled clock. A kernel's modelled start is the
latest of the stream's clock (the modelled end of what ran before it on
the stream), the modelled times of the records it waited on, and the host
time it was launched at; its modelled end is that start plus its model.
So a late wake-up of a worker thread (scheduling, the GIL) is absorbed by
the next hold instead of adding up along the stream: the timeline the
host observes is the modelled one as long as the real work keeps up.

A kernel *overruns* when it runs longer than its model by more than
:data:`OVERRUN_TOLERANCE_NS`, from when its worker really began it to
when it really ended (its computation took longer than the model gives
it; a hold's own wake-up error stays well inside the tolerance). A kernel
that begins late (its worker woke up late, or the kernel before it
overran) holds that much less: the stream's modelled clock goes on from
the modelled end either way, so lateness is absorbed by the slack of the
kernels after it, and what is left of it when the host synchronizes is
the device's *sync lag* (how long after the modelled end of the work it
waited for the synchronize returned: the error of a step's time). The
:data:`LEDGER` counts every modelled kernel (its modelled time, how much
it overran, how late it began) and every synchronize's lag;
:func:`take_timing` hands the counts over and starts new ones (the
benchmark reads them per policy).

Holding: sleep until :data:`HOLD_SPIN_NS` before the deadline, then poll
the clock. A worker that holds first lowers its timer slack to
:data:`TIMER_SLACK_NS` (``prctl(PR_SET_TIMERSLACK)``, Linux only; elsewhere
the default slack stays), so a sleep wakes within tens of microseconds
instead of the default slack's 50 µs and more.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

#: A hold polls the clock for its last stretch instead of sleeping: a sleep
#: wakes up late (timer slack, the scheduler), a short poll does not. Kept
#: short: on a 2-core machine a polling thread takes a core from the rest.
HOLD_SPIN_NS = 30_000
#: The timer slack a worker that holds asks for (``PR_SET_TIMERSLACK``).
TIMER_SLACK_NS = 1_000
#: How much later than its modelled end a kernel may end before it counts
#: as an overrun: the hold's own wake-up error plus the work a kernel does
#: after its hold (publishing its outputs), which the modelled clock absorbs.
OVERRUN_TOLERANCE_NS = 200_000
#: Lateness samples kept per count (quantiles); the counts stay exact past it.
MAX_SAMPLES = 200_000

_PR_SET_TIMERSLACK = 29
_tls = threading.local()


@dataclass(frozen=True, slots=True)
class Model:
    """A kernel's modelled duration, and what kind of kernel it is (for the
    counts: ``ffn``, ``a2e``, ``e2a``, ...)."""

    ns: int
    kind: str = "kernel"


def model_of(seconds: float | None, kind: str = "kernel") -> Model | None:
    """A :class:`Model` of ``seconds`` (None: no model, a wall-clock kernel)."""
    if seconds is None:
        return None
    if not seconds >= 0:
        raise ValueError(f"a modelled duration must be a non-negative number of seconds, got {seconds!r}")
    return Model(round(seconds * 1e9), kind)


def lower_timer_slack() -> bool:
    """Lower the calling thread's timer slack to :data:`TIMER_SLACK_NS`
    (once per thread; Linux only, any failure leaves it as it was).
    Returns whether it is lowered."""
    done = getattr(_tls, "slack", None)
    if done is not None:
        return done
    ok = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            ok = libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(TIMER_SLACK_NS), 0, 0, 0) == 0
        except (OSError, AttributeError, ImportError):  # no libc prctl: the default slack stays
            ok = False
    _tls.slack = ok
    return ok


def sleep_until(deadline_ns: int) -> None:
    """Return once ``time.perf_counter_ns()`` has reached ``deadline_ns``:
    asleep until :data:`HOLD_SPIN_NS` before it, then polling."""
    now = time.perf_counter_ns()
    if now >= deadline_ns:
        return
    lower_timer_slack()
    asleep = deadline_ns - HOLD_SPIN_NS - now
    if asleep > 0:
        time.sleep(asleep / 1e9)
    while time.perf_counter_ns() < deadline_ns:
        pass


class KernelClock:
    """The running kernel's modelled times (one per worker, reset per kernel)."""

    __slots__ = ("deadline_ns", "held_ns", "kind", "model", "start_ns")

    def __init__(self) -> None:
        self.start_ns = 0
        self.model: Model | None = None
        self.deadline_ns: int | None = None
        #: When the kernel's own work ended and its hold began (0: not yet).
        self.held_ns = 0
        self.kind = "kernel"

    def reset(self, start_ns: int, model: Model | None) -> None:
        self.start_ns = start_ns
        self.model = model
        self.deadline_ns = None
        self.held_ns = 0
        self.kind = model.kind if model is not None else "kernel"

    def holds(self, deadline_ns: int) -> None:
        """Hold until ``deadline_ns``, its modelled end (first call: its own work ends now)."""
        self.deadline_ns = deadline_ns
        if not self.held_ns:
            self.held_ns = time.perf_counter_ns()
        sleep_until(deadline_ns)

    def finish(self) -> int | None:
        """After the kernel's function: hold until its modelled end when it
        has a model and did not hold itself; returns its modelled end (None:
        a wall-clock kernel)."""
        if self.deadline_ns is None and self.model is not None:
            self.holds(self.start_ns + self.model.ns)
        return self.deadline_ns


def bind(clock: KernelClock | None) -> None:
    """Make ``clock`` the calling worker thread's kernel clock."""
    _tls.clock = clock


def kernel_start_ns() -> int:
    """Inside a kernel: its modelled start (``perf_counter_ns`` clock).
    Outside one (the host): now."""
    clock = getattr(_tls, "clock", None)
    return clock.start_ns if clock is not None else time.perf_counter_ns()


def hold_until(deadline_ns: int, kind: str = "kernel") -> None:
    """Inside a kernel: its modelled end is ``deadline_ns``; hold the stream
    until it has passed (what the kernel does after this is published at
    its modelled end). Outside one: sleep until then, nothing counted."""
    clock = getattr(_tls, "clock", None)
    if clock is None:
        sleep_until(deadline_ns)
        return
    clock.kind = kind
    clock.holds(deadline_ns)


def hold() -> None:
    """Inside a kernel launched with a model: hold until its modelled end
    now (then publish its outputs), instead of after it returns."""
    clock = getattr(_tls, "clock", None)
    if clock is None or clock.model is None:
        return
    clock.holds(clock.deadline_ns if clock.deadline_ns is not None else clock.start_ns + clock.model.ns)


# ---------------------------------------------------------------------------
# the counts


@dataclass
class KindCounts:
    """Modelled kernels of one kind: how many, their modelled time, how many
    overran and by how much in all (their run time past their model), and
    how many began later than :data:`OVERRUN_TOLERANCE_NS` after their
    modelled start; times in ns."""

    kernels: int = 0
    modelled_ns: int = 0
    overruns: int = 0
    overrun_ns: int = 0
    late_starts: int = 0
    #: Per kernel (up to MAX_SAMPLES): its own work, from its real start to
    #: its hold (ns): what a calibration reads.
    work_ns: list[int] = field(default_factory=list)

    def add(self, other: KindCounts) -> None:
        self.kernels += other.kernels
        self.modelled_ns += other.modelled_ns
        self.overruns += other.overruns
        self.overrun_ns += other.overrun_ns
        self.late_starts += other.late_starts
        self.work_ns.extend(other.work_ns[: max(0, MAX_SAMPLES - len(self.work_ns))])


@dataclass
class TimingCounts:
    """What the modelled kernels of a stretch of work cost against their
    model: per kind; every kernel's run time past its model (ns, negative
    when it began late and held less) and how late it began; each device
    synchronize's lag (when it returned after the modelled end of the work
    it waited for)."""

    kinds: dict[str, KindCounts] = field(default_factory=dict)
    over_ns: list[int] = field(default_factory=list)
    over_max_ns: int = 0
    start_lag_ns: list[int] = field(default_factory=list)
    sync_lag_ns: list[int] = field(default_factory=list)
    tolerance_ns: int = OVERRUN_TOLERANCE_NS

    def add_kernel(self, kind: str, modelled_ns: int, over_ns: int, start_lag_ns: int, work_ns: int) -> None:
        k = self.kinds.get(kind)
        if k is None:
            k = self.kinds[kind] = KindCounts()
        k.kernels += 1
        if len(k.work_ns) < MAX_SAMPLES:
            k.work_ns.append(work_ns)
        k.modelled_ns += modelled_ns
        if over_ns > self.tolerance_ns:
            k.overruns += 1
            k.overrun_ns += over_ns
        if start_lag_ns > self.tolerance_ns:
            k.late_starts += 1
        if len(self.over_ns) < MAX_SAMPLES:
            self.over_ns.append(over_ns)
            self.start_lag_ns.append(start_lag_ns)
        if over_ns > self.over_max_ns:
            self.over_max_ns = over_ns

    def merge(self, other: TimingCounts) -> TimingCounts:
        """Add ``other``'s counts to these (returns self)."""
        for kind, k in other.kinds.items():
            self.kinds.setdefault(kind, KindCounts()).add(k)
        room = max(0, MAX_SAMPLES - len(self.over_ns))
        self.over_ns.extend(other.over_ns[:room])
        self.start_lag_ns.extend(other.start_lag_ns[:room])
        self.over_max_ns = max(self.over_max_ns, other.over_max_ns)
        self.sync_lag_ns.extend(other.sync_lag_ns[: max(0, MAX_SAMPLES - len(self.sync_lag_ns))])
        return self

    @property
    def total(self) -> KindCounts:
        out = KindCounts()
        for k in self.kinds.values():
            out.add(k)
            out.work_ns = []
        return out

    def to_dict(self) -> dict[str, Any]:
        """The counts as JSON (times in µs, shares in %)."""
        t = self.total
        return {
            "kernels": t.kernels,
            "modelled_us": round(t.modelled_ns / 1e3, 1),
            "overruns": t.overruns,
            "overrun_pct": _pct(t.overruns, t.kernels),
            "overrun_us": round(t.overrun_ns / 1e3, 1),
            "overrun_time_pct": _pct(t.overrun_ns, t.modelled_ns),
            "late_starts": t.late_starts,
            "tolerance_us": round(self.tolerance_ns / 1e3, 1),
            "over_us": _quantiles(self.over_ns, self.over_max_ns if self.over_ns else 0),
            "start_lag_us": _quantiles(self.start_lag_ns, max(self.start_lag_ns, default=0)),
            "sync_lag_us": _quantiles(self.sync_lag_ns, max(self.sync_lag_ns, default=0)),
            "by_kind": {
                kind: {
                    "kernels": k.kernels,
                    "modelled_us": round(k.modelled_ns / 1e3, 1),
                    "overruns": k.overruns,
                    "overrun_us": round(k.overrun_ns / 1e3, 1),
                    "late_starts": k.late_starts,
                    "work_us": _quantiles(k.work_ns, max(k.work_ns, default=0)),
                }
                for kind, k in sorted(self.kinds.items())
            },
        }


def _pct(part: float, whole: float) -> float | None:
    return round(100.0 * part / whole, 4) if whole else None


def _quantiles(samples: list[int], most: int) -> dict[str, Any]:
    if not samples:
        return {"samples": 0, "median": None, "p90": None, "p99": None, "max": None}
    data = sorted(samples)

    def q(p: float) -> float:
        return round(data[round(p * (len(data) - 1))] / 1e3, 1)

    return {"samples": len(data), "median": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(most / 1e3, 1)}


class Ledger:
    """The device's counts since they were last taken (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = TimingCounts()

    def kernel(
        self, kind: str, model_start_ns: int, deadline_ns: int, real_start_ns: int, held_ns: int, real_end_ns: int
    ) -> None:
        """Count a modelled kernel: its modelled start and end, when its
        worker really began it, when its hold began (its own work done) and
        when it really ended."""
        modelled = deadline_ns - model_start_ns
        with self._lock:
            self._counts.add_kernel(
                kind,
                modelled,
                (real_end_ns - real_start_ns) - modelled,
                real_start_ns - model_start_ns,
                (held_ns or real_end_ns) - real_start_ns,
            )

    def sync(self, lag_ns: int) -> None:
        with self._lock:
            if len(self._counts.sync_lag_ns) < MAX_SAMPLES:
                self._counts.sync_lag_ns.append(lag_ns)

    def take(self) -> TimingCounts:
        with self._lock:
            counts, self._counts = self._counts, TimingCounts()
        return counts

    def peek(self) -> TimingCounts:
        with self._lock:
            return TimingCounts().merge(self._counts)


#: The emulated device's counts.
LEDGER = Ledger()


def take_timing() -> TimingCounts:
    """The counts of every modelled kernel since they were last taken (and
    start new ones)."""
    return LEDGER.take()


def peek_timing() -> TimingCounts:
    """A copy of the counts so far (nothing reset)."""
    return LEDGER.peek()
