"""One FFN step's overlap schedule: the edges of ``docs/design.md`` driven
from the connector calls the upstream loop makes.

The session knows nothing of afd-plugin: the wrappers hand it each receive
as a function and its keyword arguments, and each send as a call, its
output, its context and its stage (the CAMP2P adapter parses them). It is
told the step's plan (layer list, stage ids, the receive kwargs of each
(layer, stage)) and a stream set, and is then fed the loop's calls in order:

* first ``recv``: fork (every K_s waits on C), then the prologue: A2E of the
  first layer for every stage on its K_s, each followed by ``a_done``;
* ``recv(L, s)``: C waits ``a_done(L, s)``; the prefetched payload is returned;
* ``send(L, s)``: ``f_done`` recorded on C; K_s waits it, runs E2A(L, s),
  then the lookahead A2E of the stage's next layer and its ``a_done``;
* ``close``: C waits the last event of every K_s (join), always.

Tensor ownership (no ``record_stream``): A2E outputs stay referenced until
K_s has waited ``f_done`` of their FFN; FFN outputs stay referenced until C
has waited an event that K_s recorded after their E2A. After ``close`` the
session holds nothing.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

from camp2p_overlap.core.env_vars import MAX_STAGES
from camp2p_overlap.core.keys import A2E, E2A, EventKey, OpKey
from camp2p_overlap.core.log import logger
from camp2p_overlap.core.observe.trace import ExpectedSchedule, StepTrace, TraceRecorder
from camp2p_overlap.core.overlap.plan import BOTH_SIDES, Directions, OpKeys, StageLayer, StepPlan
from camp2p_overlap.core.overlap.streams.base import DoneHandle, OpHandle, Stream, StreamPoisonedError
from camp2p_overlap.core.overlap.streams.streamset import StreamSet


class ScheduleMismatchError(RuntimeError):
    """The loop asked for data the session cannot hand over without risking
    wrong data (a receive for a group whose next message was already taken
    for a different (layer, stage))."""


class SessionError(RuntimeError):
    """Internal invariant broken (a wait on an event never recorded, ...)."""


@dataclass(slots=True)
class IssuedOp:
    """A connector op the session issued, in issue order."""

    kind: str
    layer: int | None
    stage: int | None
    stream: str
    handle: OpHandle
    seq: int = -1


@dataclass(frozen=True)
class SessionSnapshot:
    """A copy of a session's progress, readable from another thread (the
    watchdog): never a sync, only event queries and handle states."""

    step_id: int
    plan: StepPlan
    directions: Directions
    received: int
    consumed: frozenset[StageLayer]
    sent: frozenset[StageLayer]
    ops: tuple[IssuedOp, ...]
    events: tuple[tuple[EventKey, Any], ...]
    side_streams: Mapping[int, str]
    opened_ns: int
    #: The host has closed the step: every op, record and wait of it is
    #: issued (on a device the streams may still be running them).
    closed: bool = False


class RunningOp(OpHandle):
    """The handle of an op being submitted (while the host runs it)."""

    def __init__(self) -> None:
        self.start_ns = time.perf_counter_ns()

    def result(self) -> Any:
        raise SessionError("the op is still being submitted")

    def done(self) -> bool:
        return False


def _identity(payload: Any) -> Any:
    return payload


def _call_or(call: Callable[[], Any] | None, fn: Callable[..., Any], kw: Mapping[str, Any]) -> Callable[[], Any]:
    """The loop's receive as it was made, or ``fn(**kw)``."""
    return call if call is not None else (lambda: fn(**kw))


_FORK = EventKey.fork()
#: The handle of a steady-path E2A that ran without failing, in a session
#: without an op log (nothing of it is kept: not its result, not its times).
_SENT = DoneHandle()
#: The host clock of an op the steady path runs itself (``direct_submit``).
clock = time.perf_counter_ns
#: The issue sequence of a session without a trace (never read: every
#: ``next(self._seq)`` is on a traced path).
_NO_SEQ: Any = iter(())
#: The join key of each stage id (made once, not per step).
_JOINS = {s: EventKey.join(s) for s in range(MAX_STAGES)}


class RecvSlot(NamedTuple):
    """A receive's steady-path slot (unpacked in field order on the path)."""

    key: StageLayer
    kwargs: Mapping[str, Any]
    a_done_key: EventKey
    a_done: Any


class SendSlot(NamedTuple):
    """A send's steady-path slot (unpacked in field order on the path): its
    E2A's events and label, then its lookahead A2E's, None after the last
    layer."""

    layer: int
    stage: int
    side_stream: Stream
    f_done_key: EventKey
    f_done: Any
    e_done_key: EventKey
    e_done: Any
    e2a_label: str
    ahead: StageLayer | None
    ahead_kwargs: Mapping[str, Any] | None
    ahead_a_done_key: EventKey | None
    ahead_a_done: Any
    ahead_a2e_label: str | None


#: How many plans' slots a stream set keeps (a runner sees a few shapes).
MAX_SLOT_PLANS = 64


def steady_slots(
    streamset: StreamSet, plan: StepPlan, pool: Mapping[EventKey, Any] | None
) -> tuple[tuple[RecvSlot, ...], dict[StageLayer, SendSlot]] | None:
    """The steady path's slots of ``plan`` on ``streamset``, gathered once
    per plan (kept on the stream set, whose streams they name) from the
    backend's event ``pool``; None without a pool, or while an event of the
    plan is not in it (none is made here: this may run inside a capture).
    A pooled event is never replaced (``TorchStreamBackend.record`` only
    adds), so kept slots stay right for the stream set's life."""
    if pool is None:
        return None
    cache: dict[int, Any] | None = getattr(streamset, "session_slots", None)  # a view of one: gathered afresh
    kept = cache.get(id(plan)) if cache is not None else None
    if kept is not None and kept[0] is plan:
        return kept[1]
    streams, keys = streamset.streams, plan.keys
    events: dict[EventKey, Any] = {}
    for op_keys in keys.values():
        for key in (op_keys.a_done, op_keys.f_done, op_keys.e_done):
            ev = pool.get(key)
            if ev is None:
                return None
            events[key] = ev
    recv = tuple(RecvSlot(key, plan.recv_kw[key], keys[key].a_done, events[keys[key].a_done]) for key in plan.sequence)
    send: dict[StageLayer, SendSlot] = {}
    for key in plan.sequence:
        L, s = key
        op, nxt = keys[key], plan.next_of[L]
        ahead = (nxt, s) if nxt is not None else None
        after = keys[ahead] if ahead is not None else None
        send[key] = SendSlot(
            layer=L,
            stage=s,
            side_stream=streams[s],
            f_done_key=op.f_done,
            f_done=events[op.f_done],
            e_done_key=op.e_done,
            e_done=events[op.e_done],
            e2a_label=op.e2a_label,
            ahead=ahead,
            ahead_kwargs=plan.recv_kw[ahead] if ahead is not None else None,
            ahead_a_done_key=after.a_done if after is not None else None,
            ahead_a_done=events[after.a_done] if after is not None else None,
            ahead_a2e_label=after.a2e_label if after is not None else None,
        )
    made = (recv, send)
    if cache is not None:
        if len(cache) >= MAX_SLOT_PLANS:
            cache.clear()
        cache[id(plan)] = (plan, made)
    return made


def _issued(o: IssuedOp | tuple[Any, ...]) -> IssuedOp:
    """An entry of a session's op list as an :class:`IssuedOp` (a side-stream
    op is listed as a plain tuple of its fields, made into one when read)."""
    return o if type(o) is IssuedOp else IssuedOp(*o)  # type: ignore[arg-type]


class OverlapSession:
    """Drive one step. Not thread-safe: one loop thread calls it."""

    def __init__(
        self,
        *,
        connector: Any,
        plan: StepPlan,
        streamset: StreamSet,
        directions: Directions = BOTH_SIDES,
        recorder: TraceRecorder | None = None,
        step_id: int = 0,
        context_of: Callable[[Any], Any] = _identity,
        op_log: bool = True,
    ) -> None:
        if not plan.layers or not plan.stages:
            raise SessionError("a step plan needs at least one layer and one stage")
        streams = streamset.streams
        try:
            #: Each stage's side stream (K_s): read, never changed (a stream
            #: set shares one such dict among its sessions of these stages).
            side_of = getattr(streamset, "side_streams_of", None)  # a view of a stream set has none
            self.side_streams = side_of(plan.stages) if side_of is not None else {s: streams[s] for s in plan.stages}
        except KeyError:
            raise SessionError(f"no side stream for stage(s) {[s for s in plan.stages if s not in streams]}") from None
        #: The object whose calls this session serves (the runner's connector;
        #: None once closed).
        self.connector = connector
        self.plan = plan
        self.order = plan.sequence
        self._keys = plan.keys
        self._streamset = streamset
        self.backend = streamset.backend
        #: Which connector ops run on the side streams.
        self.directions = directions
        self._context_of = context_of
        #: Whether the steady path lists its ops (``_ops``, for stall reports,
        #: traces and :meth:`issued`): a session no watchdog reads and no
        #: trace records (a kept one: ``session_routers.KeptSession``) lists
        #: only the ops of its other paths, and keeps no E2A's result or times.
        self._log_ops = op_log
        #: FFN outputs per stage, until C waits an event K_s recorded after their E2A.
        self._f_refs: dict[int, list[Any]] = {}
        for s in plan.stages:
            self._f_refs[s] = []
        # What close() empties in place (the per-step records below are made
        # afresh by _open()).
        #: Each receive issued and not yet taken: its handle, or on the steady
        #: path without an op log, ``(payload,)`` for one that returned.
        self._a_handle: dict[StageLayer, OpHandle | tuple[Any]] = {}
        #: The kwargs of each receive issued off the plan (a planned one's
        #: are the plan's: ``plan.recv_kw``), until it is taken or the step closes.
        self._a_kwargs: dict[StageLayer, dict[str, Any]] = {}
        #: A2E outputs, until K_s has waited their FFN's f_done.
        self._inflight: dict[StageLayer, Any] = {}
        #: id(context) -> (layer, stage), for payloads handed to the loop.
        self._contexts: dict[int, StageLayer] = {}
        self._direct: dict[EventKey, Any] | None = None
        self._recv_slots: tuple[RecvSlot, ...] | None = None
        self._send_slots: dict[StageLayer, SendSlot] | None = None
        self._open(recorder, step_id)

    def reopen(self, connector: Any) -> None:
        """Serve the next step of the same plan on the same streams, for
        ``connector``: a closed session without a trace starts afresh, as a
        new one would (a step that keeps its session per stream set: see
        ``session_routers.KeptSession``). The closed step's snapshot goes."""
        if not self.closed or self._trace is not None:
            raise SessionError("only a closed session without a trace may be reopened")
        self.connector = connector
        self._probe()
        # _open()'s records, less what close() left fresh (its op list and
        # event dict) and what only a trace reads
        self.next_recv = 0
        self.forked = self.fallen_back = self.closed = False
        if self._consumed:  # (the steady path without an op log adds to neither)
            self._consumed = set()
        if self._sent:
            self._sent = set()
        if self._e_done_c:
            self._e_done_c.clear()
        self._op_log = self._ops if self._log_ops else None
        self.t_open_ns = time.perf_counter_ns()
        self._closed_snapshot = self._closed_parts = None
        if self.backend.reports_step_errors:
            self.backend.begin_step(list(self.side_streams.values()))

    def _open(self, recorder: TraceRecorder | None, step_id: int) -> None:
        """The per-step part of a session: its trace, what :meth:`_probe`
        reads, and the step's own records."""
        backend = self.backend
        self.step_id = step_id
        self._trace = StepTrace(recorder, step_id, backend) if recorder is not None else None
        self._probe()
        #: The index in ``self.order`` of the next expected receive.
        self.next_recv = 0
        self.forked = False
        self.fallen_back = False
        self.closed = False
        self._recv_fn: Callable[..., Any] | None = None
        self._events: dict[EventKey, Any] = {}
        self._consumed: set[StageLayer] = set()
        self._sent: set[StageLayer] = set()
        self._e_done_c: dict[int, EventKey] = {}
        #: Every op issued, in issue order: an :class:`IssuedOp`, or for a
        #: side-stream op the tuple of its fields (read through ``_issued``).
        self._ops: list[Any] = []
        #: ``_ops`` while the steady path lists its ops, else None.
        self._op_log: list[Any] | None = self._ops if self._log_ops else None
        self._ffn_start: dict[StageLayer, tuple[int, int]] = {}
        #: Host issue order of every record, wait and op of the step (traces:
        #: the checker rebuilds each stream's FIFO and the event graph from it).
        self._seq = itertools.count() if self._trace is not None else _NO_SEQ  # read only while tracing
        self.t_open_ns = time.perf_counter_ns()
        #: The snapshot taken when the step closed: what the watchdog reads
        #: while the device may still be running the step. Built when first
        #: asked for, from what the step held when it closed (``_closed_parts``).
        self._closed_snapshot: SessionSnapshot | None = None
        self._closed_parts: tuple[Any, ...] | None = None
        if backend.reports_step_errors:
            backend.begin_step(list(self.side_streams.values()))

    def _probe(self) -> None:
        """The compute stream, and the backend's probes and the steady
        path's slots, asked again each step (a backend patched since the
        last step is seen)."""
        backend = self.backend
        #: The compute stream (the runner's current stream).
        self.compute = backend.compute_stream()
        #: The steady path of a receive and a send (the first branch of
        #: :meth:`recv` and of :meth:`send`): no trace, and the schedule's waits and the
        #: lookahead through this class's own methods (a subclass or a
        #: patched class that overrides one takes the general path).
        cls = type(self)
        directions = self.directions
        self._steady = (
            self._trace is None
            and directions.a2e_side
            and directions.e2a_side
            and cls.wait_event is _BASE_WAIT_EVENT
            and cls.issue_a2e is _BASE_ISSUE_A2E
        )
        #: On the steady path, the backend's event pool when its record and
        #: wait are the plain event calls (``StreamBackend.direct_events``):
        #: the steady path then records and waits on the events itself.
        pool = self._direct
        self._direct = backend.direct_events() if self._steady else None
        #: And the backend's scope, when it is a plain call (``direct_scope``).
        self._scope = backend.direct_scope() if self._direct is not None else None
        #: And whether it runs an op submitted in scope itself (``direct_submit``).
        self._run_here = self._scope is not None and backend.direct_submit()
        #: The steady path's per-(layer, stage) slots (:func:`steady_slots`):
        #: a receive's and a send's keys, events and streams, gathered once
        #: per plan and stream set; None off the steady path, or while an
        #: event of the plan is not in the backend's pool yet (the first step
        #: of a plan records them through the backend, on the general path).
        if self._scope is None:
            self._recv_slots = self._send_slots = None
        elif self._recv_slots is None or self._direct is not pool:  # the last step's slots hold while its pool does
            slots = steady_slots(self._streamset, self.plan, self._direct)
            self._recv_slots, self._send_slots = slots if slots is not None else (None, None)

    # ------------------------------------------------------------------
    # events and ops
    # Trace-only work (issue sequence numbers, host timestamps of waits and
    # FFN spans) is done only while a recorder is active.
    def _record(self, stream: Stream, key: EventKey) -> Any:
        ev = self.backend.record(stream, key)
        self._events[key] = ev
        if self._trace is not None:
            now = time.perf_counter_ns()
            self._trace.event("record", key, stream.name, now, now, next(self._seq))
        return ev

    def wait_event(self, stream: Stream, key: EventKey) -> None:
        """Make ``stream`` wait the event of ``key`` recorded in this step:
        every wait of the schedule goes through here (a test's broken
        schedule overrides it to drop one)."""
        ev = self._events.get(key)
        if ev is None:
            raise SessionError(f"wait on event {key.label()!r} that was not recorded in this step")
        if self._trace is None:
            self.backend.wait(stream, ev)
            return
        seq = next(self._seq)
        t0 = time.perf_counter_ns()
        self.backend.wait(stream, ev)
        self._trace.event("wait", key, stream.name, t0, time.perf_counter_ns(), seq)

    def _submit(
        self,
        stream: Stream,
        kind: str,
        layer: int | None,
        stage: int | None,
        fn: Callable[[], Any],
        label: str | None = None,
    ) -> OpHandle:
        """Issue one connector op on ``stream``, remembered in issue order."""
        seq = next(self._seq) if self._trace is not None else -1
        text = label or OpKey(kind, layer, stage).label()
        if stream is not self.compute:
            h = self.backend.submit(stream, fn, text)
            self._ops.append((kind, layer, stage, stream.name, h, seq))
            return h
        # The host runs a compute-stream op: listed before it runs, so a
        # stall report shows it running while it blocks.
        op = IssuedOp(kind, layer, stage, stream.name, RunningOp(), seq)
        self._ops.append(op)
        try:
            op.handle = self.backend.submit(stream, fn, label=text)
        except BaseException as exc:
            op.handle = DoneHandle(exc=exc, start_ns=op.handle.start_ns, end_ns=time.perf_counter_ns())
            raise
        return op.handle

    def _run_on_c(
        self, kind: str, layer: int | None, stage: int | None, fn: Callable[[], Any], label: str | None = None
    ) -> Any:
        h = self._submit(self.compute, kind, layer, stage, fn, label)
        try:
            return h.result()
        finally:
            h.release()

    def _ffn_started(self, key: StageLayer) -> None:
        if self._trace is not None:
            self._ffn_start[key] = (time.perf_counter_ns(), next(self._seq))

    def _ffn_ended(self, key: StageLayer) -> None:
        if self._trace is not None:
            t_end = time.perf_counter_ns()
            t_start, seq = self._ffn_start.pop(key, (t_end, -1))
            self._trace.ffn(key[0], key[1], t_start, t_end, seq)

    # ------------------------------------------------------------------
    # fork / prologue / lookahead
    def _fork(self) -> None:
        pool = self._direct
        ev = pool.get(_FORK) if pool is not None else None
        if ev is None:
            self._record(self.compute, _FORK)
            for k in self.side_streams.values():
                self.wait_event(k, _FORK)
        else:  # the steady path's pooled event: _record and wait_event, inline
            ev.record(self.compute)
            if self._op_log is not None:  # the step's record of its events (stall reports)
                self._events[_FORK] = ev
            for k in self.side_streams.values():
                k.wait_event(ev)
        self.forked = True

    def issue_a2e(self, layer: int, stage: int) -> None:
        """Queue the receive (A2E) of ``(layer, stage)`` on the stage's side
        stream and record its ``a_done``: every receive the session issues
        goes through here."""
        fn = self._recv_fn
        assert fn is not None
        key = (layer, stage)
        kw = self.plan.recv_kw.get(key)
        keys = self._keys.get(key)
        if kw is None or keys is None:  # off the plan: only a broken schedule asks
            kw, keys = self.plan.build_recv_kwargs(layer, stage), OpKeys.of(layer, stage)
            self._a_kwargs[key] = kw
        k = self.side_streams[stage]
        if self._trace is None:  # the steady path: _submit and _record inline
            if self._run_here:  # backend.submit(k, ...), inline (direct_scope and direct_submit)
                with self._scope(k):  # type: ignore[misc]
                    h = self._a2e_here(fn, kw)
            else:
                h = self.backend.submit(k, partial(fn, **kw), keys.a2e_label)
            self._a_handle[key] = h
            if self._op_log is not None:
                self._op_log.append((A2E, layer, stage, k.name, h, -1))
            pool = self._direct
            ev = pool.get(keys.a_done) if pool is not None else None
            if ev is None:
                ev = self.backend.record(k, keys.a_done)
            else:  # the backend's record, inline (direct_events)
                ev.record(k)
            self._events[keys.a_done] = ev
            return
        self._a_handle[key] = self._submit(k, A2E, layer, stage, partial(fn, **kw), keys.a2e_label)
        self._record(k, keys.a_done)

    def _prologue_here(self, fn: Callable[..., Any], slots: tuple[RecvSlot, ...]) -> None:
        """The prologue on the steady path without an op log, with ops run
        in scope by the host: :meth:`issue_a2e` of the first layer's
        receives (the plan's first slots, in stage order), each read from
        its slot."""
        scope, side, handles = self._scope, self.side_streams, self._a_handle
        for key, kw, _, a_done in slots[: len(self.plan.stages)]:
            k = side[key[1]]
            with scope(k):  # type: ignore[misc]
                handles[key] = self._a2e_here(fn, kw)
            a_done.record(k)

    def _a2e_here(self, fn: Callable[..., Any], kw: Mapping[str, Any]) -> DoneHandle | tuple[Any]:
        """A receive run by the host in its side stream's scope, already
        entered (``backend.submit_here``, inline: ``direct_submit``): its
        handle, timed while the session lists its ops; without an op log, a
        receive that returned is held as ``(payload,)``."""
        if self._op_log is None:
            try:
                return (fn(**kw),)
            except BaseException as exc:  # noqa: BLE001 - handed back, as the backend does
                return DoneHandle(None, exc)
        t0 = clock()
        try:
            return DoneHandle(fn(**kw), None, t0, clock())
        except BaseException as exc:  # noqa: BLE001 - handed back, as the backend does
            return DoneHandle(None, exc, t0, clock())

    # ------------------------------------------------------------------
    # the connector calls
    def recv(self, fn: Callable[..., Any], kw: Mapping[str, Any], call: Callable[[], Any] | None = None) -> Any:
        """A receive of the loop: ``fn(**kw)`` is the connector's receive
        (used for prefetches); ``call`` runs the loop's call as it was made
        (default: ``fn(**kw)``). ``kw`` holds ``layer_idx`` and ``ubatch_idx``."""
        i = self.next_recv
        slots = self._recv_slots
        if slots is not None and i < len(slots):  # (a fallen-back step has no slots)
            key, planned_kw, a_key, a_done = slots[i]
            if kw == planned_kw:  # the planned receive (so its layer and stage too)
                # The steady path: the first receive forks and issues the
                # prologue (as below); then C waits a_done (wait_event,
                # inline), and the prefetched payload is handed over.
                if not i:
                    self._recv_fn = fn
                    self._fork()
                    if self._run_here and self._op_log is None:
                        self._prologue_here(fn, slots)
                    else:
                        first_layer = self.plan.layers[0]
                        for stage in self.plan.stages:  # the prologue
                            self.issue_a2e(first_layer, stage)
                self.next_recv = i + 1
                # _take_prefetched(*key), inline: issued in this step (and so
                # its a_done recorded) exactly when its handle is held
                h = self._a_handle.pop(key, None)
                if h is None:
                    raise SessionError(f"wait on event {a_key.label()!r} that was not recorded in this step")
                self.compute.wait_event(a_done)  # backend.wait, inline (direct_events)
                if type(h) is tuple:  # a receive that returned, held without a handle (no op log)
                    payload = h[0]
                elif type(h) is DoneHandle and h.exception is None:  # result() and release(), inline
                    payload, h.value = h.value, None
                else:
                    payload = self._take_handle(h, key[1])
                self._f_refs[key[1]].clear()  # as below
                if self._op_log is not None:  # the step's records for stall reports
                    self._consumed.add(key)
                self._inflight[key] = payload
                self._contexts[id(self._context_of(payload))] = key
                return payload
        got = (kw.get("layer_idx"), kw.get("ubatch_idx"))
        if self.fallen_back:
            return self._recv_after_fallback(dict(kw), got, _call_or(call, fn, kw))
        expected = self.order[self.next_recv] if self.next_recv < len(self.order) else None
        if expected is None or got != expected or kw != self.plan.recv_kw[expected]:
            self._fall_back(expected, got, kw)
            return self._recv_after_fallback(dict(kw), got, _call_or(call, fn, kw))
        L, s = expected
        if self.next_recv == 0:
            self._recv_fn = fn
            self._fork()
            if self.directions.a2e_side:
                for stage in self.plan.stages:  # the prologue
                    self.issue_a2e(self.plan.layers[0], stage)
        self.next_recv += 1
        if self.directions.a2e_side:
            self.wait_event(self.compute, self._keys[expected].a_done)
            payload = self._take_prefetched(L, s)
        else:
            # A2E on C: the group's previous E2A (on K_s) must be done first.
            if self.directions.e2a_side and s in self._e_done_c:
                self.wait_event(self.compute, self._e_done_c[s])
                # That E2A failed (host-visible, CPU backend): raise it as the
                # serial path would, instead of an A2E no peer will answer.
                failed = self._side_error([self.side_streams[s]])
                if failed is not None:
                    raise failed
            payload = self._run_on_c(A2E, L, s, _call_or(call, fn, kw), self._keys[expected].a2e_label)
        # C has now waited an event recorded on K_s after every earlier E2A
        # of this stage: their FFN outputs may be freed.
        self._f_refs[s].clear()
        self._consumed.add(expected)
        self._inflight[expected] = payload
        self._contexts[id(self._context_of(payload))] = expected
        if self._trace is not None:
            self._ffn_started(expected)
        return payload

    def _take_prefetched(self, L: int, s: int) -> Any:
        h = self._a_handle.pop((L, s))
        self._a_kwargs.pop((L, s), None)
        return self._take_handle(h, s)

    def _take_handle(self, h: OpHandle | tuple[Any], s: int) -> Any:
        """The result of a receive's handle ``h`` (stage ``s``), released."""
        if type(h) is tuple:  # a receive that returned, held as (payload,) without a handle
            return h[0]
        try:
            return h.result()
        except StreamPoisonedError:
            first = self.backend.step_errors([self.side_streams[s]])
            if first:
                raise first[0] from None
            raise
        finally:
            # The handle stays in self._ops for traces and stall reports; the
            # payload must not: ownership is tracked in self._inflight.
            h.release()

    def send(
        self,
        call: Callable[..., Any],
        output: Any,
        context: Any,
        stage: int | None,
        args: tuple[Any, ...] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """A send of the loop: ``call()`` runs it as the loop made it; or,
        given ``args``, ``call(*args, **kwargs)`` does (a router's call as it
        came, with no partial made for it on the steady path)."""
        # Popped: the payload (and so its context) stays alive until its send,
        # so the id cannot be reused while it is mapped.
        key = self._contexts.pop(id(context), None)
        slot = self._send_slots.get(key) if self._send_slots is not None else None  # slot[1]: slot.stage, by index
        # (A fallen-back step has no slots; a steady step's receive maps each
        # planned key once, so a key popped here was not sent before.)
        if slot is not None and stage == slot[1]:
            # The steady path (both directions on the side streams, this
            # class's wait and lookahead, the backend's pooled events): the
            # same records, waits and ops in the same order as below, with
            # each record and wait the event's or the stream's own call, and
            # with the stage's E2A and its lookahead A2E issued under one
            # switch to K_s (``backend.scope``).
            L, s, k, f_key, f_done, e_key, e_done, e2a_label, ahead, ahead_kw, a_key, a_done, a2e_label = slot
            events, ops = self._events, self._op_log
            if ops is not None:  # the step's records for stall reports
                self._sent.add(key)
            f_done.record(self.compute)
            with self._scope(k):  # type: ignore[misc]
                k.wait_event(f_done)
                if self._run_here and ops is None:  # backend.submit_here, inline; no op log: only a failure kept
                    try:
                        if args is None:
                            call()
                        else:
                            call(*args, **kwargs)  # type: ignore[arg-type]
                        h = _SENT
                    except BaseException as exc:  # noqa: BLE001 - handed back, as the backend does
                        h = DoneHandle(None, exc)
                else:
                    run = call if args is None else partial(call, *args, **kwargs)  # type: ignore[arg-type]
                    if self._run_here:  # backend.submit_here(k, run, label), inline (direct_submit)
                        t0 = clock()
                        try:
                            h = DoneHandle(run(), None, t0, clock())
                        except BaseException as exc:  # noqa: BLE001 - handed back, as the backend does
                            h = DoneHandle(None, exc, t0, clock())
                    else:
                        h = self.backend.submit_here(k, run, e2a_label)
                if ops is not None:  # the step's records (stall reports): its op, and its events in record order
                    ops.append((E2A, L, s, k.name, h, -1))
                    # e_done(L, s): with both directions on K_s no wait reads
                    # it (the next a_done, or the join, orders what follows
                    # the E2A), so only a session that lists its ops records it
                    e_done.record(k)
                    events[f_key] = f_done
                    events[e_key] = e_done
                self._f_refs[s].append((output, context, call, args, kwargs))
                self._inflight.pop(key, None)  # K_s has waited f_done(L, s)
                if h is _SENT:  # (the steady path's E2A ran without failing)
                    pass
                elif type(h) is DoneHandle:  # h.done() and h.result(), inline
                    if h.exception is not None:
                        h.result()  # a host-side failure surfaces here, as in the serial path
                elif h.done():
                    h.result()
                # (no _e_done_c: only a session that runs A2E on C reads it)
                if ahead is None:
                    return None
                # issue_a2e(*ahead), inline
                fn = self._recv_fn
                assert fn is not None
                if self._run_here:  # backend.submit_here, inline (direct_submit)
                    h = self._a2e_here(fn, ahead_kw)  # type: ignore[arg-type]
                else:
                    h = self.backend.submit_here(k, partial(fn, **ahead_kw), a2e_label)
                self._a_handle[ahead] = h
                if ops is not None:
                    ops.append((A2E, ahead[0], s, k.name, h, -1))
                a_done.record(k)
                if ops is not None:
                    events[a_key] = a_done
            return None
        if args is not None:
            call = partial(call, *args, **kwargs)  # type: ignore[arg-type]
        if self.fallen_back:
            return self._send_on_c(call, key)
        if key is None or key in self._sent or stage != key[1]:
            self._fall_back(("send for a received (layer, stage)",), ("send", key, "stage", stage), {})
            return self._send_on_c(call, key)
        L, s = key
        keys = self._keys[key]
        self._sent.add(key)
        if self._trace is not None:
            self._ffn_ended(key)
        self._record(self.compute, keys.f_done)
        if self.directions.e2a_side:
            k = self.side_streams[s]
            self.wait_event(k, keys.f_done)
            h = self._submit(k, E2A, L, s, call, keys.e2a_label)
            self._record(k, keys.e_done)
            self._f_refs[s].append((output, context, call))
            self._inflight.pop(key, None)  # K_s has waited f_done(L, s)
            if h.done():
                h.result()  # a host-side failure surfaces here, as in the serial path
            self._e_done_c[s] = keys.e_done
        else:
            self._submit(self.compute, E2A, L, s, call, keys.e2a_label).result()
            self._e_done_c[s] = keys.e_done_c
            self._record(self.compute, keys.e_done_c)
        nxt = self.plan.next_of[L]
        if nxt is not None and self.directions.a2e_side:
            if not self.directions.e2a_side:
                self.wait_event(self.side_streams[s], keys.e_done_c)
                self._inflight.pop(key, None)
            self.issue_a2e(nxt, s)
        return None

    # ------------------------------------------------------------------
    # mismatch handling
    def _fall_back(self, expected: Any, got: Any, kw: Mapping[str, Any]) -> None:
        logger.warning(
            "camp2p-overlap: step %d: the FFN loop asked for %s with %s, the session "
            "planned %s; draining the side streams and running the rest of this step "
            "serially on the compute stream",
            self.step_id,
            got,
            dict(kw),
            expected,
        )
        self.fallen_back = True
        self._recv_slots = self._send_slots = None  # the steady path is over for this step
        self.join()

    def _recv_after_fallback(self, kw: dict[str, Any], got: tuple[Any, Any], run: Callable[[], Any]) -> Any:
        issued_kw = self._a_kwargs.get(got) or self.plan.recv_kw.get(got)  # type: ignore[arg-type]
        if got in self._a_handle and issued_kw == kw:
            payload = self._take_prefetched(*got)  # type: ignore[arg-type]
        elif any(s == kw.get("ubatch_idx") for (_, s) in self._a_handle):
            pending = sorted(k for k in self._a_handle if k[1] == kw.get("ubatch_idx"))
            raise ScheduleMismatchError(
                f"receive for (layer {got[0]}, stage {got[1]}) but the next message of that "
                f"stage's group was already received for (layer, stage) {pending}; refusing "
                "to hand over data that may belong to another layer"
            )
        else:
            payload = self._run_on_c(A2E, got[0], got[1], run)
        self._contexts[id(self._context_of(payload))] = got  # type: ignore[assignment]
        self._ffn_started(got)  # type: ignore[arg-type]
        return payload

    def _send_on_c(self, call: Callable[[], Any], key: StageLayer | None) -> Any:
        if key is not None:
            self._sent.add(key)
            self._inflight.pop(key, None)
            self._ffn_ended(key)
        L, s = key if key is not None else (None, None)
        return self._run_on_c(E2A, L, s, call)

    # ------------------------------------------------------------------
    # join
    def join(self, *, release: bool = True) -> None:
        """Make the compute stream wait the last work of every side stream,
        then release the buffers held for them (:meth:`release_buffers`;
        ``release`` False: the caller does, as :meth:`close`)."""
        if not self.forked:
            return
        pool, compute = self._direct, self.compute
        for s, k in self.side_streams.items():
            join = _JOINS.get(s) or EventKey.join(s)
            ev = pool.get(join) if pool is not None else None
            if ev is None:
                self._record(k, join)
                self.wait_event(compute, join)
            else:  # the steady path's pooled event: _record and wait_event, inline
                ev.record(k)
                if self._op_log is not None:  # the step's record of its events (stall reports)
                    self._events[join] = ev
                compute.wait_event(ev)
        # Every side-stream op has completed (CPU) or is ordered before C's
        # next work (device): nothing the step allocated needs holding.
        if release:
            self.release_buffers()

    def release_sent_outputs(self) -> None:
        """Drop the references to the FFN outputs the step's sends (E2A)
        read, which the session holds until the compute stream has waited
        the side stream's later work."""
        for refs in self._f_refs.values():
            refs.clear()

    def release_buffers(self) -> None:
        """Drop every buffer reference held for the side streams: the FFN
        outputs sent (:meth:`release_sent_outputs`) and the received A2E
        outputs whose FFN the side stream has not waited yet."""
        self.release_sent_outputs()
        self._inflight.clear()

    def close(self, *, raising: bool = False) -> None:
        """Join every side stream and release every reference. Raises the
        first error a side-stream op hit during the step unless the caller
        is already raising (then it is logged), or the compute stream's work
        failed first (the device synchronize reports that one)."""
        if self.closed:
            return
        self.closed = True
        try:
            if type(self).join is _BASE_JOIN:
                self.join(release=False)  # released below, with every other record
            else:  # a subclass's join
                self.join()
        finally:
            # What the closed snapshot is built from, when first asked for: the
            # step's own records, handed over (never changed again), not copied.
            ops, events = self._ops, self._events
            self._closed_parts = (self.next_recv, self._consumed, self._sent, ops, events)
            self._ops, self._events = [], {}
            error = self._side_error(list(self.side_streams.values())) if self.backend.reports_step_errors else None
            short = not raising and not self.fallen_back and self.next_recv < len(self.order)
            unconsumed = [k for k in self._a_handle if k not in self._consumed] if short and self._a_handle else []
            if self._trace is not None:
                self._trace.emit((o.kind, o.layer, o.stage, o.stream, o.handle, o.seq) for o in map(_issued, ops))
            self._a_handle.clear()
            self._a_kwargs.clear()
            self._contexts.clear()
            self._inflight.clear()
            for refs in self._f_refs.values():
                refs.clear()
            self._recv_fn = None
            self.connector = None
        if short:
            logger.warning(
                "camp2p-overlap: step %d ended after %d of %d planned receives; prefetched but never consumed: %s",
                self.step_id,
                self.next_recv,
                len(self.order),
                unconsumed,
            )
        if error is not None:
            if raising:
                logger.log(
                    logging.ERROR,
                    "camp2p-overlap: step %d: side-stream error while the step was already failing: %r",
                    self.step_id,
                    error,
                )
            else:
                raise error

    def _side_error(self, streams: list[Stream]) -> BaseException | None:
        """The asynchronous error of ``streams`` the host raises: the first
        (in the order kernels ran) of theirs and the compute stream's, unless
        that one is the compute stream's: the device synchronize reports it
        (a side stream's error may be its consequence)."""
        errors = self.backend.step_errors([self.compute, *streams])
        if not errors or any(errors[0] is e for e in self.backend.step_errors([self.compute])):
            return None
        return errors[0]

    # ------------------------------------------------------------------
    def expected_schedule(self) -> ExpectedSchedule:
        return ExpectedSchedule(self.plan.layers, self.plan.stages, self.directions.a2e_side, self.directions.e2a_side)

    def stage_layer_of(self, context: Any) -> StageLayer | None:
        """The ``(layer, stage)`` whose received payload carried ``context``
        (what the loop hands back to the send), or None."""
        return self._contexts.get(id(context))

    def a2e_issued(self, layer: int, stage: int) -> bool:
        """Whether this step has issued the receive of ``(layer, stage)``."""
        return (layer, stage) in self._a_handle

    def held(self) -> dict[str, int]:
        """How many entries each per-step record holds (the receive
        function counts 1 while set); every count is 0 once closed."""
        return {
            "recv_fn": int(self._recv_fn is not None),
            "a2e_handles": len(self._a_handle),
            "a2e_kwargs": len(self._a_kwargs),
            "contexts": len(self._contexts),
            "received_buffers": len(self._inflight),
            "sent_outputs": sum(len(refs) for refs in self._f_refs.values()),
            "events": len(self._events),
            "ops": len(self._ops),
        }

    def issued(self) -> list[tuple[str, int | None, int | None]]:
        """``(kind, layer, stage)`` of every op issued so far, in issue order."""
        ops = self._closed_parts[3] if self._closed_parts is not None else self._ops
        return [(o.kind, o.layer, o.stage) for o in map(_issued, ops)]

    def snapshot(self) -> SessionSnapshot:
        """The session's progress, copied; safe to take from another thread.
        Once closed: the step as the host left it (what the device runs)."""
        if self._closed_snapshot is not None:
            return self._closed_snapshot
        parts = self._closed_parts
        if parts is None:
            snap = self._snapshot_of(self.next_recv, self._consumed, self._sent, self._ops, self._events, self.closed)
            parts = self._closed_parts
            if parts is None:  # not closed meanwhile (close() hands its records over before it empties them)
                return snap
        snap = self._snapshot_of(*parts, True)
        self._closed_snapshot = snap
        return snap

    def _snapshot_of(
        self,
        received: int,
        consumed: set[StageLayer],
        sent: set[StageLayer],
        ops: list[Any],
        events: dict[EventKey, Any],
        closed: bool,
    ) -> SessionSnapshot:
        return SessionSnapshot(
            step_id=self.step_id,
            plan=self.plan,
            directions=self.directions,
            received=received,
            consumed=frozenset(consumed),
            sent=frozenset(sent),
            ops=tuple(map(_issued, ops)),
            events=tuple(events.items()),
            side_streams={s: k.name for s, k in self.side_streams.items()},
            opened_ns=self.t_open_ns,
            closed=closed,
        )


#: The schedule's own wait and lookahead (the steady path runs them inline
#: only while a session's class still has these).
_BASE_WAIT_EVENT = OverlapSession.wait_event
_BASE_ISSUE_A2E = OverlapSession.issue_a2e
_BASE_JOIN = OverlapSession.join
