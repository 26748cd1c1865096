"""The per-step decision: whether one call of the runner's ``_ffn_forward``
engages, with what plan and layout; else the reason it runs serially. And,
below, the rollout modes and the rung of the rollout ladder a
configuration is on.

What does not change between a runner's steps (the connector's class and
routability, the runner's AFD role, the backend and layout) is
read once into :class:`RunnerFacts`, kept on the runner's state and read
again when the engine's ``generation`` moves (apply, unpatch, a module
installed, a refresh) or the runner holds another connector. What changes
per step (the stage ids, the layer list, ``max_num_tokens``) is read per
step; the plan is cached per shape."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.env_vars import MAX_STAGES
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.plan import A2E_ONLY, COMM_SIDE, E2A_ONLY, PARITY, REORDER, Layout, StepPlan, step_plan
from camp2p_overlap.core.overlap.routes import route_problem, routed_elsewhere
from camp2p_overlap.core.overlap.streams import BackendUnavailable, resolve_backend_name
from camp2p_overlap.core.patching.installer import live_target

if TYPE_CHECKING:
    from camp2p_overlap.core.patching.lifecycle import PatchEngine


@dataclass(frozen=True)
class Decision:
    """What one call of ``_ffn_forward`` does: engage with ``plan`` on
    ``backend`` in ``layout`` (``engages``), or run upstream's serial path
    for ``reason`` (:func:`serial`)."""

    engages: bool
    #: Why the call runs serially ("" when it engages).
    reason: str = ""
    plan: StepPlan | None = None
    backend: str | None = None
    layout: Layout = COMM_SIDE
    #: The rollout mode the step engages in (VLLM_CAMP2P_MULTISTREAM_MODE).
    mode: str = "overlap"


def serial(reason: str) -> Decision:
    """The decision to run upstream's serial path, for ``reason``."""
    return Decision(engages=False, reason=reason)


@dataclass
class RunnerFacts:
    """What a runner's steps share until the engine's generation moves or
    the runner holds another connector: why none may engage (``problem``),
    else the backend and layout."""

    generation: int
    connector: Any
    problem: str | None = None
    backend: str | None = None
    layout: Layout | None = None
    #: The connector's routed attributes.
    attributes: tuple[str, ...] = ()
    #: Per plan: its engaging decision (a plan is cached per shape).
    engaging: dict[int, Decision] = field(default_factory=dict)


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
    facts.attributes = tuple(spec.attribute for _, spec in routes)
    facts.problem = route_problem(connector, facts.attributes)
    if facts.problem is not None:
        return facts
    role = getattr(getattr(runner, "afd_config", None), "role", None)
    if role != "ffn":
        facts.problem = f"AFD role is {role!r}, not 'ffn'"
        return facts
    facts.layout = layout_of(cfg)
    try:
        facts.backend = resolve_backend_name(cfg.backend, getattr(runner, "device", None))
    except BackendUnavailable:
        pass  # asked again each step (decide): a device backend may become available
    return facts


def decide(engine: PatchEngine, runner: Any, kwargs: Mapping[str, Any], state: Any) -> Decision:
    """Whether this call of ``runner._ffn_forward(**kwargs)`` engages, and
    its plan; the step has already checked that the patch layer is on, the
    call is not re-entrant and every target is ready. ``state``: the
    runner's state, which keeps its :class:`RunnerFacts`."""
    cfg = engine.config
    connector = getattr(runner, "connector", None)
    facts = state.facts
    if facts is None or facts.generation != engine.generation or facts.connector is not connector:
        facts = state.facts = runner_facts(engine, runner, connector)
    if facts.problem is not None:
        return serial(facts.problem)
    busy = routed_elsewhere(connector, facts.attributes)
    if busy is not None:
        return serial(busy)
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
    group = camp2p.group_problem(connector, stages)
    if group is not None:
        return serial(group)
    if facts.layout is None:
        return serial("both directions are switched off (A2E=0 and E2A=0)")
    if facts.backend is None:  # a device backend not available yet may be later
        try:
            facts.backend = resolve_backend_name(cfg.backend, getattr(runner, "device", None))
        except BackendUnavailable as exc:
            return serial(str(exc))
    layer_fn = live_target(engine.manifest, camp2p.LAYER_INDICES_TARGET)
    if layer_fn is None:
        return serial("_ffn_layer_indices is not available")
    layers = tuple(map(int, layer_fn(runner)))
    if not layers:
        return serial("the step has no FFN layers")
    if len(set(layers)) != len(layers):
        return serial(f"layer list repeats a layer: {list(layers)}")
    plan = step_plan(layers, stages, getattr(runner, "max_num_tokens", None))
    made = facts.engaging.get(id(plan))
    if made is None or made.plan is not plan:
        if len(facts.engaging) >= 64:
            facts.engaging.clear()
        made = facts.engaging[id(plan)] = Decision(
            engages=True, plan=plan, backend=facts.backend, layout=facts.layout, mode=cfg.mode
        )
    return made


# ---------------------------------------------------------------------------
# rollout modes and the ladder
# The rollout modes (``VLLM_CAMP2P_MULTISTREAM_MODE``): what each one
# changes in an engaged step, and the rung of the rollout ladder a
# configuration is on (docs/design.md, "Rollout modes and the ladder").
#
# * ``overlap``: A2E/E2A on a side stream per stage (HCCL group), as the
#   direction switches say (``comm-side``, ``e2a-only``, ``a2e-only``);
# * ``reorder``: the overlap's issue order (prologue A2E of every stage, then
#   E2A(L, s) followed at once by A2E(L+1, s)), every op on the compute stream;
# * ``parity``: the session engaged, every op on the compute stream in the
#   order the FFN loop calls it (upstream's order).
#
# The session needs no mode of its own: each mode is a layout (``plan.py``).


#: The rungs in the order a new deployment climbs them.
LADDER = ("parity", "reorder", "e2a-only", "overlap")


def layout_of(cfg: OverlapConfig) -> Layout | None:
    """The layout of an engaged step under ``cfg.mode``; the direction
    switches apply to ``overlap`` only (None: both are off)."""
    if cfg.mode == "parity":
        return PARITY
    if cfg.mode == "reorder":
        return REORDER
    return _SWITCHED[(cfg.a2e_on_side_stream, cfg.e2a_on_side_stream)]


_SWITCHED = {(True, True): COMM_SIDE, (False, True): E2A_ONLY, (True, False): A2E_ONLY, (False, False): None}


def rung(cfg: OverlapConfig) -> str:
    """The ladder rung ``cfg`` sets: ``off``, one of :data:`LADDER`, or
    ``a2e-only`` (off the ladder: E2A=0), or ``none`` (overlap with both
    directions off: every step runs serially)."""
    if not cfg.enabled:
        return "off"
    if cfg.mode != "overlap":
        return cfg.mode
    if cfg.a2e_on_side_stream and cfg.e2a_on_side_stream:
        return "overlap"
    if cfg.e2a_on_side_stream:
        return "e2a-only"
    if cfg.a2e_on_side_stream:
        return "a2e-only"
    return "none"
