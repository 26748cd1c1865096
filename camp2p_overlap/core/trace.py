"""A trace of what ran where and when, and a checker that every edge of the
design (``docs/design.md``, "Edges") held in it.

A recorder is opt-in (:func:`recording`); with none active, the wrappers pay
nothing for tracing. Times are ``time.perf_counter_ns()`` on the host (CPU
backend: real op times), or device times resolved from timing events when a
device backend was asked for them, or kernel times from a profiler trace
(``core/device_timeline.py``).

Two records of a step's events can be in a trace: the session's (what it
asked for: ``source="session"``, in host issue order ``seq``) and the
backend's (what the streams performed: ``source="backend"``, in execution
order ``order``, each wait bound to the very event it waited on). The
checker reads the backend's where there is one (the CPU backend keeps it).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import threading
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from camp2p_overlap.core.intercept_switch import INTERCEPTS

OP_KINDS = ("a2e", "ffn", "e2a", "wait", "record", "step")


@dataclass
class TraceOp:
    kind: str
    layer: int | None
    stage: int | None
    stream: str
    start_ns: int
    end_ns: int
    step: int
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

    def extend(self, ops: Iterable[TraceOp]) -> None:
        with self._lock:
            self._ops.extend(ops)

    def ops(self, step: int | None = None) -> list[TraceOp]:
        with self._lock:
            ops = list(self._ops)
        if step is not None:
            ops = [o for o in ops if o.step == step]
        return sorted(ops, key=lambda o: (o.start_ns, o.end_ns))

    def steps(self) -> list[int]:
        with self._lock:
            return sorted({o.step for o in self._ops})

    def clear(self) -> None:
        with self._lock:
            self._ops.clear()

    # -- serial (not engaged) path --------------------------------------
    def serial_state(self) -> dict[str, object]:
        state = getattr(self._serial, "state", None)
        if state is None:
            state = self._serial.state = {"step": 0, "ffn_start": {}}
        return state

    def to_json(self) -> str:
        return json.dumps([asdict(o) for o in self.ops()])


_active_lock = threading.Lock()
_active: TraceRecorder | None = None


def current_recorder() -> TraceRecorder | None:
    return _active


@contextlib.contextmanager
def recording(recorder: TraceRecorder | None = None) -> Iterator[TraceRecorder]:
    """Record every step run inside the block (all threads). The
    process's intercept switch is held meanwhile, so that the connector
    wrappers see the recorder."""
    global _active
    rec = recorder or TraceRecorder()
    INTERCEPTS.hold()
    try:
        with _active_lock:
            previous, _active = _active, rec
        try:
            yield rec
        finally:
            with _active_lock:
                _active = previous
    finally:
        INTERCEPTS.release()


def _key_stage(key: Hashable) -> tuple[int | None, int | None]:
    """(layer, stage) named by an event key (``(kind, layer, stage)``, ``("join", stage)``)."""
    if isinstance(key, tuple) and len(key) == 3:
        return key[1], key[2]
    if isinstance(key, tuple) and len(key) == 2 and key[0] == "join":
        return None, key[1]
    return None, None


class StepTrace:
    """One engaged step's trace bookkeeping, kept apart from the schedule:
    the session calls it only when a recorder is active. With a ``backend``
    that keeps a stream log (CPU), the records and waits its streams
    performed go into the trace as well, with every op's execution order."""

    def __init__(self, recorder: TraceRecorder, step_id: int, backend: Any = None) -> None:
        self.recorder = recorder
        self.step_id = step_id
        self._ops: list[TraceOp] = []
        self._backend = backend if backend is not None and backend.start_log() else None

    def event(self, kind: str, key: Hashable, stream: str, t0: int, t1: int, seq: int) -> None:
        """A record or a wait of the event named ``key`` (``(kind, layer, stage)``)."""
        layer, stage = _key_stage(key)
        self._ops.append(TraceOp(kind, layer, stage, stream, t0, t1, self.step_id, repr(key), seq))

    def ffn(self, layer: int, stage: int, t0: int, t1: int, seq: int) -> None:
        self._ops.append(TraceOp("ffn", layer, stage, "C", t0, t1, self.step_id, "", seq))

    def emit(self, ops: Iterable[tuple[str, int | None, int | None, str, Any, int]]) -> None:
        """Hand the step's trace to the recorder, with every op that ran:
        ``(kind, layer, stage, stream, handle, seq)``."""
        for kind, layer, stage, stream, h, seq in ops:
            if h.start_ns is not None and h.end_ns is not None:
                op = TraceOp(kind, layer, stage, stream, h.start_ns, h.end_ns, self.step_id, "", seq)  # type: ignore[arg-type]
                op.order = _spaced(h.order)
                self._ops.append(op)
        if self._backend is not None:
            self._add_stream_log(self._backend.stop_log())
            self._backend = None
        self.recorder.extend(self._ops)
        self._ops = []

    def _add_stream_log(self, log: Sequence[Any]) -> None:
        """The records and waits the streams performed, and the FFN's place in
        the compute stream's execution order. C is the host: its entries are
        sequential in time, and the FFN ran between the wait that returned
        before it started and the record that fired after it ended."""
        performed = [
            TraceOp(
                e.kind,
                *_key_stage(e.key),
                e.stream,
                e.start_ns,
                e.end_ns,
                self.step_id,
                repr(e.key),
                order=_spaced(e.order),
                event=e.event,
                source="backend",
            )
            for e in log
        ]
        on_c = sorted(
            (o.end_ns, o.order)
            for o in [*performed, *self._ops]
            if o.stream == "C" and o.order >= 0 and o.kind != "ffn"
        )
        ends = [end for end, _ in on_c]
        for o in self._ops:
            if o.kind == "ffn":
                i = bisect.bisect_right(ends, o.start_ns)
                o.order = on_c[i - 1][1] + 1 if i else -1  # odd: right after that entry
        self._ops.extend(performed)


def _spaced(order: int) -> int:
    """A backend execution order, doubled so that a host-side FFN can sit
    between two entries of C (at an odd position)."""
    return 2 * order if order >= 0 else -1


# ---------------------------------------------------------------------------
# The edge checker
# ---------------------------------------------------------------------------


def side_stream_name(stage: int) -> str:
    return f"K{stage}"


@dataclass(frozen=True)
class ExpectedSchedule:
    """What a step was planned to do."""

    layers: tuple[int, ...]
    stages: tuple[int, ...]
    a2e_side: bool
    e2a_side: bool

    def stream_for(self, kind: str, stage: int) -> str:
        if kind == "a2e" and self.a2e_side:
            return side_stream_name(stage)
        if kind == "e2a" and self.e2a_side:
            return side_stream_name(stage)
        return "C"

    @classmethod
    def serial(cls, layers: Sequence[int], stages: Sequence[int]) -> ExpectedSchedule:
        return cls(tuple(layers), tuple(stages), False, False)


@dataclass
class CheckResult:
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return "all edges held" if self.ok else "\n".join(self.violations)


def check_step(ops: Sequence[TraceOp], expected: ExpectedSchedule, *, source: str = "auto") -> CheckResult:
    """Check that every edge of the design held in one step's trace.

    Two kinds of evidence: the timings (each op started after what it
    depends on ended; no two ops of one stage group at once; C ran one op at
    a time in the loop's order; everything inside the step span), and the
    event graph: each dependency (edges 3, 4, 5/6) must be a path of stream
    order and record->wait edges, each side stream must start with a wait on
    C (fork) and end before a wait of C after its last op (join), no wait
    may bind to an event not recorded in the step, and no side stream may
    wait on another stage's stream.

    ``source`` says whose records and waits build the graph: ``"backend"``
    (what the streams performed, in execution order, each wait bound to the
    event it waited on and satisfied only after that event fired),
    ``"session"`` (what the session asked for, in issue order, a wait bound
    to the latest record of its name), ``"device"`` (a profiler's kernel
    timeline, ``core/device_timeline.py``: device times only, no event
    graph), or ``"auto"``: the backend's where the trace has them."""
    if source not in ("auto", "backend", "session", "device"):
        raise ValueError(f"source must be auto, backend, session or device, not {source!r}")
    if source == "auto":
        source = "backend" if any(o.source == "backend" for o in ops) else "session"
    res = CheckResult()
    bad = res.violations.append
    by: dict[tuple[str, int | None, int | None], list[TraceOp]] = defaultdict(list)
    for o in ops:
        by[(o.kind, o.layer, o.stage)].append(o)
    plan = [(L, s) for L in expected.layers for s in expected.stages]
    planned = set(plan)

    # Completeness, and nothing outside the plan (no A2E past the last layer).
    for kind in ("a2e", "ffn", "e2a"):
        for L, s in plan:
            n = len(by.get((kind, L, s), []))
            if n != 1:
                bad(f"{kind}(L{L},s{s}) ran {n} times, expected once")
        for o in ops:
            if o.kind == kind and (o.layer, o.stage) not in planned:
                bad(f"{kind}(L{o.layer},s{o.stage}) is outside the step's plan")

    def one(kind: str, L: int, s: int) -> TraceOp | None:
        found = by.get((kind, L, s))
        return found[0] if found and len(found) == 1 else None

    for L, s in plan:
        a, f, e = one("a2e", L, s), one("ffn", L, s), one("e2a", L, s)
        # Stream selection.
        for o in (a, f, e):
            if o is None:
                continue
            want = "C" if o.kind == "ffn" else expected.stream_for(o.kind, s)
            if o.stream != want:
                bad(f"{o.kind}(L{L},s{s}) ran on {o.stream}, expected {want}")
        # Edge 3: FFN waits for its A2E. Edge 4: E2A waits for its FFN.
        if a and f and f.start_ns < a.end_ns:
            bad(f"ffn(L{L},s{s}) started {a.end_ns - f.start_ns} ns before its a2e ended")
        if f and e and e.start_ns < f.end_ns:
            bad(f"e2a(L{L},s{s}) started {f.end_ns - e.start_ns} ns before its ffn ended")

    # Edge 5/6: per stage, the group's communication ops never overlap and
    # keep the serial order a2e(L0) e2a(L0) a2e(L1) e2a(L1) ...
    for s in expected.stages:
        seq = [one(k, L, s) for L in expected.layers for k in ("a2e", "e2a")]
        prev: TraceOp | None = None
        for o in seq:
            if o is None:
                continue
            if prev is not None and o.start_ns < prev.end_ns:
                bad(f"group of stage {s}: {o.kind}(L{o.layer}) started before {prev.kind}(L{prev.layer}) ended")
            prev = o
        # No op of stage s on another stage's stream.
        for o in ops:
            if o.stage == s and o.stream.startswith("K") and o.stream != side_stream_name(s):
                bad(f"{o.kind}(L{o.layer},s{s}) ran on another stage's stream {o.stream}")

    # The compute stream runs its ops (every FFN, and A2E/E2A where that
    # direction stays on C) one at a time, in the loop's order.
    want_c = [
        (k, L, s) for L, s in plan for k in ("a2e", "ffn", "e2a") if k == "ffn" or expected.stream_for(k, s) == "C"
    ]
    on_c = sorted(
        (o for o in ops if o.kind in ("a2e", "ffn", "e2a") and o.stream == "C"), key=lambda o: (o.start_ns, o.end_ns)
    )
    got_c = [(o.kind, o.layer, o.stage) for o in on_c]
    if got_c != want_c:
        first = next(
            (i for i, (g, w) in enumerate(zip(got_c, want_c, strict=False)) if g != w), min(len(got_c), len(want_c))
        )
        bad(
            f"compute stream order differs from the loop order at position {first}: "
            f"ran {got_c[first : first + 3]}, expected {want_c[first : first + 3]}"
        )
    prev = None
    for o in on_c:
        if prev is not None and o.start_ns < prev.end_ns:
            bad(f"{o.kind}(L{o.layer},s{o.stage}) started on C before {prev.kind}(L{prev.layer},s{prev.stage}) ended")
        prev = o

    if source != "device":
        _check_event_graph(ops, expected, plan, one, bad, source)

    # Edges 1 and 7: everything inside the step (fork and join).
    steps = [o for o in ops if o.kind == "step"]
    if len(steps) != 1:
        bad(f"expected one step span, found {len(steps)}")
    else:
        st = steps[0]
        for o in ops:
            if o.kind in ("a2e", "ffn", "e2a") and (o.start_ns < st.start_ns or o.end_ns > st.end_ns):
                bad(f"{o.kind}(L{o.layer},s{o.stage}) ran outside the step (fork/join)")
    return res


def _check_event_graph(
    ops: Sequence[TraceOp],
    expected: ExpectedSchedule,
    plan: list[tuple[int, int]],
    one: Callable[[str, int, int], TraceOp | None],
    bad: Callable[[str], None],
    source: str = "session",
) -> None:
    """Rebuild what ran on each stream, in order, and the event edges
    (record -> wait) between streams, and check that every edge of the
    design is a path in that graph: a proof by construction, independent of
    how the timings happened to fall."""
    nodes = [o for o in ops if o.kind in ("a2e", "ffn", "e2a") or (o.kind in ("record", "wait") and o.source == source)]
    if not nodes:
        return
    if source == "backend":
        unordered = [o for o in nodes if o.order < 0]
        for o in unordered:
            bad(f"{o.kind}(L{o.layer},s{o.stage}) on {o.stream} has no place in the backend's execution order")
        nodes = [o for o in nodes if o.order >= 0]
        order = sorted(range(len(nodes)), key=lambda i: nodes[i].order)
    elif all(o.seq >= 0 for o in nodes):
        order = sorted(range(len(nodes)), key=lambda i: nodes[i].seq)
    else:  # serial path: host order
        order = sorted(range(len(nodes)), key=lambda i: (nodes[i].start_ns, nodes[i].end_ns))
    index = {id(nodes[i]): i for i in order}
    rank = {i: r for r, i in enumerate(order)}
    bound: dict[int, int] = {}  # wait -> the record it binds to
    succ: dict[int, list[int]] = defaultdict(list)
    per_stream: dict[str, list[int]] = defaultdict(list)
    for i in order:
        per_stream[nodes[i].stream].append(i)
    for seq in per_stream.values():
        for a, b in itertools.pairwise(seq):
            succ[a].append(b)
    # Events. Session: a wait orders after the latest record of that name
    # issued before it. Backend: after the record of the very event it waited
    # on, and it must not have returned before that event fired. Never a wait
    # on an event not recorded in this step.
    latest: dict[str, int] = {}
    by_event = {o.event: i for i, o in enumerate(nodes) if o.kind == "record" and source == "backend"}
    recorded_on: dict[int, str] = {}
    for i in order:
        o = nodes[i]
        if o.kind == "record":
            latest[o.detail] = i
            recorded_on[i] = o.stream
        elif o.kind == "wait":
            j = by_event.get(o.event) if source == "backend" else latest.get(o.detail)
            if j is None:
                bad(f"{o.stream} waits on event {o.detail} that was not recorded before in this step")
                continue
            if source == "backend":
                recorded_on[j] = nodes[j].stream
                if o.end_ns < nodes[j].end_ns:
                    bad(f"{o.stream}'s wait on event {o.detail} returned before that event fired")
            if o.stream != "C" and recorded_on[j] not in ("C", o.stream):
                bad(f"{o.stream} waits on event {o.detail} recorded on {recorded_on[j]}: an edge between stage streams")
            succ[j].append(i)
            bound[i] = j

    reach_cache: dict[int, set[int]] = {}

    def reach(a: int) -> set[int]:
        got = reach_cache.get(a)
        if got is None:
            got, todo = {a}, [a]
            while todo:
                for b in succ[todo.pop()]:
                    if b not in got:
                        got.add(b)
                        todo.append(b)
            reach_cache[a] = got
        return got

    def before(x: TraceOp | None, y: TraceOp | None, what: str) -> None:
        if x is None or y is None or id(x) not in index or id(y) not in index:
            return  # missing, or reported above as outside the execution order
        if index[id(y)] not in reach(index[id(x)]):
            bad(
                f"{what}: nothing orders {x.kind}(L{x.layer},s{x.stage}) on {x.stream} before "
                f"{y.kind}(L{y.layer},s{y.stage}) on {y.stream}"
            )

    nxt = dict(itertools.pairwise(expected.layers))
    for L, s in plan:
        a, f, e = one("a2e", L, s), one("ffn", L, s), one("e2a", L, s)
        before(a, f, "edge 3 (FFN waits its A2E)")
        before(f, e, "edge 4 (E2A waits its FFN)")
        if L in nxt:
            before(e, one("a2e", nxt[L], s), "edge 5/6 (lookahead A2E after its group's E2A)")

    c_ops = [i for i in per_stream.get("C", []) if nodes[i].kind in ("a2e", "ffn", "e2a")]
    for name, seq in per_stream.items():
        if name == "C":
            continue
        # Edge 1: a side stream starts by waiting on the compute stream.
        head = nodes[seq[0]]
        if head.kind != "wait" or seq[0] not in bound or recorded_on[bound[seq[0]]] != "C":
            bad(f"edge 1 (fork): {name} starts with {head.kind} {head.detail}, not a wait on an event of C")
        # Edge 7: everything queued on the side stream is ordered before a
        # wait on C that follows every op of C.
        last_c = c_ops[-1] if c_ops else None
        joined = [
            j
            for j in reach(seq[-1])
            if nodes[j].stream == "C" and nodes[j].kind == "wait" and (last_c is None or rank[j] > rank[last_c])
        ]
        if not joined:
            bad(f"edge 7 (join): the work of {name} is not waited by C after the step's last op on C")


def overlaps(a: TraceOp, b: TraceOp) -> bool:
    """Whether two ops ran at the same time for some positive interval."""
    return a.start_ns < b.end_ns and b.start_ns < a.end_ns


def find(ops: Iterable[TraceOp], kind: str, layer: int, stage: int) -> TraceOp:
    for o in ops:
        if o.kind == kind and o.layer == layer and o.stage == stage:
            return o
    raise KeyError((kind, layer, stage))


def to_chrome_trace(ops: Sequence[TraceOp], process: str = "camp2p-overlap", pid: int = 1) -> list[dict]:
    """Chrome trace-event records (Perfetto / chrome://tracing), one track
    (thread) per stream, named ``C``, ``K0``, ``K1`` ..."""
    if not ops:
        return []
    # Where the backend says what its streams performed, show that (not also
    # what the session asked for).
    performed = {o.step for o in ops if o.source == "backend"}
    ops = [o for o in ops if not (o.kind in ("record", "wait") and o.source == "session" and o.step in performed)]
    origin = min(o.start_ns for o in ops)
    streams = sorted({o.stream for o in ops}, key=lambda n: (n != "C", n))
    tids = {name: i + 1 for i, name in enumerate(streams)}
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}}]
    for name, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for o in ops:
        if o.kind == "step":
            label = f"step {o.step}"
        elif o.kind == "kernel":
            label = o.detail or o.kind
        elif o.layer is None:
            label = o.kind
        else:
            label = f"{o.kind} L{o.layer} s{o.stage}"
        events.append(
            {
                "name": label,
                "cat": o.kind,
                "ph": "X",
                "pid": pid,
                "tid": tids[o.stream],
                "ts": (o.start_ns - origin) / 1000.0,
                "dur": max(o.end_ns - o.start_ns, 0) / 1000.0,
                "args": {"layer": o.layer, "stage": o.stage, "step": o.step, "detail": o.detail, "source": o.source},
            }
        )
    return events
