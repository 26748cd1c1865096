"""Fault plans for the emulated CAMP2P world: make one op of one (layer,
stage) raise, stall for a while, or lose its attention peer.

A :class:`FaultPlan` attaches to a :class:`~camp2p_overlap.emulation.world.World`
through the transport's ``fault_hook`` and a thin wrapper around the runner's
model. The transport calls the hook inside the A2E and E2A *kernels*: on the
worker thread of the stream the op was issued on (a side stream when the
overlap is engaged, the compute stream otherwise), after the host has moved
on, so a fault there is an asynchronous error of that stream. The model
wrapper runs on the host (the FFN's host part), so an FFN fault is a host
error, raised at once. A fault fires at most once after
:meth:`FaultPlan.arm`; the step after it runs clean.

What each action does, per op:

* ``raise``: the op raises ``fault.exc_type`` before doing anything.
* ``delay``: the op sleeps ``fault.delay_s`` first, then runs normally; the
  step's outputs must not change.
* ``stop``: the attention rank of the stage stops answering. An A2E then
  waits the transport's ``op_timeout_s`` and raises
  :class:`~camp2p_overlap.emulation.world.PeerTimeoutError` (the emulated
  transport models this itself). An E2A on hardware spins for the peer's
  handshake; the emulated E2A models no handshake, so the plan plays it: the
  E2A waits ``op_timeout_s`` and raises the same error. ``stop`` does not
  apply to the FFN.

Used by ``tests/overlap/test_faults.py``, ``tests/overlap/test_watchdog.py`` and
``tests/patching/test_patch_orders.py``; also handy for trying the watchdog by hand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from camp2p_overlap.emulation.world import PeerTimeoutError, World

Action = Literal["raise", "delay", "stop"]
OpKind = Literal["a2e", "ffn", "e2a"]

ACTIONS: tuple[Action, ...] = ("raise", "delay", "stop")
FAULT_SITES: tuple[OpKind, ...] = ("a2e", "ffn", "e2a")


class InjectedFault(RuntimeError):
    """The error a ``raise`` fault throws by default."""


class InjectedIOError(OSError):
    """A second injected error type, so tests can tell types apart."""


@dataclass(frozen=True)
class Fault:
    action: Action
    op: OpKind
    layer: int
    stage: int
    delay_s: float = 0.0
    exc_type: type[BaseException] = InjectedFault

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}")
        if self.op not in FAULT_SITES:
            raise ValueError(f"unknown op kind {self.op!r}")
        if self.action == "stop" and self.op == "ffn":
            raise ValueError("a stopped peer applies to A2E/E2A, not to the FFN")

    def expected_error(self) -> type[BaseException] | None:
        """The exception type the caller of the step must see, or None when
        the step must succeed with unchanged outputs."""
        if self.action == "raise":
            return self.exc_type
        if self.action == "stop":
            return PeerTimeoutError
        return None

    def describe(self) -> str:
        extra = f" {self.delay_s * 1e3:.1f} ms" if self.action == "delay" else ""
        if self.action == "raise":
            extra = f" {self.exc_type.__name__}"
        return f"{self.action}{extra} at {self.op}(L{self.layer},s{self.stage})"


@dataclass
class Firing:
    fault: Fault
    thread: str
    at_ns: int


@dataclass
class FaultPlan:
    """Faults for one world. ``install()`` hooks it in, ``remove()`` takes
    it out; ``arm()`` makes the faults fire (once each) from then on."""

    world: World
    faults: Sequence[Fault] = ()
    fired: list[Firing] = field(default_factory=list)
    #: Called with the fault just before it acts (tests use it to observe).
    on_fire: Callable[[Fault], None] | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[Fault] = []
        self._installed = False
        self._model: Any = None
        self._ffn_calls: dict[int, int] = {}
        self._stages: tuple[int, ...] = ()
        self._orig_begin: Any = None

    # -- wiring ----------------------------------------------------------
    def install(self) -> FaultPlan:
        if self._installed:
            return self
        transport = self.world.transport
        if transport.fault_hook is not None:
            raise RuntimeError("the transport already has a fault hook")
        transport.fault_hook = self._transport_hook
        self._orig_begin = transport.begin_step
        plan = self

        def begin_step(step: int, layers: Sequence[int], stages: Sequence[int]) -> None:
            with plan._lock:
                plan._ffn_calls = {}
                plan._stages = tuple(stages)
            plan._orig_begin(step, layers, stages)

        transport.begin_step = begin_step  # type: ignore[method-assign]
        self._model = self.world.runner.model
        self.world.runner.model = _FaultyModel(self._model, self)
        self._installed = True
        return self

    def remove(self) -> None:
        if not self._installed:
            return
        transport = self.world.transport
        transport.fault_hook = None
        del transport.begin_step  # back to the class attribute
        self.world.runner.model = self._model
        self._installed = False
        self.disarm()

    def __enter__(self) -> FaultPlan:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def arm(self, faults: Sequence[Fault] | None = None) -> None:
        with self._lock:
            self._armed = list(self.faults if faults is None else faults)

    def disarm(self) -> None:
        with self._lock:
            self._armed = []

    @property
    def pending(self) -> list[Fault]:
        with self._lock:
            return list(self._armed)

    # -- firing ----------------------------------------------------------
    def _take(self, op: str, layer: int, stage: int) -> Fault | None:
        with self._lock:
            for i, f in enumerate(self._armed):
                if f.op == op and f.layer == layer and f.stage == stage:
                    del self._armed[i]
                    self.fired.append(Firing(f, threading.current_thread().name, time.perf_counter_ns()))
                    return f
        return None

    def _act(self, f: Fault) -> None:
        if self.on_fire is not None:
            self.on_fire(f)
        if f.action == "raise":
            raise f.exc_type(f"injected {f.describe()}")
        if f.action == "delay":
            time.sleep(f.delay_s)
            return
        # stop
        transport = self.world.transport
        transport.stop_peer(f.stage)
        if f.op == "e2a":
            # The emulated E2A has no handshake to wait for: play the spin.
            time.sleep(transport.op_timeout_s)
            raise PeerTimeoutError(
                f"e2a(L{f.layer}) of stage {f.stage}: no handshake from attention after "
                f"{transport.op_timeout_s:.1f} s (peer stopped)"
            )
        # a2e: the transport itself waits op_timeout_s and raises.

    def _transport_hook(self, kind: str, layer: int, stage: int) -> None:
        f = self._take(kind, layer, stage)
        if f is not None:
            self._act(f)

    def _ffn_hook(self, layer: int) -> None:
        with self._lock:
            n = self._ffn_calls.get(layer, 0)
            self._ffn_calls[layer] = n + 1
            stages = self._stages
        stage = stages[n] if n < len(stages) else -1
        f = self._take("ffn", layer, stage)
        if f is not None:
            self._act(f)


class _FaultyModel:
    """The runner's model with an FFN fault point. The loop calls the model
    once per (layer, stage) in stage order, so the n-th call for a layer in
    a step belongs to the n-th stage of that step."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self._inner = inner
        self._plan = plan

    def compute_ffn_output(self, *, hidden_states: Any, layer_idx: int) -> Any:
        self._plan._ffn_hook(int(layer_idx))
        return self._inner.compute_ffn_output(hidden_states=hidden_states, layer_idx=layer_idx)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass
class StepOutcome:
    """What one bounded step did: its results, or the exception it raised,
    or that it did not finish in time (``hung``)."""

    results: dict[tuple[int, int], Any] | None
    error: BaseException | None
    hung: bool
    seconds: float


def run_step_bounded(world: World, step: int, timeout_s: float, **forward_kwargs: Any) -> StepOutcome:
    """Run step number ``step`` of ``world`` (``world.steps_run`` is set so
    the attention peers send the same data as any other run of that step
    number) on a helper thread and wait at most ``timeout_s`` for it. A step
    still running then is reported as ``hung`` (its thread is a daemon)."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["results"] = world.run_step(**forward_kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed back
            box["error"] = exc

    world.steps_run = step - 1
    t0 = time.perf_counter()
    th = threading.Thread(target=body, name=f"camp2p-test-step-{step}", daemon=True)
    th.start()
    th.join(timeout_s)
    seconds = time.perf_counter() - t0
    if th.is_alive():
        return StepOutcome(None, None, True, seconds)
    return StepOutcome(box.get("results"), box.get("error"), False, seconds)
