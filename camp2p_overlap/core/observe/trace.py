"""A trace of what ran where and when, read by the edge checker ``verify/edges.py`` (``docs/design.md``, "Edges
of one step"). A recorder is opt-in (:func:`recording`); with none active, a step pays one read of the active
recorder. Times are host ``perf_counter_ns`` (CPU backend), device times from timing events, the emulated device's
log of what its streams ran, or kernel times from a profiler trace (``verify/profiler_timeline.py``).

Two records of a step's events can be in a trace: the session's (what it
asked for: ``source="session"``, in host issue order ``seq``) and the
backend's (what the streams performed: ``source="backend"``, in execution
order ``order``, each wait bound to the very event it waited on). The
checker reads the backend's where there is one (the emulated device keeps it).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core.keys import COMPUTE_STREAM, FFN_STREAM, EventKey, side_stream_name


@dataclass
class TraceOp:
    kind: str  # a connector op (keys.CONNECTOR_OP_KINDS), "ffn", "record", "wait", or a step's span ("step")
    layer: int | None
    stage: int | None
    stream: str
    start_ns: int
    end_ns: int
    step: int
    #: A record's or a wait's event (:meth:`EventKey.label`, read back with
    #: :meth:`EventKey.parse`); a device kernel's name; else empty.
    detail: str = ""
    #: Host issue order within the step (session ops, records and waits):
    #: the order in which work was queued on its stream. -1 where unknown
    #: (the serial path, where start times give the order).
    seq: int = -1
    #: Position in the backend's execution order (ops, and records and waits
    #: the streams performed); -1 where the backend keeps none.
    order: int = -1
    #: The identity of the event a backend record or wait touched (-1: none).
    event: int = -1
    #: Who says this record or wait happened: "session" (it asked the backend)
    #: or "backend" (a stream performed it).
    source: str = "session"

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class TraceRecorder:
    """Collects :class:`TraceOp` from every step while active."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: list[TraceOp] = []
        #: Steps whose device evidence is still arriving: resolved on read.
        self._pending: list[Callable[[], list[TraceOp]]] = []
        self._steps = 0
        #: Serial-path bookkeeping: per thread, per stage, when FFN started.
        self._serial = threading.local()

    def next_step(self) -> int:
        with self._lock:
            self._steps += 1
            return self._steps

    def add(self, op: TraceOp) -> None:
        with self._lock:
            self._ops.append(op)

    def defer(self, resolve: Callable[[], list[TraceOp]]) -> None:
        """Add a step's ops when they are read: a device backend's streams
        perform the step after the host has returned from it, so its trace
        is built once the reader has synchronized."""
        with self._lock:
            self._pending.append(resolve)

    def _resolve(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for resolve in pending:
            ops = resolve()
            with self._lock:
                self._ops.extend(ops)

    def ops(self, step: int | None = None) -> list[TraceOp]:
        self._resolve()
        with self._lock:
            ops = list(self._ops)
        if step is not None:
            ops = [o for o in ops if o.step == step]
        return sorted(ops, key=lambda o: (o.start_ns, o.end_ns))

    def steps(self) -> list[int]:
        self._resolve()
        with self._lock:
            return sorted({o.step for o in self._ops})

    # -- serial (not engaged) path --------------------------------------
    def serial_state(self) -> dict[str, object]:
        state = getattr(self._serial, "state", None)
        if state is None:
            state = self._serial.state = {"step": 0, "ffn_start": {}}
        return state


_active_lock = threading.Lock()
active: TraceRecorder | None = None


@contextlib.contextmanager
def recording(recorder: TraceRecorder | None = None) -> Iterator[TraceRecorder]:
    """Record every step run inside the block (all threads): a step reads
    the active recorder (a module global) once, when it starts."""
    global active
    rec = recorder or TraceRecorder()
    with _active_lock:
        previous, active = active, rec
    try:
        yield rec
    finally:
        with _active_lock:
            active = previous


class StepTrace:
    """One engaged step's trace bookkeeping (the session calls it only while a recorder is active). With a
    ``backend`` that keeps a stream log (the emulated device), what its streams performed goes in too: every record
    and wait, each op's and each FFN's kernels, in execution order; built when the recorder is read, after the
    reader synchronized the device (:meth:`TraceRecorder.defer`)."""

    def __init__(self, recorder: TraceRecorder, step_id: int, backend: Any = None, log: Any = None) -> None:
        self.recorder = recorder
        self.step_id = step_id
        self._ops: list[TraceOp] = []
        self._backend = backend if backend is not None and backend.start_log() else None
        #: A stream log kept by the caller (the serial path), read at resolve time.
        self._log = log
        #: Ops handed in one by one (the serial path), emitted with the rest.
        self._issued: list[tuple[str, int | None, int | None, str, Any, int]] = []

    def op(self, kind: str, layer: int | None, stage: int | None, stream: str, handle: Any) -> None:
        """An op and its handle (times resolved when the trace is read)."""
        self._issued.append((kind, layer, stage, stream, handle, -1))

    def event(self, kind: str, key: EventKey, stream: str, t0: int, t1: int, seq: int) -> None:
        """A record or a wait of the event ``key`` (its label is the op's ``detail``)."""
        self._ops.append(TraceOp(kind, key.layer, key.stage, stream, t0, t1, self.step_id, key.label(), seq))

    def ffn(self, layer: int, stage: int, t0: int, t1: int, seq: int, stream: str = COMPUTE_STREAM) -> None:
        """The host window in which the loop issued the FFN of ``(layer, stage)``, on ``stream``."""
        self._ops.append(TraceOp("ffn", layer, stage, stream, t0, t1, self.step_id, "", seq))

    def emit(self, ops: Iterable[tuple[str, int | None, int | None, str, Any, int]] = ()) -> None:
        """Hand the step's trace to the recorder, with every op that ran:
        ``(kind, layer, stage, stream, handle, seq)``."""
        issued = [*self._issued, *ops]
        self._issued = []
        log = self._backend.stop_log() if self._backend is not None else self._log
        self._backend = None
        host, self._ops = self._ops, []
        self.recorder.defer(lambda: self._resolve(issued, host, log))

    def _resolve(self, issued: list[tuple[Any, ...]], host: list[TraceOp], log: Any) -> list[TraceOp]:
        out: list[TraceOp] = []
        for kind, layer, stage, stream, h, seq in issued:
            if h.start_ns is not None and h.end_ns is not None:
                op = TraceOp(kind, layer, stage, stream, h.start_ns, h.end_ns, self.step_id, "", seq)
                op.order = _spaced(h.order)
                out.append(op)
        entries = list(log.entries() if hasattr(log, "entries") else log or [])
        if entries:
            self._place_ffn(host, entries)
            self._widen_step_span(entries)
        out.extend(host)
        out.extend(
            TraceOp(
                e.kind,
                e.key.layer,
                e.key.stage,
                e.stream,
                e.start_ns,
                e.end_ns,
                self.step_id,
                e.key.label(),
                order=_spaced(e.order),
                event=e.event,
                source="backend",
            )
            for e in entries
            if e.kind in ("record", "wait") and isinstance(e.key, EventKey)
        )
        return out

    @staticmethod
    def _place_ffn(host: list[TraceOp], entries: list[Any]) -> None:
        """Each FFN as its stream ran it: the kernels the loop launched on
        the FFN's stream inside the FFN's host window (not an op's)."""
        by_stream: dict[str, list[tuple[int, Any]]] = {}
        for e in entries:
            if e.kind == "kernel" and not e.label:
                by_stream.setdefault(e.stream, []).append((e.launched_ns, e))
        for kernels in by_stream.values():
            kernels.sort(key=lambda pair: pair[0])
        for o in host:
            if o.kind != "ffn":
                continue
            kernels = by_stream.get(o.stream, [])
            starts = [k for k, _ in kernels]
            lo, hi = bisect.bisect_left(starts, o.start_ns), bisect.bisect_right(starts, o.end_ns)
            mine = [e for _, e in kernels[lo:hi]]
            if mine:
                o.start_ns = min(e.start_ns for e in mine)
                o.end_ns = max(e.end_ns for e in mine)
                o.order = _spaced(min(e.order for e in mine))

    def _widen_step_span(self, entries: list[Any]) -> None:
        """The step ends when the compute stream has run its last work of
        the step (the joins), not when the host returned."""
        c_end = max((e.end_ns for e in entries if e.stream == COMPUTE_STREAM), default=None)
        if c_end is None:
            return
        with self.recorder._lock:
            for o in self.recorder._ops:
                if o.kind == "step" and o.step == self.step_id and o.end_ns < c_end:
                    o.end_ns = c_end


def _spaced(order: int) -> int:
    """A backend execution order, doubled (orders of the trace stay even,
    leaving room between two entries for what a reader inserts)."""
    return 2 * order if order >= 0 else -1


@dataclass(frozen=True)
class ExpectedSchedule:
    """What a step was planned to do: where each op kind runs (A2E and E2A on
    K_s or C, the FFN on F or C) and, with ``prefetch``, the overlap's issue
    order (unset: the overlap's where a receive or the FFN runs on a side
    stream, else the loop's)."""

    layers: tuple[int, ...]
    stages: tuple[int, ...]
    a2e_side: bool
    e2a_side: bool
    ffn_side: bool = False
    prefetch: bool | None = None

    def __post_init__(self) -> None:
        if self.prefetch is None:
            object.__setattr__(self, "prefetch", self.a2e_side or self.ffn_side)

    def stream_for(self, kind: str, stage: int) -> str:
        if kind == "ffn":
            return FFN_STREAM if self.ffn_side else COMPUTE_STREAM
        if (kind == "a2e" and self.a2e_side) or (kind == "e2a" and self.e2a_side):
            return side_stream_name(stage)
        return COMPUTE_STREAM

    def issue_order(self) -> list[tuple[str, int, int]]:
        """Every op ``(kind, layer, stage)`` in the order the host issues it: the loop's (A2E, FFN, E2A per
        (layer, stage)), or with ``prefetch`` the overlap's (the first layer's A2E of every stage, then per
        (layer, stage) the FFN, the E2A and the stage's next A2E)."""
        plan = [(L, s) for L in self.layers for s in self.stages]
        if not self.prefetch:
            return [(k, L, s) for L, s in plan for k in ("a2e", "ffn", "e2a")]
        nxt = dict(zip(self.layers, (*self.layers[1:], None), strict=True))
        out = [("a2e", self.layers[0], s) for s in self.stages] if self.layers else []
        for L, s in plan:
            out += [("ffn", L, s), ("e2a", L, s)]
            if nxt[L] is not None:
                out.append(("a2e", nxt[L], s))
        return out

    @classmethod
    def of_layout(cls, layers: Sequence[int], stages: Sequence[int], layout: Any) -> ExpectedSchedule:
        """The schedule of a step of ``layers`` x ``stages`` in ``layout`` (a ``plan.Layout``)."""
        return cls(tuple(layers), tuple(stages), layout.a2e_side, layout.e2a_side, layout.ffn_side, layout.prefetch)

    @classmethod
    def serial(cls, layers: Sequence[int], stages: Sequence[int]) -> ExpectedSchedule:
        return cls(tuple(layers), tuple(stages), False, False)
