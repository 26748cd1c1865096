"""Stand-in for ``afd_plugin.v1.worker.npu.ffn_model_runner`` as on
afd-plugin's ``main`` (commit 2e4378f, vLLM 0.26.0; stack ``vllm-0.26.0``),
imported under that module name when the finder models that stack.

What differs from the ``release/v0.19.1rc1`` stand-in
(``ffn_model_runner.py``), as docs/design.md records it:

* the loop enters a fresh forward context for every (layer, stage), sized by
  that stage's tokens, and receives, computes and sends inside it;
* ``_ffn_layer_indices`` reads ``runner.afd_config`` directly (a runner
  without one raises ``AttributeError``).

The decode graph path (``use_aclgraph``, ``capture_model``,
``_capture_graphs``, ``execute_model``'s replay; graph key and pool) is the
release line's unchanged; the captured loop is this file's ``_ffn_forward``.

The signatures of ``_ffn_forward`` and ``_ffn_layer_indices`` are those of
the release line. Written from the upstream interface, not upstream's code.
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
    if not runner.afd_config.compute_gate_on_attention:
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
        num_stages = max(len(dp_metadata_list), 1)
        stage_ids = sorted(int(k) for k in dp_metadata_list) or [0]
        out = None
        for layer_idx in _ffn_layer_indices(self):
            for stage_idx in stage_ids:
                # One context per (layer, stage), sized by this stage's tokens.
                with ascend_forward_context(
                    num_stages=num_stages,
                    num_tokens=_stage_tokens(self, dp_metadata_list, stage_idx),
                    aclgraph_runtime_mode=aclgraph_runtime_mode,
                ) as ctx:
                    payload = self.connector.recv_attn_output(
                        ubatch_idx=stage_idx, layer_idx=layer_idx, max_num_tokens=self.max_num_tokens
                    )
                    payload.context.metadata.layer_idx = layer_idx
                    payload.context.metadata.stage_idx = stage_idx
                    ctx["dp_metadata"] = dp_metadata_list.get(stage_idx)
                    ctx["additional_kwargs"]["afd_metadata"] = payload.context.metadata
                    _set_moe_layer_index(layer_idx)
                    out = self.model.compute_ffn_output(hidden_states=payload.hidden_states, layer_idx=layer_idx)
                    _send_ffn_output(self.connector, out, payload.context, stage_idx=stage_idx)
        return out
