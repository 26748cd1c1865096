"""One FFN step: what a call of the wrapped ``_ffn_forward`` does, as one
object whose methods read top to bottom in the order a step runs.

:func:`make_wrappers` builds, when an engine applies, the one wrapper the
manifest names (``ffn_forward``), bound to that engine and its runtime (as
OpenTelemetry's instrumentations build ``_traced_execute_factory(tracer)``).
Each call runs :func:`run_step`, which runs 1. and 2. itself and makes an
:class:`FfnStep` for every step that goes on:

1. the gate: a step of an engine being removed runs the original;
2. the decided-serial fast path: a bucket adaptive engage decided for serial
   runs the original, timed, without being planned;
3. the refresh (a reloaded target module is wrapped again) and the decision
   (engage or not, and the plan), with the runner's side streams;
4. the choice: the static setting (capture, adaptive off, parity/reorder),
   or adaptive engage's path for the step's bucket;
5. the engaged step: a session, the connector routed to it for the step's
   duration (``connector_routes``), the watchdog, and the join on every exit;
6. the step's time, for adaptive engage.

The only module global a step reads is the active trace recorder (one read
per step, ``core.observe.trace.current_recorder``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from camp2p_overlap.core.keys import COMPUTE_STREAM
from camp2p_overlap.core.log import log_once
from camp2p_overlap.core.observe import trace as _trace
from camp2p_overlap.core.observe.trace import TraceOp, TraceRecorder, current_recorder
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.adaptive import AdaptiveEngage, BucketKey, Passed, pow2_ceil
from camp2p_overlap.core.overlap.capture_guard import GUARD
from camp2p_overlap.core.overlap.decision import GRAPH_OFF, GRAPH_SERIAL_VARIANT, Decision, decide, serial, streams_for
from camp2p_overlap.core.overlap.graphs import GraphCapture, graph_variants_refusal
from camp2p_overlap.core.overlap.runner_state import NotWeaklyReferenceable, PlannedShape, RunnerState, SerialPass
from camp2p_overlap.core.overlap.runtime import OverlapRuntime
from camp2p_overlap.core.overlap.serial_trace import run_traced_serial
from camp2p_overlap.core.overlap.session import OverlapSession
from camp2p_overlap.core.overlap.session_routers import ROUTER_MAKERS, ROUTERS, KeptSession
from camp2p_overlap.core.overlap.streams import BackendUnavailable
from camp2p_overlap.core.overlap.streams.base import StreamBackend
from camp2p_overlap.core.overlap.streams.streamset import StreamSet
from camp2p_overlap.core.overlap.watchdog import start_watchdog
from camp2p_overlap.core.patching.installer import MARK, Wrapper

if TYPE_CHECKING:
    from camp2p_overlap.core.patching.lifecycle import PatchEngine

Wrapped = Callable[..., Any]
Args = tuple[Any, ...]
Kwargs = dict[str, Any]

NOT_APPLIED = "the layer is not applied (or is being removed)"
SERIAL_PROBE = "adaptive: serial probe step"
SERIAL_FASTER = "adaptive: serial is faster for this shape"
NO_STREAMS_IN_CAPTURE = (
    "graph capture before any eager overlap step on this runner; side streams are created only outside capture"
)


def make_wrappers(engine: PatchEngine, *, runtime: OverlapRuntime) -> dict[str, Any]:
    """What ``engine`` installs, by manifest key: the ``ffn_forward`` and
    ``capture_graphs`` wrappers, and the router factories that ``route``
    targets name (``session_routers.ROUTERS``; nothing of them is installed
    on a class)."""

    capture = GraphCapture(engine, runtime, bucket_of)

    def capture_graphs(wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> Any:
        return capture(wrapped, instance, args, kwargs)

    # run_step itself, bound to the engine and runtime (a partial: no frame of
    # ours between wrapt's call and the step)
    ffn_forward = partial(run_step, engine, runtime)
    setattr(ffn_forward, MARK, True)
    setattr(capture_graphs, MARK, True)
    wrapper: Wrapper = ffn_forward
    graphs: Wrapper = capture_graphs
    return {"ffn_forward": wrapper, "capture_graphs": graphs, **ROUTERS}


def bucket_of(runner: str, layers: int, dp_metadata_list: Any) -> BucketKey:
    """The adaptive bucket of a step of runner ``runner`` (its name) with
    ``layers`` FFN layers: its stage count and its largest stage's tokens
    rounded up to a power of two."""
    tokens = camp2p.max_stage_tokens(dp_metadata_list)
    tokens = 0 if tokens <= 0 else 1 << (tokens - 1).bit_length()  # pow2_ceil, inline
    stages = len(dp_metadata_list) if dp_metadata_list else 1  # camp2p.stage_count, inline
    return _named_tuple_of(BucketKey, (runner, stages, layers, tokens))


#: ``tuple.__new__(NamedTupleClass, values)``: that named tuple, built without
#: its constructor (a NamedTuple's own ``__new__`` is a Python function).
_named_tuple_of = tuple.__new__


class TimedBucket(NamedTuple):
    """The adaptive bucket a step is counted in, the backend that times it,
    the runner's state (its timings), and whether this step is timed."""

    key: BucketKey
    backend: StreamBackend
    state: RunnerState
    timed: bool = True


#: What :meth:`FfnStep.decided_serial_bucket` gives for a decided-serial
#: step that is not timed (seven in eight: ``AdaptiveSettings.serial_time_every``).
_UNTIMED: TimedBucket = _named_tuple_of(TimedBucket, (None, None, None, False))
#: ``Passed.UNTIMED``, read as a module global (an enum class's attribute
#: costs a lookup through its metaclass on every step).
_PASSED_UNTIMED = Passed.UNTIMED


def run_step(
    engine: PatchEngine, runtime: OverlapRuntime, wrapped: Wrapped, runner: Any, args: Args, kwargs: Kwargs
) -> Any:
    """One call of the wrapped ``_ffn_forward``. 1. and 2. run here: a step
    of a decided-serial bucket (:func:`decided_serial_bucket`) runs the
    original with no :class:`FfnStep` made; every other step is one."""
    if _trace._active is not None:  # a recorder: the step traces its serial path too (current_recorder(), inline)
        return FfnStep(engine, runtime, wrapped, runner, args, kwargs).run()
    gate = engine.gate
    depth = gate.enter()
    if not depth:
        step = FfnStep(engine, runtime, wrapped, runner, args, kwargs)
        step.count_serial(NOT_APPLIED)
        return step.run_original()
    try:
        decided = decided_serial_bucket(engine, runtime, runner, kwargs, depth)
        if decided is None:
            return FfnStep(engine, runtime, wrapped, runner, args, kwargs).run_planned()
        runtime.counters.serial(SERIAL_FASTER)
        if decided is _UNTIMED:
            return wrapped(*args, **kwargs)
        return decided.state.timings.timed(decided.key, "serial", decided.backend, partial(wrapped, *args, **kwargs))
    finally:
        gate.exit()


def decided_serial_bucket(
    engine: PatchEngine, runtime: OverlapRuntime, runner: Any, kwargs: Kwargs, depth: int
) -> TimedBucket | None:
    """The bucket, when this step belongs to one that adaptive engage
    decided runs serially and it is not a probe: the step then runs the
    original without being planned (no refresh, no decision, no stream
    set), as the planned path would have run it; :data:`_UNTIMED` for
    such a step that is not timed (no bucket is made for it). The bucket
    comes from the runner's last planned step (its layer count) and this
    step's stages and tokens; a probe, a capture, a runner not planned yet,
    or a step nested in another on this thread (``depth``, the gate's count
    of the thread's steps, above 1: inside an engaged step's session, say)
    takes the planned path, which refuses a re-entrant one. Never raises:
    None whenever unsure."""
    cfg = engine.config
    if depth != 1 or not (cfg.adaptive and cfg.enabled and cfg.mode == "overlap"):
        return None
    entry = runtime.runners._states.get(id(runner))  # runtime.runners.of(runner), inline
    state = entry[1] if entry is not None and entry[0]() is runner else None
    shape = state.planned if state is not None else None
    if shape is None:
        return None
    try:
        if kwargs.get("is_graph_capturing") or shape.capturing():  # shape.backend.is_capturing(), one frame less
            return None
        dp_metadata_list = kwargs["dp_metadata_list"]
        tokens = camp2p.max_stage_tokens(dp_metadata_list)
        stages = len(dp_metadata_list) if dp_metadata_list else 1  # camp2p.stage_count, inline
    except Exception:  # noqa: BLE001 - the planned path gives the reason
        return None
    adaptive = runtime.adaptive
    kept = state.serial_pass
    if (
        kept is None
        or kept.adaptive is not adaptive
        or kept.shape is not shape
        or kept.stages != stages
        or not kept.above < tokens <= kept.tokens
    ):
        kept = _keep_serial_pass(state, adaptive, shape, stages, tokens)
        if kept is None:
            return None
    # The re-probe interval was synced on the planned step before (the
    # engine's configuration does not change while it is applied).
    passed = adaptive.pass_serial_bucket(kept.bucket)
    if passed is _PASSED_UNTIMED:
        return _UNTIMED
    return _named_tuple_of(TimedBucket, (kept.key, shape.backend, state, True)) if passed else None


def _keep_serial_pass(
    state: RunnerState, adaptive: AdaptiveEngage, shape: PlannedShape, stages: int, tokens: int
) -> SerialPass | None:
    """The runner's bucket for a step of ``stages`` stages and ``tokens``
    tokens (at most, per stage), kept on its state so that the next steps
    of that bucket build no key and look nothing up; None when adaptive
    engage has no such bucket yet (the planned path makes it)."""
    rounded = pow2_ceil(tokens)
    key = BucketKey(shape.runner, stages, shape.layers, rounded)
    bucket = adaptive.bucket(key)
    if bucket is None:
        return None
    # the token counts that round to ``rounded``: (rounded / 2, rounded], or (-1, 0]
    above = rounded >> 1 if rounded > 1 else rounded - 1
    kept = state.serial_pass = SerialPass(adaptive, shape, stages, above, rounded, key, bucket)
    return kept


#: A kept session's keyword: no op log (no watchdog or trace reads it).
_NO_OP_LOG = {"op_log": False}

#: The route targets read last and their (attribute, router maker) pairs
#: (one tuple, replaced whole: steps of other threads and engines read it).
_MAKERS_READ: tuple[Any, tuple[tuple[str, Any], ...]] = ((), ())


def _makers_of(routes: tuple[tuple[Any, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """(attribute, ``session_routers.ROUTER_MAKERS`` entry) of each route
    target, made again only when the installer's routes change."""
    global _MAKERS_READ
    last = _MAKERS_READ
    if last[0] is routes:
        return last[1]
    made = tuple((spec.attribute, ROUTER_MAKERS[spec.router]) for _, spec in routes)
    _MAKERS_READ = (routes, made)
    return made


class FfnStep:
    """One call of the wrapped ``_ffn_forward``, with the engine and runtime
    its wrapper is bound to."""

    __slots__ = ("_capture", "args", "engine", "kwargs", "recorder", "runner", "runtime", "wrapped")

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

    # -- 1. the gate (a step with a trace recorder; run_step runs the others)
    def run(self) -> Any:
        recorder = self.recorder = current_recorder()
        gate = self.engine.gate
        depth = gate.enter()
        if not depth:
            self.count_serial(NOT_APPLIED)
            return self.run_original()
        try:
            if recorder is None:  # 2., here too: a decided-serial step makes nothing more
                decided = decided_serial_bucket(self.engine, self.runtime, self.runner, self.kwargs, depth)
                if decided is not None:
                    if decided is _UNTIMED:
                        self.runtime.counters.serial(SERIAL_FASTER)
                        return self.wrapped(*self.args, **self.kwargs)
                    return self.run_adaptive_serial(decided, probe=False)
            return self.run_planned()
        finally:
            gate.exit()

    def run_planned(self) -> Any:
        """3. to 6.: a step that is not a decided-serial one."""
        decision, streamset = self.decide()
        if streamset is None:  # decide() gives a reason whenever it gives no streams
            self.count_serial(decision.reason)
            log_once(logging.INFO, "gate", "camp2p-overlap: running the serial FFN path: %s", decision.reason)
            if self.recorder is None:  # run_original(), inline for a step without a trace
                return self.wrapped(*self.args, **self.kwargs)
            return self.run_original()
        # 4.: capture follows the static setting (a graph replays what it
        # captured), and so do parity/reorder steps and adaptive engage off.
        if not self.engine.config.adaptive or decision.mode != "overlap" or self.is_capture(streamset.backend):
            return self.run_engaged(decision, streamset)
        return self.run_adaptive(decision, streamset)

    # -- 3. refresh and decision -----------------------------------------------
    def decide(self) -> tuple[Decision, StreamSet | None]:
        """The decision and, when it engages, the runner's stream set."""
        engine, runtime = self.engine, self.runtime
        if engine.unready is not None or not engine.config.enabled or runtime.local.session is not None:
            blocked = self.blocking_reason()  # blocking_reason(), inline for a ready step
            if blocked is not None:
                return serial(blocked), None
        try:
            decision = decide(engine, self.runner, self.kwargs, runtime.decisions)
        except Exception as exc:  # noqa: BLE001 - planning must never break the original call
            return serial(f"could not plan the step ({type(exc).__name__}: {exc})"), None
        if not decision.engages:
            return decision, None
        try:
            streamset = runtime.runners.streams(self.runner, decision.backend)  # type: ignore[arg-type]
        except (BackendUnavailable, NotWeaklyReferenceable) as exc:
            return serial(str(exc)), None
        if streamset is None:
            return serial(NO_STREAMS_IN_CAPTURE), None
        if self.is_capture(streamset.backend):
            if not engine.config.graph_overlap:
                return serial(GRAPH_OFF), None
            refused = graph_variants_refusal(engine, decision.backend)
            if refused is not None:
                return serial(refused), None  # upstream's graph only
            state = runtime.runners.of(self.runner)
            if engine.config.graph == "adaptive" and (state is None or state.variant_capture is None):
                return serial(GRAPH_SERIAL_VARIANT), None  # upstream's own graph: the serial variant
        return decision, streamset

    def blocking_reason(self) -> str | None:
        """Why no step may engage now, whatever the call: the patch layer is
        switched off, the call is re-entrant inside an active step, or a
        target is not ready (after the refresh that wraps a reloaded target
        module again)."""
        if not self.engine.config.enabled:
            return "switched off"
        if self.runtime.local.session is not None:  # runtime.active_session(), inline
            return "re-entrant FFN forward inside an active step"
        engine = self.engine
        if engine.unready is None:  # the one read of the lifecycle a ready step makes
            return None
        unready = engine.refresh_and_report_unready()
        return None if unready is None else f"not every target of the stack is patched ({unready})"

    # -- 4. the choice -------------------------------------------------------
    def run_adaptive(self, decision: Decision, streamset: StreamSet) -> Any:
        """An engageable eager step: the bucket's path (overlap, or the
        original as decided or as a probe), timed without blocking the host."""
        runtime, plan, backend = self.runtime, decision.plan, streamset.backend
        assert plan is not None
        state = runtime.runners.get(self.runner)  # decide() made it, with the streams
        name = state.name
        if state.planned is None or state.planned.layers != len(plan.layers) or state.planned.backend is not backend:
            state.planned = PlannedShape(name, len(plan.layers), backend)
        bucket = TimedBucket(bucket_of(name, len(plan.layers), self.kwargs.get("dp_metadata_list")), backend, state)
        adaptive = self.adaptive()
        state.timings.read_ready()
        path, probe = adaptive.choose(bucket.key)
        if path != "overlap":
            return self.run_adaptive_serial(bucket, probe=probe)
        return state.timings.timed(bucket.key, path, backend, lambda: self.run_engaged(decision, streamset))

    def run_adaptive_serial(self, bucket: TimedBucket, *, probe: bool) -> Any:
        """A step of ``bucket`` that adaptive engage runs on the original
        path (decided, or as a probe), timed for the bucket."""
        runtime = self.runtime
        runtime.counters.serial(SERIAL_PROBE if probe else SERIAL_FASTER)
        return bucket.state.timings.timed(bucket.key, "serial", bucket.backend, self.run_original)

    def adaptive(self) -> AdaptiveEngage:
        """The runtime's adaptive engage, with the engine's re-probe interval."""
        adaptive = self.runtime.adaptive
        every = self.engine.config.reprobe_every
        if adaptive.settings.reprobe_every != every:
            adaptive.settings = replace(adaptive.settings, reprobe_every=every)
        return adaptive

    # -- 5. the engaged step -------------------------------------------------
    def run_engaged(self, decision: Decision, streamset: StreamSet) -> Any:
        """The step under a session, counted under its rollout mode once the
        connector is routed to it."""
        runtime, recorder = self.runtime, self.recorder
        step_id = recorder.next_step() if recorder is not None else 0
        capturing = self._capture  # is_capture(), as decide() computed it
        if capturing is None:
            capturing = self.is_capture(streamset.backend)
        seconds = self.engine.config.watchdog_s
        with streamset.lock:
            connector = self.runner.connector
            kept = self.session_of(decision, streamset, connector, step_id, keep=not (capturing or seconds))
            session = kept.session
            refused = kept.route(connector)
            if refused is not None:  # decide() checked it: only a race with another thread's step lands here
                kept.unroute()  # a router bound before the refusal lets its callee go too
                session.close(raising=True)  # nothing was issued: closing only releases it
                self.count_serial(refused)
                log_once(logging.INFO, "gate", "camp2p-overlap: running the serial FFN path: %s", refused)
                return self.run_original()
            if capturing:  # a capture, not a step: counted as the variant it captures
                runtime.counters.graph_capture("overlap")
                state = runtime.runners.of(self.runner)
                mark = state.variant_capture if state is not None else None
                if mark is not None:  # the patch layer's variant of a decode graph is being captured
                    mark.engaged, mark.layers = True, len(decision.plan.layers)  # type: ignore[union-attr]
            else:
                runtime.counters.engaged(decision.mode)
            # No watchdog inside a capture: its timer thread would query events
            # while the capture runs (global capture mode forbids it), and a
            # captured step only records work, it cannot stall.
            watchdog = None if capturing or not seconds else start_watchdog(seconds, session.snapshot, step_id)
            t0 = time.perf_counter_ns() if recorder is not None else 0
            local = runtime.local  # this thread's session (runtime.set_session, inline)
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
                kept.unroute()  # on every exit path: nothing of ours stays on the instance
                local.session = None
                if watchdog is not None:
                    watchdog.cancel()
                if recorder is not None:
                    recorder.add(TraceOp("step", None, None, COMPUTE_STREAM, t0, time.perf_counter_ns(), step_id))

    def session_of(
        self, decision: Decision, streamset: StreamSet, connector: Any, step_id: int, *, keep: bool
    ) -> KeptSession:
        """The step's session and its routers. The stream set keeps the last
        ones it made (``keep``: not a capture, no watchdog thread reading the
        session, no trace, the overlap mode's own streams, this package's
        session class), and a step of the same decision and route targets
        reopens that session and binds its routers again; any other step
        makes new ones."""
        runtime = self.runtime
        routes = self.engine.installer.routes()
        keep = keep and self.recorder is None and decision.mode == "overlap" and runtime.session_class is OverlapSession
        if keep:
            kept: KeptSession | None = streamset.kept_session
            if kept is not None and kept.decision is decision and kept.routes is routes and kept.session.closed:
                kept.session.reopen(connector)
                return kept
        session = runtime.session_class(
            connector=connector,
            plan=decision.plan,  # type: ignore[arg-type]
            streamset=streamset if decision.mode == "overlap" else streams_for(decision.mode, streamset),
            directions=decision.directions,
            recorder=self.recorder,
            step_id=step_id,
            context_of=camp2p.context_of,
            **_NO_OP_LOG if keep else {},
        )
        kept = KeptSession(decision, routes, _makers_of(routes), session)
        streamset.kept_session = kept if keep else None
        return kept

    # -- the original (traced while a recorder is active) -----------------------
    def run_original(self) -> Any:
        recorder = self.recorder
        if recorder is None:
            return self.wrapped(*self.args, **self.kwargs)
        return run_traced_serial(recorder, self.engine, self.runner, lambda: self.wrapped(*self.args, **self.kwargs))
