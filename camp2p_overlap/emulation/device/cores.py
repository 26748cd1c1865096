"""The emulated device's vector cores: one pool per process (the multi-rank world runs one emulated device per rank).

A kernel declares what it takes at launch (:class:`CoreDemand`): how many cores its blocks run on, and whether
all of them must be resident at once. A stream's worker claims the cores before it runs the kernel and gives them
back when the kernel ends, so a kernel that cannot get its cores holds its stream, as on a device:

* **resident** (CAM's A2E/E2A, whose blocks synchronise with one another; the MoE's MC2 dispatch and combine,
  collective kernels whose blocks every peer rank's blocks wait on): the blocks are dispatched as cores come free
  and each holds its core from then on, so a kernel only part-dispatched already holds what it got, and runs once
  it holds all. One that asks for more cores than the device has can never run: it fails at once
  (:class:`CoreBudgetError`), the stream's asynchronous error.
* **not resident** (the experts' kernels: their blocks run in waves): it starts once it holds one core, taking what
  is free up to its count; a modelled one with fewer cores than it asked for lasts proportionally longer
  (``waves``).

Cores come free to the waiting kernels in the order they asked. A spinning kernel (an A2E whose peer has not sent)
keeps its cores until it ends: nothing here takes cores back. With no pool configured (:func:`set_core_budget`
not called, or called with None) kernels take no cores and nothing waits: the device of every earlier check.

:func:`core_state` gives the pool's holders and waiters, for the stall report (the device module's optional
``core_state`` capability).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

#: The orders free cores can be handed out in (:class:`CorePool`): a device's block dispatch order is not public.
HAND_OUT_ORDERS = ("oldest", "newest")
#: How often a kernel waiting for cores looks whether its stream is being stopped.
_WAIT_POLL_S = 0.05


class CoreBudgetError(RuntimeError):
    """A kernel whose blocks must all be resident asks for more cores than the device has."""


@dataclass(frozen=True, slots=True)
class CoreDemand:
    """What one kernel takes: ``cores`` blocks, each on a core of its own; ``resident``: all of them at once;
    ``kind``: what it is (``a2e``, ``moe-a2a``, ``ffn``, ...), for reports."""

    cores: int
    resident: bool = False
    kind: str = "kernel"

    def __post_init__(self) -> None:
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1:
            raise ValueError(f"a kernel takes a positive whole number of cores, got {self.cores!r}")


@dataclass(slots=True, eq=False)
class Claim:
    """One kernel's claim on the pool: what it asked for and what it holds."""

    demand: CoreDemand
    stream: str
    label: str
    since_ns: int = field(default_factory=time.perf_counter_ns)
    held: int = 0
    #: It holds what it needs to run (all its cores, or, not resident, at least one).
    ready: bool = False
    #: When it got its cores after waiting for them (0: it did not wait): the earliest its modelled start can be.
    waited_until_ns: int = 0

    @property
    def waves(self) -> int:
        """How many rounds its blocks run in on the cores it holds (1 for a resident kernel)."""
        return max(1, math.ceil(self.demand.cores / max(self.held, 1)))

    def text(self) -> str:
        kind = "resident" if self.demand.resident else "in waves"
        return f"{self.label} on {self.stream}: holds {self.held} of {self.demand.cores} ({kind})"


class CorePool:
    """The vector cores of one emulated device."""

    def __init__(self, total: int, order: str = "oldest") -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"a device has a positive whole number of vector cores, got {total!r}")
        if order not in HAND_OUT_ORDERS:
            raise ValueError(f"cores are handed out {' or '.join(HAND_OUT_ORDERS)} first, not {order!r}")
        self.total = total
        #: Which waiting kernel free cores go to first: the one that asked first (``oldest``), or last (``newest``).
        self.order = order
        self.free = total
        self._cond = threading.Condition(threading.Lock())
        self._waiting: deque[Claim] = deque()
        self._running: list[Claim] = []
        #: Kernels that had to wait for cores, and kernels that ran on fewer cores than they have blocks.
        self.waits = 0
        self.short = 0

    def claim(self, demand: CoreDemand, stream: str, label: str, stopping: Callable[[], bool]) -> Claim | None:
        """Wait until the kernel holds its cores; None when ``stopping()`` turned true first (what it held is given
        back). Raises :class:`CoreBudgetError` for a resident kernel larger than the device."""
        if demand.resident and demand.cores > self.total:
            raise CoreBudgetError(
                f"{label} on {stream} needs {demand.cores} resident vector cores; the device has {self.total}"
            )
        claim = Claim(demand, stream, label)
        with self._cond:
            self._waiting.append(claim)
            self._hand_out()
            if not claim.ready:
                self.waits += 1
            while not claim.ready:
                if stopping():
                    self._waiting.remove(claim)
                    self._give_back(claim)
                    return None
                self._cond.wait(_WAIT_POLL_S)
                claim.waited_until_ns = time.perf_counter_ns()
        return claim

    def release(self, claim: Claim) -> None:
        """The kernel has ended: its cores go to the kernels waiting, in the order they asked."""
        with self._cond:
            if claim in self._running:
                self._running.remove(claim)
            self._give_back(claim)

    def _give_back(self, claim: Claim) -> None:
        self.free += claim.held
        claim.held = 0
        self._hand_out()

    def _hand_out(self) -> None:
        """Free cores to the waiting claims, oldest first (under the condition's lock)."""
        changed = False
        newest = self.order == "newest"
        while self._waiting and self.free:
            claim = self._waiting[-1] if newest else self._waiting[0]
            take = min(claim.demand.cores - claim.held, self.free)
            claim.held += take
            self.free -= take
            changed = True
            if claim.held == claim.demand.cores or not claim.demand.resident:
                claim.ready = True
                self._waiting.remove(claim)
                self._running.append(claim)
                self.short += claim.held < claim.demand.cores
        if changed:
            self._cond.notify_all()

    def state(self) -> CoreState:
        with self._cond:
            return CoreState(
                self.total,
                self.free,
                tuple(c.text() for c in self._running),
                tuple(c.text() for c in self._waiting),
            )


@dataclass(frozen=True, slots=True)
class CoreState:
    """A copy of the pool: its size, the free cores, the kernels that hold cores and run, those that wait."""

    total: int
    free: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]

    def lines(self) -> list[str]:
        out = [f"vector cores: {self.total - self.free} of {self.total} held, {self.free} free"]
        out += [f"  running, {c}" for c in self.running]
        out += [f"  waiting, {c}" for c in self.waiting]
        return out


#: The device's pool (None: no core model).
_pool: list[CorePool | None] = [None]


#: Whether the device reports its pool's size (``get_device_properties().vector_core_num``).
_reported: list[bool] = [True]


def set_core_budget(total: int | None, *, reported: bool = True, order: str = "oldest") -> CorePool | None:
    """Give this process's emulated device ``total`` vector cores (None: no core model); ``reported``: whether its
    properties say so (False: a device whose count the layer cannot read). Returns the old pool. Set it before any
    kernel runs: claims held in the old pool stay there."""
    old = _pool[0]
    _pool[0] = CorePool(total, order) if total is not None else None
    _reported[0] = reported
    return old


def core_pool() -> CorePool | None:
    return _pool[0]


def core_budget() -> int | None:
    """The vector core count the device reports: None without a core model, or one it does not report."""
    pool = _pool[0]
    return pool.total if pool is not None and _reported[0] else None


def core_state() -> list[str]:
    """The pool's holders and waiters as report lines (empty without a core model)."""
    pool = _pool[0]
    return pool.state().lines() if pool is not None else []
