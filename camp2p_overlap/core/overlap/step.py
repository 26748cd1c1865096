"""One FFN step: what a call of the wrapped ``_ffn_forward`` does, as one object (:class:`FfnStep`) whose methods
read in the order a step runs (docs/design.md, "One step, one object"). Every step takes one path: 1. the gate;
2. the decision (:func:`decide`; what a runner's steps share is kept in :class:`RunnerFacts` until the engine's
``generation`` moves or the runner holds another connector) and the runner's side streams; 3. the choice (the static
setting, or adaptive engage's path); 4. the engaged step (a session, the connector routed to it, the watchdog, the
join on every exit), timed for adaptive engage. :func:`make_wrappers` builds the wrappers the manifest names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from camp2p_overlap.core.env_vars import MAX_STAGES
from camp2p_overlap.core.keys import COMPUTE_STREAM
from camp2p_overlap.core.log import log_once
from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.observe.trace import TraceOp, TraceRecorder
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.adaptive import SERIAL, BucketKey
from camp2p_overlap.core.overlap.graphs import GRAPH_COMM_SIDE_OPT_IN, GraphCapture, graph_variants_refusal
from camp2p_overlap.core.overlap.plan import (
    COMPUTE_SIDE,
    Layout,
    StepPlan,
    graph_needs_opt_in,
    layouts_of,
    step_plan,
)
from camp2p_overlap.core.overlap.routes import install_routes, remove_routes, route_problem
from camp2p_overlap.core.overlap.runner_state import NotWeaklyReferenceable, RunnerState
from camp2p_overlap.core.overlap.runtime import OverlapRuntime
from camp2p_overlap.core.overlap.serial_trace import run_traced_serial
from camp2p_overlap.core.overlap.streams import BackendUnavailable, core_budget, device_module_of, resolve_backend_name
from camp2p_overlap.core.overlap.streams.backend import GUARD, StreamBackend
from camp2p_overlap.core.overlap.streams.streamset import StreamSet
from camp2p_overlap.core.overlap.watch.watchdog import start_watchdog
from camp2p_overlap.core.patching.features import GRAPH_VARIANTS
from camp2p_overlap.core.patching.installer import MARK, live_namespace, target_named

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


@dataclass(frozen=True)
class Decision:
    """What one call of ``_ffn_forward`` does: engage with ``plan`` on ``backend`` in one of ``layouts``
    (``engages``), or run upstream's serial path for ``reason`` (:func:`serial`)."""

    engages: bool
    #: Why the call runs serially ("" when it engages).
    reason: str = ""
    plan: StepPlan | None = None
    backend: str | None = None
    #: The layouts the step may run, in the order listed (adaptive engage measures each; a capture takes the first).
    layouts: tuple[Layout, ...] = (COMPUTE_SIDE,)
    #: The rollout mode the step engages in (VLLM_CAMP2P_MULTISTREAM_MODE).
    mode: str = "overlap"
    #: The layouts' names, in the same order (adaptive engage's overlap paths).
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(layout.name for layout in self.layouts))

    @property
    def layout(self) -> Layout:
        """The first listed layout: what a step runs without adaptive engage, and what a capture takes."""
        return self.layouts[0]


def serial(reason: str) -> Decision:
    """The decision to run upstream's serial path, for ``reason``."""
    return Decision(engages=False, reason=reason)


@dataclass
class RunnerFacts:
    """What a runner's steps share until the engine's generation moves or the runner holds another connector: why
    none may engage (``problem``), else the backend and layouts."""

    generation: int
    connector: Any
    problem: str | None = None
    backend: str | None = None
    layouts: tuple[Layout, ...] = ()
    #: (attribute, router key) of each routed connector method.
    routes: tuple[tuple[str, str], ...] = ()
    #: The namespace holding the manifest's ``_ffn_layer_indices`` target (its module's globals, which upstream's loop
    #: reads it from; a new module object comes with a new generation), and the name; the function is read every step.
    layer_namespace: Any = None
    layer_attribute: str = ""
    #: Per stage ids: the HCCL group check's answer (group names are a fact of the connector).
    groups: dict[tuple[int, ...], str | None] = field(default_factory=dict)
    #: Per stage count: the listed layouts that fit the device's vector cores, and the verdicts (``core_budget``).
    fits: dict[int, tuple[tuple[Layout, ...], tuple[core_budget.Fit, ...]]] = field(default_factory=dict)
    #: Per (stages, ``max_num_tokens``): the layer list it last engaged with, and that decision, with its plan.
    engaging: dict[Any, tuple[list[Any], Decision]] = field(default_factory=dict)


def runner_facts(engine: PatchEngine, runner: Any, connector: Any) -> RunnerFacts:
    """Read what :class:`RunnerFacts` holds, in the order a reason is given."""
    cfg = engine.config
    facts = RunnerFacts(engine.generation, connector)
    routes = engine.installer.routes()
    owners = {spec.owner_path[-1]: owner for owner, spec in routes}
    if not routes or not all(isinstance(connector, owner) for owner in owners.values()):
        wanted = " or ".join(sorted(owners)) or "the routed connector class"
        facts.problem = f"connector is {type(connector).__name__}, not {wanted}"
        return facts
    facts.routes = tuple((spec.attribute, spec.router) for _, spec in routes)
    facts.problem = route_problem(connector, [attribute for attribute, _ in facts.routes])
    if facts.problem is not None:
        return facts
    role = getattr(getattr(runner, "afd_config", None), "role", None)
    if role != "ffn":
        facts.problem = f"AFD role is {role!r}, not 'ffn'"
        return facts
    facts.layouts = layouts_of(cfg)
    target = target_named(engine.manifest, camp2p.LAYER_INDICES_TARGET) if engine.manifest else None
    if target is not None:
        facts.layer_namespace, facts.layer_attribute = live_namespace(target), target.attribute
    try:
        facts.backend = resolve_backend_name(cfg.backend, getattr(runner, "device", None))
    except BackendUnavailable:
        pass  # asked again each step (decide): a device backend may become available
    return facts


def decide(engine: PatchEngine, runner: Any, kwargs: Mapping[str, Any], state: Any) -> Decision:
    """Whether this call of ``runner._ffn_forward(**kwargs)`` engages, and its plan; the step has already checked
    that the patch layer is on, the call is not re-entrant and every target is ready. ``state``: the runner's
    state, which keeps its :class:`RunnerFacts`."""
    cfg = engine.config
    connector = getattr(runner, "connector", None)
    facts = state.facts
    if facts is None or facts.generation != engine.generation or facts.connector is not connector:
        facts = state.facts = runner_facts(engine, runner, connector)
    if facts.problem is not None:
        return serial(facts.problem)
    if "dp_metadata_list" not in kwargs:
        return serial("_ffn_forward called without dp_metadata_list")
    try:
        stages, num_stages = camp2p.stage_ids(kwargs["dp_metadata_list"])
    except (TypeError, ValueError) as exc:
        return serial(f"stage ids of dp_metadata_list are not integers ({exc})")
    if num_stages < cfg.min_stages:
        return serial(f"{num_stages} stage(s), fewer than the minimum {cfg.min_stages}")
    stages = tuple(stages)
    if num_stages > MAX_STAGES or stages[0] < 0 or stages[-1] >= MAX_STAGES:  # sorted
        groups = ", ".join(camp2p.GROUPS)
        return serial(f"stage ids {list(stages)} do not fit CAMP2P's {MAX_STAGES} stage groups ({groups})")
    if stages not in facts.groups:
        facts.groups[stages] = camp2p.group_problem(connector, stages)
    group = facts.groups[stages]
    if group is not None:
        return serial(group)
    if not facts.layouts:
        return serial("the comm-side layout with both directions switched off (A2E=0 and E2A=0)")
    if facts.backend is None:  # a device backend not available yet may be later
        try:
            facts.backend = resolve_backend_name(cfg.backend, getattr(runner, "device", None))
        except BackendUnavailable as exc:
            return serial(str(exc))
    if num_stages not in facts.fits:
        facts.fits[num_stages] = layouts_that_fit(engine, runner, connector, facts, num_stages)
    layouts, verdicts = facts.fits[num_stages]
    if not layouts:
        return serial(core_budget.refusal(verdicts))
    layer_fn = facts.layer_namespace.get(facts.layer_attribute) if facts.layer_namespace is not None else None
    if layer_fn is None:
        return serial("_ffn_layer_indices is not available")
    listed = layer_fn(runner)  # upstream's: a range (every layer), or a list (its MoE layers)
    if type(listed) is not range:  # our own copy: a list the runner changes in place is read again
        listed = list(listed)
    max_num_tokens = getattr(runner, "max_num_tokens", None)
    shape = (stages, max_num_tokens)
    try:
        kept = facts.engaging.get(shape)
    except TypeError:  # an unhashable max_num_tokens: not kept
        shape, kept = None, None
    if kept is not None and kept[0] == listed:  # the layer list this shape engaged with before, checked then
        return kept[1]
    layers = tuple(map(int, listed))
    if not layers:
        return serial("the step has no FFN layers")
    if len(set(layers)) != len(layers):
        return serial(f"layer list repeats a layer: {list(layers)}")
    plan = step_plan(layers, stages, max_num_tokens)
    made = Decision(engages=True, plan=plan, backend=facts.backend, layouts=layouts, mode=cfg.mode)
    if shape is not None:
        if len(facts.engaging) >= 64:
            facts.engaging.clear()
        facts.engaging[shape] = (listed, made)
    return made


def layouts_that_fit(
    engine: PatchEngine, runner: Any, connector: Any, facts: RunnerFacts, stages: int
) -> tuple[tuple[Layout, ...], tuple[core_budget.Fit, ...]]:
    """The runner's listed layouts whose kernels fit the device's vector cores with ``stages`` stages, and the
    verdicts; a layout left out is logged once with its numbers."""
    device = getattr(runner, "device", None)
    try:
        mod = device_module_of(facts.backend, device)  # type: ignore[arg-type]
    except BackendUnavailable as exc:
        mod = None
        log_once(logging.INFO, "core-budget-device", "camp2p-overlap: core budget: no device module (%s)", exc)
    budget = core_budget.read_budget(facts.backend or "", mod, device, connector, engine.config)  # type: ignore[arg-type]
    layouts, verdicts = core_budget.fit(facts.layouts, stages, budget)
    for v in verdicts:
        if not v.fits and layouts:
            log_once(logging.WARNING, f"core-budget-{v.layout}-{stages}", "camp2p-overlap: core budget: %s", v.text)
    return layouts, verdicts


def make_wrappers(engine: PatchEngine, *, runtime: OverlapRuntime) -> dict[str, Any]:
    """What ``engine`` installs, by manifest key: the ``ffn_forward`` and ``capture_graphs`` wrappers, and the
    routers that ``route`` targets name (``camp2p.SESSION_ROUTERS``; nothing of them is installed on a class)."""

    capture_graphs = GraphCapture(engine, runtime, bucket_of, decide)

    def ffn_forward(wrapped: Wrapped, instance: Any, args: Args, kwargs: Kwargs) -> Any:
        return FfnStep(engine, runtime, wrapped, instance, args, kwargs).run()

    setattr(ffn_forward, MARK, True)
    setattr(capture_graphs, MARK, True)
    return {
        "ffn_forward": ffn_forward,
        "capture_graphs": capture_graphs,
        **dict.fromkeys(camp2p.SESSION_ROUTERS, camp2p.route),
    }


def bucket_of(runner: str, stages: int, layers: int, dp_metadata_list: Any, alike: bool = False) -> BucketKey:
    """The adaptive bucket of a step of runner ``runner`` (its name) with ``stages`` stages and ``layers`` FFN
    layers: and its largest stage's tokens rounded up to a power of two (0: unknown). ``alike`` (a group of FFN
    ranks): only the token counts every FFN rank receives alike (vLLM's across-DP counts), never this rank's own."""
    tokens = camp2p.max_stage_tokens(dp_metadata_list, alike=alike)
    return BucketKey(runner, stages, layers, 1 << (tokens - 1).bit_length() if tokens > 0 else 0)


class FfnStep:
    """One call of the wrapped ``_ffn_forward``, with the engine and runtime its wrapper is bound to."""

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
        """Whether this call runs inside a graph capture, computed once: the caller says so, or the current stream
        of ``backend`` (the step's) is capturing. Without a backend (a step that got none), the runner's is asked
        only while the patch layer captures (its wrapped ``_capture_graphs``)."""
        if self._capture is None:
            capture = bool(self.kwargs.get("is_graph_capturing"))
            if not capture:
                if backend is None and GUARD.captures:
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

    # -- 1. the gate, 3. the choice ------------------------------------------
    def run(self) -> Any:
        self.recorder = trace.active
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
            runtime = self.runtime
            if not runtime.group_joined:  # the first engaged step: the FFN ranks compare their configuration
                runtime.join_group(self.engine.config, self.engine.manifest.name if self.engine.manifest else None)
            group = runtime.group
            if group is not None:
                group.steps += 1
                refusal = group.refusal
                if refusal is not None:  # every rank runs upstream's path
                    self.count_serial(refusal)
                    log_once(logging.INFO, "gate", "camp2p-overlap: running the serial FFN path: %s", refusal)
                    return self.run_original()
            # 3. the choice: the static setting for a capture (a graph replays what it captured), parity/reorder,
            # adaptive off; else the bucket's path (a listed layout, or the original as decided or as a probe), timed
            # without blocking the host.
            cfg = self.engine.config
            if (
                not cfg.adaptive
                or runtime.adaptive_off is not None
                or decision.mode != "overlap"
                or self.is_capture(streamset.backend)
            ):
                return self.run_engaged(decision, streamset, decision.layout)
            plan, backend, state = decision.plan, streamset.backend, self.state
            assert plan is not None and state is not None
            dp = self.kwargs.get("dp_metadata_list")
            key = bucket_of(state.name, len(plan.stages), len(plan.layers), dp, alike=group is not None)
            state.timings.read_ready()
            adaptive, every = runtime.adaptive, cfg.reprobe_every
            if adaptive.settings.reprobe_every != every:  # the engine's re-probe interval
                adaptive.settings = replace(adaptive.settings, reprobe_every=every)
            path, probe, timed, n = adaptive.choose(key, decision.names, state.timings.settle)
            if path == SERIAL:
                # a decision point that broke the group: its reason
                refusal = group.refusal if group is not None else None
                runtime.counters.serial(refusal or (SERIAL_PROBE if probe else SERIAL_FASTER))
                if not timed:
                    return self.run_original()
                return state.timings.timed(key, SERIAL, backend, self.run_original, step=n)
            layout = decision.layouts[decision.names.index(path)]
            run = partial(self.run_engaged, decision, streamset, layout)
            return state.timings.timed(key, path, backend, run, step=n)
        finally:
            gate.exit()

    # -- 2. the decision -----------------------------------------------------
    def decision_and_streams(self) -> tuple[Decision, StreamSet | None]:
        """The decision and, when it engages, the runner's stream set."""
        engine, runtime = self.engine, self.runtime
        if not engine.config.enabled:
            return serial("switched off"), None
        if runtime.local.session is not None:
            return serial("re-entrant FFN forward inside an active step"), None
        if engine.unready is not None:  # the one read of the lifecycle a ready step makes
            unready = engine.refresh_and_report_unready()  # wraps a reloaded target module again
            if unready is not None:
                return serial(f"not every target of the stack is patched ({unready})"), None
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
            streamset = state.streamset
            if streamset is None or state.backend_name != decision.backend:
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
        if graph_needs_opt_in(cfg):
            return GRAPH_COMM_SIDE_OPT_IN
        return None

    # -- 4. the engaged step -------------------------------------------------
    def run_engaged(self, decision: Decision, streamset: StreamSet, layout: Layout) -> Any:
        """The step under a session in ``layout``, counted under its rollout mode and layout once the connector is
        routed to it."""
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
                layout=layout,
                recorder=recorder,
                step_id=step_id,
                context_of=camp2p.context_of,
            )
            routers, installed = [], []  # type: ignore[var-annotated]
            for attribute, key in self.state.facts.routes:  # type: ignore[union-attr]
                # make(callee, thread) is partial(route, session, key, callee, thread)
                routers.append((attribute, partial(partial, camp2p.route, session, key)))
            refused = install_routes(connector, routers, installed, checked=True)
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
                    mark.layout = layout.name
            else:
                runtime.counters.engaged(decision.mode, layout.name)
            # No watchdog inside a capture: the watcher would query events while the capture runs (global capture
            # mode forbids it), and a captured step only records work, it cannot stall. Where upstream's capture is
            # not wrapped (its target refused), no guard keeps the watcher out of it: it follows no step past the host.
            follow = self.engine.feature_refusal(GRAPH_VARIANTS) is None
            watchdog = None if capturing else start_watchdog(seconds, session.snapshot, step_id, runtime.group, follow)
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
                remove_routes(connector, installed)  # on every exit path: nothing of ours stays on the instance
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
