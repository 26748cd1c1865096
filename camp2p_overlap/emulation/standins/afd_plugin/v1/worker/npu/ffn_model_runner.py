"""Stand-in for ``afd_plugin.v1.worker.npu.ffn_model_runner`` as on
afd-plugin's ``release/v0.19.1rc1`` line (stack ``vllm-0.19.1``): the FFN
runner with the contract's ``_ffn_forward`` loop shape and module helpers.
One forward context spans the whole step, sized by the first stage's
tokens; ``_ffn_layer_indices`` treats a runner without ``afd_config`` as
running every layer. (afd-plugin ``main``: ``ffn_model_runner_main.py``.)

The decode graph path (docs/design.md, "Upstream's decode graph path
(FULL_DECODE_ONLY)") is the same on both lines: with ``use_aclgraph``,
``execute_ffn_step`` sends warm-up and capture steps to ``capture_model``
(a warm-up runs ``_ffn_forward`` eagerly; a capture records it once per graph
key under ``torch.npu.graph(graph, pool=self.graph_pool)`` into
``self._acl_graphs[key]``), and ``execute_model`` replays a captured key and
runs any other eagerly. ``torch.npu`` is looked up at call time only.

Written from the upstream interface described in docs/design.md;
it keeps the order of calls and the signatures, not upstream's code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ....connectors.metadata import AFDF2ATransferPayload

_moe_layer_index: list[int | None] = [None]
#: The forward context in force (vLLM keeps one per process), or None.
_forward_context: list[dict[str, Any] | None] = [None]


class NPUModelRunner:
    """Stand-in base class (vLLM-Ascend's runner)."""


@contextlib.contextmanager
def ascend_forward_context(**kwargs: Any) -> Iterator[dict[str, Any]]:
    ctx = {"dp_metadata": None, "additional_kwargs": {}, **kwargs}
    previous, _forward_context[0] = _forward_context[0], ctx
    try:
        yield ctx
    finally:
        _forward_context[0] = previous


def get_forward_context() -> dict[str, Any] | None:
    return _forward_context[0]


def _stage_tokens(runner: Any, dp_metadata_list: Any, stage_idx: int) -> int:
    meta = (dp_metadata_list or {}).get(stage_idx)
    return int(getattr(meta, "num_tokens", 0) or 0) if meta is not None else int(runner.max_num_tokens)


def _set_moe_layer_index(layer_idx: int) -> None:
    _moe_layer_index[0] = layer_idx


def _is_moe_layer(hf_config: Any, layer_idx: int) -> bool:
    first_dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    freq = int(getattr(hf_config, "moe_layer_freq", 1) or 1)
    return layer_idx >= first_dense and layer_idx % freq == 0


def _ffn_layer_indices(runner):
    num_layers = max(int(runner.num_layers or 0), 1)
    afd_config = getattr(runner, "afd_config", None)
    if afd_config is None or not afd_config.compute_gate_on_attention:
        return range(num_layers)
    hf = runner.model_config.hf_config
    return [i for i in range(num_layers) if _is_moe_layer(hf, i)]


def _send_ffn_output(connector: Any, ffn_output: Any, context: Any, *, stage_idx: int) -> None:
    if not isinstance(ffn_output, AFDF2ATransferPayload):
        connector.send_ffn_output(ffn_output, context, ubatch_idx=stage_idx)
        return
    extra: dict[str, Any] = {"ubatch_idx": stage_idx}
    if ffn_output.shared_output is not None:
        extra["expand_x_shared"] = ffn_output.shared_output
    connector.send_ffn_output(ffn_output.routed_output, context, **extra)


# The names the runner module imports for its graph path (graph_path.py).
from . import graph_path  # noqa: E402
from .graph_path import (  # noqa: E402,F401 - re-exported under upstream's module
    AFDGraphRunMode,
    CUDAGraphMode,
    GraphCaptureContext,
    _cudagraph_capturing_enabled,
    _use_npu_aclgraph,
    get_global_graph_pool,
    graph_capture,
    graph_run_mode,
    make_ffn_graph_key,
    set_cudagraph_capturing_enabled,
)


class AFDNPUFFNModelRunner(NPUModelRunner):
    # The graph path (shared by both lines: graph_path.py), as attributes of
    # this class, where upstream defines them.
    __init__ = graph_path.init_runner
    execute_ffn_step = graph_path.execute_ffn_step
    execute_model = graph_path.execute_model
    _make_graph_key = graph_path._make_graph_key
    capture_model = graph_path.capture_model
    _capture_graphs = graph_path._capture_graphs

    def _ffn_forward(
        self,
        *,
        dp_metadata_list,
        aclgraph_runtime_mode=None,
        is_graph_capturing=False,
        update_connector_state=True,
    ):
        if update_connector_state:
            self.connector.control_plane.update_state_from_dp_metadata(dp_metadata_list)
        stage_ids = sorted(int(k) for k in dp_metadata_list) or [0]
        out = None
        with ascend_forward_context(
            num_stages=max(len(dp_metadata_list), 1),
            num_tokens=_stage_tokens(self, dp_metadata_list, stage_ids[0]),
        ) as ctx:
            for layer_idx in _ffn_layer_indices(self):
                for stage_idx in stage_ids:
                    payload = self.connector.recv_attn_output(
                        ubatch_idx=stage_idx, layer_idx=layer_idx, max_num_tokens=self.max_num_tokens
                    )
                    payload.context.metadata.layer_idx = layer_idx
                    payload.context.metadata.stage_idx = stage_idx
                    ctx["dp_metadata"] = dp_metadata_list[stage_idx] if dp_metadata_list else None
                    ctx["additional_kwargs"]["afd_metadata"] = payload.context.metadata
                    _set_moe_layer_index(layer_idx)
                    out = self.model.compute_ffn_output(hidden_states=payload.hidden_states, layer_idx=layer_idx)
                    _send_ffn_output(self.connector, out, payload.context, stage_idx=stage_idx)
        return out
