"""The CAMP2P adapter: what the wrappers know of afd-plugin's CAMP2P
connector and NPU FFN runner (the targets of ``patches/*.toml``): how their
calls carry the stage, layer and context, and which HCCL group serves each
stage. The session and the engine know none of this."""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from functools import partial
from threading import get_ident
from typing import Any

#: The runner's layer list, read (never wrapped) to plan the lookahead.
LAYER_INDICES_TARGET = "_ffn_layer_indices"
#: CAMP2P's HCCL group of each stage id (the process-group names the
#: connector creates, one per micro-batch: ``afd``, ``afd1``, ``afd2``).
GROUPS = ("afd", "afd1", "afd2")
#: The connector attributes holding the HCCL communicator names of its
#: first, second and third group (empty when the group was not created).
COMM_NAME_FIELDS = ("hccl_comm_name", "hccl_comm_name2", "hccl_comm_name3")


class GroupError(ValueError):
    """A stage has no HCCL group the connector would use."""


def group_of(stage: int) -> str:
    return GROUPS[stage] if 0 <= stage < len(GROUPS) else f"stage {stage}"


def comm_names_for(num_ubatches: int) -> tuple[str, str, str]:
    """The three communicator-name fields as the connector fills them for
    ``num_ubatches``, group names standing in for the run-time HCCL names:
    the second repeats the first for one micro-batch; the third is empty below three."""
    n = max(1, int(num_ubatches))
    return GROUPS[0], GROUPS[1] if n > 1 else GROUPS[0], GROUPS[2] if n > 2 else ""


def resolve_group(stage: int, names: tuple[str, str, str]) -> str:
    """The communicator the connector's A2E/E2A of ``stage`` use (stage 1: the
    second name, else the first; stage 2: the third; others: the first).
    Raises :class:`GroupError` where the connector would fail."""
    first, second, third = names
    if stage < 0:
        raise GroupError(f"stage {stage} is negative")
    if stage == 1:
        name = second or first
    elif stage == 2:
        if not third:
            raise GroupError("stage 2 has no third HCCL group (hccl_comm_name3 is empty: num_ubatches < 3)")
        name = third
    else:
        name = first
    if not name:
        raise GroupError(f"stage {stage}: hccl_comm_name is empty (the connector is not initialized)")
    return name


def connector_comm_names(connector: Any) -> tuple[str, str, str]:
    """The connector's three communicator-name fields. Raises
    :class:`GroupError` when it lacks them."""
    try:
        first, second, third = _comm_names(connector)
    except AttributeError:
        missing = [f for f in COMM_NAME_FIELDS if not hasattr(connector, f)]
        if not missing:
            raise
        raise GroupError(f"{type(connector).__name__} has no {', '.join(missing)}") from None
    return str(first or ""), str(second or ""), str(third or "")


_comm_names = operator.attrgetter(*COMM_NAME_FIELDS)


def stage_groups(names: tuple[str, str, str], stages: Any) -> dict[int, str]:
    """Stage id -> communicator name, for every stage. Raises :class:`GroupError`."""
    return {int(s): resolve_group(int(s), names) for s in stages}


def shared_groups(groups: Mapping[int, str]) -> dict[str, list[int]]:
    """Communicator name -> its stages, for every name used by more than one stage."""
    by_group: dict[str, list[int]] = {}
    for s, g in sorted(groups.items()):
        by_group.setdefault(g, []).append(s)
    return {g: ss for g, ss in by_group.items() if len(ss) > 1}


def group_problem(connector: Any, stages: Any) -> str | None:
    """Why the step must not engage, or None: two stages on one HCCL group would
    put two streams on its window, whose A2E and E2A share a handshake counter."""
    try:
        names = connector_comm_names(connector)
    except GroupError as exc:
        return f"HCCL group check: {exc}"
    return _check_groups(names, tuple(stages))


@functools.lru_cache(maxsize=64)
def _check_groups(names: tuple[str, str, str], stages: tuple[int, ...]) -> str | None:
    """:func:`group_problem` for given names and stages (the same every step)."""
    try:
        groups = stage_groups(names, stages)
    except GroupError as exc:
        return f"HCCL group check: {exc}"
    shared = shared_groups(groups)
    if shared:
        what = "; ".join(f"stages {', '.join(map(str, ss))} share HCCL group {g!r}" for g, ss in shared.items())
        return f"HCCL group check: {what} (one side stream per group is required; is num_ubatches too small?)"
    return None


def stage_count(dp_metadata_list: Any) -> int:
    """How many stages ``_ffn_forward``'s ``dp_metadata_list`` names (1 when none)."""
    return max(len(dp_metadata_list or ()), 1)


def stage_ids(dp_metadata_list: Any) -> tuple[list[int], int]:
    """(sorted stage ids, stage count) of ``_ffn_forward``'s ``dp_metadata_list``."""
    if not dp_metadata_list:
        return [0], 1
    return sorted(map(int, dp_metadata_list)), len(dp_metadata_list)  # stage_count(), inline: not empty here


def max_stage_tokens(dp_metadata_list: Any, alike: bool = False) -> int:
    """The largest token count of the step's stages: ``num_tokens`` (the
    emulation), or the sum of vLLM's ``num_tokens_across_dp_cpu`` (every
    attention rank's tokens, proportional to what this FFN rank receives); 0
    when the metadata carries neither. ``alike``: the across-DP sum only (what
    every FFN rank receives alike), never this rank's own ``num_tokens``."""
    best = 0
    for meta in (dp_metadata_list or {}).values():
        count = None if alike else getattr(meta, "num_tokens", None)
        if count is None:
            count = _tokens_across_dp(meta)
        if type(count) is int:  # the common case, without int()'s checks
            if count > best:
                best = count
            continue
        try:
            best = max(best, int(count))
        except (TypeError, ValueError):
            continue
    return best


def _tokens_across_dp(meta: Any) -> Any:
    """The sum of ``num_tokens_across_dp_cpu`` (a small CPU tensor; 0: none),
    from ``tolist()``: a torch sum and its ``int()`` cost ten times as much,
    on every step."""
    across = getattr(meta, "num_tokens_across_dp_cpu", None)
    if across is None:
        return 0
    try:
        values = across.tolist() if hasattr(across, "tolist") else across
        if type(values) is list or type(values) is tuple:
            total = 0
            for v in values:
                if type(v) is not int:
                    return int(across.sum())  # nested, or not integers: the tensor's own sum
                total += v
            return total
        return int(values)
    except (TypeError, ValueError, AttributeError):
        return 0


#: The connector calls a ``route`` target may name, each handed by :func:`route` to the step's session.
SESSION_ROUTERS = ("recv_attn_output", "send_ffn_output")


def route(session: Any, key: str, callee: Any, thread: int, *args: Any, **kwargs: Any) -> Any:
    """A step's router of the connector call ``key`` (one of :data:`SESSION_ROUTERS`), bound with ``partial`` and set
    on the connector instance for the step (``routes.install_routes``): on the step's thread while ``session`` is open,
    the call goes to it; else ``callee`` runs it as it was made.

    - ``recv_attn_output(ubatch_idx=0, **kwargs)``: ``session.recv(callee, kw)``, ``kw`` the call's keywords with
      ``ubatch_idx`` by name (the session calls ``callee(**kw)``: the same call).
    - ``send_ffn_output(ffn_output, context, **kwargs)``: ``session.send(call, output, context, stage)``, ``call`` the
      call as it was made, ``stage`` its ``ubatch_idx``, else its context's ``metadata.stage_idx``."""
    if get_ident() != thread or session.closed:
        return callee(*args, **kwargs)
    if key == "recv_attn_output":
        if args or "ubatch_idx" not in kwargs:
            kwargs = {**kwargs, "ubatch_idx": args[0] if args else kwargs.get("ubatch_idx", 0)}
        return session.recv(callee, kwargs)
    n = len(args)
    output = args[0] if n else kwargs.get("ffn_output")
    context = args[1] if n >= 2 else kwargs.get("context")
    if "ubatch_idx" in kwargs:
        stage = int(kwargs["ubatch_idx"])
    else:
        stage = getattr(getattr(context, "metadata", None), "stage_idx", None)
        stage = None if stage is None else int(stage)
    return session.send(partial(callee, *args, **kwargs), output, context, stage)


def context_layer(ctx: Any) -> int | None:
    return getattr(getattr(ctx, "metadata", None), "layer_idx", None)


def context_of(payload: Any) -> Any:
    """What ties a received payload to the send of its FFN output: the
    payload's transfer context, which the loop passes back to the send."""
    return getattr(payload, "context", payload)
