"""``camp2p-overlap doctor``: what this box has and whether the patch layer
would engage here.

Reports, without raising:

* installed versions of vLLM, torch, torch_npu, wrapt and afd-plugin (from
  distribution metadata; nothing is imported for this);
* which shipped stack fits the installed versions and why
  (``manifest.select_checked``: vLLM, and afd-plugin where installed),
  every stack's own verdict, and how the installed vLLM-Ascend compares
  with the line the stack was checked with (reported, never gated);
* every target of the stack's manifest: whether its module imports (the
  ImportError text when not), whether the attribute is defined where the
  manifest says, and whether its signature matches. Importing the target
  modules imports afd-plugin, vLLM and torch_npu, as a worker would;
* the stream backend that would be used: the configured one resolved
  against the device this box has (an NPU through torch_npu, else a CUDA
  GPU, else none);
* every ``VLLM_CAMP2P_*`` switch, as set and as parsed (a malformed value is
  reported, every malformed one at once, not raised), and the rollout mode
  and ladder rung they set, with the ladder (:func:`ladder_line`);
* the layouts an engaged step runs (:func:`layout_rows`: those listed in
  ``VLLM_CAMP2P_MULTISTREAM_LAYOUT`` under ``overlap``), where each puts
  A2E, E2A and the FFN, and whether a decode graph captures it; and the
  ``comm-side`` graph opt-in (``VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE``),
  whether it is set, with a one-line pointer to why it is an opt-in;
* one line on decode graphs (:func:`decode_graph_line`): ``off``
  (``GRAPH=0``: decode replays upstream's graph), ``refused`` (graph
  variants asked for, and the installed torch_npu lacks the multi-stream
  capture fix, the first listed layout is ``comm-side`` without its graph
  opt-in, or another refusal), or ``ok``;
* the FFN rank group (:func:`group_section`, the ``FFN rank group:`` line):
  outside a worker (no ``torch.distributed`` process group) how the FFN
  ranks of a worker decide together; in a process with one, what
  ``rank_group.discover()`` finds;
* with ``--config``: the deployment's connector settings as the CAMP2P
  connector will see them (``tools/deployment.py``).

Exit status 0 when nothing would refuse, 1 otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from camp2p_overlap.core import config as cfgmod
from camp2p_overlap.core import env_vars
from camp2p_overlap.core.env_vars import TABLE as ENV_TABLE
from camp2p_overlap.core.observe.decode_graphs import UPSTREAM_GRAPH, rung_hint
from camp2p_overlap.core.overlap import rank_group
from camp2p_overlap.core.overlap.plan import CALLER, LADDER, Layout, graph_needs_opt_in, layouts_of, rung
from camp2p_overlap.core.overlap.streams import core_budget
from camp2p_overlap.core.patching.manifest import (
    ManifestError,
    StackManifest,
    TargetSpec,
    check_stacks,
    load_manifest,
    load_manifests,
    select_checked,
    signature_difference,
    signature_of,
)
from camp2p_overlap.core.patching.torch_npu_capture import (
    NOT_INSTALLED,
    REFUSED_KEEPS,
    CaptureFixVerdict,
    installed_capture_fix,
)
from camp2p_overlap.core.patching.versions import (
    AFD_PLUGIN_DIST,
    COMMIT_SHOWN,
    VLLM_ASCEND_DIST,
    VLLM_DIST,
    VersionCheck,
    built_from,
    installed_version,
    same_release,
)
from camp2p_overlap.tools.deployment import deployment_text, read_deployment

SCHEMA = "camp2p-overlap/doctor/v1"

#: Display name -> distribution name.
DISTRIBUTIONS = {
    "vllm": VLLM_DIST,
    "torch": "torch",
    "torch_npu": "torch-npu",
    "wrapt": "wrapt",
    "afd-plugin": AFD_PLUGIN_DIST,
    "vllm-ascend": VLLM_ASCEND_DIST,
    "camp2p-overlap": "camp2p-overlap",
}

#: Environment variable -> OverlapConfig field (from the table of variables).
SWITCH_FIELDS = {v.name: v.field for v in ENV_TABLE}

#: The rung after the ladder's layouts (``plan.LADDER``): decode graphs (``VLLM_CAMP2P_MULTISTREAM_GRAPH``).
GRAPH_RUNG = "decode graphs"
#: The rungs a new deployment climbs, as doctor prints them.
FULL_LADDER = (*LADDER, GRAPH_RUNG)
#: The opt-in rungs: what a rung name is followed by in the ladder.
OPT_IN_RUNGS = {"comm-side": "opt-in"}
#: Why a ``comm-side`` decode graph is an opt-in, in one line (the long form: docs/design.md).
COMM_SIDE_GRAPH_WHY = (
    "upstream keeps graph HCCL on the capture's stream (afd-plugin's NPU p2p_hccl graph code; its DeepSeek-V4 "
    "report §2.8.2: comm on the parent stream fastest; vllm-ascend #15500, #3582): "
    'docs/design.md ("Streams", "Decode graphs")'
)
#: A decode graph's capture of a listed layout (``layout_rows``' ``decode_graph``).
CAPTURED, NEEDS_OPT_IN, OPTED_IN, EAGER_ONLY = "captured", "needs-opt-in", "opted-in", "eager-only"

_STANDIN_DIR = Path(__file__).resolve().parent.parent / "emulation" / "standins"


def _versions() -> dict[str, str | None]:
    return {name: installed_version(dist) for name, dist in DISTRIBUTIONS.items()}


def _is_standin(module: Any) -> bool:
    try:
        return Path(module.__file__).resolve().is_relative_to(_STANDIN_DIR)
    except (AttributeError, TypeError, ValueError):
        return False


def check_target(t: TargetSpec) -> dict[str, Any]:
    """Import the target's module and compare the target with the manifest."""
    row: dict[str, Any] = {
        "target": t.id,
        "module": t.module,
        "qualname": t.qualname,
        "action": t.action,
        "status": "ok",
        "detail": "",
    }
    try:
        module = importlib.import_module(t.module)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, with its text
        row.update(status="import-error", detail=f"{type(exc).__name__}: {exc}")
        return row
    if _is_standin(module):
        row.update(status="stand-in", detail=f"{t.module} is camp2p-overlap's emulation stand-in, not afd-plugin")
        return row
    owner: Any = module
    for part in t.owner_path:
        owner = vars(owner).get(part) if hasattr(owner, "__dict__") else None
        if owner is None:
            row.update(status="missing", detail=f"{part!r} not found in {t.module}")
            return row
    if t.attribute not in vars(owner):
        inherited = hasattr(owner, t.attribute)
        row.update(
            status="missing",
            detail=f"{t.attribute!r} is not defined in {getattr(owner, '__qualname__', t.module)}"
            + (" itself (only inherited)" if inherited else ""),
        )
        return row
    raw = vars(owner)[t.attribute]
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    try:
        diff = signature_difference(t.signature, signature_of(func))
    except (TypeError, ValueError) as exc:
        diff = f"signature unreadable: {exc}"
    if diff:
        row.update(status="signature-mismatch", detail=diff)
    return row


def _device() -> tuple[str | None, str]:
    """('npu' | 'cuda' | None, how it was found)."""
    notes = []
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch

            importlib.import_module("torch_npu")
            npu = getattr(torch, "npu", None)
            if npu is not None and npu.is_available():
                return "npu", f"torch_npu: {npu.device_count()} NPU(s)"
            notes.append("torch_npu imports but torch.npu.is_available() is False")
        except Exception as exc:  # noqa: BLE001 - reported
            notes.append(f"importing torch_npu failed: {type(exc).__name__}: {exc}")
    else:
        notes.append("torch_npu is not installed")
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda", f"CUDA: {torch.cuda.device_count()} GPU(s)"
        notes.append("torch.cuda.is_available() is False")
    except Exception as exc:  # noqa: BLE001 - reported
        notes.append(f"torch: {type(exc).__name__}: {exc}")
    return None, "; ".join(notes)


def _backend(configured: str, device: str | None) -> dict[str, Any]:
    from camp2p_overlap.core.overlap.streams import BackendUnavailable, resolve_backend_name

    if device is None and configured in ("auto", "npu", "cuda"):
        return {
            "configured": configured,
            "resolved": None,
            "reason": "none: this box has no NPU (torch_npu and a device) and no CUDA GPU",
        }
    try:
        import torch

        name = resolve_backend_name(configured, torch.device(device) if device else None)
    except BackendUnavailable as exc:
        return {"configured": configured, "resolved": None, "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported
        return {"configured": configured, "resolved": None, "reason": f"{type(exc).__name__}: {exc}"}
    reason = f"{name} streams"
    if name == "cpu":
        reason = "cpu: worker-thread streams (emulation and tests only)"
    return {"configured": configured, "resolved": name, "reason": reason}


def _config(env: Any = None) -> tuple[dict[str, Any], cfgmod.OverlapConfig | None, list[str]]:
    """(config section, the configuration (None when it is refused), the
    problems: one ``configuration: ...`` line per malformed variable)."""
    import os

    env = os.environ if env is None else env
    try:
        cfg = cfgmod.load_config(env)
        error, problems = None, []
    except cfgmod.ConfigError as exc:
        cfg, error, problems = None, str(exc), [f"configuration: {p}" for p in exc.problems]
    switches = []
    for name, fld in SWITCH_FIELDS.items():
        value = getattr(cfg, fld) if cfg is not None else None
        switches.append(
            {
                "name": name,
                "raw": env.get(name),
                "field": fld,
                "value": value,
                "description": cfgmod.ENV_VARS.get(name, ""),
            }
        )
    section = {
        "ok": error is None,
        "error": error,
        "enabled": cfg.enabled if cfg else None,
        "mode": cfg.mode if cfg else None,
        "rung": rung(cfg) if cfg else None,
        "ladder": list(FULL_LADDER),
        "layouts_listed": list(cfg.layouts) if cfg else None,
        "layouts": layout_rows(cfg) if cfg else None,
        "graph_comm_side": graph_comm_side(cfg, env.get(env_vars.ENV_GRAPH_COMM_SIDE)) if cfg else None,
        "switches": switches,
    }
    return section, cfg, problems


#: The channel the FFN ranks' exchanges take (``rank_group.RankGroup.channel``, without its key prefix).
GROUP_CHANNEL = "the default process group's c10d store"
#: Who the FFN ranks of a group are (``rank_group.discover``).
GROUP_MEMBERS = (
    "the ranks sharing the MoE's collectives (vLLM's expert-parallel group, else the torch.distributed world)"
)


def _dist_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")  # nothing imported: a worker's process already has it
    try:
        return dist is not None and bool(dist.is_available()) and bool(dist.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without it: not initialized
        return False


def group_section(cfg: cfgmod.OverlapConfig | None) -> dict[str, Any]:
    """The FFN rank group as this process would see it: ``initialized`` (whether torch.distributed has a process
    group here; doctor normally runs outside the worker, where it has none: this process is one FFN rank), and
    where it has one, what ``rank_group.discover()`` finds (``size``, ``rank``, ``members``, ``source``, or its
    ``problem``); ``channel``; ``timeout_s`` (VLLM_CAMP2P_MULTISTREAM_GROUP_TIMEOUT_S as configured; None: the
    configuration is refused)."""
    section: dict[str, Any] = {
        "initialized": _dist_initialized(),
        "size": 1,
        "rank": 0,
        "members": [0],
        "source": None,
        "problem": None,
        "channel": GROUP_CHANNEL,
        "timeout_variable": env_vars.ENV_GROUP_TIMEOUT,
        "timeout_s": cfg.group_timeout_s if cfg is not None else None,
    }
    if not section["initialized"]:
        return section
    try:
        found = rank_group.discover()
    except Exception as exc:  # noqa: BLE001 - reported
        section["problem"] = f"discovery failed ({type(exc).__name__}: {exc})"
        return section
    section.update(
        size=found.size, rank=found.rank, members=list(found.members), source=found.source, problem=found.problem
    )
    return section


def group_line(g: dict[str, Any]) -> str:
    """The ``FFN rank group:`` line of :func:`group_section`'s ``g``."""
    timeout = "(the configuration is refused)" if g["timeout_s"] is None else f"{g['timeout_s']:g} s"
    waits = f"each exchange waiting up to {g['timeout_variable']}={timeout}"
    if not g["initialized"]:
        return (
            "FFN rank group: this process is one FFN rank (torch.distributed is not initialized here); in a worker "
            f"with several FFN ranks, {GROUP_MEMBERS} decide together over {g['channel']}, {waits}; "
            'stats()["group"] shows it there'
        )
    if g["problem"] is not None:
        return f"FFN rank group: the FFN ranks cannot decide together here: {g['problem']} (adaptive engage is off)"
    if g["size"] == 1:
        return f"FFN rank group: this process is one FFN rank ({g['source']})"
    return (
        f"FFN rank group: FFN rank {g['rank']} of {g['size']} ({g['source']} {g['members']}), deciding together "
        f'over {g["channel"]}, {waits}; stats()["group"] shows it once a step engaged'
    )


#: The stage count the core verdicts assume without a deployment: CAMP2P with DBO runs two micro-batches.
DEFAULT_STAGES = 2


def core_section(
    cfg: cfgmod.OverlapConfig | None, device: str | None, deploy: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The core budget rule as this box would apply it (docs/design.md, "Cores beside collectives"): the numbers it
    reads, where from, and the verdict for each listed layout; None when the configuration is refused. The device's
    count is read from ``torch.npu`` where this box has an NPU; CAM's from the deployment (``--config``), else
    CAMP2P's default; the stage count from the deployment's ``num_ubatches``, else two."""
    if cfg is None:
        return None
    mod = None
    if device == "npu":
        import torch

        mod = getattr(torch, "npu", None)
    extra = (deploy or {}).get("extra") or {}
    aiv = extra.get("aiv_num")
    connector = SimpleNamespace(aiv_num=aiv) if aiv is not None else SimpleNamespace()
    # Judged as for an NPU: the FFN ranks doctor speaks for run on one, whatever this box has.
    budget = core_budget.read_budget("npu", mod, None, connector, cfg)
    if aiv is not None:
        budget = replace(budget, cam_from=f"aiv_num of {deploy['source']}")  # type: ignore[index]
    else:
        cam_from = (
            f"CAMP2P's default core_num {core_budget.DEFAULT_CAM_CORES}; doctor --config FILE reads the deployment's"
        )
        budget = replace(budget, cam_from=cam_from)
    used = [r for r in (deploy or {}).get("stages", []) if r.get("in_use")]
    stages = len(used) or DEFAULT_STAGES
    _, verdicts = core_budget.fit(layouts_of(cfg), stages, budget)
    return {
        "vector": budget.vector,
        "vector_from": budget.vector_from,
        "cam": budget.cam,
        "cam_from": budget.cam_from,
        "moe": budget.moe,
        "moe_from": budget.moe_from,
        "stages": stages,
        "verdicts": [{"layout": v.layout, "needed": v.needed, "fits": v.fits, "text": v.text} for v in verdicts],
    }


def core_lines(c: dict[str, Any]) -> list[str]:
    """The ``core budget:`` lines of :func:`core_section`'s ``c``."""
    lines = [f"core budget ({c['stages']} stage(s)): an overlap layout engages only where its kernels fit"]
    lines += [f"  [{'fits' if v['fits'] else 'SERIAL'}] {v['text']}" for v in c["verdicts"]]
    return lines


def describe_layout(layout: Layout) -> str:
    """Where ``layout`` runs each op kind, and in which order it issues the receives, in words."""

    def where(kind: str) -> str:
        return "the caller's stream C" if kind == CALLER else "each stage's side stream K_s"

    if layout.a2e == layout.e2a:
        comm = f"A2E/E2A on {where(layout.a2e)}"
    else:
        comm = f"A2E on {where(layout.a2e)}, E2A on {where(layout.e2a)}"
    order = "the overlap's order" if layout.prefetch else "the loop's order"
    return f"{comm} in {order}, the FFN on " + ("its side stream F" if layout.ffn_side else "C")


def layout_rows(cfg: cfgmod.OverlapConfig) -> list[dict[str, Any]]:
    """The layouts an engaged step runs under ``cfg`` (``plan.layouts_of``), in order: under ``overlap`` those listed
    in VLLM_CAMP2P_MULTISTREAM_LAYOUT (``listed_as``: the listed name; ``comm-side`` runs as ``e2a-only`` or
    ``a2e-only`` with a direction switched off), else the mode's own. ``decode_graph``: what a decode graph's overlap
    variant makes of it with VLLM_CAMP2P_MULTISTREAM_GRAPH on: ``captured``; ``needs-opt-in`` (A2E/E2A on side
    streams: upstream's serial graph is captured instead unless VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1);
    ``opted-in``; ``eager-only`` (not the first listed: graphs capture the first)."""
    rows = []
    for i, layout in enumerate(layouts_of(cfg)):
        listed_as = None
        if cfg.mode == "overlap":
            listed_as = layout.name if layout.name in cfgmod.LAYOUTS else "comm-side"
        if i > 0:
            graph, detail = EAGER_ONLY, "a decode graph captures the first listed layout"
        elif layout.comm_on_side and not cfg.graph_comm_side:
            graph = NEEDS_OPT_IN
            detail = (
                f"A2E/E2A on side streams: captured only with {env_vars.ENV_GRAPH_COMM_SIDE}=1, else upstream's "
                "serial graph; eager steps still run it"
            )
        elif layout.comm_on_side:
            graph, detail = OPTED_IN, f"A2E/E2A on side streams, captured: {env_vars.ENV_GRAPH_COMM_SIDE}=1"
        else:
            graph, detail = CAPTURED, "every CAM op on the capture's stream"
        rows.append(
            {
                "name": layout.name,
                "listed_as": listed_as,
                "a2e": layout.a2e,
                "e2a": layout.e2a,
                "ffn": layout.ffn,
                "order": "overlap" if layout.prefetch else "loop",
                "where": describe_layout(layout),
                "decode_graph": graph,
                "detail": detail,
            }
        )
    return rows


def graph_comm_side(cfg: cfgmod.OverlapConfig, raw: str | None) -> dict[str, Any]:
    """The ``comm-side`` decode-graph opt-in: its variable, whether it is set (``set``; ``raw`` as given), whether
    this configuration needs it (the first layout an engaged step runs puts A2E/E2A on side streams) and why it is
    an opt-in (a pointer)."""
    first = next(iter(layouts_of(cfg)), None)
    return {
        "name": env_vars.ENV_GRAPH_COMM_SIDE,
        "set": cfg.graph_comm_side,
        "raw": raw,
        "needed": first is not None and first.comm_on_side,
        "why": COMM_SIDE_GRAPH_WHY,
    }


def _rung_text(name: str, on: bool) -> str:
    text = f"[{name}]" if on else name
    return text + (f" ({OPT_IN_RUNGS[name]})" if name in OPT_IN_RUNGS else "")


def ladder_line(rung_now: str | None, graph: str | None) -> str:
    """The ladder, each rung the configuration is on in brackets (the layouts of ``rung_now``, and decode graphs when
    ``graph`` is not ``0``); a rung off the ladder (``e2a-only``, ``a2e-only``) is named after it, and ``off`` (the
    master switch) too."""
    if rung_now == "off":
        return (
            "ladder: "
            + " -> ".join(_rung_text(name, False) for name in FULL_LADDER)
            + f" ({env_vars.ENV_SWITCH} is off)"
        )
    on = set((rung_now or "").split(","))
    if graph not in (None, "0"):
        on.add(GRAPH_RUNG)
    line = "ladder: " + " -> ".join(_rung_text(name, name in on) for name in FULL_LADDER)
    off = sorted(on - set(FULL_LADDER) - {"", "none"})  # none: the layouts line says why
    if off:
        line += f"; {', '.join(off)}: off the ladder"
    return line


@dataclass(frozen=True)
class DecodeGraphs:
    """What decode graphs capture with this configuration on this box."""

    status: str  # "ok", "refused" or "off"
    reason: str

    @property
    def line(self) -> str:
        return f"decode graphs: {self.status}: {self.reason}"


def torch_npu_verdict(configured_backend: str | None) -> CaptureFixVerdict | None:
    """The verdict graph variants are judged by here: the installed
    torch_npu's; :data:`NOT_INSTALLED` when none is installed but the
    backend is configured ``npu``; None (not judged) otherwise. The doctor
    cannot know the runtime backend, so an installed torch_npu is judged
    whatever the configured backend."""
    found = installed_capture_fix()
    if found is None and configured_backend == "npu":
        return NOT_INSTALLED
    return found


def decode_graph_line(
    cfg: cfgmod.OverlapConfig | None,
    torch_npu: CaptureFixVerdict | None,
    extra_refusal: str | None = None,
) -> DecodeGraphs:
    """``off`` at ``GRAPH=0`` (or with no configuration), ``refused`` when
    graph variants are asked for and ``torch_npu`` (None: not judged) lacks
    the capture fix, the first layout an engaged step runs puts A2E/E2A on
    side streams without VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1, or
    ``extra_refusal`` (another source's reason, e.g. a missing capture
    target) says no, else ``ok``."""
    if cfg is None:
        return DecodeGraphs("off", f"the configuration is refused, so {UPSTREAM_GRAPH}")
    if cfg.graph == "0":
        return DecodeGraphs("off", f"{env_vars.ENV_GRAPH} is 0: {UPSTREAM_GRAPH} for every key; {rung_hint()}")
    asked = f"{env_vars.ENV_GRAPH}={cfg.graph}"
    refusals = [r for r in (extra_refusal,) if r is not None]
    first = next(iter(layouts_of(cfg)), None)
    if graph_needs_opt_in(cfg):
        refusals.append(
            f"the first layout, {first.name}, puts A2E/E2A on side streams, which a decode graph captures only with "
            f"{env_vars.ENV_GRAPH_COMM_SIDE}=1 (every key keeps upstream's serial graph; the eager overlap applies)"
        )
    if torch_npu is not None and not torch_npu.fixed:
        refusals.append(f"{torch_npu.reason}; {REFUSED_KEEPS}")
    if refusals:
        return DecodeGraphs("refused", f"{asked}, but " + "; and ".join(refusals))
    what = "the layer's step for every key" if cfg.graph == "1" else "both variants per key"
    if first is not None and cfg.mode == "overlap":
        what += f" (layout {first.name})"
    npu = torch_npu.reason if torch_npu is not None else "no torch_npu is installed, so no NPU capture is judged"
    return DecodeGraphs("ok", f"{asked}: decode graphs capture {what}; {npu}")


def _decode_graphs(cfg: cfgmod.OverlapConfig | None, extra_refusal: str | None = None) -> DecodeGraphs:
    return decode_graph_line(cfg, torch_npu_verdict(cfg.backend if cfg is not None else None), extra_refusal)


def vllm_ascend_check(manifest: StackManifest, found: str | None) -> dict[str, Any]:
    """The installed vLLM-Ascend against the line ``manifest`` was checked
    with: a release (same public version), or a commit (named by the
    setuptools-scm label of the installed version). Never gated: the patch
    targets live in afd-plugin; this tells a user what to check."""
    expected = manifest.vllm_ascend or None
    row: dict[str, Any] = {"expected": expected, "found": found, "status": "unknown", "detail": ""}
    commit = manifest.vllm_ascend_commit
    if found is None:
        row.update(status="not-installed", detail=f"no {VLLM_ASCEND_DIST} distribution is installed")
    elif commit is not None:
        ok, node = built_from(found, commit)
        if node is None:
            row["detail"] = f"{found} names no commit; check that vllm-ascend is commit {commit[:COMMIT_SHOWN]}"
        elif ok:
            row.update(status="ok", detail=f"{found} is built from commit {commit[:COMMIT_SHOWN]}")
        else:
            row.update(status="differs", detail=f"{found} is built from commit {node}, not {commit[:COMMIT_SHOWN]}")
    elif expected is not None:
        ok = same_release(found, expected)
        row.update(status="ok" if ok else "differs", detail=f"{found} {'is' if ok else 'is not'} release {expected}")
    return row


def _stack_match(chosen: StackManifest, vc: VersionCheck, checks: list[tuple[StackManifest, VersionCheck]]) -> dict:
    return {
        "stack": chosen.name if vc.ok else None,
        "describe": chosen.describe(),
        "why": vc.reason,
        "afd_plugin_source": chosen.afd_plugin_source,
        "candidates": [{"stack": m.name, "describe": m.describe(), "ok": c.ok, "reason": c.reason} for m, c in checks],
        "vllm_ascend": vllm_ascend_check(chosen, installed_version(VLLM_ASCEND_DIST)),
    }


def diagnose(stack: str | None = None, deployment: str | None = None) -> dict[str, Any]:
    """Everything the doctor reports, as a JSON-ready dict (schema in
    ``docs/benchmark.md``)."""
    problems: list[str] = []
    notes: list[str] = []
    versions = _versions()
    try:
        stacks = (load_manifest(stack),) if stack else load_manifests()
        checks = check_stacks(stacks)
        manifest, vc = select_checked(checks)
        match = _stack_match(manifest, vc, checks)
    except ManifestError as exc:
        config_section, cfg, config_problems = _config()
        graphs = _decode_graphs(cfg)
        return {
            "schema": SCHEMA,
            "ok": False,
            "problems": [f"manifest: {exc}", *config_problems] + ([graphs.line] if graphs.status == "refused" else []),
            "notes": [],
            "stack": stack,
            "stack_match": None,
            "versions": versions,
            "vllm_check": None,
            "targets": [],
            "device": None,
            "device_detail": "",
            "backend": None,
            "config": config_section,
            "decode_graphs": {"status": graphs.status, "reason": graphs.reason},
            "group": group_section(cfg),
            "cores": None,
            "deployment": read_deployment(deployment, cfg) if deployment else None,
        }
    if not vc.ok:
        problems.append(f"vLLM version gate: {vc.reason}")
    if versions["afd-plugin"] is None:
        problems.append(f"afd-plugin is not installed (distribution {AFD_PLUGIN_DIST})")
    ascend = match["vllm_ascend"]
    if vc.ok and ascend["status"] in ("differs", "unknown") and ascend["expected"]:
        notes.append(
            f"vLLM-Ascend: {ascend['detail']}; stack {manifest.name} was checked with vLLM-Ascend "
            f"{ascend['expected']} (not gated: make sure this vLLM-Ascend runs the vLLM and afd-plugin above)"
        )
    specs = list(manifest.targets())
    targets = [check_target(t) for t in specs]
    feature_refusals: list[str] = []  # an optional target's problem refuses its feature only
    for spec, row in zip(specs, targets, strict=True):
        if row["status"] == "ok":
            continue
        text = f"target {row['target']}: {row['status']}: {row['detail']}"
        if spec.optional is not None:
            feature_refusals.append(f"{text} (it only serves {spec.optional}; the eager overlap would apply)")
            notes.append(feature_refusals[-1])
        else:
            problems.append(text)
    config_section, cfg, config_problems = _config()
    problems += config_problems  # one per malformed variable
    if config_section["ok"] and not config_section["enabled"]:
        notes.append(f"{env_vars.ENV_SWITCH} is off: the patch layer would not apply (switch it on to use it)")
    device, device_detail = _device()
    backend = _backend(cfg.backend if cfg is not None else "auto", device)
    if backend["resolved"] is None:
        problems.append(f"stream backend: {backend['reason']}")
    elif backend["resolved"] == "cpu":
        notes.append("the cpu backend is for the emulation and tests, not for a deployment")
    graphs = _decode_graphs(cfg, "; ".join(feature_refusals) or None)
    if graphs.status == "refused":
        problems.append(graphs.line)
    group = group_section(cfg)
    if group["problem"] is not None:
        notes.append(f"FFN rank group: {group['problem']}: every FFN rank decides alone (adaptive engage is off)")
    deploy = None
    if deployment:
        deploy = read_deployment(deployment, cfg)
        problems += [f"deployment: {p}" for p in deploy["problems"]]
        if versions["afd-plugin"] is None:
            notes.append("afd-plugin is not installed: the deployment was read from the config alone")
    cores = core_section(cfg, device, deploy) if cfg is not None and cfg.mode == "overlap" else None
    if cores is not None and cores["verdicts"] and not any(v["fits"] for v in cores["verdicts"]):
        notes.append(
            "core budget: no listed layout fits the device's vector cores: every step would run upstream's path "
            '(docs/design.md, "Cores beside collectives"; docs/validation.md says how to settle the numbers on a box)'
        )
    return {
        "schema": SCHEMA,
        "ok": not problems,
        "problems": problems,
        "notes": notes,
        "stack": manifest.name,
        "stack_match": match,
        "versions": versions,
        "vllm_check": {"ok": vc.ok, "found": vc.found, "supported": vc.supported, "reason": vc.reason},
        "targets": targets,
        "device": device,
        "device_detail": device_detail,
        "backend": backend,
        "config": config_section,
        "decode_graphs": {"status": graphs.status, "reason": graphs.reason},
        "group": group,
        "cores": cores,
        "deployment": deploy,
    }


def layout_text(c: dict[str, Any]) -> list[str]:
    """The rollout lines of a readable config section: mode and rung, the ladder, the layouts an engaged step runs
    and the ``comm-side`` decode-graph opt-in."""
    graph = next((s["value"] for s in c["switches"] if s["name"] == env_vars.ENV_GRAPH), None)
    lines = [
        f"  rollout: mode {c['mode']}, rung {c['rung']}",
        f"  {ladder_line(c['rung'], graph)}; what to check at each rung: "
        'docs/validation.md ("Checklist for an Ascend box")',
    ]
    listed = ",".join(c["layouts_listed"])
    rows = c["layouts"]
    if c["mode"] != "overlap":
        lines.append(
            f"  layouts: {', '.join(r['name'] for r in rows)} (mode {c['mode']}; "
            f"{env_vars.ENV_LAYOUT}={listed} applies to mode overlap)"
        )
    elif not rows:
        lines.append(f"  layouts: none ({env_vars.ENV_LAYOUT}={listed} leaves none to run: every step runs serially)")
    else:
        several = "; adaptive engage measures each per shape and runs the fastest" if len(rows) > 1 else ""
        lines.append(f"  layouts ({env_vars.ENV_LAYOUT}={listed}{several}):")
        for r in rows:
            name = r["name"] if r["listed_as"] in (None, r["name"]) else f"{r['listed_as']} as {r['name']}"
            lines.append(f"    {name}: {r['where']}; decode graphs: {r['decode_graph']} ({r['detail']})")
    g = c["graph_comm_side"]
    state = f"set ({g['name']}={g['raw']})" if g["set"] else "not set"
    lines.append(f"  comm-side decode graphs: only with {g['name']}=1, {state}; why: {g['why']}")
    return lines


def doctor_text(d: dict[str, Any]) -> str:
    lines = [f"camp2p-overlap doctor (stack {d['stack']})", "", "versions (installed distributions):"]
    for name, version in d["versions"].items():
        lines.append(f"  {name:<15} {version or 'not installed'}")
    m = d.get("stack_match")
    if m is not None:
        head = f"stack: {m['stack']} matched" if m["stack"] else "stack: NONE matched"
        lines += ["", f"{head}: {m['describe']}"]
        for c in m["candidates"]:
            lines.append(f"  [{'ok' if c['ok'] else 'no'}] {c['stack']}: {c['reason']}")
        if m["afd_plugin_source"]:
            lines.append(f"  afd-plugin checked: {m['afd_plugin_source']}")
        a = m["vllm_ascend"]
        if a["expected"]:
            lines.append(f"  vLLM-Ascend checked: {a['expected']}; installed: {a['status']}" + (f" ({a['detail']})"))
    vc = d["vllm_check"]
    if vc is not None:
        lines += ["", f"vLLM version gate: {'ok' if vc['ok'] else 'REFUSED'}: {vc['reason']}"]
    lines += ["", "patch targets (imported to check):"]
    for row in d["targets"]:
        mark = "ok" if row["status"] == "ok" else row["status"].upper()
        lines.append(
            f"  [{mark}] {row['target']} ({row['action']})" + (f"\n      {row['detail']}" if row["detail"] else "")
        )
    b = d["backend"]
    lines += ["", f"device: {d['device'] or 'none'} ({d['device_detail']})"]
    if b is not None:
        lines.append(f"stream backend: configured {b['configured']} -> {b['resolved'] or 'none'} ({b['reason']})")
    c = d["config"]
    lines += [
        "",
        "switches" + ("" if c["ok"] else " (CONFIGURATION ERROR: each malformed one is a problem below)") + ":",
    ]
    for s in c["switches"]:
        raw = "unset" if s["raw"] is None else repr(s["raw"])
        value = "-" if s["value"] is None and not c["ok"] else repr(s["value"])
        lines.append(f"  {s['name']:<36} {raw:<10} -> {s['field']} = {value}")
    if c["ok"]:
        lines += layout_text(c)
    g = d.get("decode_graphs")
    if g is not None:
        lines += ["", DecodeGraphs(**g).line]
    if d.get("group") is not None:
        lines += ["", group_line(d["group"])]
    if d.get("cores") is not None:
        lines += ["", *core_lines(d["cores"])]
    if d.get("deployment") is not None:
        lines += deployment_text(d["deployment"])
    lines.append("")
    for note in d["notes"]:
        lines.append(f"note: {note}")
    if d["ok"]:
        lines.append("OK: nothing would refuse on this box.")
    else:
        lines.append(f"NOT READY: {len(d['problems'])} problem(s):")
        lines += [f"  - {p}" for p in d["problems"]]
    return "\n".join(lines)


def main_doctor(*, as_json: bool, stack: str | None = None, deployment: str | None = None, out: Any = None) -> int:
    import json

    out = out or sys.stdout
    d = diagnose(stack, deployment)
    print(json.dumps(d, indent=2) if as_json else doctor_text(d), file=out)
    return 0 if d["ok"] else 1
