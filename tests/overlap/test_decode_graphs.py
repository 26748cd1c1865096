"""Decode graphs with both variants (``VLLM_CAMP2P_MULTISTREAM_GRAPH=adaptive``)
on the emulated device, through the stand-in runners' upstream graph path,
on both stacks: capture of both variants, per-key choice at replay, the
attention side's view, failures of the second capture, unpatch, stats."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from support.capture_breakers import ForgetsToJoin, SyncsInCapture
from support.logs import PackageLogs
from support.overlap import apply_cpu, assert_same, world

from camp2p_overlap.core.config import ConfigError, load_config
from camp2p_overlap.core.layer import Layer
from camp2p_overlap.core.overlap.graphs import OVERLAP, SERIAL, VariantGraph
from camp2p_overlap.emulation import device
from camp2p_overlap.emulation.world import World

pytestmark = pytest.mark.usefixtures("standin_stack", "emulated_torch_npu")

#: The rollout modes a graph can capture, as config overrides.
MODES: dict[str, dict[str, Any]] = {
    "overlap": {"adaptive": True},
    "overlap-fixed": {"adaptive": False},
    "e2a-only": {"a2e_on_side_stream": False},
    "parity": {"mode": "parity"},
    "reorder": {"mode": "reorder"},
}


def graph_world(**kw: Any) -> World:
    w = world(layers=3, stage_ids=(0, 1), tokens=8, graph=True, **kw)
    assert w.runner.use_aclgraph
    return w


def refs_of(w: World, steps: range) -> dict[int, dict]:
    """Eager serial outputs (unpatched, graphs off) of each step number."""
    w.runner.use_aclgraph = False
    try:
        out = {}
        for n in steps:
            w.steps_run = n - 1
            out[n] = w.run_step()
        return out
    finally:
        w.runner.use_aclgraph = True


def replay(w: World, n: int) -> dict:
    w.steps_run = n - 1
    return w.run_step()  # the key is captured: execute_model replays


def entry_of(w: World) -> dict[str, Any]:
    (entry,) = w.runner._acl_graphs.values()
    return entry


@pytest.mark.parametrize("mode", list(MODES))
def test_both_variants_capture_and_every_replay_is_bitwise_serial(layer: Layer, mode: str) -> None:
    w = graph_world()
    refs = refs_of(w, range(1, 21))
    apply_cpu(layer=layer, graph="adaptive", **MODES[mode])
    try:
        w.capture()
        entry = entry_of(w)
        chooser = entry["graph"]
        assert isinstance(chooser, VariantGraph)
        upstream = chooser.captured.upstream
        # Upstream's own capture holds the serial step; ours the mode's variant.
        assert {name for name, _, _ in upstream.nodes()} <= {"C", "capture"}
        side = mode in ("overlap", "overlap-fixed", "e2a-only")
        assert ({"K0", "K1"} <= {name for name, _, _ in chooser.captured.ours.nodes()}) == side
        for n in range(1, 21):
            assert_same(replay(w, n), refs[n], f"{mode}: replay {n}")
        replays = chooser.captured.replays
        assert replays[SERIAL] + replays[OVERLAP] == 20
        if mode != "overlap":  # the static variants always replay the layer's
            assert replays == {SERIAL: 0, OVERLAP: 20}
        else:  # learning runs both
            assert replays[SERIAL] >= 3 and replays[OVERLAP] >= 3
    finally:
        assert layer.engine.unpatch(timeout=10)
    assert entry["graph"] is upstream  # identity restored


def test_graph_mode_1_and_0_capture_one_graph_as_before(layer: Layer) -> None:
    for value, side in (("1", True), ("0", False)):
        w = graph_world()
        apply_cpu(layer=layer, graph=value)
        try:
            w.capture()
            graph = entry_of(w)["graph"]
            assert not isinstance(graph, VariantGraph)
            assert ({"K0", "K1"} <= {name for name, _, _ in graph.nodes()}) == side
        finally:
            assert layer.engine.unpatch(timeout=10)


def test_a_key_switches_variant_mid_run_bitwise_and_the_switch_is_logged_once(
    layer: Layer, logs: PackageLogs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected replay times: the overlap is faster for the first replays
    (the key decides overlap), then slower (a re-probe switches it to
    serial). Every replay stays bitwise equal; the switch is one log line."""
    w = graph_world()
    refs = refs_of(w, range(1, 61))
    apply_cpu(layer=layer, graph="adaptive", adaptive=True, reprobe_every=4)
    runtime = layer.runtime
    phase = {"overlap_s": 0.001}

    def injected(key: Any, mode: str, backend: Any, token: Any) -> None:
        runtime.adaptive.record(key, mode, phase["overlap_s"] if mode == OVERLAP else 0.002)

    try:
        w.capture()
        chooser = entry_of(w)["graph"]
        monkeypatch.setattr(runtime, "record_step_time", injected)
        seen: list[str] = []
        for n in range(1, 61):
            if n == 15:
                phase["overlap_s"] = 0.004
            before = dict(chooser.captured.replays)
            assert_same(replay(w, n), refs[n], f"replay {n}")
            seen.append(OVERLAP if chooser.captured.replays[OVERLAP] > before[OVERLAP] else SERIAL)
        (graph_stats,) = layer.runtime.stats()["graphs"]
        assert graph_stats["decision"] == SERIAL
        # Decided overlap before the change; after it, serial except the
        # re-probes of the other variant (every few decided replays).
        assert seen[8:14].count(OVERLAP) > seen[8:14].count(SERIAL), seen
        assert seen[-12:].count(SERIAL) >= 8, seen
        lines = [m for m in logs.messages if "graph/" in m and "-> serial" in m]
        assert len(lines) == 1, lines
    finally:
        assert layer.engine.unpatch(timeout=10)


def test_each_groups_op_order_is_the_same_for_both_variants(layer: Layer) -> None:
    """What the attention side sees: per group (stage), the sequence of
    CAMP2P ops of a replay, A2E(L, s), E2A(L, s), A2E(L+1, s), ..., is the
    same whichever variant replays."""
    w = graph_world()
    apply_cpu(layer=layer, graph="adaptive", adaptive=False)
    order: dict[int, list[tuple[str, int]]] = {}
    lock = threading.Lock()

    def hook(kind: str, layer_idx: int, stage: int) -> None:
        with lock:
            order.setdefault(stage, []).append((kind, layer_idx))

    try:
        w.capture()
        captured = entry_of(w)["graph"].captured
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
        assert layer.engine.unpatch(timeout=10)


@pytest.mark.parametrize(
    ("session", "reason"),
    [(SyncsInCapture, "CaptureViolation: Stream.synchronize()"), (ForgetsToJoin, "not joined back")],
    ids=["synchronize", "unjoined"],
)
def test_a_failed_second_capture_keeps_upstreams_graph_logged_once_and_counted(
    layer: Layer, logs: PackageLogs, monkeypatch: pytest.MonkeyPatch, session: type, reason: str
) -> None:
    w = graph_world()
    refs = refs_of(w, range(1, 4))
    apply_cpu(layer=layer, graph="adaptive")
    monkeypatch.setattr(layer.runtime, "session_class", session)
    try:
        w.capture()
        graph = entry_of(w)["graph"]
        assert not isinstance(graph, VariantGraph)  # upstream's own graph stays
        (failure,) = layer.runtime.stats()["graph_capture_failures"].items()
        assert reason in failure[0] and failure[1] == 1
        assert len(logs.texts("second variant of a decode graph was not captured", logging.WARNING)) == 1
        for n in range(1, 4):
            assert_same(replay(w, n), refs[n])
    finally:
        assert layer.engine.unpatch(timeout=10)
    assert entry_of(w)["graph"] is graph


def test_unpatch_during_a_capture_waits_and_restores_identity(layer: Layer) -> None:
    w = graph_world()
    refs = refs_of(w, range(1, 3))
    apply_cpu(layer=layer, graph="adaptive")
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
        assert layer.engine.unpatch(timeout=0.2) is False
    finally:
        go.set()
        t.join(20)
    model.compute_ffn_output = original
    w.synchronize()
    chooser = entry_of(w)["graph"]
    assert isinstance(chooser, VariantGraph)
    upstream = chooser.captured.upstream
    assert layer.engine.unpatch(timeout=10) is True
    assert entry_of(w)["graph"] is upstream
    for n in range(1, 3):
        assert_same(replay(w, n), refs[n])


def test_a_runner_captured_before_apply_is_left_alone(layer: Layer) -> None:
    w = graph_world()
    w.capture()
    graph = entry_of(w)["graph"]
    apply_cpu(layer=layer, graph="adaptive")
    try:
        replay(w, 1)
        assert entry_of(w)["graph"] is graph
        assert layer.runtime.stats()["graphs"] == []
    finally:
        assert layer.engine.unpatch(timeout=10)
    assert entry_of(w)["graph"] is graph


def test_stats_count_replays_per_variant_and_steps_count_eager_only(layer: Layer) -> None:
    w = graph_world()
    apply_cpu(layer=layer, graph="adaptive", adaptive=False)
    try:
        w.capture()
        steps_before = dict(layer.runtime.stats()["steps"])
        for n in range(1, 6):
            replay(w, n)
        st = layer.runtime.stats()
        assert st["steps"] == steps_before  # replays are not eager steps
        (g,) = st["graphs"]
        assert g["variants"] == [SERIAL, OVERLAP] and g["replays"] == {SERIAL: 0, OVERLAP: 5}
        assert g["decision"] == OVERLAP and isinstance(g["key"], str)
        if "graph_replays" in st:
            assert st["graph_replays"] == {SERIAL: 0, OVERLAP: 5}
    finally:
        assert layer.engine.unpatch(timeout=10)


@pytest.mark.parametrize("raw", ["2", "auto", "adaptiv", "yes please"])
def test_bad_values_of_graph_are_refused(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"VLLM_CAMP2P_MULTISTREAM_GRAPH=.* is not one of 0, 1, adaptive"):
        load_config({"VLLM_CAMP2P_MULTISTREAM_GRAPH": raw})
    assert load_config({"VLLM_CAMP2P_MULTISTREAM_GRAPH": " Adaptive "}).graph == "adaptive"
