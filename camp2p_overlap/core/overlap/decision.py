"""The per-step decision: whether one call of the runner's ``_ffn_forward``
engages the overlap, and with what plan; else the reason it runs serially.
And, below, the rollout modes and the rung of the rollout ladder a
configuration is on."""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.env_vars import MAX_STAGES
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.connector_routes import route_problem
from camp2p_overlap.core.overlap.plan import BOTH_SIDES, Directions, StepPlan, step_plan
from camp2p_overlap.core.overlap.streams import BackendUnavailable, resolve_backend_name
from camp2p_overlap.core.overlap.streams.base import Stream, StreamBackend
from camp2p_overlap.core.patching.features import GRAPH_VARIANTS
from camp2p_overlap.core.patching.installer import live_target, target_named

if TYPE_CHECKING:
    from camp2p_overlap.core.patching.lifecycle import PatchEngine

GRAPH_OFF = "inside graph capture and VLLM_CAMP2P_MULTISTREAM_GRAPH is off"
GRAPH_SERIAL_VARIANT = "inside graph capture: the serial variant (VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive)"


@dataclass(frozen=True)
class Decision:
    """What one call of ``_ffn_forward`` does: engage the overlap with
    ``plan`` on ``backend`` (``engages``), or run upstream's serial path for
    ``reason`` (:func:`serial`)."""

    engages: bool
    #: Why the call runs serially ("" when it engages).
    reason: str = ""
    plan: StepPlan | None = None
    backend: str | None = None
    directions: Directions = BOTH_SIDES
    #: The rollout mode the step engages in (VLLM_CAMP2P_MULTISTREAM_MODE).
    mode: str = "overlap"
    #: A serial decision whose reason may pass while every input the memo
    #: compares stays equal (another thread's step has routed the connector,
    #: a device backend not available yet): never memoised.
    passing: bool = False
    #: Made from the step's layer list (``_ffn_layer_indices``): every
    #: engaging decision, and a serial one about the list. The memo compares
    #: the list only for these: any other serial decision is made before it
    #: is read.
    reads_layers: bool = False


def serial(reason: str, *, passing: bool = False, reads_layers: bool = False) -> Decision:
    """The decision to run upstream's serial path, for ``reason`` (``passing``
    and ``reads_layers``: see :class:`Decision`)."""
    return Decision(engages=False, reason=reason, passing=passing, reads_layers=reads_layers)


class DecisionMemo:
    """A runner's last decision, with every input it was made from, so that
    a step whose inputs all compare equal takes it without deciding again:
    an engaging one, or a serial one for a reason those inputs hold (a
    connector of another class, a role, too few stages, shared HCCL groups;
    not a :attr:`Decision.passing` one). One memo per patch layer's runtime:
    it is emptied on unpatch, so a decision never outlives the apply it was
    made under.

    The inputs are what :func:`decide` reads: the configuration, the
    manifest and its route targets, the connector's class and its three
    HCCL communicator names (None without them), the runner's AFD role,
    device and ``max_num_tokens``, the stage ids of ``dp_metadata_list``
    (its keys, as given), and, for a decision that
    :attr:`~Decision.reads_layers`, the live ``_ffn_layer_indices`` with
    what it returned. A call inside a graph capture is never memoised. What
    may change between
    two steps with equal inputs is re-checked where it is used: another
    thread's step routing the connector (``ConnectorRoutes.install`` checks
    it again), and a plan the loop does not follow (the session falls back
    and logs it)."""

    __slots__ = ("_last",)

    #: Runners whose decision a memo keeps, at most (a worker has one or two).
    KEPT = 64

    def __init__(self) -> None:
        #: id(runner) -> (inputs, layer function, its list, decision). Keyed
        #: by id only: the inputs decide alone, so a new runner at an old id
        #: finds a right answer.
        self._last: dict[int, tuple[tuple[Any, ...], Any, Any, Decision]] = {}

    def clear(self) -> None:
        self._last = {}

    def __len__(self) -> int:
        return len(self._last)


def decide(engine: PatchEngine, runner: Any, kwargs: Mapping[str, Any], memo: DecisionMemo | None = None) -> Decision:
    """Whether this call of ``runner._ffn_forward(**kwargs)`` engages, and
    its plan; the step has already checked that the patch layer is on, the call is
    not re-entrant and every target is ready (``FfnStep.blocking_reason``).
    With ``memo``, a decision is kept per runner with its inputs (not a
    :attr:`Decision.passing` one), and a later call whose inputs compare
    equal gets it back (:class:`DecisionMemo`)."""
    connector = getattr(runner, "connector", None)
    dp_metadata_list = kwargs.get("dp_metadata_list", _NONE)
    if memo is None or kwargs.get("is_graph_capturing") or type(dp_metadata_list) is not dict:
        return _decide(engine, runner, kwargs, connector, None)
    # None without the three names: not a CAMP2P connector (the decision says
    # why); the first one read plainly, so that such a connector raises nothing
    names = None
    if getattr(connector, _FIRST_COMM_NAME, _NONE) is not _NONE:
        try:
            names = _comm_names(connector)
        except AttributeError:
            pass
    manifest = engine.manifest
    inputs = (
        engine.config,
        manifest,
        engine.installer.routes(),
        type(connector),
        names,
        getattr(getattr(runner, "afd_config", None), "role", None),
        getattr(runner, "device", None),
        getattr(runner, "max_num_tokens", None),
        tuple(dp_metadata_list),
    )
    rid = id(runner)
    last = memo._last.get(rid)  # (inputs, layer function, its list, decision)
    if last is not None and not last[3].reads_layers:  # decided before the layer list is read
        try:
            if last[0] == inputs:
                return last[3]
        except Exception:  # noqa: BLE001 - an input that does not compare: decided afresh
            pass
    read = _LAYER_FN_READ
    if read[0] is not manifest:
        read = _layer_fn_target(manifest)
    if read[1] is None:
        layer_fn = live_target(manifest, camp2p.LAYER_INDICES_TARGET)
    else:  # live_target() for a module function, with its target looked up once per manifest
        module = sys.modules.get(read[1])
        layer_fn = vars(module).get(read[2]) if module is not None else None
    try:
        layers = layer_fn(runner)  # type: ignore[misc]
        if type(layers) is not range:  # a list the caller could change in place: compared by value
            layers = tuple(layers)
    except Exception:  # noqa: BLE001 - None, or a runner it fails on: decided in order, with the reason
        return _decide(engine, runner, kwargs, connector, None)
    if last is not None:
        try:
            if last[1] is layer_fn and last[2] == layers and last[0] == inputs:
                return last[3]
        except Exception:  # noqa: BLE001 - an input that does not compare: decided afresh
            pass
    decision = _decide(engine, runner, kwargs, connector, layers)
    if not decision.passing:  # engaging, or serial for a reason the inputs hold
        kept = memo._last
        if len(kept) >= DecisionMemo.KEPT:
            kept.clear()
        kept[rid] = (inputs, layer_fn, layers, decision)
    return decision


_NONE: Any = object()
_comm_names = camp2p.comm_name_fields
_FIRST_COMM_NAME = camp2p.COMM_NAME_FIELDS[0]

#: The manifest read last, with the module and attribute of its
#: ``_ffn_layer_indices`` target when that is a module function (one tuple,
#: replaced whole: threads of other engines read it too).
_LAYER_FN_READ: tuple[Any, str | None, str] = (None, None, "")


def _layer_fn_target(manifest: Any) -> tuple[Any, str | None, str]:
    """(``manifest``, module, attribute) of its layer function target; the
    module None when the target is not a module function (or ``manifest``
    has none): :func:`live_target` looks it up then."""
    global _LAYER_FN_READ
    t = target_named(manifest, camp2p.LAYER_INDICES_TARGET) if manifest is not None else None
    read = (manifest, t.module, t.attribute) if t is not None and not t.owner_path else (manifest, None, "")
    _LAYER_FN_READ = read
    return read


def _decide(
    engine: PatchEngine,
    runner: Any,
    kwargs: Mapping[str, Any],
    connector: Any,
    layer_list: Any = None,
) -> Decision:
    """:func:`decide` itself; ``layer_list``: what the live
    ``_ffn_layer_indices`` returned for ``runner``, when the caller has
    called it (None: called here)."""
    cfg = engine.config
    problem, attributes = _class_problem(engine, connector)
    if problem is not None:  # its class is an input of the memo
        return serial(problem)
    problem = route_problem(connector, attributes)
    if problem is not None:  # the instance's state (another thread's step routed it, say) may pass
        return serial(problem, passing=True)
    role = getattr(getattr(runner, "afd_config", None), "role", None)
    if role != "ffn":
        return serial(f"AFD role is {role!r}, not 'ffn'")
    if "dp_metadata_list" not in kwargs:
        return serial("_ffn_forward called without dp_metadata_list")
    try:
        stages, num_stages = camp2p.stage_ids(kwargs["dp_metadata_list"])
    except (TypeError, ValueError) as exc:
        return serial(f"stage ids of dp_metadata_list are not integers ({exc})")
    if num_stages < cfg.min_stages:
        return serial(f"{num_stages} stage(s), fewer than the minimum {cfg.min_stages}")
    if num_stages > MAX_STAGES or stages[0] < 0 or stages[-1] >= MAX_STAGES:  # sorted
        groups = ", ".join(camp2p.GROUPS)
        return serial(f"stage ids {stages} do not fit CAMP2P's {MAX_STAGES} stage groups ({groups})")
    problem = camp2p.group_problem(connector, stages)
    if problem is not None:
        return serial(problem)
    if cfg.mode == "overlap" and not (cfg.a2e_on_side_stream or cfg.e2a_on_side_stream):
        return serial("both directions are switched off (A2E=0 and E2A=0)")
    try:
        backend = resolve_backend_name(cfg.backend, getattr(runner, "device", None))
    except BackendUnavailable as exc:
        return serial(str(exc), passing=True)
    if layer_list is None:
        layer_fn = live_target(engine.manifest, camp2p.LAYER_INDICES_TARGET)
        if layer_fn is None:
            return serial("_ffn_layer_indices is not available", reads_layers=True)
        layer_list = layer_fn(runner)
    layers = tuple(map(int, layer_list))
    if not layers:
        return serial("the step has no FFN layers", reads_layers=True)
    if len(set(layers)) != len(layers):
        return serial(f"layer list repeats a layer: {list(layers)}", reads_layers=True)
    if kwargs.get("is_graph_capturing"):
        if not cfg.graph_overlap:
            return serial(GRAPH_OFF)
        refused = graph_variants_refused(engine)
        if refused is not None:  # the capture runs serially: upstream's own graph
            return serial(refused)
    plan = step_plan(layers, tuple(stages), getattr(runner, "max_num_tokens", None))
    return _engaging(plan, backend, mode_directions(cfg), cfg.mode)


#: The last engaging decisions, by (id of their plan, backend, id of their
#: directions, mode): a step of a shape seen before builds none.
_ENGAGING: dict[tuple[int, str, int, str], Decision] = {}
_ENGAGING_KEPT = 64


def _engaging(plan: StepPlan, backend: str, directions: Directions, mode: str) -> Decision:
    """The decision to engage with these (one shared object per plan and
    setting: plans are cached per shape, and a Decision is immutable)."""
    key = (id(plan), backend, id(directions), mode)
    found = _ENGAGING.get(key)
    if found is not None and found.plan is plan and found.directions is directions:
        return found
    if len(_ENGAGING) >= _ENGAGING_KEPT:
        _ENGAGING.clear()
    made = _ENGAGING[key] = Decision(
        engages=True, plan=plan, backend=backend, directions=directions, mode=mode, reads_layers=True
    )
    return made


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
    problem, attributes = _class_problem(engine, connector)
    return problem if problem is not None else route_problem(connector, attributes)


def _class_problem(engine: PatchEngine, connector: Any) -> tuple[str | None, tuple[str, ...]]:
    """(why ``connector`` is not an instance of every class that holds the
    installed ``route`` targets, or None; the routed attributes)."""
    routes = engine.installer.routes()
    read = _attributes_of(routes)
    if read is not None:
        for owner in read[0]:
            if not isinstance(connector, owner):
                read = None
                break
    if read is None:
        wanted = sorted({spec.owner_path[-1] for spec in _route_specs(engine)}) or ["the routed connector class"]
        return f"connector is {type(connector).__name__}, not {' or '.join(wanted)}", ()
    return None, read[1]


#: The routes read last and what :func:`_attributes_of` made of them (one
#: tuple, replaced whole: threads of other engines read it too).
_ROUTES_READ: tuple[Any, Any] = ((), None)


def _attributes_of(routes: tuple[tuple[Any, Any], ...]) -> tuple[tuple[type, ...], tuple[str, ...]] | None:
    """(the classes a connector must be an instance of, every one, and the
    routed attributes) of an installer's routes, or None when there are
    none; computed again only when the routes read change."""
    global _ROUTES_READ
    last = _ROUTES_READ
    if last[0] is routes:
        return last[1]
    owners = tuple({id(owner): owner for owner, _ in routes}.values())
    made = (owners, tuple(spec.attribute for _, spec in routes)) if routes else None
    _ROUTES_READ = (routes, made)
    return made


def _route_specs(engine: PatchEngine) -> list[Any]:
    manifest = engine.manifest
    return [t for t in manifest.targets() if t.action == "route"] if manifest is not None else []


# ---------------------------------------------------------------------------
# rollout modes and the ladder
# The rollout modes (``VLLM_CAMP2P_MULTISTREAM_MODE``): what each one
# changes in an engaged step, and the rung of the rollout ladder a
# configuration is on (docs/design.md, "Rollout modes and the ladder").
#
# * ``overlap``: A2E/E2A on a side stream per stage (HCCL group), as the
#   direction switches say;
# * ``reorder``: the overlap's issue order (prologue A2E of every stage, then
#   E2A(L, s) followed at once by A2E(L+1, s)), every op on the compute stream;
# * ``parity``: the session engaged, every op on the compute stream in the
#   order the FFN loop calls it (upstream's order).
#
# The session needs no mode of its own: ``parity`` is the session with both
# directions on the compute stream, ``reorder`` the session with both on
# "side streams" that are all the compute stream.


#: The rungs in the order a new deployment climbs them.
LADDER = ("parity", "reorder", "e2a-only", "overlap")


def mode_directions(cfg: OverlapConfig) -> Directions:
    """The session's directions for ``cfg.mode``; the direction switches
    apply to ``overlap`` only. One shared object per combination."""
    if cfg.mode == "parity":
        return _directions(False, False)
    if cfg.mode == "reorder":
        return _directions(True, True)
    return _directions(cfg.a2e_on_side_stream, cfg.e2a_on_side_stream)


@functools.lru_cache(maxsize=4)
def _directions(a2e_side: bool, e2a_side: bool) -> Directions:
    return Directions(a2e_side, e2a_side)


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


@dataclass(frozen=True)
class ComputeOnlyStreams:
    """A stream set whose every stage "side stream" is the compute stream
    (the ``parity`` and ``reorder`` modes): the session records, waits and
    issues as in ``overlap``, but everything runs in order on the caller."""

    backend: StreamBackend
    streams: Mapping[int, Stream]
    lock: Any


def streams_for(mode: str, streamset: Any) -> Any:
    """What the session of a ``mode`` step runs on: the runner's stream set,
    or for ``parity``/``reorder`` a view of it with only the compute stream."""
    if mode == "overlap":
        return streamset
    compute = streamset.backend.compute_stream()
    return ComputeOnlyStreams(streamset.backend, dict.fromkeys(streamset.streams, compute), streamset.lock)
