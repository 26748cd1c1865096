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

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from camp2p_overlap._log import logger
from camp2p_overlap.streams.base import OpHandle, Stream, StreamBackend
from camp2p_overlap.streams.cpu import StreamPoisonedError
from camp2p_overlap.trace import ExpectedSchedule, TraceOp, TraceRecorder, side_stream_name

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
        self._ffn_start: dict[StageLayer, int] = {}
        #: Issued (kind, layer, stage) for stall reports.
        self.issued: list[tuple[str, int, int]] = []
        self.t_open_ns = time.perf_counter_ns()
        self.backend.begin_step(list(self.K.values()))

    # ------------------------------------------------------------------
    # events
    def _record(self, stream: Stream, key: Hashable) -> Any:
        ev = self.backend.record(stream, key)
        self._events[key] = ev
        if self.recorder is not None:
            now = time.perf_counter_ns()
            self._trace.append(TraceOp("record", _l(key), _s(key), stream.name, now, now, self.step_id, repr(key)))
        return ev

    def _wait(self, stream: Stream, key: Hashable) -> None:
        ev = self._events.get(key)
        if ev is None:
            raise SessionError(f"wait on event {key!r} that was not recorded in this step")
        t0 = time.perf_counter_ns()
        self.backend.wait(stream, ev)
        if self.recorder is not None:
            self._trace.append(
                TraceOp("wait", _l(key), _s(key), stream.name, t0, time.perf_counter_ns(), self.step_id, repr(key))
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
        h = self.backend.submit(k, lambda: fn(**kw), label=f"a2e L{layer} s{stage}")
        self._a_handle[(layer, stage)] = h
        self._a_kwargs[(layer, stage)] = kw
        self._ops.append(_PendingOp("a2e", layer, stage, k.name, h))
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
            h = self.backend.submit(self.C, lambda: wrapped(*args, **kwargs), label=f"a2e L{L} s{s}")
            self._ops.append(_PendingOp("a2e", L, s, "C", h))
            self.issued.append(("a2e", L, s))
            payload = h.result()
        # C has now waited an event recorded on K_s after every earlier E2A
        # of this stage: their FFN outputs may be freed.
        self._f_refs[s].clear()
        self._consumed.add((L, s))
        self._inflight[(L, s)] = payload
        self._contexts[id(getattr(payload, "context", payload))] = (L, s)
        self._ffn_start[(L, s)] = self._stamp()
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
        if self.recorder is not None:
            self._trace.append(TraceOp("ffn", L, s, "C", self._ffn_start.pop((L, s), t_end), t_end, self.step_id))
        self._record(self.C, ("f", L, s))
        if self.dir.e2a_side:
            k = self.K[s]
            self._wait(k, ("f", L, s))
            h = self.backend.submit(k, lambda: wrapped(*args, **kwargs), label=f"e2a L{L} s{s}")
            self._ops.append(_PendingOp("e2a", L, s, k.name, h))
            self.issued.append(("e2a", L, s))
            self._last_k[s] = self._record(k, ("e", L, s))
            self._f_refs[s].append((out, args, kwargs))
            self._inflight.pop(key, None)  # K_s has waited f_done(L, s)
            if h.done():
                h.result()  # a host-side failure surfaces here, as in the serial path
        else:
            h = self.backend.submit(self.C, lambda: wrapped(*args, **kwargs), label=f"e2a L{L} s{s}")
            self._ops.append(_PendingOp("e2a", L, s, "C", h))
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
            payload = wrapped(*args, **kwargs)
        key = (got[0], got[1])
        self._contexts[id(getattr(payload, "context", payload))] = key  # type: ignore[assignment]
        return payload

    def _send_on_c(self, wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: Any) -> Any:
        if key is not None:
            self._sent.add(key)
            self._inflight.pop(key, None)
        return wrapped(*args, **kwargs)

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
        read-only (event queries), for the watchdog."""
        lines = [f"step {self.step_id}: {self.pos}/{len(self.order)} receives handed to the loop"]
        for key, ev in list(self._events.items()):
            try:
                done = bool(ev.query())
            except Exception as exc:  # noqa: BLE001 - diagnostics only
                done = f"query failed: {exc}"  # type: ignore[assignment]
            lines.append(f"  event {key!r}: {'done' if done is True else done or 'pending'}")
        pending = [f"{o.kind}(L{o.layer},s{o.stage}) on {o.stream}" for o in list(self._ops) if not o.handle.done()]
        lines.append("  ops not finished: " + (", ".join(pending) or "none"))
        return "\n".join(lines)

    def _emit_trace(self) -> None:
        if self.recorder is None:
            return
        for o in self._ops:
            h = o.handle
            if h.start_ns is None or h.end_ns is None:
                continue
            self._trace.append(TraceOp(o.kind, o.layer, o.stage, o.stream, h.start_ns, h.end_ns, self.step_id))
        self.recorder.extend(self._trace)
        self._trace = []


def _l(key: Hashable) -> int | None:
    return key[1] if isinstance(key, tuple) and len(key) == 3 else None


def _s(key: Hashable) -> int | None:
    if isinstance(key, tuple) and len(key) == 3:
        return key[2]
    if isinstance(key, tuple) and len(key) == 2 and key[0] == "join":
        return key[1]
    return None
