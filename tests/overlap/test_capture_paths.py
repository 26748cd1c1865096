"""The patch layer's own capture paths on the emulated device (installed as
``torch.npu``), through the stand-in runners' upstream graph path
(warm-up, ``capture_model``/``_capture_graphs``, replay from
``execute_model``), on both stacks.

Every mode the patch layer captures (the compute-side overlap, parity,
reorder; comm-side, e2a-only and a2e-only with
VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1 on a device whose graphs allow
comm kernels on a forked stream) passes the device's capture rules and its
replays are bitwise equal to eager serial steps with the same inputs; in
compute-side every A2E and E2A is captured on the capture's stream and only
the FFN forks; as ``torch.npu`` the device refuses a comm-side capture; the
edge checker passes on a captured step's log; a rule broken inside the
patch layer's capture path (injected here) is caught and leaves nothing
capturing; a fault inside the capture surfaces with its type and the next
steps are correct; ``unpatch()`` during a capture waits for it and the
captured graph still replays."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from support.capture_breakers import ForgetsToJoin, QueriesInCapture, ReadsOnTheHost, SyncsInCapture
from support.npu_rule import CapturedKernels, device_not_as_torch_npu
from support.overlap import SessionSpy, apply_cpu, assert_same, world

from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.core.overlap.watch.watchdog import WATCHER_THREAD
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.emulation import device
from camp2p_overlap.emulation.world import World
from camp2p_overlap.verify import edges

pytestmark = pytest.mark.usefixtures("standin_stack", "emulated_torch_npu")

COMM_SIDE = {"layouts": ("comm-side",), "graph_comm_side": True}
#: name -> the config overrides of a mode the patch layer captures.
MODES: dict[str, dict[str, Any]] = {
    "compute-side": {},  # the default layout
    "comm-side": COMM_SIDE,
    "e2a-only": {**COMM_SIDE, "a2e_on_side_stream": False},
    "a2e-only": {**COMM_SIDE, "e2a_on_side_stream": False},
    "parity": {"mode": "parity"},
    "reorder": {"mode": "reorder"},
}
#: The modes that capture A2E or E2A on the stages' side streams: only where the device is not torch.npu.
COMM_SIDE_MODES = ("comm-side", "e2a-only", "a2e-only")
#: Per comm-side mode, the CAMP2P ops captured on the stages' side streams.
ON_SIDE_STREAMS = {"comm-side": {"a2e", "e2a"}, "e2a-only": {"e2a"}, "a2e-only": {"a2e"}}


def graph_world(**kw: Any) -> World:
    w = world(layers=3, stage_ids=(0, 1), tokens=8, **kw)
    w.runner.use_aclgraph = True
    w.runner.graph_pool = device.graph_pool_handle()
    return w


def step(w: World, n: int, **flags: Any) -> dict:
    """Step ``n`` through the runner's ``execute_ffn_step`` (eager, warm-up,
    capture or replay, as upstream dispatches), as attention drives it."""
    dp = w.dp_metadata()
    w.transport.begin_step(n, w.layer_list(), sorted(dp))
    w.runner.execute_ffn_step(dp_metadata_list=dp, **flags)
    w.synchronize()
    return dict(w.transport.results)


def capture(w: World, n: int) -> Any:
    step(w, n, is_warmup=True)
    step(w, n, is_graph_capturing=True)
    (entry,) = w.runner._acl_graphs.values()
    return entry["graph"]


def eager_serial(w: World, steps: range) -> dict[int, dict]:
    """The unpatched eager outputs of ``steps``."""
    w.runner.use_aclgraph = False
    try:
        return {n: step(w, n) for n in steps}
    finally:
        w.runner.use_aclgraph = True


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_captures_legally_and_replays_bitwise(
    patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    if mode in COMM_SIDE_MODES:
        device_not_as_torch_npu(monkeypatch)  # as torch.npu the device refuses them (below)
    w = graph_world()
    refs = eager_serial(w, range(10, 14))
    apply_cpu(patch_layer=patch_layer, graph=True, **MODES[mode])
    kernels = CapturedKernels(monkeypatch)
    try:
        graph = capture(w, 1)
        streams = {name for name, _, _ in graph.nodes()}
        # What was captured: the side streams only where the mode puts ops there.
        if mode == "compute-side":  # the FFN on F; A2E and E2A on the capture's stream
            assert "F" in streams and not streams & {"K0", "K1"}, streams
        elif mode in COMM_SIDE_MODES:
            assert streams >= {"K0", "K1"} and "F" not in streams, streams
        else:
            assert streams <= {"C", "capture"}, streams
        comm = kernels.comm()
        assert len(comm) == 2 * 3 * 2  # an A2E and an E2A per (layer, stage), each a CAM comm kernel
        off_origin = {kind for stream, origin, kind in comm if stream != origin}
        assert off_origin == ON_SIDE_STREAMS.get(mode, set()), comm
        assert all(stream in ("K0", "K1") for stream, origin, _ in comm if stream != origin)
        for n in range(10, 14):
            assert_same(step(w, n), refs[n], f"{mode} replay of step {n}")
        assert graph.replays == 4
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


@pytest.mark.parametrize("mode", COMM_SIDE_MODES)
def test_as_torch_npu_the_device_refuses_a_comm_side_capture_and_the_layer_works_on(
    patch_layer: PatchLayer, mode: str
) -> None:
    """VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1 on the device standing in for torch.npu: the first CAM comm kernel
    captured on a stage's side stream fails the capture (upstream's NPU graph code keeps HCCL on the capture's
    stream); nothing is stored for the key, nothing is left capturing, and the eager comm-side steps are correct."""
    w = graph_world()
    refs = eager_serial(w, range(70, 72))
    apply_cpu(patch_layer=patch_layer, graph=True, **MODES[mode])
    try:
        step(w, 1, is_warmup=True)
        with pytest.raises(device.CaptureViolation, match=r"a CAM comm kernel \((a2e|e2a)\) was captured on stream K"):
            step(w, 1, is_graph_capturing=True)
        assert not device.capture_in_progress()
        assert w.runner._acl_graphs == {}
        device.synchronize()
        w.runner.use_aclgraph = False
        before = patch_layer.runtime.stats()["layout_steps"].get(mode, 0)
        for n in range(70, 72):
            assert_same(step(w, n), refs[n])
        assert patch_layer.runtime.stats()["layout_steps"][mode] == before + 2  # comm-side (or its e2a/a2e-only)
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


@pytest.mark.parametrize("mode", ["compute-side", "comm-side"])
def test_the_edge_checker_passes_on_a_captured_steps_log(
    patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The session of a captured step logs what it issued into the graph; the edge checker passes on it, and the
    graph replays bitwise."""
    if mode in COMM_SIDE_MODES:
        device_not_as_torch_npu(monkeypatch)
    w = graph_world()
    refs = eager_serial(w, range(80, 82))
    apply_cpu(patch_layer=patch_layer, graph=True, **MODES[mode])
    try:
        step(w, 1, is_warmup=True)
        sessions = SessionSpy(monkeypatch, keep=True, patch_layer=patch_layer)
        step(w, 1, is_graph_capturing=True)
        (session,) = sessions.kept
        assert session.layout.name == mode
        assert {stream for *_, stream in session.log()} == ({"C", "F"} if mode == "compute-side" else {"C", "K0", "K1"})
        rec = trace.TraceRecorder()
        session.emit_trace(rec)
        result = edges.check_step(rec.ops(), session.expected_schedule(), source="session", timings=False)
        assert result.ok, str(result)
        for n in range(80, 82):
            assert_same(step(w, n), refs[n])
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def test_the_serial_variant_captures_when_graph_mode_is_off(patch_layer: PatchLayer) -> None:
    """GRAPH off: the capture takes the serial path (no side stream in the graph)."""
    w = graph_world()
    refs = eager_serial(w, range(20, 22))
    apply_cpu(patch_layer=patch_layer, graph=False)
    try:
        graph = capture(w, 1)
        assert {name for name, _, _ in graph.nodes()} <= {"C", "capture"}
        for n in range(20, 22):
            assert_same(step(w, n), refs[n])
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


@pytest.mark.parametrize(
    ("session", "message"),
    [
        (SyncsInCapture, r"Stream\.synchronize\(\) of C while a graph capture is in progress"),
        (QueriesInCapture, r"Event\.query\(\) while a graph capture is in progress"),
        (ForgetsToJoin, r"not joined back"),
        (ReadsOnTheHost, r"Tensor\.item\(\): a host read of a tensor a captured kernel writes"),
    ],
    ids=["synchronize", "query", "unjoined", "host-read"],
)
def test_a_rule_broken_inside_the_layers_capture_path_is_caught(
    patch_layer: PatchLayer, monkeypatch: pytest.MonkeyPatch, session: type, message: str
) -> None:
    w = graph_world()
    (ref,) = eager_serial(w, range(30, 31)).values()
    apply_cpu(patch_layer=patch_layer, graph=True)
    try:
        step(w, 1, is_warmup=True)  # eager: creates the side streams
        monkeypatch.setattr(patch_layer.runtime, "session_class", session)
        with pytest.raises(device.CaptureViolation, match=message):
            step(w, 1, is_graph_capturing=True)
        assert not device.capture_in_progress()
        assert w.runner._acl_graphs == {}  # nothing stored for the key
        monkeypatch.setattr(patch_layer.runtime, "session_class", StepSession)
        device.synchronize()
        w.runner.use_aclgraph = False
        assert_same(step(w, 30), ref)  # the device and the patch layer work on
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def test_the_rules_hold_for_the_layers_own_paths_with_a_watchdog_thread(patch_layer: PatchLayer) -> None:
    """A watchdog configured on the step: the capture is short, so its timer
    never fires inside it, and the capture passes."""
    w = graph_world()
    refs = eager_serial(w, range(40, 42))
    apply_cpu(patch_layer=patch_layer, graph=True, watchdog_s=30.0)
    try:
        capture(w, 1)
        for n in range(40, 42):
            assert_same(step(w, n), refs[n])
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


class InjectedFault(RuntimeError):
    pass


def test_a_fault_inside_the_capture_surfaces_and_the_next_steps_are_correct(patch_layer: PatchLayer) -> None:
    w = graph_world()
    refs = eager_serial(w, range(50, 53))
    apply_cpu(patch_layer=patch_layer, graph=True)
    model = w.runner.model
    original = model.compute_ffn_output
    calls = {"n": 0}

    def failing(**kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise InjectedFault("model failed during capture")
        return original(**kw)

    try:
        step(w, 1, is_warmup=True)
        model.compute_ffn_output = failing
        with pytest.raises(InjectedFault, match="model failed during capture"):
            step(w, 1, is_graph_capturing=True)
        assert not device.capture_in_progress() and w.runner._acl_graphs == {}
        model.compute_ffn_output = original
        graph = capture(w, 2)  # the capture goes through once the fault is gone
        for n in range(50, 53):
            assert_same(step(w, n), refs[n])
        assert graph.replays == 3
    finally:
        model.compute_ffn_output = original
        assert patch_layer.engine.unpatch(timeout=10)


def test_unpatch_during_a_capture_waits_for_it_and_the_graph_replays(patch_layer: PatchLayer) -> None:
    w = graph_world()
    refs = eager_serial(w, range(60, 62))
    apply_cpu(patch_layer=patch_layer, graph=True)
    step(w, 1, is_warmup=True)
    inside, go = threading.Event(), threading.Event()
    model = w.runner.model
    original = model.compute_ffn_output

    def held(**kw: Any) -> Any:
        if device.capture_in_progress() and not inside.is_set():
            inside.set()
            go.wait(10)
        return original(**kw)

    model.compute_ffn_output = held
    done: dict[str, Any] = {}
    t = threading.Thread(target=lambda: done.setdefault("r", step(w, 1, is_graph_capturing=True)))
    t.start()
    try:
        assert inside.wait(10), "the capture never reached the model"
        assert patch_layer.engine.unpatch(timeout=0.2) is False  # refused while the captured step runs
        assert device.capture_in_progress()
    finally:
        go.set()
        t.join(20)
    model.compute_ffn_output = original
    assert "r" in done and not device.capture_in_progress()
    assert patch_layer.engine.unpatch(timeout=10) is True
    # The graph holds the overlap it captured; it replays without the patch layer
    # (its side streams closed with the patch layer: a device graph needs them not).
    (entry,) = w.runner._acl_graphs.values()
    assert "F" in {name for name, _, _ in entry["graph"].nodes()}  # the FFN stream of the compute-side layout
    for n in range(60, 62):
        assert_same(step(w, n), refs[n])


def test_a_capture_creates_no_stream_and_the_streams_do_not_grow_with_keys(patch_layer: PatchLayer) -> None:
    w = graph_world()
    apply_cpu(patch_layer=patch_layer, graph=True)
    try:
        step(w, 1, is_warmup=True)
        # The step watcher ends before each capture and the next eager step starts it again: not a stream's.
        before = {t.name for t in threading.enumerate()} - {WATCHER_THREAD}
        for tokens in (2, 4, 6):
            w.transport.begin_step(2, w.layer_list(), [0, 1])
            dp = w.dp_metadata({0: tokens, 1: tokens})
            w.runner.execute_ffn_step(dp_metadata_list=dp, is_warmup=True)
            w.synchronize()
            w.transport.begin_step(3, w.layer_list(), [0, 1])
            w.runner.execute_ffn_step(dp_metadata_list=dp, is_graph_capturing=True)
            w.synchronize()
        assert len(w.runner._acl_graphs) == 3  # one graph per key
        assert {t.name for t in threading.enumerate()} - {WATCHER_THREAD} == before
    finally:
        assert patch_layer.engine.unpatch(timeout=10)


def test_a_watchdog_following_an_earlier_step_ends_before_a_capture(patch_layer: PatchLayer) -> None:
    """A watchdog still following an eager step's device work (it queries
    events) is ended when a capture begins: no query overlaps the capture."""
    from camp2p_overlap.core.overlap.watch import watchdog

    w = graph_world()
    apply_cpu(patch_layer=patch_layer, graph=True, watchdog_s=30.0)
    try:
        step(w, 1, is_warmup=True)  # eager, engaged: its watchdog may still follow it
        watcher = watchdog.WATCHER.thread()
        assert watcher is not None
        capture(w, 1)
        assert not watcher.is_alive()
        assert not [t for t in threading.enumerate() if t.name == WATCHER_THREAD and t.is_alive()]
        assert watchdog.stop_watchdogs() is True
    finally:
        assert patch_layer.engine.unpatch(timeout=10)
