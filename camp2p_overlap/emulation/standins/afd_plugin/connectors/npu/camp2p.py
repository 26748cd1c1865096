"""Stand-in for ``afd_plugin.connectors.npu.camp2p``: ``CAMP2pAFDConnector``
with the contract's FFN-side methods and signatures.

The transport (``self.transport``, an emulated link to attention ranks, see
``camp2p_overlap.emulation.world``) plays the part of the ``a2e``/``e2a``
custom ops. Like the real connector, a receive touches no connector state
besides what it returns, so a later (layer, stage) can be received early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..metadata import AFDA2FTransferPayload, AFDTransferContext, AFDTransferMetadata


class AFDConnectorBase:
    """Stand-in for the connector base class."""


@dataclass
class CAMP2PTransferState:
    atten_batch_size: Any
    x_active_mask: Any = None


class _ControlPlane:
    def __init__(self, connector: CAMP2pAFDConnector) -> None:
        self._connector = connector

    def update_state_from_dp_metadata(self, dp_metadata_list: Any) -> None:
        self._connector.dp_metadata_list = dp_metadata_list


def _get_group_ep(ubatch_idx: int, name1: str, name2: str, name3: str) -> str:
    # The real connector's rule: stage 1 falls back to the first group when
    # there is no second; stage 2 has no fallback; other stages take the first.
    if ubatch_idx == 1:
        return name2 or name1
    if ubatch_idx == 2:
        if not name3:
            raise RuntimeError("CAMP2P ubatch 2 requires a third HCCL group")
        return name3
    if ubatch_idx < 0:
        raise RuntimeError(f"CAMP2P ubatch index must be non-negative: {ubatch_idx}")
    return name1


class CAMP2pAFDConnector(AFDConnectorBase):
    def __init__(self, transport: Any = None, *, hidden_size: int = 0, num_ubatches: int = 3, aiv_num: int = 8) -> None:
        self.transport = transport
        #: The vector cores each A2E/E2A runs on (the real connector's, from ``core_num``/``ffn_core_num``).
        self.aiv_num = aiv_num
        # One HCCL group per micro-batch, named as the real connector's
        # process groups are (the real fields hold HCCL communicator names).
        n = max(1, int(num_ubatches))
        self.num_ubatches = n
        self.hccl_comm_name = "afd"
        self.hccl_comm_name2 = "afd1" if n > 1 else self.hccl_comm_name
        self.hccl_comm_name3 = "afd2" if n > 2 else ""
        self.hidden_size = hidden_size
        self.dp_metadata_list: Any = None
        self.control_plane = _ControlPlane(self)
        self.is_graph_capturing = False
        self.is_warmup = False
        self.is_initialized = True

    def _num_tokens(self, ubatch_idx: int) -> int:
        meta = self.dp_metadata_list[ubatch_idx] if self.dp_metadata_list else None
        return int(getattr(meta, "num_tokens", meta or 0))

    def recv_attn_output(self, ubatch_idx: int = 0, **kwargs: Any) -> AFDA2FTransferPayload:
        layer_idx = kwargs["layer_idx"]
        max_num_tokens = kwargs.get("max_num_tokens")
        group = _get_group_ep(ubatch_idx, self.hccl_comm_name, self.hccl_comm_name2, self.hccl_comm_name3)
        hidden, atten_batch_size = self.transport.a2e(
            group=group,
            stage=ubatch_idx,
            layer=layer_idx,
            num_tokens=self._num_tokens(ubatch_idx),
            max_num_tokens=max_num_tokens,
        )
        context = AFDTransferContext(
            metadata=AFDTransferMetadata(layer_idx=layer_idx, stage_idx=ubatch_idx),
            states=CAMP2PTransferState(atten_batch_size=atten_batch_size),
        )
        return AFDA2FTransferPayload(hidden_states=hidden, context=context)

    def send_ffn_output(self, ffn_output: Any, context: Any, **kwargs: Any) -> None:
        ubatch_idx = kwargs.get("ubatch_idx", context.metadata.stage_idx)
        group = _get_group_ep(ubatch_idx, self.hccl_comm_name, self.hccl_comm_name2, self.hccl_comm_name3)
        self.transport.e2a(
            group=group,
            stage=ubatch_idx,
            layer=context.metadata.layer_idx,
            routed=ffn_output,
            shared=kwargs.get("expand_x_shared"),
            atten_batch_size=context.states.atten_batch_size,
        )
        return None
