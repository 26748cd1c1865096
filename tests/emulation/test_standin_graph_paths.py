"""The stand-in FFN runners' decode graph path, on both stacks
(docs/design.md, "Upstream's decode graph path (FULL_DECODE_ONLY)"):
``execute_model`` runs eagerly without ``use_aclgraph``; with it, a warm-up
step runs ``_ffn_forward`` eagerly, a capture step records it once per graph
key under ``torch.npu.graph(graph, pool=...)`` into ``_acl_graphs[key]``, a
captured key replays without running the loop, and any other key runs
eagerly. ``torch.npu`` is a small recording fake here (set for the test
only), which runs the work at once on the host."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from camp2p_overlap.emulation import standins
from camp2p_overlap.emulation.world import StageMeta

pytestmark = pytest.mark.usefixtures("standin_stack")
HIDDEN = 4
LAYERS = 2


class FakeStream:
    def __init__(self, name: str, device: Any = None) -> None:
        self.name = name
        self.device = device
        self.waited: list[FakeStream] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other)


class FakeGraph:
    def __init__(self, npu: FakeNPU) -> None:
        self.npu = npu
        self.pools: list[Any] = []
        self.captured = False
        self.replays = 0

    def capture_begin(self, pool: Any = None) -> None:
        self.pools.append(pool)

    def capture_end(self) -> None:
        self.captured = True

    def replay(self) -> None:
        assert self.captured, "replay of a graph that was never captured"
        self.replays += 1
        self.npu.log.append("replay")


class FakeNPU:
    """The names of the emulated device module that the runner uses."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.default = FakeStream("default")
        self.current = self.default
        self.capturing: FakeGraph | None = None
        self.graphs: list[FakeGraph] = []
        self.pool = object()
        self.free = 1 << 20

    def Stream(self, device: Any = None) -> FakeStream:
        return FakeStream(f"s{len(self.log)}", device)

    def current_stream(self) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        previous, self.current = self.current, s
        try:
            yield
        finally:
            self.current = previous

    def NPUGraph(self) -> FakeGraph:
        graph = FakeGraph(self)
        self.graphs.append(graph)
        return graph

    @contextlib.contextmanager
    def graph(self, g: FakeGraph, pool: Any = None, stream: Any = None) -> Iterator[None]:
        self.log.append("graph:enter")
        g.capture_begin(pool=pool)
        self.capturing = g
        try:
            yield
        finally:
            self.capturing = None
            g.capture_end()
            self.free -= 4096  # the capture takes memory from the pool
            self.log.append("graph:exit")

    def graph_pool_handle(self) -> Any:
        self.log.append("graph_pool_handle")
        return self.pool

    def mem_get_info(self) -> tuple[int, int]:
        return self.free, 1 << 21

    def is_current_stream_capturing(self) -> bool:
        return self.capturing is not None

    def synchronize(self) -> None:
        self.log.append("synchronize")


class FakeTransport:
    """What the stand-in connector calls: A2E returns the stage's tokens, E2A records."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []

    def a2e(self, *, group: str, stage: int, layer: int, num_tokens: int, max_num_tokens: int) -> tuple:
        return torch.full((max(num_tokens, 1), HIDDEN), float(10 * stage + layer)), num_tokens

    def e2a(self, *, group: str, stage: int, layer: int, routed: Any, shared: Any, atten_batch_size: Any) -> None:
        self.sent.append((layer, stage))


class Model:
    def compute_ffn_output(self, *, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return hidden_states + layer_idx


class Spy:
    """Records each ``_ffn_forward`` call with the fake device's state, then runs it."""

    def __init__(self, runner: Any, npu: FakeNPU | None) -> None:
        self.original = runner._ffn_forward
        self.npu = npu
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> Any:
        seen = dict(kwargs)
        if self.npu is not None:
            seen["under_graph"] = self.npu.capturing
            seen["stream"] = self.npu.current
        self.calls.append(seen)
        return self.original(**kwargs)


def _modules() -> tuple[ModuleType, ModuleType]:
    runner_mod, conn_mod, _ = standins.import_standins(standins.REAL_ROOT)
    return runner_mod, conn_mod


def _runner(*, use_aclgraph: bool, npu: FakeNPU | None) -> tuple[Any, Spy, FakeTransport, list[Any]]:
    runner_mod, conn_mod = _modules()
    transport = FakeTransport()
    connector = conn_mod.CAMP2pAFDConnector(transport, hidden_size=HIDDEN)
    updates: list[Any] = []
    update = connector.control_plane.update_state_from_dp_metadata

    def record_update(dp: Any) -> None:
        updates.append(dp)
        update(dp)

    connector.control_plane.update_state_from_dp_metadata = record_update
    runner = runner_mod.AFDNPUFFNModelRunner(
        connector=connector,
        model=Model(),
        num_layers=LAYERS,
        max_num_tokens=16,
        afd_config=SimpleNamespace(compute_gate_on_attention=False),
        use_aclgraph=use_aclgraph,
    )
    spy = Spy(runner, npu)
    runner._ffn_forward = spy
    return runner, spy, transport, updates


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> FakeNPU:
    fake = FakeNPU()
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    return fake


def _dp(**tokens: int) -> dict[int, StageMeta]:
    return {int(s.removeprefix("s")): StageMeta(n) for s, n in tokens.items()}


def test_the_stack_has_its_own_runner_file(standin_stack: str) -> None:
    runner_mod, _ = _modules()
    want = "ffn_model_runner_main.py" if standin_stack == "vllm-0.26.0" else "ffn_model_runner.py"
    assert Path(runner_mod.__file__).name == want


def test_without_aclgraph_every_step_is_eager_and_no_device_module_is_touched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(torch, "npu", raising=False)  # any use of torch.npu would raise
    runner, spy, transport, _ = _runner(use_aclgraph=False, npu=None)
    assert runner.use_aclgraph is False and runner.graph_pool is None
    dp = _dp(s0=4, s1=3)
    runner.execute_model(dp_metadata_list=dp)
    runner.execute_ffn_step(dp_metadata_list=dp, is_warmup=True)
    runner.execute_ffn_step(dp_metadata_list=dp, is_graph_capturing=True)
    runner.execute_model(dp_metadata_list=dp, is_graph_capturing=True)
    assert [c["dp_metadata_list"] for c in spy.calls] == [dp] * 4
    assert all(set(c) == {"dp_metadata_list"} for c in spy.calls)  # upstream's eager call: nothing else
    assert runner._acl_graphs == {}
    assert runner.capture_model(dp_metadata_list=dp) == 0
    assert transport.sent == [(layer, stage) for _ in range(4) for layer in range(LAYERS) for stage in (0, 1)]


def test_the_graph_pool_is_one_per_stand_in_module(npu: FakeNPU) -> None:
    first, *_ = _runner(use_aclgraph=True, npu=npu)
    second, *_ = _runner(use_aclgraph=True, npu=npu)
    assert first.graph_pool is npu.pool and second.graph_pool is npu.pool
    assert npu.log.count("graph_pool_handle") == 1


def test_a_warm_up_step_runs_the_loop_eagerly_and_captures_nothing(npu: FakeNPU) -> None:
    runner, spy, transport, updates = _runner(use_aclgraph=True, npu=npu)
    dp = _dp(s0=4)
    runner.execute_ffn_step(dp_metadata_list=dp, is_warmup=True)
    runner.execute_model(dp_metadata_list=dp, is_warmup=True, is_graph_capturing=True)  # warm-up wins
    assert len(spy.calls) == 2
    for call in spy.calls:
        assert call["is_graph_capturing"] is False and call["under_graph"] is None
        assert call["stream"] is npu.default
        assert call.get("update_connector_state", True) is True  # the loop sets the connector state itself
    assert npu.graphs == [] and runner._acl_graphs == {}
    assert updates == [dp, dp]
    assert len(transport.sent) == 2 * LAYERS


def test_capture_records_the_loop_once_per_key_under_the_pool_and_replay_skips_it(
    npu: FakeNPU, standin_stack: str
) -> None:
    runner_mod, _ = _modules()
    runner, spy, transport, updates = _runner(use_aclgraph=True, npu=npu)
    dp = _dp(s0=4, s1=2)
    key = runner._make_graph_key(dp)

    runner.execute_ffn_step(dp_metadata_list=dp, is_graph_capturing=True)
    assert len(npu.graphs) == 1
    graph = npu.graphs[0]
    assert graph.pools == [npu.pool] and graph.captured
    (call,) = spy.calls
    assert call["under_graph"] is graph
    assert call["stream"] is not npu.default  # graph_capture's own stream
    assert call["stream"].waited == [npu.default]  # ordered after the work queued before the capture
    assert call["stream"].device == "cpu"  # made for the runner's device
    assert call["is_graph_capturing"] is True and call["update_connector_state"] is False
    assert call["aclgraph_runtime_mode"] is runner_mod.CUDAGraphMode.FULL
    assert updates == [dp]  # set once, before the graph, outside it
    assert list(runner._acl_graphs) == [key]
    entry = runner._acl_graphs[key]
    assert entry["graph"] is graph
    assert torch.equal(entry["output"], torch.full((2, HIDDEN), 10.0 + 1 + (LAYERS - 1)))  # last (layer, stage)
    assert runner_mod._cudagraph_capturing_enabled == [False]

    # The same key again: no second graph, the loop does not run.
    runner.execute_model(dp_metadata_list=dp, is_graph_capturing=True)
    assert len(npu.graphs) == 1 and len(spy.calls) == 1

    # A live step with that key replays: no loop, no connector update, no A2E/E2A on the host.
    sent = list(transport.sent)
    runner.execute_ffn_step(dp_metadata_list=_dp(s0=4, s1=2))
    runner.execute_model(dp_metadata_list=dp)
    assert graph.replays == 2 and len(spy.calls) == 1 and updates == [dp]
    assert transport.sent == sent


def test_a_key_not_captured_runs_eagerly(npu: FakeNPU) -> None:
    runner, spy, _, _ = _runner(use_aclgraph=True, npu=npu)
    runner.execute_ffn_step(dp_metadata_list=_dp(s0=8), is_graph_capturing=True)
    other = _dp(s0=5)
    assert runner._make_graph_key(other) not in runner._acl_graphs
    runner.execute_ffn_step(dp_metadata_list=other)
    assert npu.graphs[0].replays == 0
    assert len(spy.calls) == 2
    assert spy.calls[1]["dp_metadata_list"] == other and spy.calls[1]["under_graph"] is None
    assert set(spy.calls[1]) == {"dp_metadata_list", "under_graph", "stream"}


def test_capture_model_returns_the_memory_the_capture_took(npu: FakeNPU) -> None:
    runner, *_ = _runner(use_aclgraph=True, npu=npu)
    assert runner.capture_model(dp_metadata_list=_dp(s0=4), is_warmup=True) == 0
    assert runner.capture_model(dp_metadata_list=_dp(s0=4)) == 4096
    assert runner.capture_model(dp_metadata_list=_dp(s0=4)) == 0  # key already captured


def test_a_step_without_dp_metadata_is_refused(npu: FakeNPU) -> None:
    runner, spy, _, _ = _runner(use_aclgraph=True, npu=npu)
    for call in (runner.execute_ffn_step, runner.execute_model, runner.capture_model):
        with pytest.raises(RuntimeError):
            call(dp_metadata_list=None)
    assert spy.calls == []


def test_the_graph_key_is_per_stage_token_counts() -> None:
    runner_mod, _ = _modules()
    key = runner_mod.make_ffn_graph_key
    # Counts across attention ranks, summed per FFN rank (4 attention ranks over 2 FFN ranks).
    meta = SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor([1, 2, 3, 4]))
    assert key({0: meta}, attention_size=4, ffn_size=2, fallback=16) == ((0, (3, 7)),)
    # DP-level counts (2 DP ranks, TP 2) stand for each TP rank of their DP rank.
    meta = SimpleNamespace(num_tokens_across_dp_cpu=[3, 5])
    assert key({1: meta, 0: meta}, attention_size=4, ffn_size=2) == ((0, (6, 10)), (1, (6, 10)))
    # Without counts: the fallback per FFN rank, or the metadata's repr when nothing aggregates.
    assert key({0: StageMeta(4)}, attention_size=2, ffn_size=2, fallback=16) == ((0, (16, 16)),)
    assert key({0: StageMeta(4)}) == ((0, (repr(StageMeta(4)),)),)
    assert key({0: StageMeta(4)}) != key({0: StageMeta(5)})
    assert key({0: StageMeta(4)}) != key({0: StageMeta(4), 1: StageMeta(4)})


def test_graphs_follow_the_config_unless_forced_eager(npu: FakeNPU) -> None:
    runner_mod, _ = _modules()
    use = runner_mod._use_npu_aclgraph
    mode = SimpleNamespace(name="FULL_DECODE_ONLY")
    config = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False), compilation_config=SimpleNamespace(cudagraph_mode=mode)
    )
    assert use(config, False) is True
    config.model_config.enforce_eager = True
    assert use(config, True) is False
    assert use(None, False) is False and use(None, True) is True
