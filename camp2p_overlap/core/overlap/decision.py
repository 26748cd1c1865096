"""The per-step decision: whether one call of the runner's ``_ffn_forward``
engages the overlap, and with what plan; else the reason it runs serially."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from camp2p_overlap.core.env_vars import MAX_STAGES
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.connector_routes import route_problem
from camp2p_overlap.core.overlap.plan import BOTH_SIDES, Directions, StepPlan, step_plan
from camp2p_overlap.core.overlap.rollout import mode_directions
from camp2p_overlap.core.overlap.streams import BackendUnavailable, resolve_backend_name
from camp2p_overlap.core.patching.features import GRAPH_VARIANTS
from camp2p_overlap.core.patching.installer import live_target

if TYPE_CHECKING:
    from camp2p_overlap.core.patching.lifecycle import PatchEngine

GRAPH_OFF = "inside graph capture and VLLM_CAMP2P_MULTISTREAM_GRAPH is off"
GRAPH_SERIAL_VARIANT = "inside graph capture: the serial variant (VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive)"


@dataclass(frozen=True)
class Decision:
    reason: str | None  # None: engage
    plan: StepPlan | None = None
    backend: str | None = None
    directions: Directions = BOTH_SIDES
    #: The rollout mode the step engages in (VLLM_CAMP2P_MULTISTREAM_MODE).
    mode: str = "overlap"


def decide(engine: PatchEngine, runner: Any, kwargs: Mapping[str, Any]) -> Decision:
    """Whether this call of ``runner._ffn_forward(**kwargs)`` engages, and
    its plan; the step has already checked that the layer is on, the call is
    not re-entrant and every target is ready (``FfnStep.blocking_reason``)."""
    cfg = engine.config
    connector = getattr(runner, "connector", None)
    problem = connector_problem(engine, connector)
    if problem is not None:
        return Decision(problem)
    role = getattr(getattr(runner, "afd_config", None), "role", None)
    if role != "ffn":
        return Decision(f"AFD role is {role!r}, not 'ffn'")
    if "dp_metadata_list" not in kwargs:
        return Decision("_ffn_forward called without dp_metadata_list")
    try:
        stages, num_stages = camp2p.stage_ids(kwargs["dp_metadata_list"])
    except (TypeError, ValueError) as exc:
        return Decision(f"stage ids of dp_metadata_list are not integers ({exc})")
    if num_stages < cfg.min_stages:
        return Decision(f"{num_stages} stage(s), fewer than the minimum {cfg.min_stages}")
    if num_stages > MAX_STAGES or any(not 0 <= s < MAX_STAGES for s in stages):
        groups = ", ".join(camp2p.GROUPS)
        return Decision(f"stage ids {stages} do not fit CAMP2P's {MAX_STAGES} stage groups ({groups})")
    problem = camp2p.group_problem(connector, stages)
    if problem is not None:
        return Decision(problem)
    if cfg.mode == "overlap" and not (cfg.a2e_on_side_stream or cfg.e2a_on_side_stream):
        return Decision("both directions are switched off (A2E=0 and E2A=0)")
    try:
        backend = resolve_backend_name(cfg.backend, getattr(runner, "device", None))
    except BackendUnavailable as exc:
        return Decision(str(exc))
    layer_fn = live_target(engine.manifest, camp2p.LAYER_INDICES_TARGET)
    if layer_fn is None:
        return Decision("_ffn_layer_indices is not available")
    layers = tuple(map(int, layer_fn(runner)))
    if not layers:
        return Decision("the step has no FFN layers")
    if len(set(layers)) != len(layers):
        return Decision(f"layer list repeats a layer: {list(layers)}")
    if kwargs.get("is_graph_capturing"):
        if not cfg.graph_overlap:
            return Decision(GRAPH_OFF)
        refused = graph_variants_refused(engine)
        if refused is not None:  # the capture runs serially: upstream's own graph
            return Decision(refused)
    plan = step_plan(layers, tuple(stages), getattr(runner, "max_num_tokens", None))
    return Decision(None, plan, backend, mode_directions(cfg), cfg.mode)


def graph_variants_refused(engine: PatchEngine) -> str | None:
    """Why the decode graph variants are refused, or None: a target only
    they need (the manifest's ``optional = "graph_variants"``:
    ``_capture_graphs``) is missing or its signature changed, while the eager
    overlap is applied (``PatchEngine.feature_refusal``). A step inside a
    graph capture then runs serially, so the graph captured is upstream's
    own. ``decide()`` checks it for a call with ``is_graph_capturing``; a
    caller that finds a capture otherwise (the backend's ``is_capturing()``)
    calls this too. Lock-free."""
    return engine.feature_refusal(GRAPH_VARIANTS)


def connector_problem(engine: PatchEngine, connector: Any) -> str | None:
    """Why the runner's connector cannot serve an engaged step, or None: it
    must be an instance of the class that holds the manifest's ``route``
    targets, and each of them must be routable on the instance
    (:func:`~camp2p_overlap.core.overlap.connector_routes.route_problem`)."""
    routes = engine.installer.routes()
    if not routes or not all(isinstance(connector, owner) for owner, _ in routes):
        wanted = sorted({spec.owner_path[-1] for spec in _route_specs(engine)}) or ["the routed connector class"]
        return f"connector is {type(connector).__name__}, not {' or '.join(wanted)}"
    return route_problem(connector, [spec.attribute for _, spec in routes])


def _route_specs(engine: PatchEngine) -> list[Any]:
    manifest = engine.manifest
    return [t for t in manifest.targets() if t.action == "route"] if manifest is not None else []
