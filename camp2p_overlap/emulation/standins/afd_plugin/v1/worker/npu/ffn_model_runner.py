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
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ....connectors.metadata import AFDF2ATransferPayload


def _npu() -> Any:
    """``torch.npu``, looked up at each call (importing this module imports
    no torch: a hook that wraps it must not pull torch in)."""
    import torch

    return torch.npu  # type: ignore[attr-defined]


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


# --- The decode graph path (FULL_DECODE_ONLY): stand-ins for the names the
# runner module imports from vLLM, vLLM-Ascend and afd-plugin's
# ``v1/worker/cuda_graph.py``. ``torch.npu`` is looked up at each call, never
# at import, so the emulated world can install its device module first.


class CUDAGraphMode(enum.Enum):
    """Stand-in for ``vllm.config.CUDAGraphMode`` (the members used here)."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2


class AFDGraphRunMode(str, enum.Enum):
    """What one ``execute_model`` call does (afd-plugin's ``cuda_graph``)."""

    EAGER = "eager"
    WARMUP = "warmup"
    CAPTURE = "capture"
    REPLAY = "replay"


#: Graph mode names with which a runner that is not forced eager uses graphs.
_GRAPH_MODE_NAMES = frozenset({"FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE"})
#: vLLM's capture flag (``vllm.compilation.monitor``), set around a capture.
_cudagraph_capturing_enabled: list[bool] = [False]
#: The platform's process-wide graph pool (vLLM ``Platform._global_graph_pool``).
_global_graph_pool: list[Any] = [None]


def set_cudagraph_capturing_enabled(enabled: bool) -> None:
    _cudagraph_capturing_enabled[0] = bool(enabled)


def get_global_graph_pool() -> Any:
    """One pool for every runner (upstream: per process; here: per stand-in
    module), made on first use from ``torch.npu.graph_pool_handle()``."""
    if _global_graph_pool[0] is None:
        _global_graph_pool[0] = _npu().graph_pool_handle()
    return _global_graph_pool[0]


@dataclass
class GraphCaptureContext:
    stream: Any


@contextlib.contextmanager
def graph_capture(device: Any = None) -> Iterator[GraphCaptureContext]:
    """Stand-in for vLLM-Ascend's ``graph_capture``: the capture runs on a new
    stream, ordered after the work already queued on the current one."""
    stream = _npu().Stream(device=device)
    current = _npu().current_stream()
    if current is not stream:
        stream.wait_stream(current)
    with _npu().stream(stream):
        yield GraphCaptureContext(stream)


def _token_values(values: Any) -> tuple[int, ...]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (int, float)):
        return (int(values),)
    return tuple(int(v) for v in values)


def _aggregates(attention_size: int | None, ffn_size: int | None) -> bool:
    return (
        attention_size is not None
        and ffn_size is not None
        and int(ffn_size) > 0
        and int(attention_size) >= int(ffn_size)
        and int(attention_size) % int(ffn_size) == 0
    )


def _per_ffn_rank(values: tuple[int, ...], attention_size: int, ffn_size: int, fallback: int) -> tuple[int, ...]:
    # DP-level counts (one per DP rank) stand for every TP rank of that DP rank.
    if values and len(values) < attention_size and attention_size % len(values) == 0:
        repeat = attention_size // len(values)
        values = tuple(v for v in values for _ in range(repeat))
    if len(values) < attention_size:
        return (max(1, fallback),) * ffn_size
    group = attention_size // ffn_size
    return tuple(max(1, sum(values[i * group : (i + 1) * group])) for i in range(ffn_size))


def make_ffn_graph_key(
    dp_metadata_list: Any,
    *,
    attention_size: int | None = None,
    ffn_size: int | None = None,
    fallback: int = 1,
) -> tuple[tuple[int, tuple], ...]:
    """The FFN graph key: per stage id, in order, ``(stage_idx, counts)`` with
    the stage's token counts across attention ranks
    (``num_tokens_across_dp_cpu``) summed per FFN rank when the attention
    ranks split evenly over the FFN ranks. Metadata without counts keys as
    ``fallback`` per FFN rank, or as its ``repr`` when nothing aggregates."""
    parts: list[tuple[int, tuple]] = []
    aggregate = _aggregates(attention_size, ffn_size)
    for stage_idx, meta in sorted((dp_metadata_list or {}).items()):
        counts = getattr(meta, "num_tokens_across_dp_cpu", None)
        if counts is None:
            values: tuple = (max(1, int(fallback)),) * int(ffn_size) if aggregate else (repr(meta),)
        else:
            values = _token_values(counts)
            if aggregate:
                values = _per_ffn_rank(values, int(attention_size), int(ffn_size), int(fallback))
        parts.append((int(stage_idx), values))
    return tuple(parts)


def graph_run_mode(
    *, is_warmup: bool, is_graph_capturing: bool, graph_enabled: bool, graph_exists: bool
) -> AFDGraphRunMode:
    """Warm-up first, then capture; replay only a captured key; else eager."""
    if is_warmup:
        return AFDGraphRunMode.WARMUP
    if is_graph_capturing:
        return AFDGraphRunMode.CAPTURE
    if graph_enabled and graph_exists:
        return AFDGraphRunMode.REPLAY
    return AFDGraphRunMode.EAGER


def _use_npu_aclgraph(vllm_config: Any, inherited: bool) -> bool:
    """Graphs on unless forced eager: asked for (``inherited``) or a graph
    ``cudagraph_mode`` in the config. Without a config, as asked."""
    if vllm_config is None:
        return bool(inherited)
    if bool(getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False)):
        return False
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return bool(inherited) or getattr(mode, "name", None) in _GRAPH_MODE_NAMES


class AFDNPUFFNModelRunner(NPUModelRunner):
    def __init__(
        self,
        *,
        connector: Any,
        model: Any,
        num_layers: int,
        max_num_tokens: int,
        afd_config: Any,
        device: Any = "cpu",
        model_config: Any = None,
        vllm_config: Any = None,
        use_aclgraph: bool = False,
    ) -> None:
        self.connector = connector
        self.model = model
        self.num_layers = num_layers
        self.max_num_tokens = max_num_tokens
        self.afd_config = afd_config
        self.device = device
        self.model_config = model_config
        self.vllm_config = vllm_config
        self.use_aclgraph = _use_npu_aclgraph(vllm_config, use_aclgraph)
        #: One captured graph per graph key: {"graph": ..., "output": ...}.
        self._acl_graphs: dict[tuple, dict[str, Any]] = {}
        self.graph_pool = get_global_graph_pool() if self.use_aclgraph else None

    def execute_ffn_step(self, *, dp_metadata_list, is_graph_capturing=False, is_warmup=False):
        if dp_metadata_list is None:
            raise RuntimeError("AFD NPU FFN requires dp_metadata_list")
        if bool(self.use_aclgraph) and (is_graph_capturing or is_warmup):
            self.capture_model(
                dp_metadata_list=dp_metadata_list,
                is_warmup=is_warmup,
                is_attn_graph_capturing=is_graph_capturing,
            )
            return None
        self.execute_model(dp_metadata_list=dp_metadata_list)
        return None

    def execute_model(
        self,
        scheduler_output=None,
        intermediate_tensors=None,
        *,
        dp_metadata_list=None,
        is_graph_capturing=False,
        is_warmup=False,
    ):
        if dp_metadata_list is None:
            raise RuntimeError("the FFN runner steps on the DP metadata the attention side sent; got none")
        graph_info = self._acl_graphs.get(self._make_graph_key(dp_metadata_list))
        enabled = bool(self.use_aclgraph)
        mode = graph_run_mode(
            is_warmup=is_warmup and enabled,
            is_graph_capturing=is_graph_capturing and enabled,
            graph_enabled=enabled,
            graph_exists=graph_info is not None,
        )
        if mode is AFDGraphRunMode.REPLAY:
            graph_info["graph"].replay()  # no host work: no state update, no input copy
            return None
        if mode in (AFDGraphRunMode.WARMUP, AFDGraphRunMode.CAPTURE):
            return self.execute_ffn_step(
                dp_metadata_list=dp_metadata_list,
                is_graph_capturing=is_graph_capturing,
                is_warmup=is_warmup,
            )
        self._ffn_forward(dp_metadata_list=dp_metadata_list)
        return None

    def _make_graph_key(self, dp_metadata_list) -> tuple:
        attention_size = getattr(self.connector, "attn_size", None)
        ffn_size = getattr(self.connector, "ffn_size", None)
        return make_ffn_graph_key(
            dp_metadata_list,
            attention_size=None if attention_size is None else int(attention_size),
            ffn_size=None if ffn_size is None else int(ffn_size),
            fallback=int(self.max_num_tokens),
        )

    def capture_model(self, dp_metadata_list=None, is_warmup=False, is_attn_graph_capturing=True) -> int:
        """One warm-up step (eager) or one capture of this step's key; returns
        the device memory the call took (free memory before minus after)."""
        if not self.use_aclgraph:
            return 0
        if dp_metadata_list is None:
            raise RuntimeError("a graph capture needs the DP metadata of the step it captures")
        free_before = int(_npu().mem_get_info()[0])
        set_cudagraph_capturing_enabled(True)
        try:
            if is_warmup:
                self._ffn_forward(dp_metadata_list=dp_metadata_list, is_graph_capturing=False)
            else:
                with graph_capture(device=self.device):
                    self._capture_graphs(
                        aclgraph_runtime_mode=CUDAGraphMode.FULL,
                        dp_metadata_list=dp_metadata_list,
                        is_attn_graph_capturing=is_attn_graph_capturing,
                    )
        finally:
            set_cudagraph_capturing_enabled(False)
        return max(0, free_before - int(_npu().mem_get_info()[0]))

    def _capture_graphs(self, *, aclgraph_runtime_mode, dp_metadata_list, is_attn_graph_capturing=True) -> None:
        control_plane = self.connector.control_plane
        if control_plane is None:
            raise RuntimeError("graph capture needs a connector with a DP metadata control plane")
        graph_key = self._make_graph_key(dp_metadata_list)
        if graph_key in self._acl_graphs:
            return  # one graph per key
        graph = _npu().NPUGraph()
        # The connector state is set once, outside the graph; the captured loop skips it.
        control_plane.update_state_from_dp_metadata(dp_metadata_list)
        with _npu().graph(graph, pool=self.graph_pool):
            output = self._ffn_forward(
                dp_metadata_list=dp_metadata_list,
                aclgraph_runtime_mode=aclgraph_runtime_mode,
                is_graph_capturing=is_attn_graph_capturing,
                update_connector_state=False,
            )
        self._acl_graphs[graph_key] = {"graph": graph, "output": output}

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
