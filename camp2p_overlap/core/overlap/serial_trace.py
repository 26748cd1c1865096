"""The serial path, traced: what a step that runs upstream's original does
while a trace recorder is active (the bench and verify tools', never a
worker's by default). It sits in the overlap room, not the observe room: it
reads CAMP2P's call shapes and routes a connector instance, which the
observe room may not import (the rooms contract in ``pyproject.toml``).

While it runs, the connector's ``route`` targets are routed to the step's
trace (:data:`TRACE_ROUTERS`): each A2E and E2A becomes a tracked op of the
device registered for the ``cpu`` backend (host-timed where none is), the
FFN the span from a receive to its send; that device's stream log, where it
keeps one, is the trace's evidence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from threading import get_ident
from typing import Any

from camp2p_overlap.core.keys import A2E, COMPUTE_STREAM, E2A, OpKey
from camp2p_overlap.core.observe.trace import StepTrace, TraceOp, TraceRecorder
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.routes import ConnectorRoutes, MakeRouter, Wrapped
from camp2p_overlap.core.overlap.streams import registered_capabilities
from camp2p_overlap.core.overlap.streams.base import DoneHandle


def run_traced_serial(recorder: TraceRecorder, engine: Any, runner: Any, original: Callable[[], Any]) -> Any:
    """Run ``original()`` (the step's original ``_ffn_forward``) as a traced
    serial step of ``recorder``; the trace is emitted on every exit."""
    state = recorder.serial_state()
    step_id = recorder.next_step()
    previous = state["step"], state.get("trace")
    # The registered cpu device's stream log, the trace's evidence (none on a
    # real device: its truth is the profiler's).
    caps = registered_capabilities("cpu")
    log = caps.new_log() if caps.new_log is not None else None
    saved_log = caps.set_log(log) if caps.set_log is not None else None
    state["step"], state["trace"] = step_id, StepTrace(recorder, step_id, log=log)
    routes = traced_routes(recorder, engine, runner)
    t0 = time.perf_counter_ns()
    try:
        return original()
    finally:
        if routes is not None:
            routes.remove()
        if caps.set_log is not None:
            caps.set_log(saved_log)
        state["trace"].emit()
        recorder.add(TraceOp("step", None, None, COMPUTE_STREAM, t0, time.perf_counter_ns(), step_id))
        state["step"], state["trace"] = previous


def traced_routes(recorder: TraceRecorder, engine: Any, runner: Any) -> ConnectorRoutes | None:
    """The runner's connector routed to this step's trace (None: not a routed class)."""
    connector = getattr(runner, "connector", None)
    targets = [spec for owner, spec in engine.installer.routes() if isinstance(connector, owner)]
    if not targets:
        return None
    routes = ConnectorRoutes(connector)
    if routes.install([(spec.attribute, TRACE_ROUTERS[spec.router](recorder)) for spec in targets]) is not None:  # type: ignore[index]
        return None
    return routes


def _tracked(fn: Callable[[], Any], label: str) -> Any:
    """``fn()`` as a tracked op of the registered device, else host-timed."""
    tracked = registered_capabilities("cpu").tracked
    if tracked is not None:
        return tracked(fn, label)
    t0 = time.perf_counter_ns()
    try:
        value = fn()
    except BaseException as exc:  # noqa: BLE001 - handed back, as tracked() does
        return DoneHandle(None, exc, t0, time.perf_counter_ns())
    return DoneHandle(value, None, t0, time.perf_counter_ns())


def _trace_op(recorder: TraceRecorder, state: dict[str, Any], kind: str, layer: Any, stage: Any, h: Any) -> None:
    """A serial op into its step's trace; outside a traced step (a router used
    on its own), into a trace of its own, emitted at once."""
    trace = state.get("trace")
    if trace is not None:
        trace.op(kind, layer, stage, COMPUTE_STREAM, h)
        return
    alone = StepTrace(recorder, state["step"])
    alone.op(kind, layer, stage, COMPUTE_STREAM, h)
    alone.emit()


# Each router factory binds its recorder; a router serves only the thread that installed it.
def _traced_recv(recorder: TraceRecorder) -> MakeRouter:
    """The original receive, traced as the serial path's A2E."""

    def make(callee: Wrapped, thread: int) -> Wrapped:
        def recv_attn_output(*args: Any, **kwargs: Any) -> Any:
            if get_ident() != thread:
                return callee(*args, **kwargs)
            kw = camp2p.recv_kwargs(args, kwargs)
            layer, stage = kw.get("layer_idx"), kw.get("ubatch_idx")
            h = _tracked(lambda: callee(*args, **kwargs), OpKey(A2E, layer, stage).label())
            state = recorder.serial_state()
            _trace_op(recorder, state, A2E, layer, stage, h)
            payload = h.result()
            state["ffn_start"][id(camp2p.context_of(payload))] = (layer, stage, time.perf_counter_ns())  # type: ignore[index]
            return payload

        return recv_attn_output

    return make


def _traced_send(recorder: TraceRecorder) -> MakeRouter:
    """The original send, traced as the serial path's FFN (since its
    receive) and E2A."""

    def make(callee: Wrapped, thread: int) -> Wrapped:
        def send_ffn_output(*args: Any, **kwargs: Any) -> Any:
            if get_ident() != thread:
                return callee(*args, **kwargs)
            _, ctx, stage = camp2p.send_call(args, kwargs)
            state = recorder.serial_state()
            t0 = time.perf_counter_ns()
            started = state["ffn_start"].pop(id(ctx), None)  # type: ignore[attr-defined]
            layer = started[0] if started else camp2p.context_layer(ctx)
            trace = state.get("trace")
            if started and trace is not None:
                trace.ffn(layer, stage, started[2], t0, -1)  # type: ignore[union-attr]
            h = _tracked(lambda: callee(*args, **kwargs), OpKey(E2A, layer, stage).label())
            _trace_op(recorder, state, E2A, layer, stage, h)
            return h.result()

        return send_ffn_output

    return make


#: The trace routers, by the same keys as ``routes.SESSION_ROUTERS``.
TRACE_ROUTERS: dict[str, Callable[[TraceRecorder], MakeRouter]] = {
    "recv_attn_output": _traced_recv,
    "send_ffn_output": _traced_send,
}
