"""One FFN step's schedule: the edges of docs/design.md ("Edges of one step") driven from the connector calls the
upstream loop makes, each op on the stream its layout names (``plan.Layout``), through the device module's own
stream API. The session knows nothing of afd-plugin: the router (``camp2p.route``) hands it each receive as a
function and its kwargs, and each send as a call with its output, context and stage.

One path: production, a trace, the watchdog and a capture run the same code; the session always keeps the step's
log (ops, records and waits in issue order) that stall reports and traces read. A test's broken schedule overrides
one seam: :meth:`wait_event` (every wait), :meth:`issue_a2e` (every receive issued ahead) or :meth:`join`.

Tensor ownership (no ``record_stream``): an A2E output read on another stream than its own stays referenced until
its stream has waited an event recorded after its FFN; an FFN output read by an E2A on another stream, until the
FFN's stream has waited an event recorded after that E2A. After ``close`` the session holds nothing.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from camp2p_overlap.core.env_vars import MAX_STAGES
from camp2p_overlap.core.keys import A2E, E2A, EventKey, OpKey
from camp2p_overlap.core.log import logger
from camp2p_overlap.core.observe.trace import ExpectedSchedule, StepTrace, TraceRecorder
from camp2p_overlap.core.overlap.plan import COMM_SIDE, SIDE, Layout, OpKeys, StageLayer, StepPlan
from camp2p_overlap.core.overlap.streams.base import DoneHandle, OpHandle, Stream, StreamPoisonedError

clock = time.perf_counter_ns
FORK_KEY = EventKey.fork()
#: By stage: the join of K_s; None: of the FFN stream F.
JOIN_KEYS = {s: EventKey.join(s) for s in (*range(MAX_STAGES), None)}


class ScheduleMismatchError(RuntimeError):
    """The loop asked for data the session cannot hand over without risking wrong data (a receive for a group
    whose next message was already taken for a different (layer, stage))."""


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
    """A copy of a session's progress, readable from another thread (the watchdog): never a sync, only event
    queries and handle states."""

    step_id: int
    plan: StepPlan
    layout: Layout
    received: int
    sent: frozenset[StageLayer]
    ops: tuple[IssuedOp, ...]
    events: tuple[tuple[EventKey, Any], ...]
    #: Each stage's A2E and FFN stream, and the side streams the step forks (by stage; None: F), by name.
    a2e_streams: Mapping[int, str]
    ffn_streams: Mapping[int, str]
    side_streams: Mapping[int | None, str]
    opened_ns: int
    #: The step's records and waits, ``(kind, key, stream, seq)``, and FFNs, ``(layer, stage, seq)``, in issue order.
    marks: tuple[tuple[str, EventKey, str, int], ...] = ()
    ffns: tuple[tuple[int, int, int], ...] = ()
    #: The host has issued the whole step (the device may still be running it).
    closed: bool = False
    #: The device's vector cores now, as report lines: who holds them, who waits (None: the device cannot say).
    core_state: Callable[[], list[str]] | None = None


class RunningOp(OpHandle):
    """The handle of an op being submitted (while the host runs it), from ``start_ns``."""

    def result(self) -> Any:
        raise SessionError("the op is still being submitted")

    def done(self) -> bool:
        return False


def _identity(payload: Any) -> Any:
    return payload


class StepSession:
    """Drive one step on its layout. Not thread-safe: one loop thread calls it."""

    def __init__(
        self,
        *,
        connector: Any,
        plan: StepPlan,
        streamset: Any,
        layout: Layout = COMM_SIDE,
        recorder: TraceRecorder | None = None,
        step_id: int = 0,
        context_of: Callable[[Any], Any] = _identity,
    ) -> None:
        if not plan.layers or not plan.stages:
            raise SessionError("a step plan needs at least one layer and one stage")
        self.backend = backend = streamset.backend
        #: The device module: the session drives its streams and events through the module's own API.
        self.mod = backend.mod
        self._run_op = backend.run_op
        #: The compute stream (the caller's current stream).
        self.compute = compute = backend.compute_stream()
        #: The side streams the step forks and joins: by stage, K_s; under None, the FFN stream F.
        self.side_streams: dict[int | None, Stream] = {}
        #: By stage: the stream of its A2E, its FFN and its E2A.
        self.a2e_on: dict[int, Stream] = {}
        self.ffn_on: dict[int, Stream] = {}
        self.e2a_on: dict[int, Stream] = {}
        #: FFN outputs per stage, until the FFN's stream waits an event recorded after their E2A.
        self._f_refs: dict[int, list[Any]] = {}
        f = compute
        if layout.ffn == SIDE:
            f = self.side_streams[None] = streamset.ffn
        for s in plan.stages:
            k = compute
            if layout.a2e == SIDE or layout.e2a == SIDE:
                k = streamset.streams.get(s)
                if k is None:
                    raise SessionError(f"no side stream for stage {s}")
                self.side_streams[s] = k
            self.a2e_on[s] = k if layout.a2e == SIDE else compute
            self.e2a_on[s] = k if layout.e2a == SIDE else compute
            self.ffn_on[s] = f
            self._f_refs[s] = []
        #: The object whose calls this session serves (None once closed).
        self.connector = connector
        self.plan = plan
        self.order = plan.sequence
        self.layout = layout
        self.step_id = step_id
        self._keys = plan.keys
        self._context_of = context_of
        self._trace = StepTrace(recorder, step_id, backend) if recorder is not None else None
        if backend.take_errors is not None:  # the side streams' asynchronous errors of an earlier step go
            backend.take_errors(list(self.side_streams.values()))
        #: The index in ``self.order`` of the next expected receive.
        self.next_recv = 0
        self.forked = self.fallen_back = self.closed = self._closing = False
        self._recv_fn: Callable[..., Any] | None = None
        #: The stream whose scope the session is in (an E2A and its lookahead switch once).
        self._in_scope: Stream | None = None
        #: The side stream the session made current for the loop's work (None: the caller's is current).
        self._current: Stream | None = None
        #: Each receive issued and not yet taken: its handle.
        self._a_handle: dict[StageLayer, OpHandle] = {}
        #: The kwargs of each receive issued off the plan, until taken.
        self._a_kwargs: dict[StageLayer, dict[str, Any]] = {}
        #: A2E outputs, until their E2A stream has waited their FFN's f_done.
        self._inflight: dict[StageLayer, Any] = {}
        #: id(context) -> (layer, stage), for payloads handed to the loop.
        self._contexts: dict[int, StageLayer] = {}
        #: Each stage's last E2A event, while a receive on another stream must wait it.
        self._last_e2a: dict[int, EventKey] = {}
        # The step's log, always kept: what the watchdog and a trace read.
        self._events: dict[EventKey, Any] = {}
        self._sent: set[StageLayer] = set()
        #: Every op issued, in issue order.
        self._ops: list[tuple[str, int | None, int | None, str, OpHandle, int]] = []
        #: The op the host is issuing now: (kind, layer, stage, stream, start, seq), else None.
        self._issuing: tuple[Any, ...] | None = None
        #: Every record and wait as the host issued it: (kind, key, stream name, time, seq).
        self._marks: list[tuple[str, EventKey, str, int, int]] = []
        #: Each FFN's host window: (layer, stage, t0, t1, seq).
        self._ffns: list[tuple[int, int, int, int, int]] = []
        self._ffn_start: dict[StageLayer, tuple[int, int]] = {}
        #: Host issue order of every record, wait, op and FFN of the step.
        self._seq = itertools.count()
        self.t_open_ns = clock()
        self._closed_snapshot: SessionSnapshot | None = None

    # ------------------------------------------------------------------
    # events and ops
    def _record(self, stream: Stream, key: EventKey) -> None:
        ev = self._events[key] = self.backend.event(key)
        ev.record(stream)
        self._marks.append(("record", key, stream.name, clock(), next(self._seq)))

    def wait_event(self, stream: Stream, key: EventKey) -> None:
        """Make ``stream`` wait the event of ``key`` recorded in this step (every wait of the schedule)."""
        ev = self._events.get(key)
        if ev is None:
            raise SessionError(f"wait on event {key.label()!r} that was not recorded in this step")
        self._marks.append(("wait", key, stream.name, clock(), next(self._seq)))
        stream.wait_event(ev)

    def _edge(self, after: Stream, key: EventKey, before: Stream) -> None:
        """``before`` waits what ``after`` has queued so far (nothing when they are one stream: its order holds)."""
        if after is not before:
            self._record(after, key)
            self.wait_event(before, key)

    def _submit(
        self, stream: Stream, kind: str, layer: int | None, stage: int | None, fn: Callable[[], Any], label: str
    ) -> OpHandle:
        """Issue one connector op on ``stream``, listed in issue order; while the host runs it, it is the
        session's ``_issuing`` op (a stall report shows an op the host blocks in)."""
        op = self._issuing = (kind, layer, stage, stream.name, clock(), next(self._seq))
        try:
            if self._in_scope is stream:
                h = self._run_op(fn, label)
            else:
                with self.mod.stream(stream):
                    h = self._run_op(fn, label)
        except BaseException as exc:
            self._ops.append((kind, layer, stage, op[3], DoneHandle(exc=exc, start_ns=op[4], end_ns=clock()), op[5]))
            raise
        finally:
            self._issuing = None
        self._ops.append((kind, layer, stage, op[3], h, op[5]))
        return h

    def _run_on_c(self, kind: str, layer: int | None, stage: int | None, fn: Callable[[], Any], label: str) -> Any:
        h = self._submit(self.compute, kind, layer, stage, fn, label)
        try:
            return h.result()
        finally:
            h.release()

    # ------------------------------------------------------------------
    # the receives issued ahead
    def issue_a2e(self, layer: int, stage: int) -> None:
        """Queue the receive (A2E) of ``(layer, stage)`` on the stage's A2E stream and record its ``a_done``: every
        receive the session issues ahead goes through here."""
        fn = self._recv_fn
        assert fn is not None
        key = (layer, stage)
        kw, keys = self.plan.recv_kw.get(key), self._keys.get(key)
        if kw is None or keys is None:  # off the plan: only a broken schedule asks
            kw, keys = self.plan.build_recv_kwargs(layer, stage), OpKeys.of(layer, stage)
            self._a_kwargs[key] = kw
        k = self.a2e_on[stage]
        self._a_handle[key] = self._submit(k, A2E, layer, stage, partial(fn, **kw), keys.a2e_label)
        if k is not self.ffn_on[stage]:
            self._record(k, keys.a_done)

    # ------------------------------------------------------------------
    # the connector calls
    def recv(self, fn: Callable[..., Any], kw: Mapping[str, Any], call: Callable[[], Any] | None = None) -> Any:
        """A receive of the loop: ``fn(**kw)`` is the connector's receive (used for prefetches); ``call`` runs the
        loop's call as it was made (default: ``fn(**kw)``). ``kw`` holds ``layer_idx`` and ``ubatch_idx``."""
        got = (kw.get("layer_idx"), kw.get("ubatch_idx"))
        if self.fallen_back:
            return self._recv_after_fallback(dict(kw), got, call or partial(fn, **kw))
        expected = self.order[self.next_recv] if self.next_recv < len(self.order) else None
        if expected is None or got != expected or kw != self.plan.recv_kw[expected]:
            self._fall_back(expected, got, kw)
            return self._recv_after_fallback(dict(kw), got, call or partial(fn, **kw))
        L, s = expected
        prefetch = self.layout.prefetch
        if self.next_recv == 0:  # the fork: every side stream waits what the caller's stream has queued
            self._recv_fn = fn
            self.forked = True
            if self.side_streams:
                self._record(self.compute, FORK_KEY)
                for k in self.side_streams.values():
                    self.wait_event(k, FORK_KEY)
            if prefetch:
                for stage in self.plan.stages:  # the prologue
                    self.issue_a2e(self.plan.layers[0], stage)
        self.next_recv += 1
        f = self.ffn_on[s]
        if prefetch:
            if self.a2e_on[s] is not f:
                self.wait_event(f, self._keys[expected].a_done)
            payload = self._take_prefetched(L, s)
        else:
            if s in self._last_e2a:  # group order: the stage's last E2A (on its side stream) first
                self.wait_event(self.compute, self._last_e2a.pop(s))
                failed = self._side_error([self.e2a_on[s]])  # that E2A failed: raise it, as the serial path would
                if failed is not None:
                    raise failed
            payload = self._run_on_c(A2E, L, s, call or partial(fn, **kw), self._keys[expected].a2e_label)
        # The FFN's stream has waited an event recorded after every earlier E2A of this stage: their FFN outputs
        # may go.
        self._f_refs[s].clear()
        self._inflight[expected] = payload
        self._contexts[id(self._context_of(payload))] = expected
        if f is not self._current and f is not self.compute:
            # The loop's own work runs on the FFN's side stream from here to the step's close: its FFNs, and what
            # it issues between a send and the next receive (on afd-plugin main, the next (layer, stage)'s forward
            # context, whose mc2_mask fill the next FFN reads). Each connector call runs in its stream's scope.
            self.mod.set_stream(f)
            self._current = f
        self._ffn_start[expected] = (clock(), next(self._seq))
        return payload

    def _take_prefetched(self, L: int, s: int) -> Any:
        h = self._a_handle.pop((L, s))
        self._a_kwargs.pop((L, s), None)
        try:
            return h.result()
        except StreamPoisonedError:
            peek = self.backend.peek_errors
            first = peek([self.a2e_on[s]]) if peek is not None else []
            if first:
                raise first[0] from None
            raise
        finally:
            h.release()  # the handle stays listed; the payload is tracked in _inflight

    def send(self, call: Callable[[], Any], output: Any, context: Any, stage: int | None) -> Any:
        """A send of the loop: ``call()`` is the loop's call as it was made, ``output`` and ``context`` what it
        sends, ``stage`` its ``ubatch_idx``."""
        key = self._contexts.get(id(context))
        if key is not None:  # the FFN of (layer, stage) ends here: its host window
            now = clock()
            t0, seq = self._ffn_start.pop(key, None) or (now, -1)
            self._ffns.append((key[0], key[1], t0, now, seq))
        if self.fallen_back:
            return self._send_on_c(call, key)
        if key is None or key in self._sent or stage != key[1]:
            self._fall_back(("send for a received (layer, stage)",), ("send", key, "stage", stage), {})
            return self._send_on_c(call, key)
        L, s = key
        keys = self._keys[key]
        self._sent.add(key)
        C, f, k, ahead = self.compute, self.ffn_on[s], self.e2a_on[s], self.a2e_on[s]
        self._edge(f, keys.f_done, k)
        self._in_scope = k
        try:
            with self.mod.stream(k):
                h = self._submit(k, E2A, L, s, call, keys.e2a_label)
                if ahead is k or ahead is f:
                    # The A2E output's stream has waited f_done(L, s) (or is the FFN's): it may go.
                    self._inflight.pop(key, None)
                if k is not f:  # the FFN output stays until the FFN's stream waits an event recorded after this E2A
                    self._f_refs[s].append((output, context, call))
                if h.done():
                    h.result()  # a host-side failure surfaces here, as in the serial path
                nxt = self.plan.next_of[L]
                if nxt is not None and self.layout.prefetch:
                    self._edge(k, keys.e_done if k is not C else keys.e_done_c, ahead)
                    self._inflight.pop(key, None)  # the A2E stream has waited this E2A, so its FFN
                    self.issue_a2e(nxt, s)
                elif ahead is not k and nxt is not None:  # a receive on C waits this E2A
                    self._record(k, keys.e_done)
                    self._last_e2a[s] = keys.e_done
        finally:
            self._in_scope = None
        return None

    # ------------------------------------------------------------------
    # when the loop does something unplanned
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
            payload = self._run_on_c(A2E, got[0], got[1], run, OpKey(A2E, got[0], got[1]).label())
        self._contexts[id(self._context_of(payload))] = got  # type: ignore[assignment]
        self._ffn_start[got] = (clock(), next(self._seq))  # type: ignore[index]
        return payload

    def _send_on_c(self, call: Callable[[], Any], key: StageLayer | None) -> Any:
        if key is not None:
            self._sent.add(key)
            self._inflight.pop(key, None)
        L, s = key if key is not None else (None, None)
        return self._run_on_c(E2A, L, s, call, OpKey(E2A, L, s).label())

    # ------------------------------------------------------------------
    # join and close
    def join(self) -> None:
        """Make the caller's stream current again and wait the last work of every side stream, then release the
        buffers."""
        if self._current is not None:
            self._current = None
            self.mod.set_stream(self.compute)
        if self.forked:
            for s, k in self.side_streams.items():
                self._edge(k, JOIN_KEYS[s], self.compute)
        self._last_e2a.clear()
        self.release_buffers()

    def release_buffers(self) -> None:
        """Drop every buffer held for the side streams: FFN outputs sent, received A2E outputs not yet waited."""
        for refs in self._f_refs.values():
            refs.clear()
        self._inflight.clear()

    def close(self, *, raising: bool = False) -> None:
        """Join every side stream and release every reference. Raises the first error a side-stream op hit during
        the step unless the caller is already raising (then it is logged), or the compute stream's work failed
        first (the device synchronize reports that one)."""
        if self.closed or self._closing:
            return
        self._closing = True
        try:
            self.join()
        finally:
            error = self._side_error(list(self.side_streams.values()))
            short = not raising and not self.fallen_back and self.next_recv < len(self.order)
            unconsumed = list(self._a_handle) if short else []  # a receive taken leaves _a_handle
            if self._trace is not None:
                self._replay(self._trace)
            for held in (self._a_handle, self._a_kwargs, self._contexts):
                held.clear()
            self.release_buffers()
            self._recv_fn = self.connector = None
            self.closed = True  # the step's log is final: a snapshot now is the closed one
        if short:
            logger.warning(
                "camp2p-overlap: step %d ended after %d of %d planned receives; prefetched but never consumed: %s",
                self.step_id,
                self.next_recv,
                len(self.order),
                unconsumed,
            )
        if error is not None:
            if not raising:
                raise error
            logger.log(
                logging.ERROR,
                "camp2p-overlap: step %d: side-stream error while the step was already failing: %r",
                self.step_id,
                error,
            )

    def emit_trace(self, recorder: TraceRecorder) -> None:
        """Hand the step's log to ``recorder`` as a trace of the host's issue order (``source="session"``): a step
        that ran without a recorder is checked after it closed, as production ran it."""
        self._replay(StepTrace(recorder, self.step_id))

    def _replay(self, trace: StepTrace) -> None:
        for kind, key, stream, t, seq in self._marks:
            trace.event(kind, key, stream, t, t, seq)
        for layer, stage, t0, t1, seq in self._ffns:
            trace.ffn(layer, stage, t0, t1, seq, self.ffn_on[stage].name)
        trace.emit(self._ops)

    def _side_error(self, streams: list[Stream]) -> BaseException | None:
        """The asynchronous error of ``streams`` the host raises: the first (in the order kernels ran) of theirs and
        the compute stream's, unless that one is the compute stream's: the device synchronize reports it (a side
        stream's error may be its consequence)."""
        peek = self.backend.peek_errors
        if peek is None:
            return None
        errors = peek([self.compute, *streams])
        if not errors or any(errors[0] is e for e in peek([self.compute])):
            return None
        return errors[0]

    # ------------------------------------------------------------------
    # what the step's log says
    def expected_schedule(self) -> ExpectedSchedule:
        return ExpectedSchedule.of_layout(self.plan.layers, self.plan.stages, self.layout)

    def stage_layer_of(self, context: Any) -> StageLayer | None:
        """The ``(layer, stage)`` whose payload carried ``context`` (what the loop hands back to the send), or None."""
        return self._contexts.get(id(context))

    def a2e_issued(self, layer: int, stage: int) -> bool:
        """Whether this step has issued the receive of ``(layer, stage)``."""
        return (layer, stage) in self._a_handle

    def held(self) -> dict[str, int]:
        """How many buffers and handles the step holds (each 0 once closed)."""
        return {
            "recv_fn": int(self._recv_fn is not None),
            "a2e_handles": len(self._a_handle),
            "a2e_kwargs": len(self._a_kwargs),
            "contexts": len(self._contexts),
            "received_buffers": len(self._inflight),
            "sent_outputs": sum(len(refs) for refs in self._f_refs.values()),
        }

    def issued(self) -> list[tuple[str, int | None, int | None]]:
        """``(kind, layer, stage)`` of every op issued, in issue order."""
        return [(kind, layer, stage) for kind, layer, stage, *_ in self._ops]

    def log(self) -> list[tuple[Any, ...]]:
        """The step's records, waits and ops in issue order: ``(kind, label, stream)``, ``kind`` one of ``record``,
        ``wait``, ``a2e``, ``e2a``."""
        marks = [(seq, kind, key.label(), stream) for kind, key, stream, _, seq in self._marks]
        ops = [
            (seq, kind, OpKey(kind, layer, stage).label(), stream) for kind, layer, stage, stream, _, seq in self._ops
        ]
        return [entry[1:] for entry in sorted(marks + ops)]

    def snapshot(self) -> SessionSnapshot:
        """The session's progress, copied; safe to take from another thread.
        Once closed: the step as the host left it (what the device runs)."""
        if not self.closed:
            return self._snapshot(closed=False)
        if self._closed_snapshot is None:
            self._closed_snapshot = self._snapshot(closed=True)
        return self._closed_snapshot

    def _ffn_log(self) -> tuple[tuple[int, int, int], ...]:
        """Each FFN the loop has begun, ``(layer, stage, seq)``: those sent, then any the host is in."""
        done = [(L, s, seq) for L, s, _, _, seq in list(self._ffns)]
        return tuple(done + [(L, s, seq) for (L, s), (_, seq) in list(self._ffn_start.items())])

    def _issued_ops(self) -> tuple[IssuedOp, ...]:
        """The ops issued so far, and last the one the host is issuing (a :class:`RunningOp` handle)."""
        ops = [IssuedOp(*o) for o in list(self._ops)]
        issuing = self._issuing
        if issuing is not None:
            running = RunningOp()
            running.start_ns = issuing[4]
            ops.append(IssuedOp(*issuing[:4], running, issuing[5]))
        return tuple(ops)

    def _snapshot(self, *, closed: bool) -> SessionSnapshot:
        return SessionSnapshot(
            step_id=self.step_id,
            plan=self.plan,
            layout=self.layout,
            received=self.next_recv,
            sent=frozenset(self._sent),
            ops=self._issued_ops(),
            events=tuple(self._events.items()),
            a2e_streams={s: k.name for s, k in self.a2e_on.items()},
            ffn_streams={s: k.name for s, k in self.ffn_on.items()},
            side_streams={s: k.name for s, k in self.side_streams.items()},
            marks=tuple((kind, key, stream, seq) for kind, key, stream, _, seq in list(self._marks)),
            ffns=self._ffn_log(),
            opened_ns=self.t_open_ns,
            closed=closed,
            core_state=self.backend.capabilities.core_state,
        )
