"""Decode graphs with both variants (``VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive``)
on the emulated device, through the stand-in runners' upstream graph path,
on both stacks: capture of both variants, per-key choice at replay, the
attention side's view, failures of the second capture, unpatch, stats.
Which layout a variant captures: the first listed; compute-side passes the
device's ``torch.npu`` rule (CAM comm on the capture's stream); comm-side
only with VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1, and then only on a
device whose graphs allow comm kernels on a forked stream."""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

import pytest
from support.capture_breakers import ForgetsToJoin, SyncsInCapture
from support.logs import PackageLogs
from support.npu_rule import CapturedKernels, device_not_as_torch_npu
from support.overlap import apply_cpu, assert_same, bounded, eager_refs, graph_world, world

from camp2p_overlap.core.config import ConfigError, load_config
from camp2p_overlap.core.overlap.adaptive import StepTimings
from camp2p_overlap.core.overlap.graphs import GRAPH_COMM_SIDE_OPT_IN, OVERLAP, SERIAL, VariantGraph
from camp2p_overlap.core.overlap.step import FfnStep
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.emulation import device
from camp2p_overlap.emulation.world import World

pytestmark = pytest.mark.usefixtures("standin_stack", "emulated_torch_npu")

#: The rollout modes a graph can capture on the device as torch.npu, as config overrides ("overlap": the default
#: layout, compute-side; comm-side and its e2a-only/a2e-only: test_comm_side_* below).
MODES: dict[str, dict[str, Any]] = {
    "overlap": {"adaptive": True},
    "overlap-fixed": {"adaptive": False},
    "parity": {"mode": "parity"},
    "reorder": {"mode": "reorder"},
}
COMM_SIDE: dict[str, Any] = {"layouts": ("comm-side",)}


def replay(w: World, n: int) -> dict:
    w.steps_run = n - 1
    return w.run_step()  # the key is captured: execute_model replays


def entry_of_key(w: World, tokens: dict[int, int]) -> Any:
    """The graph object of the key of ``tokens``."""
    return w.runner._acl_graphs[w.graph_key(tokens)]["graph"]


def entry_of(w: World) -> dict[str, Any]:
    (entry,) = w.runner._acl_graphs.values()
    return entry


@pytest.mark.parametrize("mode", list(MODES))
def test_both_variants_capture_and_every_replay_is_bitwise_serial(patch_layer: PatchLayer, mode: str) -> None:
    w = graph_world()
    refs = eager_refs(w, range(1, 21))
    apply_cpu(patch_layer=patch_layer, graph="adaptive", **MODES[mode])
    try:
        w.capture()
        entry = entry_of(w)
        chooser = entry["graph"]
        assert isinstance(chooser, VariantGraph)
        upstream = chooser.captured.upstream
        # Upstream's own capture holds the serial step; ours the mode's variant (the overlap: the FFN on F).
        assert {name for name, _, _ in upstream.nodes()} <= {"C", "capture"}
        ours = {name for name, _, _ in chooser.captured.ours.nodes()}
        assert ("F" in ours) == mode.startswith("overlap") and not ours & {"K0", "K1"}, ours
        for n in range(1, 21):
            assert_same(replay(w, n), refs[n], f"{mode}: replay {n}")
        replays = chooser.captured.replays
        assert replays[SERIAL] + replays[OVERLAP] == 20
        if mode != "overlap":  # the static variants always replay the patch layer's
            assert replays == {SERIAL: 0, OVERLAP: 20}
        else:  # learning runs both
            assert replays[SERIAL] >= 3 and replays[OVERLAP] >= 3
    finally:
        assert patch_layer.engine.unpatch(timeout=10)
    assert entry["graph"] is upstream  # identity restored


def test_graph_mode_1_and_0_capture_one_graph_as_before(patch_layer: PatchLayer) -> None:
    for value, side in (("1", True), ("0", False)):
        w = graph_world()
        apply_cpu(patch_layer=patch_layer, graph=value)
        try:
            w.capture()
            graph = entry_of(w)["graph"]
            assert not isinstance(graph, VariantGraph)
            assert ("F" in {name for name, _, _ in graph.nodes()}) == side
        finally:
            assert patch_layer.engine.unpatch(timeout=10)


def ours_of(graph: Any) -> Any:
    """The patch layer's captured graph of a key: at GRAPH=1 the entry's graph, at adaptive its overlap variant."""
    return graph.captured.ours if isinstance(graph, VariantGraph) else graph


def replay_all(w: World, refs: dict[int, dict], context: str) -> None:
    for n in sorted(refs):
        assert_same(bounded(lambda n=n: replay(w, n)), refs[n], f"{context}: replay {n}")


@pytest.mark.parametrize("graph", ["1", "adaptive"])
def test_compute_side_keeps_every_cam_op_on_the_captures_stream_and_replays_bitwise(
    patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, graph: str
) -> None:
    """The default layout captured with the device as torch.npu (its rule: a CAM comm kernel only on the capture's
    origin stream): every A2E and E2A is captured on the capture's stream, only the FFN forks to F (joined back);
    every replay is bitwise equal to upstream's eager step."""
    w = graph_world()
    refs = eager_refs(w, range(1, 21))
    apply_cpu(patch_layer=patch_layer, graph=graph, adaptive=graph == "adaptive")
    kernels = CapturedKernels(monkeypatch)
    try:
        w.capture()
        entry = entry_of(w)
        assert isinstance(entry["graph"], VariantGraph) == (graph == "adaptive")
        assert patch_layer.runtime.stats()["graph_capture_failures"] == {}
        ours = ours_of(entry["graph"])
        assert {name for name, _, _ in ours.nodes()} == {"C", "F"}
        comm = kernels.comm()
        # ours: an A2E and an E2A per (layer, stage) (the patch layer's labelled ops), all on the origin
        assert len(comm) == 2 * 3 * 2
        assert all(stream == origin for stream, origin, _ in comm), comm
        on_f = [kind for stream, _, kind in kernels.kernels if stream == "F"]
        assert on_f and set(on_f) == {None}  # the FFN's kernels, no comm kernel
        replay_all(w, refs, f"GRAPH={graph}")
        if graph == "adaptive":  # learning replays both variants
            replays = entry["graph"].captured.replays
            assert replays[SERIAL] >= 3 and replays[OVERLAP] >= 3
            assert patch_layer.runtime.stats()["graph_replay_layouts"] == {"compute-side": replays[OVERLAP]}
        else:
            assert ours.replays == 20
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def decided(patch_layer: PatchLayer, w: World, **kwargs: Any) -> Any:
    """The decision for a call of ``w``'s runner's ``_ffn_forward``, as its step takes it."""
    kwargs = {"dp_metadata_list": w.dp_metadata(), **kwargs}
    step = FfnStep(patch_layer.engine, patch_layer.runtime, None, w.runner, (), kwargs)  # type: ignore[arg-type]
    return step.decision_and_streams()[0]


@pytest.mark.parametrize("as_npu", [True, False], ids=["as-torch-npu", "not-as-torch-npu"])
@pytest.mark.parametrize("graph", ["1", "adaptive"])
def test_comm_side_without_the_opt_in_captures_upstreams_graph_and_the_eager_steps_stay_comm_side(
    patch_layer: PatchLayer, logs: PackageLogs, monkeypatch: pytest.MonkeyPatch, graph: str, as_npu: bool
) -> None:
    """VLLM_CAMP2P_MULTISTREAM_LAYOUT=comm-side without VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE: a capture of its
    overlap variant is refused (graphs.GRAPH_COMM_SIDE_OPT_IN), whatever the device: at GRAPH=1 the capture takes the
    serial path for that reason (counted as a serial capture, logged), at adaptive the second variant is not
    captured for it (counted as a failure of the second capture, logged once), so upstream's serial graph is
    captured once; the key replays it, and eager steps still engage comm-side."""
    w = graph_world()
    if not as_npu:
        device_not_as_torch_npu(monkeypatch)
    refs = eager_refs(w, range(1, 9))
    other = {0: 4, 1: 4}  # a key not captured: its steps run eagerly
    other_refs = {}
    w.runner.use_aclgraph = False
    for n in range(9, 12):
        w.steps_run = n - 1
        other_refs[n] = w.run_step(other)
    w.runner.use_aclgraph = True
    apply_cpu(patch_layer=patch_layer, graph=graph, adaptive=graph == "adaptive", **COMM_SIDE)
    try:
        assert patch_layer.engine.config.graph_comm_side is False
        assert decided(patch_layer, w).layout.name == "comm-side"
        if graph == "1":
            assert decided(patch_layer, w, is_graph_capturing=True).reason == GRAPH_COMM_SIDE_OPT_IN
        captured = bounded(w.capture)
        st = patch_layer.runtime.stats()
        assert not isinstance(captured, VariantGraph)
        assert {name for name, _, _ in captured.nodes()} <= {"C", "capture"}  # upstream's serial graph
        assert st["graph_captures"] == {SERIAL: 1, OVERLAP: 0}  # upstream's serial step, captured once
        assert st["graphs"] == [] and st["layout_steps"] == {"comm-side": 1}  # the warm-up: eager, comm-side
        if graph == "1":
            refusal = f"camp2p-overlap: running the serial FFN path: {GRAPH_COMM_SIDE_OPT_IN}"
            assert logs.texts(refusal, logging.INFO) == [refusal]
            assert st["graph_capture_failures"] == {}
        else:
            assert st["graph_capture_failures"] == {GRAPH_COMM_SIDE_OPT_IN: 1}
            (warning,) = logs.texts("second variant of a decode graph was not captured", logging.WARNING)
            assert f"({GRAPH_COMM_SIDE_OPT_IN})" in warning
        replay_all(w, refs, "comm-side without the opt-in")
        for n in range(9, 12):  # eager steps: the comm-side overlap, bitwise serial
            w.steps_run = n - 1
            assert_same(bounded(lambda: w.run_step(other)), other_refs[n], f"eager step {n}")
        st = patch_layer.runtime.stats()
        assert st["layout_steps"]["comm-side"] >= 1 + 3 and "compute-side" not in st["layout_steps"]
        assert st["graph_replays"][OVERLAP] == 0
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


@pytest.mark.parametrize("mode", ["comm-side", "e2a-only", "a2e-only"])
@pytest.mark.parametrize("graph", ["1", "adaptive"])
def test_comm_side_with_the_opt_in_captures_and_replays_bitwise_where_the_device_allows_it(
    patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, graph: str, mode: str
) -> None:
    """VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1 on a device not standing in for torch.npu: the comm-side variant
    (its CAM ops on the stages' side streams) is captured and every replay is bitwise equal to upstream's step."""
    switches = {"e2a-only": {"a2e_on_side_stream": False}, "a2e-only": {"e2a_on_side_stream": False}}
    w = graph_world()
    device_not_as_torch_npu(monkeypatch)
    refs = eager_refs(w, range(1, 21))
    apply_cpu(
        patch_layer=patch_layer,
        graph=graph,
        adaptive=graph == "adaptive",
        graph_comm_side=True,
        **COMM_SIDE,
        **switches.get(mode, {}),
    )
    kernels = CapturedKernels(monkeypatch)
    try:
        captured = bounded(w.capture)
        assert isinstance(captured, VariantGraph) == (graph == "adaptive")
        assert patch_layer.runtime.stats()["graph_capture_failures"] == {}
        ours = ours_of(captured)
        streams = {name for name, _, _ in ours.nodes()}
        assert streams >= {"K0", "K1"} and "F" not in streams, streams
        off_origin = {kind for stream, origin, kind in kernels.comm() if stream != origin}
        assert off_origin == {"comm-side": {"a2e", "e2a"}, "e2a-only": {"e2a"}, "a2e-only": {"a2e"}}[mode]
        replay_all(w, refs, f"{mode} at GRAPH={graph}")
        if graph == "adaptive":
            replays = captured.captured.replays
            assert replays[SERIAL] >= 3 and replays[OVERLAP] >= 3
            assert patch_layer.runtime.stats()["graph_replay_layouts"] == {mode: replays[OVERLAP]}
        else:
            assert ours.replays == 20
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def test_comm_side_with_the_opt_in_as_torch_npu_fails_its_capture_and_the_key_keeps_upstreams_graph(
    patch_layer: PatchLayer, logs: PackageLogs
) -> None:
    """VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1 with the device as torch.npu: the device refuses the comm-side
    variant's CAM comm kernel on a side stream; the second capture fails (counted, logged once), the key keeps
    upstream's graph and every replay is bitwise upstream's; no hang."""
    w = graph_world()
    refs = eager_refs(w, range(1, 9))
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=True, graph_comm_side=True, **COMM_SIDE)
    try:
        captured = bounded(w.capture)
        assert not isinstance(captured, VariantGraph) and not device.capture_in_progress()
        assert {name for name, _, _ in captured.nodes()} <= {"C", "capture"}
        st = patch_layer.runtime.stats()
        (failure,) = st["graph_capture_failures"].items()
        assert failure[0].startswith("CaptureViolation: a CAM comm kernel (a2e) was captured on stream K0") and (
            failure[1] == 1
        ), failure
        assert len(logs.texts("second variant of a decode graph was not captured", logging.WARNING)) == 1
        assert st["graphs"] == []
        replay_all(w, refs, "upstream's graph")
        assert patch_layer.runtime.stats()["graph_replays"] == {SERIAL: 0, OVERLAP: 0}  # upstream's own replays
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


class InjectedTimes:
    """Every timing a runner records (steps and replays) replaced by a time
    ``seconds(choice, path)`` gives (``choice``: the key's own adaptive
    state for a replay, None for an eager step); no event is recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: Any) -> None:
        self.seconds = seconds

        def timed(
            timings: StepTimings, key: Any, path: str, backend: Any, run: Any, into: Any = None, step: int = 0
        ) -> Any:
            result = run()
            (into or timings._owner.adaptive).record(key, path, self.seconds(into, path), step)
            return result

        monkeypatch.setattr(StepTimings, "timed", timed)


def replayed_graph(chooser: VariantGraph, w: World, n: int, ref: dict) -> str:
    """Replay step ``n`` (bitwise equal to ``ref``) and say which graph object
    replayed, from the emulated graphs' own replay counts; check the label
    the patch layer counted names the same one."""
    c = chooser.captured
    before = (c.upstream.replays, c.ours.replays, dict(c.replays))
    assert_same(replay(w, n), ref, f"replay {n}")
    ran = {SERIAL: c.upstream.replays - before[0], OVERLAP: c.ours.replays - before[1]}
    assert sorted(ran.values()) == [0, 1], ran  # exactly one graph replayed
    (variant,) = [v for v, k in ran.items() if k]
    assert c.replays[variant] == before[2][variant] + 1, (variant, c.replays, before[2])
    return variant


def test_a_key_switches_variant_mid_run_bitwise_and_the_switch_is_logged_once(
    patch_layer: PatchLayer, logs: PackageLogs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected replay times: the overlap is faster for the first replays
    (the key decides overlap), then slower (a re-probe switches it to
    serial). Every replay stays bitwise equal, the graph object replayed is
    the chosen one, and the switch is one log line."""
    w = graph_world()
    refs = eager_refs(w, range(1, 61))
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=True, reprobe_every=4)
    phase = {"overlap_s": 0.001}
    InjectedTimes(monkeypatch, lambda choice, path: phase["overlap_s"] if path == OVERLAP else 0.002)
    try:
        w.capture()
        chooser = entry_of(w)["graph"]
        seen: list[str] = []
        for n in range(1, 61):
            if n == 15:
                phase["overlap_s"] = 0.004
            seen.append(replayed_graph(chooser, w, n, refs[n]))
        (graph_stats,) = patch_layer.runtime.stats()["graphs"]
        assert graph_stats["decision"] == SERIAL
        # Learning replays both; decided overlap before the change (the
        # patch layer's graph replays); after it, upstream's, except the re-probes
        # of the other variant (every few decided replays).
        assert seen[:8].count(SERIAL) >= 3 and seen[:8].count(OVERLAP) >= 3, seen
        assert seen[8:14].count(OVERLAP) > seen[8:14].count(SERIAL), seen
        assert seen[-12:].count(SERIAL) >= 8, seen
        lines = [m for m in logs.messages if " graph " in m and "-> serial" in m]
        assert len(lines) == 1, lines
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def test_two_keys_of_one_eager_bucket_each_decide_on_their_own_times(
    patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5 and 7 tokens share one eager bucket (tokens rounded up to 8); as
    graph keys each has its own decision, samples and medians: the overlap
    is faster for one key, serial for the other."""
    w = graph_world()
    five, seven = {0: 5, 1: 5}, {0: 7, 1: 7}
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=True)
    choices: dict[int, str] = {}

    def seconds(choice: Any, path: str) -> float:
        fast = OVERLAP if choices.get(id(choice)) == "five" else SERIAL
        return 0.001 if path == fast else 0.003

    InjectedTimes(monkeypatch, seconds)
    try:
        w.capture(five)
        w.capture(seven)
        graphs = {name: w.runner._acl_graphs[w.graph_key(t)]["graph"] for name, t in (("five", five), ("seven", seven))}
        assert all(isinstance(g, VariantGraph) for g in graphs.values())
        choices.update({id(g.captured.choice): name for name, g in graphs.items()})
        replays = {"five": 12, "seven": 3}  # unequal: a shared bucket would mix them
        for name, tokens in (("five", five), ("seven", seven)):
            for _ in range(replays[name]):
                w.steps_run += 1
                w.transport.begin_step(w.steps_run, w.layer_list(), [0, 1])
                w.runner.execute_model(dp_metadata_list=w.dp_metadata(tokens))
                w.synchronize()
        for _ in range(9):  # seven's learning finishes
            w.steps_run += 1
            w.transport.begin_step(w.steps_run, w.layer_list(), [0, 1])
            w.runner.execute_model(dp_metadata_list=w.dp_metadata(seven))
            w.synchronize()
        by_key = {g["key"]: g for g in patch_layer.runtime.stats()["graphs"]}
        five_stats = by_key[graphs["five"].captured.key_text]
        seven_stats = by_key[graphs["seven"].captured.key_text]
        assert five_stats["decision"] == OVERLAP and seven_stats["decision"] == SERIAL
        assert five_stats["overlap_median_ms"] == pytest.approx(1.0)
        assert seven_stats["overlap_median_ms"] == pytest.approx(3.0)
        assert sum(five_stats["replays"].values()) == 12 and sum(seven_stats["replays"].values()) == 12
        for g, st in ((graphs["five"], five_stats), (graphs["seven"], seven_stats)):
            own = g.captured.choice.snapshot()
            assert len(own) == 1 and st["samples"] == {
                SERIAL: own[0]["serial_samples"],
                OVERLAP: own[0]["overlap_samples"],
            }
        assert not [b for b in patch_layer.runtime.stats()["buckets"] if "graph" in b["key"]["runner"]]
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_each_groups_op_order_is_the_same_for_both_variants(
    patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """What the attention side sees: per group (stage), the sequence of
    CAMP2P ops of a replay, A2E(L, s), E2A(L, s), A2E(L+1, s), ..., is the
    same whichever variant replays, in either layout."""
    comm_side = layout == "comm-side"
    w = graph_world()
    if comm_side:
        device_not_as_torch_npu(monkeypatch)
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=False, layouts=(layout,), graph_comm_side=comm_side)
    order: dict[int, list[tuple[str, int]]] = {}
    lock = threading.Lock()

    def hook(kind: str, layer_idx: int, stage: int) -> None:
        with lock:
            order.setdefault(stage, []).append((kind, layer_idx))

    try:
        w.capture()
        captured = entry_of(w)["graph"].captured
        assert captured.layout == layout
        w.transport.fault_hook = hook
        seqs = {}
        for variant, graph in ((SERIAL, captured.upstream), (OVERLAP, captured.ours)):
            order.clear()
            w.transport.begin_step(7, w.layer_list(), [0, 1])
            graph.replay()
            w.synchronize()
            seqs[variant] = {s: list(v) for s, v in order.items()}
        want = [(k, L) for L in w.layer_list() for k in ("a2e", "e2a")]
        assert seqs[SERIAL] == seqs[OVERLAP] == {0: want, 1: want}
    finally:
        w.transport.fault_hook = None
        assert patch_layer.engine.unpatch(timeout=10)


@pytest.mark.parametrize(
    ("session", "reason"),
    [(SyncsInCapture, "CaptureViolation: Stream.synchronize()"), (ForgetsToJoin, "not joined back")],
    ids=["synchronize", "unjoined"],
)
def test_a_failed_second_capture_keeps_upstreams_graph_logged_once_and_counted(
    patch_layer: PatchLayer, logs: PackageLogs, monkeypatch: pytest.MonkeyPatch, session: type, reason: str
) -> None:
    w = graph_world()
    refs = eager_refs(w, range(1, 4))
    apply_cpu(patch_layer=patch_layer, graph="adaptive")
    monkeypatch.setattr(patch_layer.runtime, "session_class", session)
    try:
        w.capture()
        graph = entry_of(w)["graph"]
        assert not isinstance(graph, VariantGraph)  # upstream's own graph stays
        (failure,) = patch_layer.runtime.stats()["graph_capture_failures"].items()
        assert reason in failure[0] and failure[1] == 1
        assert len(logs.texts("second variant of a decode graph was not captured", logging.WARNING)) == 1
        for n in range(1, 4):
            assert_same(replay(w, n), refs[n])
    finally:
        assert patch_layer.engine.unpatch(timeout=10)
    assert entry_of(w)["graph"] is graph


def test_unpatch_during_a_capture_waits_and_restores_identity(patch_layer: PatchLayer) -> None:
    w = graph_world()
    refs = eager_refs(w, range(1, 3))
    apply_cpu(patch_layer=patch_layer, graph="adaptive")
    w.steps_run = 0
    w.transport.begin_step(1, w.layer_list(), [0, 1])
    w.runner.execute_ffn_step(dp_metadata_list=w.dp_metadata(), is_warmup=True)
    w.synchronize()
    inside, go = threading.Event(), threading.Event()
    model = w.runner.model
    original = model.compute_ffn_output

    def held(**kw: Any) -> Any:
        if device.capture_in_progress() and not inside.is_set():
            inside.set()
            go.wait(10)
        return original(**kw)

    model.compute_ffn_output = held
    t = threading.Thread(
        target=lambda: (
            w.transport.begin_step(1, w.layer_list(), [0, 1]),
            w.runner.execute_ffn_step(dp_metadata_list=w.dp_metadata(), is_graph_capturing=True),
        )
    )
    t.start()
    try:
        assert inside.wait(10)
        assert patch_layer.engine.unpatch(timeout=0.2) is False
    finally:
        go.set()
        t.join(20)
    model.compute_ffn_output = original
    w.synchronize()
    chooser = entry_of(w)["graph"]
    assert isinstance(chooser, VariantGraph)
    upstream = chooser.captured.upstream
    assert patch_layer.engine.unpatch(timeout=10) is True
    assert entry_of(w)["graph"] is upstream
    for n in range(1, 3):
        assert_same(replay(w, n), refs[n])


def test_a_runner_captured_before_apply_is_left_alone(patch_layer: PatchLayer) -> None:
    w = graph_world()
    w.capture()
    graph = entry_of(w)["graph"]
    apply_cpu(patch_layer=patch_layer, graph="adaptive")
    try:
        replay(w, 1)
        assert entry_of(w)["graph"] is graph
        assert patch_layer.runtime.stats()["graphs"] == []
    finally:
        assert patch_layer.engine.unpatch(timeout=10)
    assert entry_of(w)["graph"] is graph


def test_stats_count_replays_per_variant_and_steps_count_eager_only(patch_layer: PatchLayer) -> None:
    w = graph_world()
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=False)
    try:
        w.capture()
        steps_before = dict(patch_layer.runtime.stats()["steps"])
        for n in range(1, 6):
            replay(w, n)
        st = patch_layer.runtime.stats()
        assert st["steps"] == steps_before  # replays are not eager steps
        (g,) = st["graphs"]
        assert g["variants"] == [SERIAL, OVERLAP] and g["replays"] == {SERIAL: 0, OVERLAP: 5}
        assert g["decision"] == OVERLAP and isinstance(g["key"], str)
        if "graph_replays" in st:
            assert st["graph_replays"] == {SERIAL: 0, OVERLAP: 5}
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


@pytest.mark.parametrize("raw", ["2", "auto", "adaptiv", "yes please"])
def test_bad_values_of_graph_are_refused(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"VLLM_CAMP2P_MULTISTREAM_GRAPH=.* is not one of 0, 1, adaptive"):
        load_config({"VLLM_CAMP2P_MULTISTREAM_GRAPH": raw})
    assert load_config({"VLLM_CAMP2P_MULTISTREAM_GRAPH": " Adaptive "}).graph == "adaptive"


def replay_with(w: World, graph: Any, n: int) -> dict:
    """Step ``n`` replayed through ``graph`` (a graph object held apart from
    the runner's entry), synchronized; what attention received."""
    w.steps_run = n
    w.transport.begin_step(n, w.layer_list(), [0, 1])
    graph.replay()
    w.synchronize()
    return dict(w.transport.results)


def test_a_capture_with_no_eager_warm_up_captures_both_and_counts_captures_not_steps(patch_layer: PatchLayer) -> None:
    """No eager step before the capture: the side streams, the variant's
    capture stream and the pooled events are made before upstream's capture
    begins (a capture may make none). Captures are counted as captures."""
    w = graph_world()
    refs = eager_refs(w, range(1, 5))
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=False)
    try:
        w.capture(warmups=0)
        chooser = entry_of(w)["graph"]
        assert isinstance(chooser, VariantGraph), patch_layer.runtime.stats()["graph_capture_failures"]
        st = patch_layer.runtime.stats()
        assert st["steps"] == {"overlap": 0, "parity": 0, "reorder": 0, "serial": 0}
        assert st["graph_captures"] == {SERIAL: 1, OVERLAP: 1}
        for n in range(1, 5):
            assert_same(replay(w, n), refs[n])
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def test_the_variant_capture_does_not_depend_on_the_callers_stream(patch_layer: PatchLayer) -> None:
    """``_capture_graphs`` called with the default stream current (not inside
    vLLM-Ascend's ``graph_capture()``): upstream captures on a capture stream
    of its own, and so does the patch layer (the emulated device, as CUDA, refuses
    a capture on the default stream)."""
    w = graph_world()
    refs = eager_refs(w, range(1, 3))
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=False)
    try:
        dp = w.dp_metadata()
        w.transport.begin_step(1, w.layer_list(), [0, 1])
        assert isinstance(device.current_stream(), device.DefaultStream)
        w.runner._capture_graphs(aclgraph_runtime_mode=None, dp_metadata_list=dp, is_attn_graph_capturing=True)
        w.synchronize()
        assert isinstance(entry_of(w)["graph"], VariantGraph), patch_layer.runtime.stats()["graph_capture_failures"]
        for n in range(1, 3):
            assert_same(replay(w, n), refs[n])
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def test_a_variant_graph_held_across_unpatch_replays_upstreams_graph(patch_layer: PatchLayer) -> None:
    w = graph_world()
    refs = eager_refs(w, range(1, 5))
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=False)
    w.capture()
    held = entry_of(w)["graph"]
    upstream, ours = held.captured.upstream, held.captured.ours
    assert_same(replay_with(w, held, 1), refs[1])
    assert (upstream.replays, ours.replays) == (0, 1)
    assert patch_layer.engine.unpatch(timeout=10)
    assert entry_of(w)["graph"] is upstream
    assert_same(replay_with(w, held, 2), refs[2])  # never raises: upstream's graph
    assert upstream.replays == 1
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=False)  # applied again: the held one stays released
    try:
        assert_same(replay_with(w, held, 3), refs[3])
        assert upstream.replays == 2 and held.captured.replays == {SERIAL: 0, OVERLAP: 1}
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def test_unpatch_waits_for_a_replay_in_flight(patch_layer: PatchLayer) -> None:
    w = graph_world()
    refs = eager_refs(w, range(1, 3))
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=False)
    w.capture()
    chooser = entry_of(w)["graph"]
    ours = chooser.captured.ours
    inside, go = threading.Event(), threading.Event()
    real_replay = ours.replay

    def held_replay() -> None:
        inside.set()
        go.wait(10)
        real_replay()

    ours.replay = held_replay
    box: dict[str, Any] = {}

    def replay_on_a_thread() -> None:
        try:
            box["out"] = replay(w, 1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    t = threading.Thread(target=replay_on_a_thread)
    t.start()
    try:
        assert inside.wait(10)
        assert patch_layer.engine.unpatch(timeout=0.2) is False  # the replay is still inside
        assert entry_of(w)["graph"] is chooser
    finally:
        go.set()
        t.join(20)
    assert "error" not in box, box.get("error")
    assert_same(box["out"], refs[1])
    assert patch_layer.engine.unpatch(timeout=10) is True
    assert entry_of(w)["graph"] is chooser.captured.upstream
    assert_same(replay(w, 2), refs[2])


def test_reset_reaches_both_graphs_and_a_copy_replays(patch_layer: PatchLayer) -> None:
    w = graph_world()
    refs = eager_refs(w, range(1, 3))
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=False)
    try:
        w.capture()
        chooser = entry_of(w)["graph"]
        twin = copy.copy(chooser)
        assert isinstance(twin, VariantGraph) and twin.captured is chooser.captured
        assert copy.deepcopy(chooser).captured is chooser.captured  # a device graph is shared, not copied
        assert_same(replay_with(w, twin, 1), refs[1])
        assert chooser.pool() == chooser.captured.upstream.pool()
        upstream, ours = chooser.captured.upstream, chooser.captured.ours
        chooser.reset()
        assert upstream.node_count == 0 and ours.node_count == 0
        with pytest.raises(RuntimeError, match="captured nothing"):  # as upstream's reset graph does
            chooser.replay()
    finally:
        assert patch_layer.engine.unpatch(timeout=10)
    assert entry_of(w)["graph"] is upstream


def test_no_watchdog_starts_inside_a_capture(patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch) -> None:
    from camp2p_overlap.core.overlap import step

    started_in_capture: list[bool] = []
    real_start = step.start_watchdog

    def spy(*args: Any, **kwargs: Any) -> Any:
        started_in_capture.append(device.capture_in_progress())
        return real_start(*args, **kwargs)

    monkeypatch.setattr(step, "start_watchdog", spy)
    w = graph_world()
    apply_cpu(patch_layer=patch_layer, graph="1", watchdog_s=60.0)
    try:
        w.capture(warmups=2)
        assert started_in_capture == [False, False]  # the warm-ups only
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def test_a_replay_that_raises_gives_its_timing_pair_back(patch_layer: PatchLayer) -> None:
    w = graph_world()
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=True)
    try:
        w.capture()
        chooser = entry_of(w)["graph"]
        for n in range(1, 4):
            replay(w, n)
        backend = chooser.captured.backend
        made: list[Any] = []
        real_pair = backend.timing_pair
        backend.timing_pair = lambda: made.append(1) or real_pair()  # a new pair: none free in the pool

        def broken() -> None:
            raise RuntimeError("replay failed")

        chooser.captured.ours.replay = chooser.captured.upstream.replay = broken
        for _ in range(3):
            with pytest.raises(RuntimeError, match="replay failed"):
                chooser.replay()
        assert len(made) <= 1  # the first failed replay's pair came back and served the next ones
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def test_second_capture_memory_and_time_are_reported_and_a_low_free_memory_skips_it(
    patch_layer: PatchLayer, logs: PackageLogs, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = graph_world()
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=False)
    try:
        w.capture({0: 8, 1: 8})
        (g,) = patch_layer.runtime.stats()["graphs"]
        assert isinstance(g["graph_size_bytes"], int) and isinstance(g["extra_bytes"], int)
        assert g["capture_ms"] > 0 and g["upstream_capture_ms"] > 0
        (line,) = logs.texts("decode graph", logging.INFO)
        assert "upstream's capture took" in line and "the layer's overlap variant" in line and "MiB" in line
        free = [1 << 40]
        monkeypatch.setattr(entry_of_key(w, {0: 8, 1: 8}).captured.backend.mod, "mem_get_info", lambda *a: (free[0], 0))
        free[0] = 100 << 20  # below the headroom alone
        w.capture({0: 4, 1: 4})
        assert not isinstance(entry_of_key(w, {0: 4, 1: 4}), VariantGraph)
        (failure,) = patch_layer.runtime.stats()["graph_capture_failures"]
        assert "free device memory 100.0 MiB is below the margin" in failure
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def test_a_replay_that_stalls_is_reported_with_its_key_and_variant(patch_layer: PatchLayer) -> None:
    from camp2p_overlap.core.overlap.watch.watchdog import REPLAY_WATCH

    w = graph_world()
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=False, watchdog_s=0.3)
    REPLAY_WATCH.reports.clear()
    try:
        w.capture()
        for n in range(1, 4):
            replay(w, n)
        deadline = time.monotonic() + 5
        while len(REPLAY_WATCH) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(REPLAY_WATCH) == 0 and REPLAY_WATCH.reports == []  # replays that finish: no report
        hold = threading.Event()
        device.launch(lambda: hold.wait(10))  # the compute stream stalls before the replay
        w.transport.begin_step(9, w.layer_list(), [0, 1])
        w.runner.execute_model(dp_metadata_list=w.dp_metadata())
        while not REPLAY_WATCH.reports and time.monotonic() < deadline:
            time.sleep(0.01)
        hold.set()
        w.synchronize()
        (report,) = REPLAY_WATCH.reports
        assert entry_of(w)["graph"].captured.key_text in report and "(overlap variant)" in report
        assert "has not finished after 0.3 s" in report
    finally:
        hold.set()
        assert patch_layer.engine.unpatch(timeout=10)


def test_a_capture_on_one_thread_and_adaptive_eager_steps_of_another_runner_break_no_rule(
    patch_layer: PatchLayer,
) -> None:
    """Runner A captures (held inside its capture) while runner B, on another
    thread, runs adaptive eager steps: B's step timings are neither read nor
    taken while the capture is in progress (global capture mode refuses an
    event query, and the emulation an event made, from any thread), so
    neither the capture nor B's steps fail, and B's outputs are upstream's."""
    a = graph_world()
    b = world(layers=2, stage_ids=(0, 1), tokens=8)
    b_refs = eager_refs(b, range(1, 13))
    apply_cpu(patch_layer=patch_layer, graph="adaptive", adaptive=True)
    try:
        for n in range(1, 5):  # B's side streams, pooled events and timing pairs exist
            b.steps_run = n - 1
            assert_same(b.run_step(), b_refs[n])
        inside, b_done = threading.Event(), threading.Event()
        model = a.runner.model
        original = model.compute_ffn_output

        def held(**kw: Any) -> Any:
            if device.capture_in_progress() and not inside.is_set():
                inside.set()
                b_done.wait(20)
            return original(**kw)

        model.compute_ffn_output = held
        box: dict[str, Any] = {}

        def eager_steps_of_b() -> None:
            try:
                assert inside.wait(20)
                # One step (the next would need a synchronize, refused while A
                # captures): it reads the warm-up steps' timings and times itself.
                b.steps_run = 5
                b.transport.begin_step(5, b.layer_list(), [0, 1])
                b.runner._ffn_forward(dp_metadata_list=b.dp_metadata())
                box["capturing"] = device.capture_in_progress()
            except BaseException as exc:  # noqa: BLE001 - reported below
                box["error"] = exc
            finally:
                b_done.set()

        t = threading.Thread(target=eager_steps_of_b)
        t.start()
        try:
            a.capture()
        finally:
            b_done.set()
            t.join(30)
            model.compute_ffn_output = original
        assert "error" not in box, box.get("error")
        assert box["capturing"] is True  # B's steps ran inside A's capture
        assert isinstance(entry_of(a)["graph"], VariantGraph), patch_layer.runtime.stats()["graph_capture_failures"]
        b.synchronize()
        assert_same(dict(b.transport.results), b_refs[5])
        for n in range(6, 13):  # B's timings are read again after the capture
            b.steps_run = n - 1
            assert_same(b.run_step(), b_refs[n])
        assert any(bk["overlap_samples"] + bk["serial_samples"] for bk in patch_layer.runtime.stats()["buckets"])
    finally:
        assert patch_layer.engine.unpatch(timeout=10)
