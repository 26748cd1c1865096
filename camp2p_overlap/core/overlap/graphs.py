"""Decode graphs with both variants (``VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive``).

Upstream's ``_capture_graphs`` captures one graph per key and stores it in
``runner._acl_graphs[key]["graph"]``; ``execute_model`` replays it for every
later step of that key. Under ``adaptive`` the wrapped ``_capture_graphs``
lets upstream capture its own graph (the layer takes the serial path
inside it, so it is exactly upstream's graph), then captures the layer's
variant of the same step (the overlap, or the rollout mode's: parity,
reorder, one direction only) in the runner's graph pool, and puts a
:class:`VariantGraph` in the entry. Its ``replay()`` runs the variant the
key's adaptive bucket chose (learning, hysteresis, re-probes, back-off, as
eager steps), timed with pooled events on the compute stream read at a
later replay with ``query()``, never a synchronize.

Both variants keep CAMP2P's per-group op order (docs/design.md, "Decode
graphs"), so the attention side cannot tell which one replays.
``unpatch()`` puts upstream's graph objects back (identity) and releases
the layer's; a failed second capture leaves the key with upstream's graph.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from camp2p_overlap.core.log import log_once, logger
from camp2p_overlap.core.overlap.adaptive import AdaptiveEngage, BucketKey
from camp2p_overlap.core.overlap.decision import decide
from camp2p_overlap.core.overlap.streams.base import StreamBackend
from camp2p_overlap.core.overlap.watchdog import stop_watchdogs

#: The two variants, by what ``stats()`` calls them.
SERIAL, OVERLAP = "serial", "overlap"


@dataclass
class CapturedKey:
    """One key's two graphs, where they live, and what their replays did."""

    key_text: str
    entry: dict[str, Any]
    upstream: Any
    ours: Any
    bucket: BucketKey
    backend: StreamBackend
    #: Whether replays choose by timing (else the layer's variant always).
    adaptive: bool
    #: Device memory the second capture took (bytes; None: not known).
    extra_bytes: int | None = None
    replays: dict[str, int] = field(default_factory=lambda: {SERIAL: 0, OVERLAP: 0})


class VariantGraph:
    """What ``_acl_graphs[key]["graph"]`` holds while the layer is applied:
    ``replay()`` replays the variant chosen for the key."""

    def __init__(self, captured: CapturedKey, choose: Callable[[CapturedKey], tuple[str, bool]], done: Any) -> None:
        self.captured = captured
        self._choose = choose
        self._done = done

    def replay(self) -> None:
        c = self.captured
        variant, _probe = self._choose(c)
        graph = c.ours if variant == OVERLAP else c.upstream
        token = c.backend.timing_start() if c.adaptive else None
        graph.replay()
        if token is not None:
            c.backend.timing_stop(token)
        self._done(c, variant, token)

    # What else upstream or vLLM may ask of the graph object: upstream's.
    def __getattr__(self, name: str) -> Any:
        return getattr(self.captured.upstream, name)

    def __repr__(self) -> str:
        return f"VariantGraph({self.captured.key_text}, replays {self.captured.replays})"


class GraphVariants:
    """Every key captured with both variants, per runner (weakly held)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: id(runner) -> (weak ref to the runner, its captured keys by key text).
        self._runners: dict[int, tuple[weakref.ref[Any], dict[str, CapturedKey]]] = {}
        #: Second captures that failed (the key kept upstream's graph), by reason.
        self.failures: dict[str, int] = {}

    def add(self, runner: Any, captured: CapturedKey) -> None:
        with self._lock:
            ref_map = self._runners.get(id(runner))
            if ref_map is None or ref_map[0]() is not runner:
                ref_map = self._runners[id(runner)] = (weakref.ref(runner), {})
            ref_map[1][captured.key_text] = captured

    def failed(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] = self.failures.get(reason, 0) + 1

    def keys(self) -> list[CapturedKey]:
        with self._lock:
            return [c for ref, keys in self._runners.values() if ref() is not None for c in keys.values()]

    def restore_all(self) -> int:
        """Put upstream's graph object back in every entry still holding
        ours (identity), release ours; returns how many were restored."""
        with self._lock:
            runners, self._runners = self._runners, {}
        restored = 0
        for ref, keys in runners.values():
            if ref() is None:
                continue
            for c in keys.values():
                if isinstance(c.entry.get("graph"), VariantGraph) and c.entry["graph"].captured is c:
                    c.entry["graph"] = c.upstream
                    restored += 1
                reset = getattr(c.ours, "reset", None)
                if callable(reset):
                    try:
                        reset()
                    except Exception as exc:  # noqa: BLE001 - releasing must not fail unpatch
                        logger.warning("camp2p-overlap: releasing a captured graph failed: %r", exc)
                c.ours = None
        return restored

    def snapshot(self, adaptive: AdaptiveEngage) -> list[dict[str, Any]]:
        """The ``stats()["graphs"]`` entries: one per captured key."""
        buckets = {tuple(b["key"].values()): b for b in adaptive.snapshot()}
        out = []
        for c in self.keys():
            b = buckets.get(tuple(c.bucket), {})
            decision = b.get("decision") if c.adaptive else OVERLAP
            out.append(
                {
                    "key": c.key_text,
                    "variants": [SERIAL, OVERLAP],
                    "decision": decision or "learning",
                    "replays": dict(c.replays),
                    "serial_median_ms": b.get("serial_median_ms"),
                    "overlap_median_ms": b.get("overlap_median_ms"),
                    "samples": {SERIAL: b.get("serial_samples", 0), OVERLAP: b.get("overlap_samples", 0)},
                    "extra_bytes": c.extra_bytes,
                }
            )
        return out


def capture_second_variant(
    runner: Any,
    device_module: Any,
    kwargs: dict[str, Any],
    forward: Callable[[], Any],
    engaged: Callable[[], bool],
) -> tuple[Any, int | None] | str:
    """Capture the layer's variant of the step ``kwargs`` describes into a
    new graph of ``device_module`` in the runner's pool, on the current
    stream (upstream's capture stream). Returns ``(graph, extra bytes)``, or
    why there is none (a capture error, or the step did not engage)."""
    mem = getattr(device_module, "mem_get_info", None)
    graph = device_module.NPUGraph() if hasattr(device_module, "NPUGraph") else device_module.CUDAGraph()
    try:
        free_before = int(mem()[0]) if mem is not None else None
        t0 = time.perf_counter()
        pool, stream = getattr(runner, "graph_pool", None), device_module.current_stream()
        with device_module.graph(graph, pool=pool, stream=stream):
            forward()
        seconds = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - the key keeps upstream's graph
        return f"{type(exc).__name__}: {exc}"
    if not engaged():
        return "the step did not engage inside the capture (it took the serial path)"
    extra = None
    if free_before is not None:
        try:
            extra = max(0, free_before - int(mem()[0]))  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - a figure, not a failure
            extra = None
    log_once(
        logging.INFO,
        "graph-second-capture",
        "camp2p-overlap: decode graphs capture both variants (VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive); "
        "the first second capture took %.1f ms",
        seconds * 1e3,
    )
    return graph, extra


class GraphCapture:
    """One call of the wrapped ``_capture_graphs`` under ``GRAPH=adaptive``:
    upstream's capture, then the layer's variant of the same step."""

    def __init__(self, engine: Any, runtime: Any, name_of: Callable[[Any], str], bucket_of: Callable[..., Any]) -> None:
        self.engine = engine
        self.runtime = runtime
        self.name_of = name_of
        self.bucket_of = bucket_of

    def __call__(self, wrapped: Callable[..., Any], runner: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        cfg = self.engine.config
        if cfg.enabled:
            # No watchdog may query events while the capture runs (global
            # capture mode): end those still following earlier steps.
            stop_watchdogs()
        if not (cfg.enabled and cfg.graph_overlap) or not self.engine.gate.enter():
            return wrapped(*args, **kwargs)
        try:
            dp = kwargs.get("dp_metadata_list")
            self.prepare(runner, dp)
            if cfg.graph != "adaptive":
                return wrapped(*args, **kwargs)
            graphs = getattr(runner, "_acl_graphs", None)
            try:
                key = runner._make_graph_key(dp)
                existed = key in graphs  # type: ignore[operator]
            except Exception:  # noqa: BLE001 - upstream's capture decides what it does
                return wrapped(*args, **kwargs)
            result = wrapped(*args, **kwargs)
            if not existed and isinstance(graphs, dict) and isinstance(graphs.get(key), dict):
                try:
                    self.second(runner, key, graphs[key], dp, kwargs)
                except Exception as exc:  # noqa: BLE001 - the server never fails for the second variant
                    self.failed(f"{type(exc).__name__}: {exc}")
            return result
        finally:
            self.engine.gate.exit()

    def prepare(self, runner: Any, dp: Any) -> None:
        """Before the capture begins: the runner's side streams and the
        plan's pooled events, which a capture may not create. Never raises
        (a step that cannot engage inside the capture says why itself)."""
        try:
            decision = decide(self.engine, runner, {"dp_metadata_list": dp, "is_graph_capturing": True})
            if decision.reason is not None or decision.plan is None:
                return
            sset = self.runtime.streamsets.get(runner, decision.backend)
            reserve = getattr(sset.backend, "reserve", None) if sset is not None else None
            if reserve is not None:
                reserve(decision.plan.event_keys())
        except Exception as exc:  # noqa: BLE001 - the capture goes on; its step gives the reason
            log_once(logging.INFO, "graph-prepare", "camp2p-overlap: preparing a decode graph capture: %r", exc)

    def second(self, runner: Any, key: Any, entry: dict[str, Any], dp: Any, kwargs: dict[str, Any]) -> None:
        runtime, cfg = self.runtime, self.engine.config
        sset = runtime.streamsets.peek(runner)
        if sset is None:
            return self.failed("the runner has no side streams yet (no eager step engaged before the capture)")
        mod = getattr(sset.backend, "mod", None)
        if mod is None or not hasattr(mod, "graph"):
            return self.failed(f"the {sset.backend.name} backend has no graph capture")
        state: dict[str, Any] = {"engaged": False, "layers": 0}
        runtime.local.graph_variant = state
        try:
            got = capture_second_variant(
                runner,
                mod,
                kwargs,
                forward=lambda: runner._ffn_forward(
                    dp_metadata_list=dp,
                    aclgraph_runtime_mode=kwargs.get("aclgraph_runtime_mode"),
                    is_graph_capturing=kwargs.get("is_attn_graph_capturing", True),
                    update_connector_state=False,
                ),
                engaged=lambda: bool(state["engaged"]),
            )
        finally:
            runtime.local.graph_variant = None
        if isinstance(got, str):
            return self.failed(got)
        ours, extra = got
        captured = CapturedKey(
            key_text=repr(key),
            entry=entry,
            upstream=entry["graph"],
            ours=ours,
            bucket=self.bucket_of(f"{self.name_of(runner)} graph", int(state["layers"]), dp),
            backend=sset.backend,
            adaptive=bool(cfg.adaptive and cfg.mode == "overlap"),
            extra_bytes=extra,
        )
        entry["graph"] = VariantGraph(captured, self.choose, self.replayed)
        runtime.graphs.add(runner, captured)
        return None

    def failed(self, reason: str) -> None:
        self.runtime.graphs.failed(reason)
        log_once(
            logging.WARNING,
            f"graph-second-capture-failed:{reason}",
            "camp2p-overlap: the second variant of a decode graph was not captured (%s); the key keeps "
            "upstream's graph",
            reason,
        )

    def choose(self, c: CapturedKey) -> tuple[str, bool]:
        if not c.adaptive:
            return OVERLAP, False
        self.runtime.read_ready_step_times()
        return self.runtime.adaptive.choose(c.bucket)

    def replayed(self, c: CapturedKey, variant: str, token: Any) -> None:
        c.replays[variant] += 1
        count = getattr(self.runtime.counters, "graph_replay", None)
        if count is not None:
            count(variant)
        if token is not None:
            self.runtime.record_step_time(c.bucket, variant, c.backend, token)
