"""One state per FFN runner, weakly held: what the patch layer keeps of a runner
between its steps (:class:`RunnerState`). A state goes when its runner is
collected (its side streams closed). On unpatch and in a forked child a
state keeps only the runner's name, so what adaptive engage learned under it
still applies: its side streams are closed on unpatch and forgotten in a
child (the parent's stream threads are not there)."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from camp2p_overlap.core.fork import after_fork_in_child
from camp2p_overlap.core.overlap.adaptive import StepTimings
from camp2p_overlap.core.overlap.streams import make_backend
from camp2p_overlap.core.overlap.streams.backend import StreamBackend
from camp2p_overlap.core.overlap.streams.streamset import StreamSet

#: Builds a backend from its name and the runner's device.
BackendMaker = Callable[[str, Any], StreamBackend]


class NotWeaklyReferenceable(TypeError):
    """A runner the patch layer cannot hold weakly (its class has ``__slots__``
    without ``__weakref__``): its steps run serially, with this reason."""


@dataclass
class VariantCapture:
    """Set while the patch layer captures its variant of a decode graph: the
    captured step says whether it engaged, with how many layers, in which layout."""

    engaged: bool = False
    layers: int = 0
    layout: str = ""


@dataclass(eq=False)
class RunnerState:
    """What the patch layer keeps of one runner."""

    #: A short, stable name in bucket keys and stats (``Class#n``).
    name: str
    timings: StepTimings
    streamset: StreamSet | None = None
    backend_name: str | None = None
    #: What the runner's steps share until the engine's generation moves
    #: (``decision.RunnerFacts``).
    facts: Any = None
    #: Decode graph keys captured with both variants (``graphs.CapturedKey``), by key text.
    graphs: dict[str, Any] = field(default_factory=dict)
    #: While the patch layer captures its variant of a decode graph of this runner.
    variant_capture: VariantCapture | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close_streams(self) -> None:
        sset, self.streamset, self.backend_name = self.streamset, None, None
        if sset is not None:
            sset.close()

    def keep_name_only(self) -> None:
        """Everything but the name dropped (the streams not closed)."""
        self.streamset, self.backend_name, self.facts = None, None, None
        self.timings.clear()
        self.graphs = {}
        self.variant_capture = None


class RunnerStates:
    """The states of one runtime's runners, by runner identity."""

    def __init__(self, stage_ids: Sequence[int], owner: Any) -> None:
        self._stage_ids = tuple(stage_ids)
        #: What holds the adaptive engage the runners' timings feed (``owner.adaptive``).
        self._owner = owner
        #: Builds a backend (None: ``streams.make_backend``); the overhead tool swaps it.
        self.make_backend: BackendMaker | None = None
        self._names = itertools.count()
        self._lock = threading.Lock()
        #: id(runner) -> (weak reference to it, its state): one dict lookup per step.
        self._states: dict[int, tuple[weakref.ref[Any], RunnerState]] = {}
        after_fork_in_child(self._forget_in_child)

    def of(self, runner: Any) -> RunnerState | None:
        """The runner's state if it has one (never makes one)."""
        entry = self._states.get(id(runner))
        return entry[1] if entry is not None and entry[0]() is runner else None

    def get(self, runner: Any) -> RunnerState:
        """The runner's state, made on first use. Raises
        :class:`NotWeaklyReferenceable`."""
        rid = id(runner)
        entry = self._states.get(rid)
        if entry is not None and entry[0]() is runner:
            return entry[1]
        with self._lock:
            entry = self._states.get(rid)
            if entry is not None and entry[0]() is runner:
                return entry[1]
            try:
                ref = weakref.ref(runner, lambda r: self._drop(rid, r))
            except TypeError as exc:
                raise NotWeaklyReferenceable(
                    f"the runner ({type(runner).__name__}) cannot be weakly referenced, so the layer keeps no "
                    "state for it"
                ) from exc
            state = RunnerState(f"{type(runner).__name__}#{next(self._names)}", StepTimings(self._owner))
            self._states[rid] = (ref, state)
            return state

    def streams(self, runner: Any, backend_name: str) -> StreamSet | None:
        """The runner's side streams on ``backend_name``, made on first use; None
        when they would be made inside a graph capture (Ascend graphs have a small
        stream budget). Raises ``BackendUnavailable``, :class:`NotWeaklyReferenceable`."""
        state = self.get(runner)
        with state.lock:  # a step reads state.streamset first, and calls this only when it lacks the one it needs
            if state.streamset is not None and state.backend_name == backend_name:
                return state.streamset
            make = self.make_backend if self.make_backend is not None else make_backend
            backend = make(backend_name, getattr(runner, "device", None))
            if backend.is_capturing():
                return None
            state.close_streams()
            state.streamset, state.backend_name = StreamSet(backend, self._stage_ids), backend_name
            return state.streamset

    def states(self) -> list[RunnerState]:
        """Every live runner's state."""
        with self._lock:
            return [s for ref, s in self._states.values() if ref() is not None]

    def stream_sets(self) -> list[StreamSet]:
        return [s.streamset for s in self.states() if s.streamset is not None]

    def close_all(self) -> None:
        """On unpatch (graphs restored first): every state's streams closed, all but its name dropped."""
        for s in self.states():
            with s.lock:
                s.close_streams()
                s.keep_name_only()

    def _drop(self, rid: int, ref: weakref.ref[Any]) -> None:
        """The runner was collected: its state goes, its streams close."""
        with self._lock:
            entry = self._states.get(rid)
            if entry is None or entry[0] is not ref:
                return
            del self._states[rid]
        entry[1].close_streams()

    def _forget_in_child(self) -> None:
        """In a forked child: every state keeps its name only, without closing
        the parent's stream threads (not there), with new locks (a parent
        thread may have held the old ones)."""
        self._lock = threading.Lock()
        for _, s in self._states.values():
            s.lock = threading.Lock()
            s.keep_name_only()
