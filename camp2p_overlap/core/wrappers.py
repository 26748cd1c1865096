"""The wrappers the patch engine installs (``patches/*.toml`` names them by
key in :data:`WRAPPERS`), and the per-step decision whether to engage."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core import engine as patcher
from camp2p_overlap.core.config import MAX_STAGES
from camp2p_overlap.core.log import log_once, logger
from camp2p_overlap.core.session import (
    Directions,
    OverlapSession,
    StepPlan,
    StreamSet,
    normalize_recv,
    send_parts,
    send_stage,
)
from camp2p_overlap.core.streams import BackendUnavailable, make_backend, resolve_backend_name
from camp2p_overlap.core.trace import TraceOp, TraceRecorder, current_recorder

Wrapped = Callable[..., Any]

_tls = threading.local()


def active_session() -> OverlapSession | None:
    return getattr(_tls, "session", None)


# ---------------------------------------------------------------------------
# Stream sets: created once per runner (outside capture) and reused.
_sets_lock = threading.Lock()
_sets: dict[int, tuple[str, StreamSet]] = {}
#: The runner finalizer of each entry of ``_sets``: detached when the set is
#: closed otherwise, so a closed set is not kept alive until its runner dies.
_finalizers: dict[int, weakref.finalize] = {}


def _stream_set_for(runner: Any, backend_name: str) -> StreamSet | None:
    """The runner's stream set, created on first use. Streams are created
    only outside graph capture (Ascend graphs have a small stream budget):
    None when the first engaged step would have to create them inside one."""
    key = id(runner)
    with _sets_lock:
        entry = _sets.get(key)
        if entry is not None and entry[0] == backend_name:
            return entry[1]
        backend = make_backend(backend_name, getattr(runner, "device", None))
        if backend.is_capturing():
            return None
        if entry is not None:
            entry[1].close()
            old = _finalizers.pop(key, None)
            if old is not None:
                old.detach()
        sset = StreamSet(backend, range(MAX_STAGES))
        _sets[key] = (backend_name, sset)
        _finalizers[key] = weakref.finalize(runner, _drop_stream_set, key, sset)
    return sset


def _forget_stream_sets_in_child() -> None:
    """After fork: the parent's CPU stream threads do not exist in the child;
    forget the sets (without joining threads that are not there)."""
    global _sets_lock
    _sets_lock = threading.Lock()
    _sets.clear()
    for f in _finalizers.values():
        f.detach()
    _finalizers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_stream_sets_in_child)


def _drop_stream_set(key: int, sset: StreamSet) -> None:
    with _sets_lock:
        entry = _sets.get(key)
        if entry is not None and entry[1] is sset:
            del _sets[key]
            _finalizers.pop(key, None)
    sset.close()


def close_stream_sets() -> None:
    """Release every stream set (CPU worker threads) - on unpatch."""
    with _sets_lock:
        sets = [s for _, s in _sets.values()]
        _sets.clear()
        finalizers = list(_finalizers.values())
        _finalizers.clear()
    for f in finalizers:
        f.detach()
    for s in sets:
        s.close()


def stream_set_count() -> int:
    with _sets_lock:
        return len(_sets)


# ---------------------------------------------------------------------------
# The decision
@dataclass(frozen=True)
class Decision:
    reason: str | None  # None: engage
    plan: StepPlan | None = None
    backend: str | None = None
    directions: Directions = Directions()


def _stage_ids(dp_metadata_list: Any) -> tuple[list[int], int]:
    if not dp_metadata_list:
        return [0], 1
    return sorted(int(k) for k in dp_metadata_list), max(len(dp_metadata_list), 1)


def decide(engine: patcher.PatchEngine, runner: Any, kwargs: Mapping[str, Any]) -> Decision:
    """Whether this call of ``_ffn_forward`` engages the overlap, and with what plan."""
    cfg = engine.config
    if not cfg.enabled:
        return Decision("switched off")
    if active_session() is not None:
        return Decision("re-entrant FFN forward inside an active step")
    incomplete = engine.stack_complete()
    if incomplete:
        return Decision(f"not every target of the stack is patched ({incomplete})")
    connector = getattr(runner, "connector", None)
    camp2p = engine.owner_of("CAMP2pAFDConnector.recv_attn_output")
    if camp2p is None or not isinstance(connector, camp2p):
        return Decision(f"connector is {type(connector).__name__}, not CAMP2pAFDConnector")
    role = getattr(getattr(runner, "afd_config", None), "role", None)
    if role != "ffn":
        return Decision(f"AFD role is {role!r}, not 'ffn'")
    if "dp_metadata_list" not in kwargs:
        return Decision("_ffn_forward called without dp_metadata_list")
    try:
        stages, num_stages = _stage_ids(kwargs["dp_metadata_list"])
    except (TypeError, ValueError) as exc:
        return Decision(f"stage ids of dp_metadata_list are not integers ({exc})")
    if num_stages < cfg.min_stages:
        return Decision(f"{num_stages} stage(s), fewer than the minimum {cfg.min_stages}")
    if num_stages > MAX_STAGES or any(not 0 <= s < MAX_STAGES for s in stages):
        return Decision(f"stage ids {stages} do not fit CAMP2P's {MAX_STAGES} stage groups (afd, afd1, afd2)")
    if not (cfg.a2e_on_side_stream or cfg.e2a_on_side_stream):
        return Decision("both directions are switched off (A2E=0 and E2A=0)")
    try:
        backend = resolve_backend_name(cfg.backend, getattr(runner, "device", None))
    except BackendUnavailable as exc:
        return Decision(str(exc))
    layer_fn = engine.read_target("_ffn_layer_indices")
    if layer_fn is None:
        return Decision("_ffn_layer_indices is not available")
    layers = tuple(int(L) for L in layer_fn(runner))
    if not layers:
        return Decision("the step has no FFN layers")
    if len(set(layers)) != len(layers):
        return Decision(f"layer list repeats a layer: {list(layers)}")
    plan = StepPlan(layers, tuple(stages), {"max_num_tokens": getattr(runner, "max_num_tokens", None)})
    return Decision(None, plan, backend, Directions(cfg.a2e_on_side_stream, cfg.e2a_on_side_stream))


# ---------------------------------------------------------------------------
# Wrappers (wrapt signature: wrapped, instance, args, kwargs)
def ffn_forward(wrapped: Wrapped, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    engine = patcher.ENGINE
    recorder = current_recorder()
    if not engine.step_enter():
        return _serial_step(wrapped, args, kwargs, recorder)
    try:
        try:
            decision = decide(engine, instance, kwargs)
        except Exception as exc:  # noqa: BLE001 - planning must never break the original call
            decision = Decision(f"could not plan the step ({type(exc).__name__}: {exc})")
        streamset = None
        graph_off = "inside graph capture and VLLM_CAMP2P_MULTISTREAM_GRAPH is off"
        if decision.reason is None and kwargs.get("is_graph_capturing") and not engine.config.graph:
            decision = Decision(graph_off)
        if decision.reason is None:
            try:
                streamset = _stream_set_for(instance, decision.backend)  # type: ignore[arg-type]
            except BackendUnavailable as exc:
                decision = Decision(str(exc))
            else:
                if streamset is None:
                    decision = Decision(
                        "graph capture before any eager overlap step on this runner; side streams "
                        "are created only outside capture"
                    )
        if decision.reason is None and streamset is not None:
            if streamset.backend.is_capturing() and not engine.config.graph:
                decision = Decision(graph_off)
        if decision.reason is not None or streamset is None:
            log_once(
                logging.INFO,
                "gate",
                "camp2p-overlap: running the serial FFN path: %s",
                decision.reason,
            )
            return _serial_step(wrapped, args, kwargs, recorder)
        assert decision.plan is not None
        return _overlap_step(wrapped, instance, args, kwargs, decision, streamset, recorder)
    finally:
        engine.step_exit()


def _overlap_step(
    wrapped: Wrapped,
    instance: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    decision: Decision,
    streamset: StreamSet,
    recorder: TraceRecorder | None,
) -> Any:
    step_id = recorder.next_step() if recorder is not None else 0
    with streamset.lock:
        session = OverlapSession(
            connector=instance.connector,
            plan=decision.plan,  # type: ignore[arg-type]
            streamset=streamset,
            directions=decision.directions,
            recorder=recorder,
            step_id=step_id,
        )
        watchdog = _start_watchdog(session)
        t0 = time.perf_counter_ns()
        try:
            _tls.session = session
            try:
                result = wrapped(*args, **kwargs)
            except BaseException:
                _tls.session = None
                session.close(raising=True)
                raise
            _tls.session = None
            session.close()
            return result
        finally:
            _tls.session = None
            if watchdog is not None:
                watchdog.cancel()
            if recorder is not None:
                recorder.add(TraceOp("step", None, None, "C", t0, time.perf_counter_ns(), step_id))


def _start_watchdog(session: OverlapSession) -> threading.Timer | None:
    seconds = patcher.ENGINE.config.watchdog_s
    if not seconds:
        return None

    def report() -> None:
        try:
            text = session.stall_report()
        except Exception as exc:  # noqa: BLE001 - diagnostics must not raise
            text = f"stall report failed: {exc!r}"
        logger.warning(
            "camp2p-overlap: FFN step %d has not finished after %.1f s; a peer op may be missing.\n%s",
            session.step_id,
            seconds,
            text,
        )

    timer = threading.Timer(seconds, report)
    timer.daemon = True
    timer.name = "camp2p-overlap-watchdog"
    timer.start()
    return timer


def _serial_step(
    wrapped: Wrapped, args: tuple[Any, ...], kwargs: dict[str, Any], recorder: TraceRecorder | None
) -> Any:
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


def recv_attn_output(wrapped: Wrapped, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    session = active_session()
    if session is not None and session.connector is instance:
        return session.recv(wrapped, args, kwargs)
    recorder = current_recorder()
    if recorder is None:
        return wrapped(*args, **kwargs)
    kw = normalize_recv(args, kwargs)
    t0 = time.perf_counter_ns()
    payload = wrapped(*args, **kwargs)
    t1 = time.perf_counter_ns()
    state = recorder.serial_state()
    layer, stage = kw.get("layer_idx"), kw.get("ubatch_idx")
    recorder.add(TraceOp("a2e", layer, stage, "C", t0, t1, state["step"]))  # type: ignore[arg-type]
    state["ffn_start"][id(getattr(payload, "context", payload))] = (layer, stage, t1)  # type: ignore[index]
    return payload


def send_ffn_output(wrapped: Wrapped, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    session = active_session()
    if session is not None and session.connector is instance:
        return session.send(wrapped, args, kwargs)
    recorder = current_recorder()
    if recorder is None:
        return wrapped(*args, **kwargs)
    _, ctx = send_parts(args, kwargs)
    state = recorder.serial_state()
    t0 = time.perf_counter_ns()
    started = state["ffn_start"].pop(id(ctx), None)  # type: ignore[attr-defined]
    stage = send_stage(ctx, kwargs)
    layer = started[0] if started else getattr(getattr(ctx, "metadata", None), "layer_idx", None)
    if started:
        recorder.add(TraceOp("ffn", layer, stage, "C", started[2], t0, state["step"]))  # type: ignore[arg-type]
    try:
        return wrapped(*args, **kwargs)
    finally:
        recorder.add(TraceOp("e2a", layer, stage, "C", t0, time.perf_counter_ns(), state["step"]))  # type: ignore[arg-type]


#: Wrapper keys used by the manifests.
WRAPPERS: dict[str, Wrapped] = {
    "ffn_forward": ffn_forward,
    "recv_attn_output": recv_attn_output,
    "send_ffn_output": send_ffn_output,
}
