"""The ``cuda`` and ``npu`` backends: they construct only where their torch
device module is usable; the shared StreamBackend is exercised here
through a host-synchronous stand-in device module, and on a real device by
the gpu/npu-marked tests (which skip with a reason elsewhere)."""

from __future__ import annotations

import importlib.util
import itertools
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.host_device_module import HostDeviceModule, use_host_device_module
from support.overlap import (
    SHAPE,
    Schedule,
    SessionSpy,
    apply_cpu,
    assert_same,
    bounded,
    run_step,
    serial_results,
    stream_sets,
    world,
    wrap_model,
)

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.keys import A2E, COMPUTE_STREAM, E2A, FFN_STREAM, side_stream_name
from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.overlap.streams import (
    BackendUnavailable,
    StreamBackend,
    device_module,
    make_backend,
)
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.emulation import device as emulated_device
from camp2p_overlap.verify import edges


def _has_torch_npu() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: the no-CUDA refusal cannot be shown")
def test_cuda_backend_refuses_without_cuda() -> None:
    with pytest.raises(BackendUnavailable, match=r"torch\.cuda reports no CUDA device"):
        device_module("cuda")
    with pytest.raises(BackendUnavailable, match=r"backend 'cuda' unavailable: torch\.cuda reports no CUDA device"):
        make_backend("cuda", torch.device("cuda"))


@pytest.mark.skipif(_has_torch_npu(), reason="torch_npu is installed: the refusal cannot be shown")
def test_npu_backend_refuses_without_torch_npu() -> None:
    with pytest.raises(BackendUnavailable, match="backend 'npu' unavailable: torch_npu is not installed"):
        make_backend("npu")


def test_unknown_device_kind_and_incomplete_modules_are_refused() -> None:
    with pytest.raises(BackendUnavailable, match="no device module for 'xpu'"):
        device_module("xpu")
    incomplete = SimpleNamespace(__name__="fakedev", Stream=object, Event=object, stream=None)
    with pytest.raises(BackendUnavailable, match="fakedev has no current_stream"):
        StreamBackend("fake", incomplete)  # type: ignore[arg-type]
    # The FFN's side stream is made current with set_stream (compute-side): a module without it is refused too.
    no_set_stream = SimpleNamespace(
        __name__="fakedev", Stream=object, Event=object, stream=None, current_stream=lambda: None
    )
    with pytest.raises(BackendUnavailable, match="fakedev has no set_stream"):
        StreamBackend("fake", no_set_stream)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# The host stand-in device module (support.host_device_module), with a tick clock.


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch) -> HostDeviceModule:
    dev = HostDeviceModule(name="fakedev", clock=itertools.count(1).__next__, tick_ms=1.0)
    use_host_device_module(monkeypatch, dev)
    return dev


def streams_ops_ran_on(w: Any) -> dict[tuple[str, int, int], str]:
    """Fill, as the world's kernels run, (kind, layer, stage) -> the stream
    of the emulated device that ran the work (the A2E and E2A kernels, the
    FFN's kernel)."""
    ran_on: dict[tuple[str, int, int], str] = {}

    def comm(kind: str, layer: int, stage: int) -> None:
        ran_on[(kind, layer, stage)] = emulated_device.executing_stream() or "host"

    w.transport.fault_hook = comm

    def ffn(layer: int, stage: int) -> None:
        emulated_device.launch(lambda: comm("ffn", layer, stage))  # on the FFN's stream, before its kernel

    wrap_model(w, before_with_stage=ffn)
    return ran_on


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_device_backend_schedule_equals_serial_and_reuses_events(
    monkeypatch: pytest.MonkeyPatch, patch_layer: PatchLayer, layout: str
) -> None:
    """The device backend over the emulated device: every op's kernels run
    on the stream the schedule puts them on (compute-side: A2E and E2A on C,
    the FFN on F; comm-side: A2E and E2A on K_s, the FFN on C), every edge
    holds in what the streams performed, and streams and events are made
    once and reused."""
    w = world(layers=4, stage_ids=(0, 1, 2))
    scheds = [Schedule(4, (0, 1, 2), (3 + i, 9, 16 - i), step=i + 1) for i in range(6)]
    refs = serial_results(w, scheds, patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer, layouts=(layout,))
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer)
    ran_on = streams_ops_ran_on(w)
    made_after_first = None
    side = layout == "comm-side"
    expected = trace.ExpectedSchedule((0, 1, 2, 3), (0, 1, 2), side, side, not side)
    for i, (sched, ref) in enumerate(zip(scheds, refs, strict=True)):
        ran_on.clear()
        with trace.recording() as rec:
            assert_same(bounded(lambda sched=sched: run_step(w, sched)), ref)
        comm, ffn = (side_stream_name, COMPUTE_STREAM) if side else (lambda _s: COMPUTE_STREAM, FFN_STREAM)
        want = {
            (kind, L, s): comm(s) if kind in (A2E, E2A) else ffn
            for L in range(4)
            for s in (0, 1, 2)
            for kind in (A2E, "ffn", E2A)
        }
        assert ran_on == want, {k: (v, want.get(k)) for k, v in ran_on.items() if v != want.get(k)}
        res = edges.check_step(rec.ops(rec.steps()[0]), expected)
        assert res.ok, str(res)
        (sset,) = stream_sets(patch_layer)
        made = (len(sset.backend.events), tuple(id(k) for k in (*sset.streams.values(), sset.ffn)))
        if i == 0:
            made_after_first = made
    # Streams (K0, K1, K2 and F, made once) and events (pooled by key) are reused across steps.
    assert made == made_after_first
    assert len(made[1]) == 4
    assert sessions.count == len(scheds)


def test_device_capture_gates_unless_graph_mode(
    fake_device: HostDeviceModule, monkeypatch: pytest.MonkeyPatch, patch_layer: PatchLayer
) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    sched = Schedule(2, (0, 1), (5, 5), step=1)
    (ref,) = serial_results(w, [sched], patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer)
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer)
    fake_device.capturing = True
    assert_same(run_step(w, sched), ref)
    assert sessions.count == 0
    patch_layer.engine.unpatch(timeout=10)
    patch_layer.engine.apply(strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, graph=True))
    # An eager step first creates the side streams; the capture then reuses them.
    fake_device.capturing = False
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer)
    assert_same(run_step(w, sched), ref)
    streams_before_capture = fake_device.streams_created
    fake_device.capturing = True
    assert_same(run_step(w, sched), ref)
    assert sessions.count == 2
    assert fake_device.streams_created == streams_before_capture


def test_first_engaged_step_inside_capture_creates_no_streams(
    fake_device: HostDeviceModule,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    patch_layer: PatchLayer,
) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    sched = Schedule(2, (0, 1), (5, 5), step=1)
    (ref,) = serial_results(w, [sched], patch_layer=patch_layer)
    patch_layer.engine.apply(strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, graph=True))
    sessions = SessionSpy(monkeypatch, patch_layer=patch_layer)
    streams_before = fake_device.streams_created
    fake_device.capturing = True
    with caplog.at_level(logging.INFO):
        assert_same(run_step(w, sched), ref)
    assert sessions.count == 0
    assert fake_device.streams_created == streams_before
    assert "side streams are created only outside capture" in caplog.text


# ---------------------------------------------------------------------------
# Real devices (skip here)


def _device_ready(kind: str) -> str | None:
    if kind == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"
    if not _has_torch_npu():
        return "torch_npu is not installed"
    try:
        device_module("npu")
    except BackendUnavailable as exc:
        return str(exc)
    return None


def _on_device(w: Any, device: torch.device) -> None:
    """Keep the emulated transport on the host but the FFN on ``device``:
    A2E results are copied to the device on the op's stream, E2A inputs
    back to the host on the op's stream."""
    t = w.transport
    a2e, e2a = type(t).a2e.__get__(t), type(t).e2a.__get__(t)

    def a2e_dev(**kw: Any) -> Any:
        hidden, bs = a2e(**kw)
        return hidden.to(device), bs

    def e2a_dev(*, routed: torch.Tensor, shared: torch.Tensor | None, **kw: Any) -> None:
        return e2a(routed=routed.cpu(), shared=None if shared is None else shared.cpu(), **kw)

    t.a2e, t.e2a = a2e_dev, e2a_dev  # type: ignore[method-assign]


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
@pytest.mark.parametrize(
    "kind", [pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("npu", marks=pytest.mark.npu)]
)
def test_emulated_world_on_a_real_device(monkeypatch: pytest.MonkeyPatch, kind: str, layout: str) -> None:
    why = _device_ready(kind)
    if why:
        pytest.skip(why)
    from camp2p_overlap.emulation.standin_patch_layer import emulated_patch_layer, release_site, standin_site
    from camp2p_overlap.emulation.world import WorldSpec, build_world

    device = torch.device(kind, 0)
    # The emulation's own engine: the process-wide one refuses where vLLM
    # 0.19.1 is not installed (a GPU box typically has no vLLM).
    site = standin_site()
    try:
        w = build_world(
            WorldSpec(layers=6, stage_ids=(0, 1, 2), shape=SHAPE, tokens=16, op_timeout_s=10.0, device=kind),
            root=site.root,
        )
        _on_device(w, device)
        scheds = [Schedule(6, (0, 1, 2), (16, 9, 4), step=i + 1) for i in range(3)]
        refs = serial_results(w, scheds)
        patch_layer = emulated_patch_layer()
        sessions: list[object] = []

        class Counted(patch_layer.runtime.session_class):  # type: ignore[misc, name-defined]
            def __init__(self, **kw: Any) -> None:
                super().__init__(**kw)
                sessions.append(self.step_id)

        monkeypatch.setattr(patch_layer.runtime, "session_class", Counted)
        try:
            report = patch_layer.engine.apply(
                strict=True,
                manifest=site.manifest,
                config=OverlapConfig(enabled=True, backend=kind, adaptive=False, layouts=(layout,)),
            )
            assert report.engaged, str(report)
            mod = device_module(kind)
            for sched, ref in zip(scheds, refs, strict=True):

                def step(sched: Schedule = sched) -> tuple[Any, Any, Any]:
                    caller = mod.current_stream()
                    return caller, run_step(w, sched), mod.current_stream()

                before, got, after = bounded(step, timeout=60)
                assert after == before, f"{layout}: the caller's stream is not current after the step"
                mod.synchronize()
                assert_same(got, ref)
            assert len(sessions) == len(scheds)
        finally:
            assert patch_layer.engine.unpatch(timeout=30)
    finally:
        release_site(site)


def test_adaptive_device_steps_read_events_and_never_synchronize(fake_device: HostDeviceModule) -> None:
    """Adaptive engage on a device backend: step times come from timing
    events queried later; no step synchronizes anything; outputs stay equal
    across the learning steps that switch between overlap and serial."""
    import camp2p_overlap

    w = world(layers=3, stage_ids=(0, 1))
    scheds = [Schedule(3, (0, 1), (8, 8), step=i + 1) for i in range(10)]
    refs = serial_results(w, scheds)
    apply_cpu(adaptive=True)  # the process-wide patch layer: stats() reads it
    before_stats = camp2p_overlap.stats()
    before, before_layouts = before_stats["steps"], before_stats["layout_steps"]
    for sched, ref in zip(scheds, refs, strict=True):
        assert_same(bounded(lambda sched=sched: run_step(w, sched)), ref)
    after = camp2p_overlap.stats()
    ran = {k: after["steps"][k] - before[k] for k in ("overlap", "serial")}
    assert ran["overlap"] >= 3 and ran["serial"] >= 3 and sum(ran.values()) == len(scheds)
    # the overlap steps ran the default layout
    assert after["layout_steps"].get("compute-side", 0) - before_layouts.get("compute-side", 0) == ran["overlap"]
    assert fake_device.syncs == 0, "a step synchronized"
    assert fake_device.queries >= 6  # the step times were read with query()
    (bucket,) = [b for b in after["buckets"] if b["key"]["layers"] == 3 and b["key"]["tokens"] == 8]
    assert bucket["decision"] in ("compute-side", "serial") and bucket["overlap_samples"] >= 2
    assert bucket["samples"]["compute-side"] == bucket["overlap_samples"]
