"""``doctor --config``: read a deployment's AFD settings the way the CAMP2P
connector will see them, without starting anything.

Input: a vLLM config file (the YAML or JSON given to ``vllm serve
--config``; keys with dashes or underscores), a JSON file, or a JSON string,
holding any of:

* ``additional_config`` (a mapping, or the JSON string the CLI takes) with
  the ``afd`` section: ``connector``, ``role``, ``connector_extra_config``
  (afd-plugin's legacy ``afd_connector``/``afd_role`` names too);
* or the ``afd`` section at the top level;
* vLLM's micro-batching settings ``enable_dbo`` and ``ubatch_size`` (top
  level or under ``parallel_config``), or an explicit ``num_ubatches``.

What it reports (docs/design.md, "What `doctor --config` reads"): the connector class
and role; ``num_ubatches`` as the connector computes it (2 with DBO, else
``ubatch_size``, at least 1), and from it the HCCL group of each of CAMP2P's
three stages by the connector's fallback rule, with stages that share a
group flagged; ``core_num``/``attn_core_num``/``ffn_core_num`` from
``connector_extra_config`` and the resulting ``aiv_num`` of the role; and
the rollout mode and ladder rung the environment sets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from camp2p_overlap.core import config as cfgmod
from camp2p_overlap.core import env_vars
from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.plan import rung

CAMP2P = "CAMP2pAFDConnector"
#: afd-plugin's default connector when the section names none.
DEFAULT_CONNECTOR = "P2pNcclAFDConnector"
#: The connector_extra_config fields the CAMP2P connector accepts.
CAMP2P_EXTRA_FIELDS = ("core_num", "attn_core_num", "ffn_core_num", "compute_gate_on_attention", "quant_mode")
DEFAULT_CORE_NUM = 8
_ALIASES = {"afd_connector": "connector", "afd_role": "role", "afd_host": "host", "afd_port": "port"}


class DeploymentError(ValueError):
    """The deployment config cannot be read."""


def _norm(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k).replace("-", "_"): v for k, v in raw.items()}


def load_source(source: str) -> tuple[dict[str, Any], str]:
    """(the config as a mapping, where it came from): a file (YAML or JSON)
    or an inline JSON string."""
    path = Path(source)
    text, origin = source, "inline JSON"
    if not source.lstrip().startswith("{"):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise DeploymentError(f"cannot read {source}: {exc.strerror or exc}") from None
        origin = str(path)
    data: Any
    if origin != "inline JSON" and path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise DeploymentError(f"{source} is YAML; reading it needs pyyaml (pip install pyyaml)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise DeploymentError(f"{source} is not valid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DeploymentError(f"{origin} is not valid JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise DeploymentError(f"{origin} holds a {type(data).__name__}, not a mapping")
    return _norm(data), origin


def _afd_section(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    extra = cfg.get("additional_config")
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError as exc:
            raise DeploymentError(f"additional_config is not valid JSON: {exc}") from None
    afd = extra.get("afd") if isinstance(extra, Mapping) else None
    if afd is None:
        afd = cfg.get("afd")
    if afd is None:
        return None
    if not isinstance(afd, Mapping):
        raise DeploymentError(f"the afd section is a {type(afd).__name__}, not a mapping")
    return {_ALIASES.get(k, k): v for k, v in _norm(afd).items()}


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _num_ubatches(cfg: Mapping[str, Any]) -> tuple[int, str]:
    """(num_ubatches as the connector uses it, where it came from)."""
    parallel = cfg.get("parallel_config")
    scopes = [cfg] + ([_norm(parallel)] if isinstance(parallel, Mapping) else [])
    for scope in scopes:
        if scope.get("num_ubatches") is not None:
            return max(1, int(scope["num_ubatches"])), "num_ubatches"
    for scope in scopes:
        if _as_bool(scope.get("enable_dbo", False)):
            return 2, "enable_dbo"
    for scope in scopes:
        if scope.get("ubatch_size") is not None:
            return max(1, int(scope["ubatch_size"])), "ubatch_size"
    return 1, "default (no DBO, ubatch_size unset)"


def _positive_int(extra: Mapping[str, Any], key: str, problems: list[str]) -> int | None:
    value = extra.get(key)
    if value is None:
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        problems.append(f"connector_extra_config.{key}={value!r} is not an integer")
        return None
    if n <= 0:
        problems.append(f"connector_extra_config.{key}={n} must be positive")
        return None
    return n


def stage_map(num_ubatches: int) -> list[dict[str, Any]]:
    """CAMP2P's three stages: the group of each (or why it has none), whether
    the deployment's micro-batches use it, and the stages it shares its group with."""
    names = camp2p.comm_names_for(num_ubatches)
    rows: list[dict[str, Any]] = []
    for stage in range(env_vars.MAX_STAGES):
        try:
            group, error = camp2p.resolve_group(stage, names), None
        except camp2p.GroupError as exc:
            group, error = None, str(exc)
        rows.append({"stage": stage, "group": group, "in_use": stage < num_ubatches, "error": error})
    shared = camp2p.shared_groups(_groups_of(rows))
    for row in rows:
        row["shares_group_with"] = [s for s in shared.get(row["group"], []) if s != row["stage"]]
    return rows


def _groups_of(rows: list[dict[str, Any]]) -> dict[int, str]:
    """Stage -> group, for the rows of :func:`stage_map` that have one."""
    return {r["stage"]: r["group"] for r in rows if r["group"] is not None}


def read_deployment(source: str, overlap: cfgmod.OverlapConfig | None) -> dict[str, Any]:
    """The deployment section of the doctor's report (never raises: a
    config that cannot be read is a problem in it)."""
    out: dict[str, Any] = {"source": source, "problems": [], "notes": []}
    problems: list[str] = out["problems"]
    notes: list[str] = out["notes"]
    if overlap is not None:
        out["mode"], out["rung"] = overlap.mode, rung(overlap)
    else:
        out["mode"] = out["rung"] = None
    try:
        cfg, origin = load_source(source)
        afd = _afd_section(cfg)
        num_ubatches, from_key = _num_ubatches(cfg)
    except (DeploymentError, TypeError, ValueError) as exc:
        problems.append(f"deployment config: {exc}")
        return out
    out["source"] = origin
    if afd is None:
        problems.append('deployment config: no AFD section (additional_config["afd"]): AFD is off')
        return out
    connector = str(afd.get("connector", DEFAULT_CONNECTOR))
    role = str(afd.get("role", "attention"))
    out.update(connector=connector, role=role, num_ubatches=num_ubatches, num_ubatches_from=from_key)
    if connector != CAMP2P:
        problems.append(f"connector is {connector}: the overlap applies to {CAMP2P} only")
    if role != "ffn":
        notes.append(f"role is {role!r}: the overlap runs on FFN ranks only; check the FFN ranks' config")
    stages = stage_map(num_ubatches)
    out["stages"] = stages
    used = [r for r in stages if r["in_use"]]
    out["aliased"] = camp2p.shared_groups(_groups_of(stages))
    in_use = {r["stage"] for r in used}
    for g, ss in out["aliased"].items():
        text = (
            f"stages {', '.join(map(str, ss))} map to one HCCL group {g!r} (num_ubatches={num_ubatches}): "
            "a step with those stages runs serially (the HCCL group check refuses it)"
        )
        if len(in_use.intersection(ss)) > 1:
            problems.append(text)
        else:
            notes.append(text + "; only one of them is a micro-batch of this config")
    min_stages = overlap.min_stages if overlap is not None else 2
    if len(used) < min_stages:
        notes.append(
            f"num_ubatches={num_ubatches}: steps have {len(used)} stage(s), fewer than "
            f"{env_vars.ENV_MIN_STAGES}={min_stages}: the overlap will not engage"
        )
    raw_extra = afd.get("connector_extra_config") or {}
    if not isinstance(raw_extra, Mapping):
        problems.append(f"connector_extra_config is a {type(raw_extra).__name__}, not a mapping")
        raw_extra = {}
    extra = _norm(raw_extra)
    if connector == CAMP2P:
        unknown = sorted(k for k in extra if k not in CAMP2P_EXTRA_FIELDS)
        if unknown:
            problems.append(f"connector_extra_config has field(s) the CAMP2P connector rejects: {', '.join(unknown)}")
    core_num = _positive_int(extra, "core_num", problems) or DEFAULT_CORE_NUM
    ffn_core_num = _positive_int(extra, "ffn_core_num", problems)
    attn_core_num = _positive_int(extra, "attn_core_num", problems)
    override = ffn_core_num if role == "ffn" else attn_core_num if role == "attention" else None
    out["extra"] = {
        "core_num": core_num,
        "ffn_core_num": ffn_core_num,
        "attn_core_num": attn_core_num,
        "aiv_num": override if override is not None else core_num,
    }
    return out


def deployment_text(d: Mapping[str, Any]) -> list[str]:
    """The text lines of the deployment section."""
    lines = ["", f"deployment ({d['source']}):"]
    if "connector" in d:
        lines.append(f"  connector {d['connector']}, role {d['role']}")
        lines.append(f"  num_ubatches {d['num_ubatches']} (from {d['num_ubatches_from']})")
        for r in d["stages"]:
            where = r["group"] or f"none ({r['error']})"
            flags = [] if r["in_use"] else ["not used"]
            if r["shares_group_with"]:
                flags.append("ALIASED with stage " + ", ".join(map(str, r["shares_group_with"])))
            lines.append(f"  stage {r['stage']} -> group {where}" + (f"  [{'; '.join(flags)}]" if flags else ""))
        e = d["extra"]
        lines.append(
            f"  aiv_num {e['aiv_num']} (core_num {e['core_num']}, ffn_core_num {e['ffn_core_num']}, "
            f"attn_core_num {e['attn_core_num']})"
        )
    lines.append(f"  mode {d['mode']}, rung {d['rung']} (from the environment)")
    lines += [f"  note: {n}" for n in d["notes"]]
    lines += [f"  PROBLEM: {p}" for p in d["problems"]]
    return lines
