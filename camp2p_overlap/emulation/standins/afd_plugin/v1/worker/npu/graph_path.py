"""Stand-ins for the decode graph path (FULL_DECODE_ONLY) that both
afd-plugin lines share: the names the FFN runner module takes from vLLM,
vLLM-Ascend and afd-plugin's ``v1/worker/cuda_graph.py``, and the runner's
graph methods (``__init__``'s graph fields, ``execute_ffn_step``,
``execute_model``, ``_make_graph_key``, ``capture_model``,
``_capture_graphs``). Each runner stand-in assigns the methods in its own
class body, so they are attributes of the class that upstream defines them
on (docs/design.md, "Upstream's decode graph path (FULL_DECODE_ONLY)").
This file has no upstream counterpart; it only keeps the two stand-ins from
repeating the same code. Written from the upstream interface, not upstream's
code.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


def _npu() -> Any:
    """``torch.npu``, looked up at each call (importing this module imports
    no torch: a hook that wraps the runner module must not pull torch in)."""
    import torch

    return torch.npu  # type: ignore[attr-defined]


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


def init_runner(
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
