"""One FFN step's overlap schedule: the edges of ``overlap-dag.md`` driven
from the connector calls the upstream loop makes.

The session knows nothing of afd-plugin types. It is told the step's plan
(layer list and stage ids, the receive kwargs of each (layer, stage)), a
stream backend and per-stage side streams, and is then fed the loop's
``recv``/``send`` calls in order:

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
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from camp2p_overlap.core.log import logger
from camp2p_overlap.core.streams.base import OpHandle, Stream, StreamBackend
from camp2p_overlap.core.streams.cpu import StreamPoisonedError
from camp2p_overlap.core.trace import ExpectedSchedule, TraceOp, TraceRecorder, side_stream_name

StageLayer = tuple[int, int]


class ScheduleMismatchError(RuntimeError):
    """The loop asked for data the session cannot hand over without risking
    wrong data (a receive for a group whose next message was already taken
    for a different (layer, stage))."""


class SessionError(RuntimeError):
    """Internal invariant broken (a wait on an event never recorded, ...)."""


@dataclass(frozen=True)
class StepPlan:
    """The step as the loop will run it: ``for L in layers: for s in stages``."""

    layers: tuple[int, ...]
    stages: tuple[int, ...]
    #: Extra receive kwargs of every call besides ``ubatch_idx``/``layer_idx``
    #: (upstream: ``max_num_tokens``).
    recv_extra: Mapping[str, Any] = field(default_factory=dict)

    def order(self) -> list[StageLayer]:
        return [(L, s) for L in self.layers for s in self.stages]

    def next_layer(self, layer: int) -> int | None:
        i = self.layers.index(layer)
        return self.layers[i + 1] if i + 1 < len(self.layers) else None

    def recv_kwargs(self, layer: int, stage: int) -> dict[str, Any]:
        return {"ubatch_idx": stage, "layer_idx": layer, **self.recv_extra}


@dataclass(frozen=True)
class Directions:
    a2e_side: bool = True
    e2a_side: bool = True


class StreamSet:
    """A backend and one side stream per stage id, created once (outside any
    capture) and reused for every step of a runner."""

    def __init__(self, backend: StreamBackend, stage_ids: Sequence[int]) -> None:
        self.backend = backend
        self.streams: dict[int, Stream] = {s: backend.new_stream(side_stream_name(s)) for s in stage_ids}
        self.lock = threading.Lock()  # one step at a time per runner

    def close(self) -> None:
        self.backend.close()


def normalize_recv(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``recv_attn_output(self, ubatch_idx=0, **kwargs)`` call -> kwargs."""
    out = dict(kwargs)
    if args:
        out["ubatch_idx"] = args[0]
    out.setdefault("ubatch_idx", 0)
    return out


def send_parts(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
    """``send_ffn_output(self, ffn_output, context, **kwargs)`` -> (output, context)."""
    rest = list(args)
    out = rest.pop(0) if rest else kwargs.get("ffn_output")
    ctx = rest.pop(0) if rest else kwargs.get("context")
    return out, ctx


def send_stage(ctx: Any, kwargs: Mapping[str, Any]) -> int | None:
    if "ubatch_idx" in kwargs:
        return int(kwargs["ubatch_idx"])
    meta = getattr(ctx, "metadata", None)
    stage = getattr(meta, "stage_idx", None)
    return None if stage is None else int(stage)


@dataclass
class _PendingOp:
    kind: str
    layer: int
    stage: int
    stream: str
    handle: OpHandle
    seq: int = -1


class OverlapSession:
    """Drive one step. Not thread-safe: one loop thread calls it."""

    def __init__(
        self,
        *,
        connector: Any,
        plan: StepPlan,
        streamset: StreamSet,
        directions: Directions = Directions(),
        recorder: TraceRecorder | None = None,
        step_id: int = 0,
    ) -> None:
        if not plan.layers or not plan.stages:
            raise SessionError("a step plan needs at least one layer and one stage")
        missing = [s for s in plan.stages if s not in streamset.streams]
        if missing:
            raise SessionError(f"no side stream for stage(s) {missing}")
        self.connector = connector
        self.plan = plan
        self.order = plan.order()
        self.set = streamset
        self.backend = streamset.backend
        self.C = self.backend.compute_stream()
        self.K = {s: streamset.streams[s] for s in plan.stages}
        self.dir = directions
        self.recorder = recorder
        self.step_id = step_id
        self.thread = threading.get_ident()

        self.pos = 0  # index in self.order of the next expected receive
        self.forked = False
        self.fallen_back = False
        self.closed = False
        self._recv_fn: Callable[..., Any] | None = None
        self._events: dict[Hashable, Any] = {}
        self._a_handle: dict[StageLayer, OpHandle] = {}
        self._a_kwargs: dict[StageLayer, dict[str, Any]] = {}
        self._consumed: set[StageLayer] = set()
        self._sent: set[StageLayer] = set()
        #: A2E outputs, until K_s has waited their FFN's f_done.
        self._inflight: dict[StageLayer, Any] = {}
        #: id(context) -> (layer, stage), for payloads handed to the loop.
        self._contexts: dict[int, StageLayer] = {}
        #: FFN outputs per stage, until C waits an event K_s recorded after their E2A.
        self._f_refs: dict[int, list[Any]] = {s: [] for s in plan.stages}
        #: The last event recorded on K_s, or on C after a C-side E2A of stage s.
        self._last_k: dict[int, Any] = {}
        self._e_done_c: dict[int, Any] = {}
        self._ops: list[_PendingOp] = []
        self._trace: list[TraceOp] = []
        self._ffn_start: dict[StageLayer, tuple[int, int]] = {}
        #: Host issue order of every record, wait and op of the step (traces:
        #: the checker rebuilds each stream's FIFO and the event graph from it).
        self._seq = itertools.count()
        #: Issued (kind, layer, stage) for stall reports.
        self.issued: list[tuple[str, int, int]] = []
        self.t_open_ns = time.perf_counter_ns()
        self.backend.begin_step(list(self.K.values()))

    # ------------------------------------------------------------------
    # events
    def _record(self, stream: Stream, key: Hashable) -> Any:
        seq = next(self._seq)
        ev = self.backend.record(stream, key)
        self._events[key] = ev
        if self.recorder is not None:
            now = time.perf_counter_ns()
            self._trace.append(TraceOp("record", _l(key), _s(key), stream.name, now, now, self.step_id, repr(key), seq))
        return ev

    def _wait(self, stream: Stream, key: Hashable) -> None:
        ev = self._events.get(key)
        if ev is None:
            raise SessionError(f"wait on event {key!r} that was not recorded in this step")
        seq = next(self._seq)
        t0 = time.perf_counter_ns()
        self.backend.wait(stream, ev)
        if self.recorder is not None:
            self._trace.append(
                TraceOp("wait", _l(key), _s(key), stream.name, t0, time.perf_counter_ns(), self.step_id, repr(key), seq)
            )

    def _stamp(self) -> int:
        return time.perf_counter_ns()

    # ------------------------------------------------------------------
    # fork / prologue / lookahead
    def _fork(self) -> None:
        self._record(self.C, ("fork",))
        for s, k in self.K.items():
            self._wait(k, ("fork",))
            self._last_k[s] = self._events[("fork",)]
        self.forked = True

    def _issue_a2e(self, layer: int, stage: int) -> None:
        assert self._recv_fn is not None
        kw = self.plan.recv_kwargs(layer, stage)
        fn = self._recv_fn
        k = self.K[stage]
        seq = next(self._seq)
        h = self.backend.submit(k, lambda: fn(**kw), label=f"a2e L{layer} s{stage}")
        self._a_handle[(layer, stage)] = h
        self._a_kwargs[(layer, stage)] = kw
        self._ops.append(_PendingOp("a2e", layer, stage, k.name, h, seq))
        self.issued.append(("a2e", layer, stage))
        self._last_k[stage] = self._record(k, ("a", layer, stage))

    def _prologue(self) -> None:
        first = self.plan.layers[0]
        for s in self.plan.stages:
            self._issue_a2e(first, s)

    # ------------------------------------------------------------------
    # the connector calls
    def recv(self, wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kw = normalize_recv(args, kwargs)
        got = (kw.get("layer_idx"), kw.get("ubatch_idx"))
        if self.fallen_back:
            return self._recv_after_fallback(wrapped, args, kwargs, kw)
        expected = self.order[self.pos] if self.pos < len(self.order) else None
        if expected is None or got != expected or kw != self.plan.recv_kwargs(*expected):
            self._fall_back(expected, got, kw)
            return self._recv_after_fallback(wrapped, args, kwargs, kw)
        L, s = expected
        if self.pos == 0:
            self._recv_fn = wrapped
            self._fork()
            if self.dir.a2e_side:
                self._prologue()
        self.pos += 1
        if self.dir.a2e_side:
            self._wait(self.C, ("a", L, s))
            payload = self._take_prefetched(L, s)
        else:
            # A2E on C: the group's previous E2A (on K_s) must be done first.
            if self.dir.e2a_side and s in self._e_done_c:
                self._wait(self.C, self._e_done_c[s])
                # That E2A failed (host-visible, CPU backend): raise it as the
                # serial path would, instead of an A2E no peer will answer.
                failed = self.backend.step_errors([self.K[s]])
                if failed:
                    raise failed[0]
            seq = next(self._seq)
            h = self.backend.submit(self.C, lambda: wrapped(*args, **kwargs), label=f"a2e L{L} s{s}")
            self._ops.append(_PendingOp("a2e", L, s, "C", h, seq))
            self.issued.append(("a2e", L, s))
            try:
                payload = h.result()
            finally:
                h.release()
        # C has now waited an event recorded on K_s after every earlier E2A
        # of this stage: their FFN outputs may be freed.
        self._f_refs[s].clear()
        self._consumed.add((L, s))
        self._inflight[(L, s)] = payload
        self._contexts[id(getattr(payload, "context", payload))] = (L, s)
        self._ffn_start[(L, s)] = (self._stamp(), next(self._seq))
        return payload

    def _take_prefetched(self, L: int, s: int) -> Any:
        h = self._a_handle.pop((L, s))
        self._a_kwargs.pop((L, s), None)
        try:
            return h.result()
        except StreamPoisonedError:
            first = self.backend.step_errors([self.K[s]])
            if first:
                raise first[0] from None
            raise
        finally:
            # The handle stays in self._ops for traces and stall reports; the
            # payload must not: ownership is tracked in self._inflight.
            h.release()

    def send(self, wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out, ctx = send_parts(args, kwargs)
        # Popped: the payload (and so its context) stays alive until its send,
        # so the id cannot be reused while it is mapped.
        key = self._contexts.pop(id(ctx), None)
        if self.fallen_back:
            return self._send_on_c(wrapped, args, kwargs, key)
        stage = send_stage(ctx, kwargs)
        if key is None or key in self._sent or stage != key[1]:
            self._fall_back(("send for a received (layer, stage)",), ("send", key, "stage", stage), kwargs)
            return self._send_on_c(wrapped, args, kwargs, key)
        L, s = key
        self._sent.add(key)
        t_end = self._stamp()
        t_start, ffn_seq = self._ffn_start.pop((L, s), (t_end, -1))
        if self.recorder is not None:
            self._trace.append(TraceOp("ffn", L, s, "C", t_start, t_end, self.step_id, "", ffn_seq))
        self._record(self.C, ("f", L, s))
        if self.dir.e2a_side:
            k = self.K[s]
            self._wait(k, ("f", L, s))
            seq = next(self._seq)
            h = self.backend.submit(k, lambda: wrapped(*args, **kwargs), label=f"e2a L{L} s{s}")
            self._ops.append(_PendingOp("e2a", L, s, k.name, h, seq))
            self.issued.append(("e2a", L, s))
            self._last_k[s] = self._record(k, ("e", L, s))
            self._f_refs[s].append((out, args, kwargs))
            self._inflight.pop(key, None)  # K_s has waited f_done(L, s)
            if h.done():
                h.result()  # a host-side failure surfaces here, as in the serial path
        else:
            seq = next(self._seq)
            h = self.backend.submit(self.C, lambda: wrapped(*args, **kwargs), label=f"e2a L{L} s{s}")
            self._ops.append(_PendingOp("e2a", L, s, "C", h, seq))
            self.issued.append(("e2a", L, s))
            h.result()
            self._e_done_c[s] = ("ec", L, s)
            self._record(self.C, ("ec", L, s))
        if self.dir.e2a_side:
            self._e_done_c[s] = ("e", L, s)
        nxt = self.plan.next_layer(L)
        if nxt is not None and self.dir.a2e_side:
            if not self.dir.e2a_side:
                self._wait(self.K[s], ("ec", L, s))
                self._inflight.pop(key, None)
            self._issue_a2e(nxt, s)
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
        self._join()

    def _recv_after_fallback(
        self, wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], kw: dict[str, Any]
    ) -> Any:
        got = (kw.get("layer_idx"), kw.get("ubatch_idx"))
        if got in self._a_handle and self._a_kwargs.get(got) == kw:  # type: ignore[comparison-overlap]
            payload = self._take_prefetched(*got)  # type: ignore[arg-type]
        elif any(s == kw.get("ubatch_idx") for (_, s) in self._a_handle):
            pending = sorted(k for k in self._a_handle if k[1] == kw.get("ubatch_idx"))
            raise ScheduleMismatchError(
                f"receive for (layer {got[0]}, stage {got[1]}) but the next message of that "
                f"stage's group was already received for (layer, stage) {pending}; refusing "
                "to hand over data that may belong to another layer"
            )
        else:
            payload = self._run_on_c("a2e", got, wrapped, args, kwargs)
        key = (got[0], got[1])
        self._contexts[id(getattr(payload, "context", payload))] = key  # type: ignore[assignment]
        self._ffn_start[key] = (self._stamp(), next(self._seq))  # type: ignore[index]
        return payload

    def _run_on_c(
        self, kind: str, key: Any, wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A connector call run as the serial path does, after a fallback;
        traced like any other op."""
        L, s = key if isinstance(key, tuple) else (None, None)
        seq = next(self._seq)
        h = self.backend.submit(self.C, lambda: wrapped(*args, **kwargs), label=f"{kind} L{L} s{s}")
        self._ops.append(_PendingOp(kind, L, s, "C", h, seq))  # type: ignore[arg-type]
        self.issued.append((kind, L, s))  # type: ignore[arg-type]
        try:
            return h.result()
        finally:
            h.release()

    def _send_on_c(self, wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: Any) -> Any:
        if key is not None:
            self._sent.add(key)
            self._inflight.pop(key, None)
            t_end = self._stamp()
            t_start, ffn_seq = self._ffn_start.pop(key, (t_end, -1))
            if self.recorder is not None:
                self._trace.append(TraceOp("ffn", key[0], key[1], "C", t_start, t_end, self.step_id, "", ffn_seq))
        return self._run_on_c("e2a", key, wrapped, args, kwargs)

    # ------------------------------------------------------------------
    # join
    def _join(self) -> None:
        if not self.forked:
            return
        for s, k in self.K.items():
            self._record(k, ("join", s))
            self._wait(self.C, ("join", s))
        # Every side-stream op has completed (CPU) or is ordered before C's
        # next work (device): nothing the step allocated needs holding.
        for refs in self._f_refs.values():
            refs.clear()
        self._inflight.clear()

    def close(self, *, raising: bool = False) -> None:
        """Join every side stream and release every reference. Raises the
        first error a side-stream op hit during the step unless the caller
        is already raising (then it is logged)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._join()
        finally:
            errors = self.backend.step_errors(list(self.K.values()))
            unconsumed = [k for k in self._a_handle if k not in self._consumed]
            self._emit_trace()
            self._a_handle.clear()
            self._a_kwargs.clear()
            self._contexts.clear()
            self._inflight.clear()
            for refs in self._f_refs.values():
                refs.clear()
            self._events.clear()
            self._ops.clear()
            self._recv_fn = None
            self.connector = None
        if not raising and not self.fallen_back and self.pos < len(self.order):
            logger.warning(
                "camp2p-overlap: step %d ended after %d of %d planned receives; prefetched but never consumed: %s",
                self.step_id,
                self.pos,
                len(self.order),
                unconsumed,
            )
        if errors:
            if raising:
                logger.log(
                    logging.ERROR,
                    "camp2p-overlap: step %d: side-stream error while the step was already failing: %r",
                    self.step_id,
                    errors[0],
                )
            else:
                raise errors[0]

    # ------------------------------------------------------------------
    def expected_schedule(self) -> ExpectedSchedule:
        return ExpectedSchedule(self.plan.layers, self.plan.stages, self.dir.a2e_side, self.dir.e2a_side)

    def stall_report(self) -> str:
        """Which ops were issued and which recorded events have completed:
        read-only (event queries, handle states; never a sync), for the
        watchdog. May be called from another thread while the step runs.

        Layout: the header; what the compute stream C is blocked on; per
        stage (stream, HCCL group) every op issued in order with its state
        (done / running for N s / queued / enqueued on the device, not
        complete); the first unfinished op of each stage named as the
        likely missing peer op; then the events (all of them when few,
        else only the pending ones) and the unfinished ops."""
        now = time.perf_counter_ns()
        events = list(self._events.items())
        evmap = dict(events)
        ops = list(self._ops)
        consumed = set(self._consumed)

        def ev_state(key: Hashable) -> bool | str | None:
            ev = evmap.get(key)
            if ev is None:
                return None
            try:
                return bool(ev.query())
            except Exception as exc:  # noqa: BLE001 - diagnostics only
                return f"query failed: {exc}"

        def op_state(o: _PendingOp) -> tuple[bool, str]:
            h = o.handle
            if not h.done():
                if h.start_ns is None:
                    return False, "queued"
                return False, f"RUNNING for {(now - h.start_ns) / 1e9:.2f} s"
            # Device backends return at once; the event after the op tells.
            after = {"a2e": "a", "e2a": "e" if o.stream != "C" else "ec"}.get(o.kind, "")
            st = ev_state((after, o.layer, o.stage))
            if st is False:
                return False, "enqueued, not complete on the device"
            return True, "done"

        lines = [f"step {self.step_id}: {self.pos}/{len(self.order)} receives handed to the loop"]
        lines.append(
            f"  open for {(now - self.t_open_ns) / 1e9:.2f} s; plan: layers {list(self.plan.layers)}, "
            f"stages {list(self.plan.stages)}"
        )
        on_c: list[str] = []  # a C-side op in progress (one direction switched off)
        if self.pos > 0 and self.order[self.pos - 1] not in consumed:
            L, s = self.order[self.pos - 1]
            lines.append(f"  compute stream C is blocked in receive (L{L},s{s}), waiting for a2e(L{L},s{s})")
            if not self.dir.a2e_side:
                on_c.append(f"a2e(L{L},s{s}) on C")
        elif self.pos < len(self.order):
            L, s = self.order[self.pos]
            lines.append(f"  compute stream C is not waiting on a receive (FFN or E2A issue); next receive (L{L},s{s})")
        if not self.dir.e2a_side:
            sent_on_c = {(o.layer, o.stage) for o in ops if o.kind == "e2a"}
            on_c += [f"e2a(L{L},s{s}) on C" for (L, s) in sorted(set(self._sent) - sent_on_c)]
        culprits = [
            f"  likely missing peer op: {what} (in progress on the compute stream): the attention peer has not answered"
            for what in on_c
        ]
        for s in self.plan.stages:
            group = _GROUPS[s] if 0 <= s < len(_GROUPS) else f"stage {s}"
            mine = [o for o in ops if o.stage == s]
            stream = self.K[s].name if s in self.K else "?"
            lines.append(f"  stage {s} (stream {stream}, group {group}): {len(mine)} op(s) issued")
            states = [op_state(o) for o in mine]
            open_idx = [i for i, (finished, _) in enumerate(states) if not finished]
            first_open = (mine[open_idx[0]], states[open_idx[0]][1]) if open_idx else None
            # Keep long steps readable: the done ops before the last two
            # preceding the first unfinished one are counted, not listed.
            cut = max((open_idx[0] if open_idx else len(mine)) - 2, 0)
            if cut:
                lines.append(f"    ... {cut} earlier op(s) done")
            for o, (_, text) in list(zip(mine, states, strict=True))[cut:]:
                lines.append(f"    {o.kind}(L{o.layer},s{o.stage}) on {o.stream}: {text}")
            if first_open is not None:
                o, text = first_open
                role = "answered (no data)" if o.kind == "a2e" else "acknowledged"
                culprits.append(
                    f"  likely missing peer op: {o.kind}(L{o.layer},s{o.stage}) on {o.stream} ({text}): "
                    f"the attention peer of stage {s} (group {group}) has not {role}"
                )
        lines.extend(culprits or ["  every issued op has finished"])
        shown = events if len(events) <= 32 else [(k, e) for k, e in events if ev_state(k) is not True]
        if len(shown) < len(events):
            lines.append(f"  events: {len(events) - len(shown)} done, listing the other {len(shown)}")
        for key, _ev in shown:
            done = ev_state(key)
            lines.append(f"  event {key!r}: {'done' if done is True else done or 'pending'}")
        pending = [f"{o.kind}(L{o.layer},s{o.stage}) on {o.stream}" for o in ops if not op_state(o)[0]]
        lines.append("  ops not finished: " + (", ".join(pending) or "none"))
        return "\n".join(lines)

    def _emit_trace(self) -> None:
        if self.recorder is None:
            return
        for o in self._ops:
            h = o.handle
            if h.start_ns is None or h.end_ns is None:
                continue
            self._trace.append(
                TraceOp(o.kind, o.layer, o.stage, o.stream, h.start_ns, h.end_ns, self.step_id, "", o.seq)
            )
        self.recorder.extend(self._trace)
        self._trace = []


#: CAMP2P's HCCL group of each stage id (for stall reports).
_GROUPS = ("afd", "afd1", "afd2")


def _l(key: Hashable) -> int | None:
    return key[1] if isinstance(key, tuple) and len(key) == 3 else None


def _s(key: Hashable) -> int | None:
    if isinstance(key, tuple) and len(key) == 3:
        return key[2]
    if isinstance(key, tuple) and len(key) == 2 and key[0] == "join":
        return key[1]
    return None
