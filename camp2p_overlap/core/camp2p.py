"""The CAMP2P adapter: what the wrappers know of afd-plugin's CAMP2P
connector and NPU FFN runner (the targets of ``patches/*.toml``): how their
calls carry the stage, layer and context, and which HCCL group serves each
stage. The session and the engine know none of this."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The wrapped connector method whose owner is the CAMP2P connector class.
CONNECTOR_TARGET = "CAMP2pAFDConnector.recv_attn_output"
#: The runner's layer list, read (never wrapped) to plan the lookahead.
LAYER_INDICES_TARGET = "_ffn_layer_indices"
#: CAMP2P's HCCL group of each stage id.
GROUPS = ("afd", "afd1", "afd2")


def group_of(stage: int) -> str:
    return GROUPS[stage] if 0 <= stage < len(GROUPS) else f"stage {stage}"


def stage_ids(dp_metadata_list: Any) -> tuple[list[int], int]:
    """(sorted stage ids, stage count) of ``_ffn_forward``'s ``dp_metadata_list``."""
    if not dp_metadata_list:
        return [0], 1
    return sorted(int(k) for k in dp_metadata_list), max(len(dp_metadata_list), 1)


def max_stage_tokens(dp_metadata_list: Any) -> int:
    """The largest token count of the step's stages, from what the DP
    metadata carries: ``num_tokens`` (the emulation), or the sum of vLLM's
    ``num_tokens_across_dp_cpu`` (every attention rank's tokens for the
    stage; CAMP2P splits them over the FFN ranks, so it is proportional to
    what this rank receives). 0 when none of that is there."""
    best = 0
    for meta in (dp_metadata_list or {}).values():
        count = getattr(meta, "num_tokens", None)
        if count is None:
            across = getattr(meta, "num_tokens_across_dp_cpu", None)
            try:
                count = int(across.sum()) if across is not None else 0
            except (TypeError, ValueError, AttributeError):
                count = 0
        try:
            best = max(best, int(count))
        except (TypeError, ValueError):
            continue
    return best


def recv_kwargs(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``recv_attn_output(self, ubatch_idx=0, **kwargs)`` call -> its kwargs."""
    out = dict(kwargs)
    if args:
        out["ubatch_idx"] = args[0]
    out.setdefault("ubatch_idx", 0)
    return out


def send_parts(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
    """``send_ffn_output(self, ffn_output, context, **kwargs)`` -> (output, context)."""
    rest = list(args)
    out = rest.pop(0) if rest else kwargs.get("ffn_output")
    ctx = rest.pop(0) if rest else kwargs.get("context")
    return out, ctx


def send_stage(ctx: Any, kwargs: Mapping[str, Any]) -> int | None:
    """The stage a send is for: its ``ubatch_idx``, else its context's ``stage_idx``."""
    if "ubatch_idx" in kwargs:
        return int(kwargs["ubatch_idx"])
    stage = getattr(getattr(ctx, "metadata", None), "stage_idx", None)
    return None if stage is None else int(stage)


def context_layer(ctx: Any) -> int | None:
    return getattr(getattr(ctx, "metadata", None), "layer_idx", None)


def context_of(payload: Any) -> Any:
    """What ties a received payload to the send of its FFN output: the
    payload's transfer context, which the loop passes back to the send."""
    return getattr(payload, "context", payload)
