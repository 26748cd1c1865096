"""Decode graphs with both variants (``VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive``; docs/design.md, "Decode graphs").

Upstream's ``_capture_graphs`` captures one graph per key into ``runner._acl_graphs[key]["graph"]``, which
``execute_model`` replays. The wrapped ``_capture_graphs`` (:class:`GraphCapture`) runs every capture inside the
capture guard (``streams.backend.GUARD``), makes the side streams, capture stream and pooled events first (a capture
creates none), lets upstream capture its serial graph (measuring its memory and time) and, under ``adaptive`` and
above the free-memory margin, captures the patch layer's variant on its own capture stream into a
:class:`VariantGraph`. Where the stack cannot replay the variants it captures upstream's graph only (logged once).

A :class:`VariantGraph` replays the variant the key's adaptive state chose, timed with pooled events read at a later
replay. A replay is a step of the gate: ``unpatch()`` waits for those in flight, then puts upstream's graph objects
back; a ``VariantGraph`` held afterwards replays upstream's graph. Both variants keep CAMP2P's per-group op order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from camp2p_overlap.core.log import log_once, logger
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.adaptive import AdaptiveEngage, BucketKey, StepTimings
from camp2p_overlap.core.overlap.plan import graph_needs_opt_in
from camp2p_overlap.core.overlap.runner_state import RunnerState, VariantCapture
from camp2p_overlap.core.overlap.streams.backend import GUARD, StreamBackend
from camp2p_overlap.core.overlap.watch.watchdog import REPLAY_WATCH, stop_watchdogs
from camp2p_overlap.core.patching import torch_npu_capture
from camp2p_overlap.core.patching.features import GRAPH_VARIANTS

if TYPE_CHECKING:
    from camp2p_overlap.core.observe.counters import StepCounters
    from camp2p_overlap.core.overlap.runner_state import RunnerStates
    from camp2p_overlap.core.patching.gate import StepGate
    from camp2p_overlap.core.patching.lifecycle import PatchEngine

#: The two variants, by what ``stats()`` calls them.
SERIAL, OVERLAP = "serial", "overlap"
#: Below ``graph_size +`` this much free device memory, a key keeps upstream's graph only.
SECOND_CAPTURE_HEADROOM_BYTES = 256 << 20
#: Why a capture records upstream's serial graph (GRAPH=1), or the patch layer's variant is not captured
#: (adaptive), where the first listed layout puts A2E/E2A on side streams and
#: VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE is off.
GRAPH_COMM_SIDE_OPT_IN = (
    "inside graph capture: the first listed layout puts A2E/E2A on side streams, which a decode graph captures"
    " only with VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1 (upstream's NPU graph code keeps HCCL on the capture's"
    " stream)"
)


def graph_variants_refusal(engine: PatchEngine, backend_name: str | None) -> str | None:
    """Why decode graphs of ``backend_name`` capture upstream's serial graph only (a patch target of graph variants
    refused, or a torch_npu without the multi-stream capture fix), or None."""
    reason = engine.feature_refusal(GRAPH_VARIANTS)
    return reason if reason is not None else torch_npu_capture.capture_fix_refusal(backend_name or "")


@dataclass(eq=False)
class CapturedKey:
    """One key's two graphs, how they were captured, and its own choice between them."""

    key_text: str
    entry: dict[str, Any]
    upstream: Any
    ours: Any
    #: Names the key in the choice's log lines.
    bucket: BucketKey
    backend: StreamBackend
    #: The engine's step gate: a replay is counted in it (unpatch waits).
    gate: StepGate
    #: The runner's timings (read at its next step or replay).
    timings: StepTimings
    #: Whether replays choose by timing (else the patch layer's variant always).
    adaptive: bool
    #: The key's own adaptive state (one bucket: this key's).
    choice: AdaptiveEngage
    #: The layout the patch layer's variant captured.
    layout: str = ""
    #: Device memory and host time of upstream's capture and of the patch layer's.
    upstream_bytes: int | None = None
    upstream_ms: float | None = None
    extra_bytes: int | None = None
    capture_ms: float | None = None
    replays: dict[str, int] = field(default_factory=lambda: {SERIAL: 0, OVERLAP: 0})
    #: Set on unpatch (or a reset): every later replay is upstream's.
    released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class VariantGraph:
    """``_acl_graphs[key]["graph"]`` while the patch layer is applied: ``replay()`` replays the chosen variant;
    ``reset()`` and debug calls reach both graphs; anything else is upstream's graph's."""

    def __init__(self, captured: CapturedKey, capture: GraphCapture) -> None:
        self.captured = captured
        self._capture = capture

    def replay(self) -> None:
        c = self.captured
        if c.released or not c.gate.enter():  # unpatched, or being removed: upstream's graph
            c.upstream.replay()
            return
        try:
            self._capture.replay(c)
        finally:
            c.gate.exit()

    def reset(self) -> None:
        """Both graphs reset; later replays are upstream's."""
        c = self.captured
        c.released = True
        _reset(c.ours)
        c.upstream.reset()

    def enable_debug_mode(self) -> None:
        for g in (self.captured.upstream, self.captured.ours):
            g.enable_debug_mode()

    def pool(self) -> Any:
        return self.captured.upstream.pool()

    def __getattr__(self, name: str) -> Any:
        # Only for what the class does not define, and never while the
        # instance is half-built (copy and pickle look up dunders first).
        if name.startswith("__") or "captured" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.captured.upstream, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> VariantGraph:
        return VariantGraph(self.captured, self._capture)  # a captured graph is a device object: copies share it

    def __repr__(self) -> str:
        return f"VariantGraph({self.captured.key_text}, replays {self.captured.replays})"


def _reset(graph: Any) -> None:
    reset = getattr(graph, "reset", None)
    if callable(reset):
        try:
            reset()
        except Exception as exc:  # noqa: BLE001 - releasing must not fail unpatch
            logger.warning("camp2p-overlap: releasing a captured graph failed: %r", exc)


def restore_all(states: list[RunnerState]) -> None:
    """Upstream's graph object back in every entry still holding ours, ours released; called once no replay is in
    flight (the gate drained)."""
    for state in states:
        keys, state.graphs = state.graphs, {}
        for c in keys.values():
            c.released = True
            graph = c.entry.get("graph")
            if isinstance(graph, VariantGraph) and graph.captured is c:
                c.entry["graph"] = c.upstream
            _reset(c.ours)


def snapshot(states: list[RunnerState]) -> list[dict[str, Any]]:
    """The ``stats()["graphs"]`` entries, one per captured key."""
    out = []
    for state in states:
        for c in list(state.graphs.values()):
            (b,) = c.choice.snapshot() or ({},)
            with c.lock:
                replays = dict(c.replays)
            out.append(
                {
                    "key": c.key_text,
                    "runner": state.name,
                    "variants": [SERIAL, OVERLAP],
                    "decision": (b.get("decision") or "learning") if c.adaptive else OVERLAP,
                    "replays": replays,
                    "serial_median_ms": b.get("serial_median_ms"),
                    "overlap_median_ms": b.get("overlap_median_ms"),
                    "samples": {SERIAL: b.get("serial_samples", 0), OVERLAP: b.get("overlap_samples", 0)},
                    "graph_size_bytes": c.upstream_bytes,
                    "extra_bytes": c.extra_bytes,
                    "upstream_capture_ms": c.upstream_ms,
                    "capture_ms": c.capture_ms,
                }
            )
    return out


def _free_bytes(mod: Any) -> int | None:
    mem = getattr(mod, "mem_get_info", None)
    try:
        return int(mem()[0]) if mem is not None else None
    except Exception:  # noqa: BLE001 - a figure, not a failure
        return None


def _mib(n: int | None) -> str:
    return "? MiB" if n is None else f"{n / (1 << 20):.1f} MiB"


@dataclass
class _Measured:
    """Device memory a capture took (free before minus after) and its time."""

    bytes: int | None
    ms: float


def _measure(mod: Any, fn: Callable[[], Any]) -> tuple[Any, _Measured]:
    before = _free_bytes(mod)
    t0 = time.perf_counter()
    result = fn()
    ms = (time.perf_counter() - t0) * 1e3
    after = _free_bytes(mod) if before is not None else None
    return result, _Measured(None if after is None else max(0, before - after), ms)  # type: ignore[operator]


class GraphRuntime(Protocol):
    """What a capture and its replays use of the runtime (``runtime.py``)."""

    adaptive: AdaptiveEngage
    counters: StepCounters
    runners: RunnerStates

    def graph_capture_failed(self, reason: str) -> None: ...

    def graph_refused(self, reason: str) -> None: ...


class GraphCapture:
    """The wrapped ``_capture_graphs`` of one engine and its runtime."""

    def __init__(
        self,
        engine: PatchEngine,
        runtime: GraphRuntime,
        bucket_of: Callable[..., BucketKey],
        decide: Callable[..., Any],
    ) -> None:
        self.engine = engine
        self.runtime = runtime
        #: The step's bucket and decision (``step.bucket_of``, ``step.decide``).
        self.bucket_of = bucket_of
        self.decide = decide

    def __call__(self, wrapped: Callable[..., Any], runner: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if not self.engine.config.enabled or not self.engine.gate.enter():
            return wrapped(*args, **kwargs)
        try:
            # The watchdogs still following earlier steps end (the capture's synchronize runs those to their end).
            if not stop_watchdogs():
                log_once(
                    logging.WARNING,
                    "graph-watchdogs",
                    "camp2p-overlap: a step watchdog did not end before a decode graph capture; it reads no "
                    "event while the capture runs",
                )
            with GUARD.capture():
                return self.capture(wrapped, runner, args, kwargs)
        finally:
            self.engine.gate.exit()

    def capture(self, wrapped: Callable[..., Any], runner: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        cfg = self.engine.config
        if not cfg.graph_overlap:
            return wrapped(*args, **kwargs)
        dp = kwargs.get("dp_metadata_list")
        prepared = self.prepare(runner, dp)
        if prepared is None:
            return wrapped(*args, **kwargs)
        state, backend = prepared
        graphs = getattr(runner, "_acl_graphs", None)
        if cfg.graph != "adaptive" or not isinstance(graphs, dict):
            return wrapped(*args, **kwargs)
        try:
            key = runner._make_graph_key(dp)
            existed = key in graphs
        except Exception:  # noqa: BLE001 - upstream's capture decides what it does
            return wrapped(*args, **kwargs)
        result, upstream = _measure(backend.mod, lambda: wrapped(*args, **kwargs))  # type: ignore[attr-defined]
        entry = graphs.get(key)
        if not existed and isinstance(entry, dict) and "graph" in entry:
            try:
                self.second(runner, state, key, entry, dp, kwargs, upstream)
            except Exception as exc:  # noqa: BLE001 - the server never fails for the second variant
                self.failed(f"{type(exc).__name__}: {exc}")
        return result

    def prepare(self, runner: Any, dp: Any) -> tuple[RunnerState, StreamBackend] | None:
        """Before the capture: None where graph variants may not be captured (a refusal is logged and counted); else
        the runner's state and backend, with the side streams, the variant's capture stream and the plan's pooled
        events made, which a capture may not create. Never raises."""
        try:
            decision = self.decide(self.engine, runner, {"dp_metadata_list": dp}, self.runtime.runners.get(runner))
            if not decision.engages or decision.plan is None:
                return None
            refused = graph_variants_refusal(self.engine, decision.backend)
            if refused is not None:
                self.runtime.graph_refused(refused)
                log_once(logging.WARNING, f"graph-refused:{refused}", "camp2p-overlap: %s", refused)
                return None
            sset = self.runtime.runners.streams(runner, decision.backend)  # type: ignore[arg-type]
            if sset is None:
                return None
            reserve = getattr(sset.backend, "reserve", None)
            if reserve is not None:
                reserve(decision.plan.event_keys())
            if self.engine.config.graph == "adaptive":
                sset.capture_stream()
            return self.runtime.runners.get(runner), sset.backend
        except Exception as exc:  # noqa: BLE001 - the capture goes on; its step gives the reason
            log_once(logging.INFO, "graph-prepare", "camp2p-overlap: preparing a decode graph capture: %r", exc)
            return None

    def second(
        self,
        runner: Any,
        state: RunnerState,
        key: Any,
        entry: dict[str, Any],
        dp: Any,
        kwargs: dict[str, Any],
        upstream: _Measured,
    ) -> None:
        """The patch layer's variant of the step upstream just captured for ``key``."""
        runtime, cfg = self.runtime, self.engine.config
        if graph_needs_opt_in(cfg):
            return self.failed(GRAPH_COMM_SIDE_OPT_IN)  # its capture would take the serial path: not captured twice
        sset = state.streamset
        if sset is None:
            return self.failed("the runner has no side streams")
        mod = getattr(sset.backend, "mod", None)
        if mod is None or not hasattr(mod, "graph"):
            return self.failed(f"the {sset.backend.name} backend has no graph capture")
        free = _free_bytes(mod)
        need = (upstream.bytes or 0) + SECOND_CAPTURE_HEADROOM_BYTES
        if free is not None and free < need:
            return self.failed(
                f"free device memory {_mib(free)} is below the margin {_mib(need)} (this key's graph size "
                f"{_mib(upstream.bytes)} plus {_mib(SECOND_CAPTURE_HEADROOM_BYTES)})"
            )
        graph = mod.NPUGraph() if hasattr(mod, "NPUGraph") else mod.CUDAGraph()
        mark = state.variant_capture = VariantCapture()

        def capture() -> None:
            with mod.graph(graph, pool=getattr(runner, "graph_pool", None), stream=sset.capture_stream()):
                runner._ffn_forward(
                    dp_metadata_list=dp,
                    aclgraph_runtime_mode=kwargs.get("aclgraph_runtime_mode"),
                    is_graph_capturing=kwargs.get("is_attn_graph_capturing", True),
                    update_connector_state=False,
                )

        try:
            _, ours = _measure(mod, capture)
        except Exception as exc:  # noqa: BLE001 - the key keeps upstream's graph
            return self.failed(f"{type(exc).__name__}: {exc}")
        finally:
            state.variant_capture = None
        if not mark.engaged:
            return self.failed("the step did not engage inside the capture (it took the serial path)")
        captured = CapturedKey(
            key_text=repr(key),
            entry=entry,
            upstream=entry["graph"],
            ours=graph,
            bucket=self.bucket_of(f"{state.name} graph {key!r}", camp2p.stage_count(dp), mark.layers, dp),
            backend=sset.backend,
            gate=self.engine.gate,
            timings=state.timings,
            adaptive=bool(cfg.adaptive and cfg.mode == "overlap" and runtime.adaptive_off is None),
            choice=AdaptiveEngage(runtime.adaptive.settings, group=runtime.group),
            layout=mark.layout,
            upstream_bytes=upstream.bytes,
            upstream_ms=round(upstream.ms, 3),
            extra_bytes=ours.bytes,
            capture_ms=round(ours.ms, 3),
        )
        logger.info(
            "camp2p-overlap: decode graph %s of %s: upstream's capture took %s in %.1f ms, the layer's %s "
            "variant %s in %.1f ms",
            captured.key_text,
            state.name,
            _mib(upstream.bytes),
            upstream.ms,
            cfg.mode,
            _mib(ours.bytes),
            ours.ms,
        )
        entry["graph"] = VariantGraph(captured, self)
        state.graphs[captured.key_text] = captured
        return None

    def failed(self, reason: str) -> None:
        self.runtime.graph_capture_failed(reason)
        log_once(
            logging.WARNING,
            f"graph-second-capture-failed:{reason}",
            "camp2p-overlap: the second variant of a decode graph was not captured (%s); the key keeps "
            "upstream's graph",
            reason,
        )

    # -- a replay (inside the gate) ----------------------------------------
    def replay(self, c: CapturedKey) -> None:
        group = self.runtime.group
        if group is not None and group.broken is not None:  # the FFN rank group broke: upstream's graph on every rank
            variant = SERIAL
            c.upstream.replay()
        elif c.adaptive:
            variant, step = self.choose(c)
            graph = c.ours if variant == OVERLAP else c.upstream
            c.timings.timed(c.bucket, variant, c.backend, graph.replay, into=c.choice, step=step)
        else:
            variant = OVERLAP
            c.ours.replay()
        self.replayed(c, variant)

    def choose(self, c: CapturedKey) -> tuple[str, int]:
        """The variant this replay of ``c`` runs, and its step index (the key's adaptive choice; with a group of
        FFN ranks, the group's)."""
        c.timings.read_ready()
        every = self.engine.config.reprobe_every
        if c.choice.settings.reprobe_every != every:
            c.choice.settings = replace(c.choice.settings, reprobe_every=every)
        chosen = c.choice.choose(c.bucket, settle=c.timings.settle)
        return chosen.path, chosen.step

    def replayed(self, c: CapturedKey, variant: str) -> None:
        with c.lock:
            c.replays[variant] += 1
        self.runtime.counters.graph_replay(variant, c.layout if variant == OVERLAP else "")
        seconds = self.engine.config.watchdog_s
        if seconds and not GUARD.captures:
            REPLAY_WATCH.watch(seconds, c.backend, f"decode graph {c.key_text} ({variant} variant)")
