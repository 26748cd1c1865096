"""The edge checker: whether every edge of the design (``docs/design.md``,
"Edges of one step") held in a step's trace, and the Chrome trace export of traces."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from camp2p_overlap.core.keys import COMPUTE_STREAM, FFN_STREAM, EventKey, side_stream_name
from camp2p_overlap.core.observe.trace import ExpectedSchedule, TraceOp

# ---------------------------------------------------------------------------
# The edge checker
# ---------------------------------------------------------------------------

#: The label of the fork event (recorded on C, waited first by every side stream).
FORK_LABEL = EventKey.fork().label()


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


def check_step(
    ops: Sequence[TraceOp], expected: ExpectedSchedule, *, source: str = "auto", timings: bool = True
) -> CheckResult:
    """Check that every edge of the design held in one step's trace.

    Two kinds of evidence: the timings (each op started after what it
    depends on ended; no two ops of one stage group at once; C and F each
    ran one op at a time in the step's issue order; everything inside the
    step span), and the event graph: each dependency (edges 3, 4, 5/6) must
    be a path of stream order and record->wait edges, each side stream (K_s,
    F) must start with a wait on C's ``fork`` and end before a wait of C
    after its last op (join), no wait may bind to an event not recorded in
    the step, and no side stream may wait on another stage's stream.

    ``source`` says whose records and waits build the graph: ``"backend"``
    (what the streams performed, in execution order, each wait bound to the
    event it waited on and satisfied only after that event fired),
    ``"session"`` (what the session asked for, in issue order, a wait bound
    to the latest record of its name), ``"device"`` (a profiler's kernel
    timeline, ``verify/profiler_timeline.py``: device times only, no event
    graph), or ``"auto"``: the backend's where the trace has them.
    ``timings`` False: the event graph and the issue order only (a session's
    own log of a step that ran without a recorder, whose host times say
    when work was issued, not when it ran on the device)."""
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
            want = expected.stream_for(o.kind, s)
            if o.stream != want:
                bad(f"{o.kind}(L{L},s{s}) ran on {o.stream}, expected {want}")
        # Edge 3: FFN waits for its A2E. Edge 4: E2A waits for its FFN.
        if timings and a and f and f.start_ns < a.end_ns:
            bad(f"ffn(L{L},s{s}) started {a.end_ns - f.start_ns} ns before its a2e ended")
        if timings and f and e and e.start_ns < f.end_ns:
            bad(f"e2a(L{L},s{s}) started {f.end_ns - e.start_ns} ns before its ffn ended")

    # Edge 5/6: per stage, the group's communication ops never overlap and
    # keep the serial order a2e(L0) e2a(L0) a2e(L1) e2a(L1) ...
    for s in expected.stages:
        seq = [one(k, L, s) for L in expected.layers for k in ("a2e", "e2a")]
        prev: TraceOp | None = None
        for o in seq:
            if o is None:
                continue
            if timings and prev is not None and o.start_ns < prev.end_ns:
                bad(f"group of stage {s}: {o.kind}(L{o.layer}) started before {prev.kind}(L{prev.layer}) ended")
            prev = o
        # No op of stage s on another stage's stream.
        for o in ops:
            if o.stage == s and o.stream.startswith("K") and o.stream != side_stream_name(s):
                bad(f"{o.kind}(L{o.layer},s{s}) ran on another stage's stream {o.stream}")

    # The compute stream and the FFN stream run their ops one at a time, in
    # the step's issue order (the loop's, or the overlap's with prefetch).
    order = expected.issue_order()
    for name in (COMPUTE_STREAM, FFN_STREAM):
        want = [(k, L, s) for k, L, s in order if expected.stream_for(k, s) == name]
        on = sorted(
            (o for o in ops if o.kind in ("a2e", "ffn", "e2a") and o.stream == name),
            key=(lambda o: (o.start_ns, o.end_ns)) if timings else (lambda o: o.seq),
        )
        got = [(o.kind, o.layer, o.stage) for o in on]
        if got != want:
            first = next(
                (i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want))
            )
            bad(
                f"stream {name} order differs from the step's issue order at position {first}: "
                f"ran {got[first : first + 3]}, expected {want[first : first + 3]}"
            )
        prev = None
        for o in on:
            if timings and prev is not None and o.start_ns < prev.end_ns:
                bad(
                    f"{o.kind}(L{o.layer},s{o.stage}) started on {name} before "
                    f"{prev.kind}(L{prev.layer},s{prev.stage}) ended"
                )
            prev = o

    if source != "device":
        _check_event_graph(ops, expected, plan, one, bad, source)

    # Edges 1 and 7: everything inside the step (fork and join).
    steps = [o for o in ops if o.kind == "step"]
    if timings and len(steps) != 1:
        bad(f"expected one step span, found {len(steps)}")
    elif timings:
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
            if o.stream != COMPUTE_STREAM and recorded_on[j] not in (COMPUTE_STREAM, o.stream):
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

    c_ops = [i for i in per_stream.get(COMPUTE_STREAM, []) if nodes[i].kind in ("a2e", "ffn", "e2a")]
    for name, seq in per_stream.items():
        if name == COMPUTE_STREAM:
            continue
        # Edge 1: a side stream starts by waiting the fork recorded on the compute stream (another event of C
        # orders it after what that event follows only: compute-side's F would wait a_done(L0, s) first).
        head = nodes[seq[0]]
        forked = seq[0] in bound and recorded_on[bound[seq[0]]] == COMPUTE_STREAM
        if head.kind != "wait" or head.detail != FORK_LABEL or not forked:
            bad(f"edge 1 (fork): {name} starts with {head.kind} {head.detail}, not a wait on the fork event of C")
        # Edge 7: everything queued on the side stream is ordered before a
        # wait on C that follows every op of C.
        last_c = c_ops[-1] if c_ops else None
        joined = [
            j
            for j in reach(seq[-1])
            if nodes[j].stream == COMPUTE_STREAM
            and nodes[j].kind == "wait"
            and (last_c is None or rank[j] > rank[last_c])
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
    (thread) per stream, named ``C``, ``F``, ``K0``, ``K1`` ..."""
    if not ops:
        return []
    # Where the backend says what its streams performed, show that (not also
    # what the session asked for).
    performed = {o.step for o in ops if o.source == "backend"}
    ops = [o for o in ops if not (o.kind in ("record", "wait") and o.source == "session" and o.step in performed)]
    origin = min(o.start_ns for o in ops)
    streams = sorted({o.stream for o in ops}, key=lambda n: (n != COMPUTE_STREAM, n))
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
