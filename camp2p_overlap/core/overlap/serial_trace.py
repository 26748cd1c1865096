"""The serial path, traced: what a step that runs upstream's original does
while a trace recorder is active (the bench and verify tools', never a
worker's by default). It sits in the overlap room, not the observe room: it
reads CAMP2P's call shapes and routes a connector instance, which the
observe room may not import (the rooms contract in ``pyproject.toml``).

While it runs, the connector's ``route`` targets are routed, as an engaged
step's are to its session, to the step's trace (:class:`SerialTrace`): each
A2E and E2A becomes a tracked op of the device registered for the ``cpu``
backend (host-timed where none is), the FFN the span from a receive to its
send; that device's stream log, where it keeps one, is the trace's evidence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from camp2p_overlap.core.keys import A2E, COMPUTE_STREAM, E2A, OpKey
from camp2p_overlap.core.observe.trace import StepTrace, TraceOp, TraceRecorder
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.routes import Installed, install_routes, remove_routes
from camp2p_overlap.core.overlap.streams import registered_capabilities
from camp2p_overlap.core.overlap.streams.backend import run_on_host


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
            remove_routes(*routes)
        if caps.set_log is not None:
            caps.set_log(saved_log)
        state["trace"].emit()
        recorder.add(TraceOp("step", None, None, COMPUTE_STREAM, t0, time.perf_counter_ns(), step_id))
        state["step"], state["trace"] = previous


def traced_routes(recorder: TraceRecorder, engine: Any, runner: Any) -> tuple[Any, Installed] | None:
    """The runner's connector routed to this step's trace: (connector, its routes), None when not a routed class."""
    connector = getattr(runner, "connector", None)
    targets = [spec for owner, spec in engine.installer.routes() if isinstance(connector, owner)]
    if not targets:
        return None
    trace, installed = SerialTrace(recorder), []  # type: ignore[var-annotated]
    routers = [(spec.attribute, partial(partial, camp2p.route, trace, spec.router)) for spec in targets]
    if install_routes(connector, routers, installed) is not None:
        return None
    return connector, installed


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


class SerialTrace:
    """What a traced serial step's routes hand the connector's calls to (as an engaged step's hand them to its
    session): each call runs as the loop made it, as a tracked op of the registered device, traced as the serial
    path's A2E, or as its FFN (since its receive) and E2A."""

    closed = False

    def __init__(self, recorder: TraceRecorder) -> None:
        self.recorder = recorder
        #: Runs a connector call as a tracked op of the registered device, else on the host.
        self.run_op = registered_capabilities("cpu").tracked or run_on_host

    def recv(self, fn: Callable[..., Any], kw: dict[str, Any]) -> Any:
        layer, stage = kw.get("layer_idx"), kw.get("ubatch_idx")
        h = self.run_op(partial(fn, **kw), OpKey(A2E, layer, stage).label())
        state = self.recorder.serial_state()
        _trace_op(self.recorder, state, A2E, layer, stage, h)
        payload = h.result()
        state["ffn_start"][id(camp2p.context_of(payload))] = (layer, stage, time.perf_counter_ns())  # type: ignore[index]
        return payload

    def send(self, call: Callable[[], Any], output: Any, context: Any, stage: int | None) -> Any:
        state = self.recorder.serial_state()
        t0 = time.perf_counter_ns()
        started = state["ffn_start"].pop(id(context), None)  # type: ignore[attr-defined]
        layer = started[0] if started else camp2p.context_layer(context)
        trace = state.get("trace")
        if started and trace is not None:
            trace.ffn(layer, stage, started[2], t0, -1)  # type: ignore[union-attr]
        h = self.run_op(call, OpKey(E2A, layer, stage).label())
        _trace_op(self.recorder, state, E2A, layer, stage, h)
        return h.result()
