"""The wrappers the patch engine installs, built by :func:`make_wrappers`
when an engine applies, bound to that engine and its runtime (as
OpenTelemetry's instrumentations build ``_traced_execute_factory(tracer)``).
``patches/*.toml`` names them by key. No module global is read on a call.

* ``ffn_forward`` (the runner's ``_ffn_forward``): counts the step in at
  the engine's gate, decides whether it engages, and brackets an engaged
  step with an overlap session (join on every exit path);
* ``recv_attn_output`` / ``send_ffn_output`` (the CAMP2P connector): hand
  the call to the thread's session when one serves this connector, else
  call the original (traced when a recorder is active).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from camp2p_overlap.core.log import log_once
from camp2p_overlap.core.observe.trace import TraceOp, TraceRecorder, current_recorder
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.adaptive import AdaptiveEngage, BucketKey, pow2_ceil
from camp2p_overlap.core.overlap.decision import GRAPH_OFF, Decision, decide
from camp2p_overlap.core.overlap.rollout import streams_for
from camp2p_overlap.core.overlap.runtime import OverlapRuntime, PlannedShape
from camp2p_overlap.core.overlap.streams import BackendUnavailable
from camp2p_overlap.core.overlap.streams.base import StreamBackend
from camp2p_overlap.core.overlap.streams.streamset import StreamSet
from camp2p_overlap.core.overlap.watchdog import start_watchdog
from camp2p_overlap.core.patching.installer import ENABLED, MARK, Wrapper
from camp2p_overlap.core.patching.intercept_switch import INTERCEPTS

if TYPE_CHECKING:
    from camp2p_overlap.core.patching.lifecycle import PatchEngine

Wrapped = Callable[..., Any]

NOT_APPLIED = "the layer is not applied (or is being removed)"
SERIAL_PROBE = "adaptive: serial probe step"
SERIAL_FASTER = "adaptive: serial is faster for this shape"
Args = tuple[Any, ...]
Kwargs = dict[str, Any]


def make_wrappers(engine: PatchEngine, *, runtime: OverlapRuntime) -> dict[str, Wrapper]:
    """The wrappers of ``engine``, by manifest key."""
    wrappers: dict[str, Wrapper] = {
        "ffn_forward": ffn_forward_factory(engine, runtime),
        "recv_attn_output": recv_attn_output_factory(runtime),
        "send_ffn_output": send_ffn_output_factory(runtime),
    }
    for name, fn in wrappers.items():
        setattr(fn, MARK, True)
        if name != "ffn_forward":
            # while no session or recorder holds it, the original is called at once
            setattr(fn, ENABLED, INTERCEPTS)
    return wrappers


# ---------------------------------------------------------------------------
# _ffn_forward
def ffn_forward_factory(engine: PatchEngine, runtime: OverlapRuntime) -> Wrapper:
    gate = engine.gate

    def ffn_forward(wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> Any:
        recorder = current_recorder()
        if not gate.enter():
            runtime.counters.serial(NOT_APPLIED)
            return _serial_step(wrapped, args, kwargs, recorder)
        try:
            decided = _decided_serial(engine, runtime, instance, kwargs) if recorder is None else None
            if decided is not None:
                return _bucket_serial_step(runtime, decided[0], decided[1], False, wrapped, args, kwargs, None)
            incomplete = engine.refresh()  # a reloaded target module is wrapped again here
            decision, streamset = _engage(engine, runtime, instance, kwargs, incomplete)
            if streamset is None:  # _engage gives a reason whenever it gives no streams
                runtime.counters.serial(str(decision.reason))
                log_once(logging.INFO, "gate", "camp2p-overlap: running the serial FFN path: %s", decision.reason)
                return _serial_step(wrapped, args, kwargs, recorder)
            call = _Call(engine, runtime, wrapped, instance, args, kwargs, recorder)
            capturing = bool(kwargs.get("is_graph_capturing")) or streamset.backend.is_capturing()
            # capture follows the static setting; parity/reorder steps always engage
            if not engine.config.adaptive or capturing or decision.mode != "overlap":
                runtime.counters.engaged(decision.mode)
                return _overlap_step(call, decision, streamset)
            return _adaptive_step(call, decision, streamset)
        finally:
            gate.exit()

    return ffn_forward


@dataclass(frozen=True)
class _Call:
    """One call of the wrapped ``_ffn_forward``, with the engine and runtime
    its wrapper is bound to."""

    engine: PatchEngine
    runtime: OverlapRuntime
    wrapped: Wrapped
    runner: Any
    args: Args
    kwargs: Kwargs
    recorder: TraceRecorder | None


def _adaptive_step(call: _Call, decision: Decision, streamset: StreamSet) -> Any:
    """An engageable eager step: the bucket's path (overlap, or the original
    as decided or as a probe), timed without blocking the host."""
    engine, runtime, runner, kwargs = call.engine, call.runtime, call.runner, call.kwargs
    plan = decision.plan
    assert plan is not None
    backend = streamset.backend
    name = runtime.runner_name(runner)
    runtime.set_planned(runner, PlannedShape(name, len(plan.layers), backend))
    key = bucket_of(name, len(plan.layers), kwargs.get("dp_metadata_list"))
    adaptive = _synced_adaptive(engine, runtime)
    runtime.collect()
    mode, probe = adaptive.choose(key)
    if mode != "overlap":
        return _bucket_serial_step(runtime, key, backend, probe, call.wrapped, call.args, kwargs, call.recorder)
    token = backend.timing_start()
    runtime.counters.overlap()
    result = _overlap_step(call, decision, streamset)
    backend.timing_stop(token)  # a step that raised is not timed
    runtime.timed(key, mode, backend, token)
    return result


def bucket_of(runner: str, layers: int, dp_metadata_list: Any) -> BucketKey:
    """The adaptive bucket of a step of runner ``runner`` (its name) with
    ``layers`` FFN layers: its stage count and its largest stage's tokens
    rounded up to a power of two."""
    stages = camp2p.stage_count(dp_metadata_list)
    return BucketKey(runner, stages, layers, pow2_ceil(camp2p.max_stage_tokens(dp_metadata_list)))


def _synced_adaptive(engine: PatchEngine, runtime: OverlapRuntime) -> AdaptiveEngage:
    """The runtime's adaptive engage, with the engine's re-probe interval."""
    adaptive = runtime.adaptive
    if adaptive.settings.reprobe_every != engine.config.reprobe_every:
        adaptive.settings = replace(adaptive.settings, reprobe_every=engine.config.reprobe_every)
    return adaptive


def _decided_serial(
    engine: PatchEngine, runtime: OverlapRuntime, runner: Any, kwargs: Kwargs
) -> tuple[BucketKey, StreamBackend] | None:
    """(bucket, backend) when this step belongs to a bucket that adaptive
    engage decided runs serially and it is not a probe: the step then runs
    the original without being planned (no refresh, no decision, no stream
    set), as the planned path would have run it. The bucket comes from the
    runner's last planned step (its layer count) and this step's stages and
    tokens; a probe, a capture, a re-entrant call, or a runner not planned
    yet takes the planned path. Never raises: None whenever unsure."""
    cfg = engine.config
    if not (cfg.enabled and cfg.adaptive and cfg.mode == "overlap") or runtime.local.session is not None:
        return None
    shape = runtime.planned(runner)
    if shape is None or kwargs.get("is_graph_capturing"):
        return None
    try:
        if shape.backend.is_capturing():
            return None
        key = bucket_of(shape.runner, shape.layers, kwargs["dp_metadata_list"])
    except Exception:  # noqa: BLE001 - the planned path gives the reason
        return None
    return (key, shape.backend) if _synced_adaptive(engine, runtime).pass_serial(key) else None


def _bucket_serial_step(
    runtime: OverlapRuntime,
    key: BucketKey,
    backend: StreamBackend,
    probe: bool,
    wrapped: Wrapped,
    args: Args,
    kwargs: Kwargs,
    recorder: TraceRecorder | None,
) -> Any:
    """A step of ``key`` that adaptive engage runs on the original path
    (decided, or as a probe), timed for the bucket."""
    runtime.counters.serial(SERIAL_PROBE if probe else SERIAL_FASTER)
    token = backend.timing_start()
    result = _serial_step(wrapped, args, kwargs, recorder)
    backend.timing_stop(token)  # a step that raised is not timed
    runtime.timed(key, "serial", backend, token)
    return result


def _engage(
    engine: PatchEngine, runtime: OverlapRuntime, runner: Any, kwargs: Kwargs, incomplete: str | None
) -> tuple[Decision, StreamSet | None]:
    """The decision and, when it engages, the runner's stream set;
    ``incomplete``: what ``engine.refresh()`` returned for this step."""
    try:
        in_session = runtime.active_session() is not None
        decision = decide(engine, runner, kwargs, in_session=in_session, incomplete=incomplete)
    except Exception as exc:  # noqa: BLE001 - planning must never break the original call
        return Decision(f"could not plan the step ({type(exc).__name__}: {exc})"), None
    if decision.reason is not None:
        return decision, None
    try:
        streamset = runtime.streamsets.get(runner, decision.backend)  # type: ignore[arg-type]
    except BackendUnavailable as exc:
        return Decision(str(exc)), None
    if streamset is None:
        why = (
            "graph capture before any eager overlap step on this runner; side streams are created only outside capture"
        )
        return Decision(why), None
    if streamset.backend.is_capturing() and not engine.config.graph:
        return Decision(GRAPH_OFF), None
    return decision, streamset


def _overlap_step(call: _Call, decision: Decision, streamset: StreamSet) -> Any:
    runtime, recorder = call.runtime, call.recorder
    step_id = recorder.next_step() if recorder is not None else 0
    with streamset.lock:
        session = runtime.session_class(
            connector=call.runner.connector,
            plan=decision.plan,  # type: ignore[arg-type]
            streamset=streams_for(decision.mode, streamset),
            directions=decision.directions,
            recorder=recorder,
            step_id=step_id,
            context_of=camp2p.context_of,
        )
        watchdog = start_watchdog(call.engine.config.watchdog_s, session.snapshot, step_id)
        t0 = time.perf_counter_ns()
        try:
            runtime.set_session(session)
            try:
                result = call.wrapped(*call.args, **call.kwargs)
            except BaseException:
                runtime.set_session(None)
                session.close(raising=True)
                raise
            runtime.set_session(None)
            session.close()
            return result
        finally:
            runtime.set_session(None)
            if watchdog is not None:
                watchdog.cancel()
            if recorder is not None:
                recorder.add(TraceOp("step", None, None, "C", t0, time.perf_counter_ns(), step_id))


def _serial_step(wrapped: Wrapped, args: Args, kwargs: Kwargs, recorder: TraceRecorder | None) -> Any:
    if recorder is None:
        return wrapped(*args, **kwargs)
    state = recorder.serial_state()
    step_id = recorder.next_step()
    previous = state["step"]
    state["step"] = step_id
    t0 = time.perf_counter_ns()
    try:
        return wrapped(*args, **kwargs)
    finally:
        recorder.add(TraceOp("step", None, None, "C", t0, time.perf_counter_ns(), step_id))
        state["step"] = previous


# ---------------------------------------------------------------------------
# the CAMP2P connector
def recv_attn_output_factory(runtime: OverlapRuntime) -> Wrapper:
    local = runtime.local

    def recv_attn_output(wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> Any:
        session = local.session
        if session is not None and session.connector is instance:
            return session.recv(wrapped, camp2p.recv_kwargs(args, kwargs), lambda: wrapped(*args, **kwargs))
        recorder = current_recorder()
        if recorder is None:
            return wrapped(*args, **kwargs)
        return _traced_recv(recorder, wrapped, args, kwargs)

    return recv_attn_output


def send_ffn_output_factory(runtime: OverlapRuntime) -> Wrapper:
    local = runtime.local

    def send_ffn_output(wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> Any:
        session = local.session
        if session is not None and session.connector is instance:
            output, context = camp2p.send_parts(args, kwargs)
            stage = camp2p.send_stage(context, kwargs)
            return session.send(lambda: wrapped(*args, **kwargs), output, context, stage)
        recorder = current_recorder()
        if recorder is None:
            return wrapped(*args, **kwargs)
        return _traced_send(recorder, wrapped, args, kwargs)

    return send_ffn_output


def _traced_recv(recorder: TraceRecorder, wrapped: Wrapped, args: Args, kwargs: Kwargs) -> Any:
    """The original receive, traced as the serial path's A2E."""
    kw = camp2p.recv_kwargs(args, kwargs)
    t0 = time.perf_counter_ns()
    payload = wrapped(*args, **kwargs)
    t1 = time.perf_counter_ns()
    state = recorder.serial_state()
    layer, stage = kw.get("layer_idx"), kw.get("ubatch_idx")
    recorder.add(TraceOp("a2e", layer, stage, "C", t0, t1, state["step"]))  # type: ignore[arg-type]
    state["ffn_start"][id(camp2p.context_of(payload))] = (layer, stage, t1)  # type: ignore[index]
    return payload


def _traced_send(recorder: TraceRecorder, wrapped: Wrapped, args: Args, kwargs: Kwargs) -> Any:
    """The original send, traced as the serial path's FFN (since its
    receive) and E2A."""
    _, ctx = camp2p.send_parts(args, kwargs)
    state = recorder.serial_state()
    t0 = time.perf_counter_ns()
    started = state["ffn_start"].pop(id(ctx), None)  # type: ignore[attr-defined]
    stage = camp2p.send_stage(ctx, kwargs)
    layer = started[0] if started else camp2p.context_layer(ctx)
    if started:
        recorder.add(TraceOp("ffn", layer, stage, "C", started[2], t0, state["step"]))  # type: ignore[arg-type]
    try:
        return wrapped(*args, **kwargs)
    finally:
        recorder.add(TraceOp("e2a", layer, stage, "C", t0, time.perf_counter_ns(), state["step"]))  # type: ignore[arg-type]
