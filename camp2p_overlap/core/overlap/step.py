"""One FFN step: what a call of the wrapped ``_ffn_forward`` does, as one
object whose methods read top to bottom in the order a step runs.

:func:`make_wrappers` builds, when an engine applies, the wrappers the
manifest names, bound to that engine and its runtime (as OpenTelemetry's
instrumentations build ``_traced_execute_factory(tracer)``). Each call of
``_ffn_forward`` is one :class:`FfnStep`, and every step takes one path:

1. the gate: a step of an engine being removed runs the original;
2. the decision (engage or not, the plan and its layout), with the
   runner's side streams; a reloaded target module is wrapped again first;
3. the choice: the static setting (capture, adaptive off, parity/reorder),
   or adaptive engage's path for the step's bucket (a serial one runs the
   original, timed one step in ``serial_time_every``);
4. the engaged step: a session, the connector routed to it for the step's
   duration (``routes``), the watchdog, and the join on every exit;
5. the step's time, for adaptive engage.

The only module global a step reads is the active trace recorder (one read
per step, ``core.observe.trace.current_recorder``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from camp2p_overlap.core.keys import COMPUTE_STREAM
from camp2p_overlap.core.log import log_once
from camp2p_overlap.core.observe.trace import TraceOp, TraceRecorder, current_recorder
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.adaptive.engage import AdaptiveEngage, BucketKey, pow2_ceil
from camp2p_overlap.core.overlap.capture_guard import GUARD
from camp2p_overlap.core.overlap.decision import Decision, decide, serial
from camp2p_overlap.core.overlap.graphs import GraphCapture, graph_variants_refusal
from camp2p_overlap.core.overlap.routes import SESSION_ROUTERS, ConnectorRoutes
from camp2p_overlap.core.overlap.runner_state import NotWeaklyReferenceable, RunnerState
from camp2p_overlap.core.overlap.runtime import OverlapRuntime
from camp2p_overlap.core.overlap.serial_trace import run_traced_serial
from camp2p_overlap.core.overlap.streams import BackendUnavailable
from camp2p_overlap.core.overlap.streams.backend import StreamBackend
from camp2p_overlap.core.overlap.streams.streamset import StreamSet
from camp2p_overlap.core.overlap.watch.watchdog import start_watchdog
from camp2p_overlap.core.patching.installer import MARK, Wrapper

if TYPE_CHECKING:
    from camp2p_overlap.core.patching.lifecycle import PatchEngine

Wrapped = Callable[..., Any]
Args = tuple[Any, ...]
Kwargs = dict[str, Any]

NOT_APPLIED = "the layer is not applied (or is being removed)"
SERIAL_PROBE = "adaptive: serial probe step"
SERIAL_FASTER = "adaptive: serial is faster for this shape"
GRAPH_OFF = "inside graph capture and VLLM_CAMP2P_MULTISTREAM_GRAPH is off"
GRAPH_SERIAL_VARIANT = "inside graph capture: the serial variant (VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive)"
NO_STREAMS_IN_CAPTURE = (
    "graph capture before any eager overlap step on this runner; side streams are created only outside capture"
)


def make_wrappers(engine: PatchEngine, *, runtime: OverlapRuntime) -> dict[str, Any]:
    """What ``engine`` installs, by manifest key: the ``ffn_forward`` and
    ``capture_graphs`` wrappers, and the routers that ``route`` targets
    name (``routes.SESSION_ROUTERS``; nothing of them is installed on a class)."""

    capture = GraphCapture(engine, runtime, bucket_of)

    def capture_graphs(wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> Any:
        return capture(wrapped, instance, args, kwargs)

    def ffn_forward(wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> Any:
        return FfnStep(engine, runtime, wrapped, instance, args, kwargs).run()

    setattr(ffn_forward, MARK, True)
    setattr(capture_graphs, MARK, True)
    wrapper: Wrapper = ffn_forward
    graphs: Wrapper = capture_graphs
    return {"ffn_forward": wrapper, "capture_graphs": graphs, **SESSION_ROUTERS}


def bucket_of(runner: str, layers: int, dp_metadata_list: Any) -> BucketKey:
    """The adaptive bucket of a step of runner ``runner`` (its name) with
    ``layers`` FFN layers: its stage count and its largest stage's tokens
    rounded up to a power of two."""
    tokens = pow2_ceil(camp2p.max_stage_tokens(dp_metadata_list))
    return BucketKey(runner, camp2p.stage_count(dp_metadata_list), layers, tokens)


class FfnStep:
    """One call of the wrapped ``_ffn_forward``, with the engine and runtime
    its wrapper is bound to."""

    __slots__ = ("_capture", "args", "engine", "kwargs", "recorder", "runner", "runtime", "state", "wrapped")

    def __init__(
        self, engine: PatchEngine, runtime: OverlapRuntime, wrapped: Wrapped, runner: Any, args: Args, kwargs: Kwargs
    ) -> None:
        self.engine = engine
        self.runtime = runtime
        self.wrapped = wrapped
        self.runner = runner
        self.args = args
        self.kwargs = kwargs
        self.recorder: TraceRecorder | None = None
        #: The runner's state, once the decision has it.
        self.state: RunnerState | None = None
        self._capture: bool | None = None

    def is_capture(self, backend: StreamBackend | None = None) -> bool:
        """Whether this call runs inside a graph capture, computed once: the
        caller says so, or the current stream of ``backend`` (the step's) is
        capturing. Without a backend (a step that got none), the runner's is
        asked only while the patch layer captures (its wrapped ``_capture_graphs``)."""
        if self._capture is None:
            capture = bool(self.kwargs.get("is_graph_capturing"))
            if not capture:
                if backend is None and GUARD.capturing():
                    state = self.runtime.runners.of(self.runner)
                    backend = state.streamset.backend if state is not None and state.streamset else None
                capture = backend is not None and backend.is_capturing()
            self._capture = capture
        return self._capture

    def count_serial(self, reason: str) -> None:
        """A step on the original path, or a capture of the serial variant."""
        if self.is_capture():
            self.runtime.counters.graph_capture("serial")
        else:
            self.runtime.counters.serial(reason)

    # -- 1. the gate ---------------------------------------------------------
    def run(self) -> Any:
        self.recorder = current_recorder()
        gate = self.engine.gate
        if not gate.enter():
            self.count_serial(NOT_APPLIED)
            return self.run_original()
        try:
            decision, streamset = self.decision_and_streams()
            if streamset is None:  # decide() gives a reason whenever it gives no streams
                self.count_serial(decision.reason)
                log_once(logging.INFO, "gate", "camp2p-overlap: running the serial FFN path: %s", decision.reason)
                return self.run_original()
            # 3.: capture follows the static setting (a graph replays what it
            # captured), and so do parity/reorder steps and adaptive engage off.
            if not self.engine.config.adaptive or decision.mode != "overlap" or self.is_capture(streamset.backend):
                return self.run_engaged(decision, streamset)
            return self.run_adaptive(decision, streamset)
        finally:
            gate.exit()

    # -- 2. the decision -----------------------------------------------------
    def decision_and_streams(self) -> tuple[Decision, StreamSet | None]:
        """The decision and, when it engages, the runner's stream set."""
        engine, runtime = self.engine, self.runtime
        blocked = self.blocking_reason()
        if blocked is not None:
            return serial(blocked), None
        try:
            state = self.state = runtime.runners.get(self.runner)
            decision = decide(engine, self.runner, self.kwargs, state)
        except NotWeaklyReferenceable as exc:
            return serial(str(exc)), None
        except Exception as exc:  # noqa: BLE001 - planning must never break the original call
            return serial(f"could not plan the step ({type(exc).__name__}: {exc})"), None
        if not decision.engages:
            return decision, None
        capturing = bool(self.kwargs.get("is_graph_capturing"))
        refused = self.capture_refusal(decision) if capturing else None
        if refused is not None:
            return serial(refused), None
        try:
            streamset = runtime.runners.streams(self.runner, decision.backend)  # type: ignore[arg-type]
        except BackendUnavailable as exc:
            return serial(str(exc)), None
        if streamset is None:
            return serial(NO_STREAMS_IN_CAPTURE), None
        if not capturing and self.is_capture(streamset.backend):
            refused = self.capture_refusal(decision)
            if refused is not None:
                return serial(refused), None
        return decision, streamset

    def capture_refusal(self, decision: Decision) -> str | None:
        """Why a capture of this step records upstream's serial graph, or None."""
        cfg = self.engine.config
        if not cfg.graph_overlap:
            return GRAPH_OFF
        refused = graph_variants_refusal(self.engine, decision.backend)
        if refused is not None:
            return refused  # upstream's graph only
        if cfg.graph == "adaptive" and (self.state is None or self.state.variant_capture is None):
            return GRAPH_SERIAL_VARIANT  # upstream's own graph: the serial variant
        return None

    def blocking_reason(self) -> str | None:
        """Why no step may engage now, whatever the call: the patch layer is
        switched off, the call is re-entrant inside an active step, or a
        target is not ready (after the refresh that wraps a reloaded target
        module again)."""
        engine = self.engine
        if not engine.config.enabled:
            return "switched off"
        if self.runtime.local.session is not None:
            return "re-entrant FFN forward inside an active step"
        if engine.unready is None:  # the one read of the lifecycle a ready step makes
            return None
        unready = engine.refresh_and_report_unready()
        return None if unready is None else f"not every target of the stack is patched ({unready})"

    # -- 3. the choice -------------------------------------------------------
    def run_adaptive(self, decision: Decision, streamset: StreamSet) -> Any:
        """An engageable eager step: the bucket's path (overlap, or the
        original as decided or as a probe), timed without blocking the host."""
        plan, backend, state = decision.plan, streamset.backend, self.state
        assert plan is not None and state is not None
        key = bucket_of(state.name, len(plan.layers), self.kwargs.get("dp_metadata_list"))
        state.timings.read_ready()
        path, probe, timed = self.adaptive().choose(key)
        if path != "overlap":
            self.runtime.counters.serial(SERIAL_PROBE if probe else SERIAL_FASTER)
            if not timed:
                return self.run_original()
            return state.timings.timed(key, "serial", backend, self.run_original)
        return state.timings.timed(key, path, backend, lambda: self.run_engaged(decision, streamset))

    def adaptive(self) -> AdaptiveEngage:
        """The runtime's adaptive engage, with the engine's re-probe interval."""
        adaptive = self.runtime.adaptive
        every = self.engine.config.reprobe_every
        if adaptive.settings.reprobe_every != every:
            adaptive.settings = replace(adaptive.settings, reprobe_every=every)
        return adaptive

    # -- 4. the engaged step -------------------------------------------------
    def run_engaged(self, decision: Decision, streamset: StreamSet) -> Any:
        """The step under a session, counted under its rollout mode once the
        connector is routed to it."""
        runtime, recorder = self.runtime, self.recorder
        step_id = recorder.next_step() if recorder is not None else 0
        capturing = self.is_capture(streamset.backend)
        seconds = self.engine.config.watchdog_s
        with streamset.lock:
            connector = self.runner.connector
            session = runtime.session_class(
                connector=connector,
                plan=decision.plan,  # type: ignore[arg-type]
                streamset=streamset,
                layout=decision.layout,
                recorder=recorder,
                step_id=step_id,
                context_of=camp2p.context_of,
            )
            routes = ConnectorRoutes(connector)
            targets = self.engine.installer.routes()
            refused = routes.install([(spec.attribute, SESSION_ROUTERS[spec.router](session)) for _, spec in targets])  # type: ignore[index]
            if refused is not None:  # another thread's step routed it since the decision, say
                session.close(raising=True)  # nothing was issued: closing only releases it
                self.count_serial(refused)
                log_once(logging.INFO, "gate", "camp2p-overlap: running the serial FFN path: %s", refused)
                return self.run_original()
            if capturing:  # a capture, not a step: counted as the variant it captures
                runtime.counters.graph_capture("overlap")
                mark = self.state.variant_capture if self.state is not None else None
                if mark is not None:  # the patch layer's variant of a decode graph is being captured
                    mark.engaged, mark.layers = True, len(decision.plan.layers)  # type: ignore[union-attr]
            else:
                runtime.counters.engaged(decision.mode)
            # No watchdog inside a capture: its timer thread would query events
            # while the capture runs (global capture mode forbids it), and a
            # captured step only records work, it cannot stall.
            watchdog = None if capturing or not seconds else start_watchdog(seconds, session.snapshot, step_id)
            t0 = time.perf_counter_ns()
            local = runtime.local
            local.session = session
            try:
                try:
                    result = self.wrapped(*self.args, **self.kwargs)
                except BaseException:
                    local.session = None
                    session.close(raising=True)
                    raise
                local.session = None
                session.close()
                return result
            finally:
                routes.remove()  # on every exit path: nothing of ours stays on the instance
                local.session = None
                if watchdog is not None:
                    watchdog.cancel()
                if recorder is not None:
                    recorder.add(TraceOp("step", None, None, COMPUTE_STREAM, t0, time.perf_counter_ns(), step_id))

    # -- the original (traced while a recorder is active) -----------------------
    def run_original(self) -> Any:
        recorder = self.recorder
        if recorder is None:
            return self.wrapped(*self.args, **self.kwargs)
        return run_traced_serial(recorder, self.engine, self.runner, lambda: self.wrapped(*self.args, **self.kwargs))
