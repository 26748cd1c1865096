"""Stand-in for ``afd_plugin.connectors.metadata``: the transfer dataclasses,
with the field names and order of the contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class AFDTransferMetadata:
    layer_idx: int | None = None
    stage_idx: int | None = None
    seq_lens: Any = None


@dataclass(slots=True)
class AFDTransferContext:
    metadata: AFDTransferMetadata
    states: Any = None


@dataclass(slots=True)
class AFDA2FTransferPayload:
    hidden_states: Any
    context: AFDTransferContext


@dataclass(slots=True)
class AFDF2ATransferPayload:
    routed_output: Any
    shared_output: Any = None


@dataclass(slots=True)
class AFDControlPayload:
    dp_metadata_list: Any
    is_graph_capturing: bool = False
    is_warmup: bool = False
