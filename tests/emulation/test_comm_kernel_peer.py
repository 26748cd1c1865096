"""The device bench's attention peer (``emulation/comm_kernel.py``), run on
the host through a stand-in device module and the kernel's host reference:
a stage's next A2E completes only after its previous E2A plus the attention
time, the wait is reported per (layer, stage), outputs stay bitwise those
of the serial path, and the peer-cycle check fails on a schedule that breaks
the cycle (a peer that answers before it is asked) and on an A2E queued
ahead of the E2A it needs (which times out on the device instead of
hanging). The CUDA kernel itself runs in ``tests/hardware/test_gpu_validation.py``."""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support.host_device_module import HostDeviceModule, use_host_device_module
from support.overlap import assert_same

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.observe.trace import TraceOp
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.emulation.comm_kernel import KERNEL_SOURCE, DevicePeerTimeout, HostCommKernels
from camp2p_overlap.emulation.kernel_world import build_device_world
from camp2p_overlap.emulation.moe import MoEShape
from camp2p_overlap.emulation.standin_patch_layer import emulation_engine, release_site, standin_site
from camp2p_overlap.emulation.world import LinkModel, WorldSpec
from camp2p_overlap.verify.peer_cycle import check_peer_cycle

ATTN_S = 3e-3
LINK = LinkModel(latency_s=100e-6, bandwidth_Bps=50e9)
LAYERS = (0, 1, 2)
STAGES = (0, 1)


@pytest.fixture
def site() -> Iterator[Any]:
    s = standin_site()
    yield s
    release_site(s)


def _world(site: Any, dev: HostDeviceModule, kernels: HostCommKernels | None = None, **kw: Any) -> Any:
    spec = WorldSpec(
        layers=len(LAYERS),
        stage_ids=STAGES,
        tokens=8,
        shape=MoEShape(hidden=32, ffn=64, experts=2, top_k=1),
        link=LINK,
        attn_s=kw.pop("attn_s", ATTN_S),
        op_timeout_s=kw.pop("op_timeout_s", 5.0),
    )
    return build_device_world(
        spec,
        "cuda",
        root=site.root,
        module=dev,  # type: ignore[arg-type]
        kernels=kernels or HostCommKernels(3),
        device=torch.device("cpu"),
    )


def _traced(dw: Any, step: int) -> tuple[list[TraceOp], dict]:
    dw.world.steps_run = step - 1
    dw.timing.active = True
    try:
        start = dw.timing.begin()
        out = dw.world.run_step()
        dw.timing.end("step", None, None, start, dw.transport.step)
    finally:
        dw.timing.active = False
    ops = dw.timing.resolve()
    dw.synchronize()
    return ops, out


@contextlib.contextmanager
def _overlap(site: Any, layout: str = "compute-side") -> Iterator[None]:
    with emulation_engine() as engine:
        cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False, layouts=(layout,))
        assert engine.apply(config=cfg, manifest=site.manifest, strict=True).engaged
        yield


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_the_peer_cycle_holds_serial_and_overlapped(site: Any, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    dev = HostDeviceModule()
    use_host_device_module(monkeypatch, dev)
    dw = _world(site, dev)
    serial_ops, serial = _traced(dw, 1)
    waits = dw.transport.peer_wait_ns
    assert set(waits) == {(L, s) for L in LAYERS for s in STAGES}
    assert all(w >= 0 for w in waits.values())
    # Serial: the first stage's A2E of each layer waits out most of the attention time.
    assert max(waits.values()) >= ATTN_S * 1e9 * 0.5
    res = check_peer_cycle(serial_ops, LAYERS, STAGES, int(ATTN_S * 1e9))
    assert res.ok, str(res)
    with _overlap(site, layout):
        ops, got = _traced(dw, 1)
    assert_same(got, serial)
    comm_streams = {"C"} if layout == "compute-side" else {"K0", "K1"}
    assert {o.stream for o in ops if o.kind in ("a2e", "e2a")} == comm_streams
    res = check_peer_cycle(ops, LAYERS, STAGES, int(ATTN_S * 1e9))
    assert res.ok, str(res)
    # The device kernels' own clock agrees: each A2E ended after its E2A + attn.
    rec = {(k, L, s): (t0, t1) for k, L, s, t0, t1 in dw.transport.device_ops()}
    for s in STAGES:
        for prev, nxt in itertools.pairwise(LAYERS):
            assert rec[("a2e", nxt, s)][1] >= rec[("e2a", prev, s)][1] + ATTN_S * 1e9


class _EagerPeer(HostCommKernels):
    """A broken peer model: A2E answers without waiting for attention."""

    def op(self, st: torch.Tensor, rec: torch.Tensor, **kw: Any) -> None:
        kw["attn_ns"] = 0.0
        super().op(st, rec, **kw)


def test_the_cycle_check_fails_when_the_peer_answers_early(site: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = HostDeviceModule()
    use_host_device_module(monkeypatch, dev)
    dw = _world(site, dev, kernels=_EagerPeer(3))
    with _overlap(site):
        ops, _ = _traced(dw, 1)
    res = check_peer_cycle(ops, LAYERS, STAGES, int(ATTN_S * 1e9))
    assert not res.ok
    assert any("the peer answered before it was asked" in v for v in res.violations)


def test_an_a2e_queued_before_its_e2a_times_out_on_the_device(site: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A schedule that deadlocks on hardware: the lookahead A2E issued on K_s
    before the E2A it needs. The device kernel gives up after the op timeout
    and the step's synchronize raises instead of hanging."""
    dev = HostDeviceModule()
    use_host_device_module(monkeypatch, dev)
    dw = _world(site, dev, op_timeout_s=0.05)
    orig_send = StepSession.send

    def send_a2e_first(self: StepSession, call: Any, output: Any, context: Any, stage: Any) -> None:
        key = self.stage_layer_of(context)
        if key is not None and self.plan.next_layer(key[0]) is not None:
            nxt = self.plan.next_layer(key[0])
            self.issue_a2e(nxt, key[1])  # the lookahead, ahead of its E2A
            real_issue = self.issue_a2e
            self.issue_a2e = lambda layer, s: None  # type: ignore[method-assign]
            try:
                return orig_send(self, call, output, context, stage)
            finally:
                self.issue_a2e = real_issue  # type: ignore[method-assign]
        return orig_send(self, call, output, context, stage)

    monkeypatch.setattr(StepSession, "send", send_a2e_first)
    with _overlap(site), pytest.raises(DevicePeerTimeout, match=r"waited more than 0\.05 s on the device"):
        _traced(dw, 1)


def test_check_peer_cycle_on_hand_made_traces() -> None:
    def op(kind: str, layer: int, stage: int, t0: int, t1: int) -> TraceOp:
        return TraceOp(kind, layer, stage, f"K{stage}", t0, t1, 1)

    good = [op("a2e", 0, 0, 0, 10), op("e2a", 0, 0, 20, 30), op("a2e", 1, 0, 31, 130), op("e2a", 1, 0, 140, 150)]
    assert check_peer_cycle(good, (0, 1), (0,), 100, tolerance_ns=0).ok
    early = [*good[:2], op("a2e", 1, 0, 31, 90), good[3]]
    res = check_peer_cycle(early, (0, 1), (0,), 100, tolerance_ns=0)
    assert [v for v in res.violations if "before e2a(L0) started plus the attention time" in v]
    before = [*good[:2], op("a2e", 1, 0, 5, 200), good[3]]
    res = check_peer_cycle(before, (0, 1), (0,), 100, tolerance_ns=0)
    assert any("started before e2a(L0) did" in v for v in res.violations)
    res = check_peer_cycle(good[:2], (0, 1), (0,), 100)
    assert any("missing a2e" in v for v in res.violations)


def test_the_cuda_kernel_spins_on_wall_time_and_holds_shared_memory() -> None:
    """What can be checked of the CUDA source without a GPU: it spins on the
    device wall clock, never on _sleep cycles, and its only exits are the
    peer's data, the op timeout and the link time."""
    assert "%%globaltimer" in KERNEL_SOURCE and "_sleep" not in KERNEL_SOURCE
    assert "timeout_ns" in KERNEL_SOURCE and "atomicAdd" in KERNEL_SOURCE


@pytest.mark.alone
def test_the_device_bench_runs_the_peer_model_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --device cuda``'s path (device world, device trace, peer waits
    read back, the peer-cycle check on every traced step, the report) on the
    host stand-in device: every policy bitwise equal to serial, the cycle held,
    the attention time modeled."""
    from camp2p_overlap.emulation import kernel_world
    from camp2p_overlap.tools.bench.runner import BenchParams, run_bench

    dev = HostDeviceModule()
    use_host_device_module(monkeypatch, dev)
    real_build = kernel_world.build_device_world

    def build(spec: Any, kind: str, *, root: str) -> Any:
        return real_build(spec, kind, root=root, module=dev, kernels=HostCommKernels(3), device=torch.device("cpu"))  # type: ignore[arg-type]

    monkeypatch.setattr(kernel_world, "build_device_world", build)
    params = BenchParams(
        device="cuda", layers=3, stages=2, tokens=8, hidden=32, ffn=64, experts=2, top_k=1,
        link_latency_us=100.0, link_gbps=8.0, attn_us=1000.0, steps=2, warmup=1, reps=1,
    )  # fmt: skip
    report = run_bench(params).report
    assert report["attn_modeled"] is True and report["comm_model"].startswith("host reference")
    assert report["outputs_equal"] is True
    assert report["measured"]["attn_us"] == 1000.0
    by = {p["policy"]: p for p in report["policies"]}
    assert by["compute-side-fixed"]["engaged"] is True
    for p in report["policies"]:
        assert p["peer_cycle_ok"] is True and p["peer_cycle_checked_steps"] >= 1, p
        assert p["edges_checked"] is False
    # a excludes the peer wait read back from the device: well under the attention time.
    assert all(s["a_us"] < 1000.0 for s in report["measured"]["stages"]), report["measured"]


class _FakeCompiledKernel:
    """Stands in for what ``torch.cuda._compile_kernel`` returns, to check on
    the host what the launcher hands the kernel: the arguments in the order
    and types of the CUDA signature (``st, rec, mode, stage, want_seq,
    set_seq, attn_ns, link_ns, timeout_ns, nstages, record_sm``), the grid
    and the shared memory. It carries out that signature's meaning on the
    host at launch (a reading of the CUDA source, independent of
    :class:`HostCommKernels`); ``swap`` swaps two arguments to show that the
    self-test catches a kernel fed the wrong ones. This checks the host side
    only: the CUDA kernel itself runs in the gpu tests."""

    def __init__(self, swap: bool = False) -> None:
        self.swap = swap
        self.launches: list[tuple[tuple[int, int, int], int, list[Any]]] = []
        self.shared_config = 0

    def set_shared_memory_config(self, nbytes: int) -> None:
        self.shared_config = nbytes

    def __call__(self, grid: Any, block: Any, args: list[Any], shared_mem: int = 0, stream: Any = None) -> None:
        import time as _time

        self.launches.append((grid, shared_mem, list(args)))
        st, rec, mode, stage, want, setq, attn, link, timeout, nst, record_sm = args
        assert isinstance(st, torch.Tensor) and isinstance(rec, torch.Tensor)
        assert all(type(x) is int for x in (mode, stage, want, setq, nst, record_sm)), args
        assert all(type(x) is float for x in (attn, link, timeout)), args
        if self.swap:
            want, setq = setq, want
        t0 = _time.perf_counter_ns()
        if mode == 0:
            for s in range(nst):
                st[2 * s + 1], st[2 * s] = t0, 0
            st[2 * nst] = 0
            return
        ready = t0
        if want >= 0:
            ok = False
            while _time.perf_counter_ns() - t0 < timeout:
                if int(st[2 * stage]) >= want and _time.perf_counter_ns() >= int(st[2 * stage + 1]) + attn:
                    ok = True
                    break
            ready = _time.perf_counter_ns()
            if not ok:
                st[2 * nst] += 1
        while _time.perf_counter_ns() - ready < link:
            pass
        end = _time.perf_counter_ns()
        rec[0], rec[1], rec[2] = t0, ready, end
        if setq >= 0:
            st[2 * stage + 1], st[2 * stage] = end, setq


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, kernel: _FakeCompiledKernel) -> None:
    from types import SimpleNamespace

    from camp2p_overlap.emulation import comm_kernel

    props = SimpleNamespace(
        multi_processor_count=132, shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda source, name, **kw: kernel, raising=False)
    monkeypatch.setattr(comm_kernel, "_COMPILED", {})


def test_the_nvrtc_launcher_packs_the_kernel_signature(site: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from camp2p_overlap.emulation.comm_kernel import NvrtcCommKernels

    kernel = _FakeCompiledKernel()
    _fake_cuda(monkeypatch, kernel)
    k = NvrtcCommKernels(3, 4, torch.device("cpu"))  # its self-test runs through the launcher
    assert k.kind == "nvrtc (torch.cuda._compile_kernel)"
    assert kernel.shared_config == 232448
    assert {(grid, shared) for grid, shared, _ in kernel.launches} == {((4, 1, 1), 232448)}
    # The world through this launcher, on the host stand-in device: the cycle holds.
    dev = HostDeviceModule()
    use_host_device_module(monkeypatch, dev)
    dw = _world(site, dev, kernels=k)
    with _overlap(site):
        ops, _ = _traced(dw, 1)
    assert check_peer_cycle(ops, LAYERS, STAGES, int(ATTN_S * 1e9)).ok
    assert NvrtcCommKernels(3, 0, torch.device("cpu")).shared == 0  # no contention: no shared memory asked


def test_the_self_test_rejects_a_kernel_fed_the_wrong_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    from camp2p_overlap.emulation.comm_kernel import NvrtcCommKernels

    _fake_cuda(monkeypatch, _FakeCompiledKernel(swap=True))
    monkeypatch.setitem(sys.modules, "cupy", None)  # no second way either
    with pytest.raises(RuntimeError, match="comm kernel self-test failed"):
        NvrtcCommKernels(3, 0, torch.device("cpu"))


def test_comm_cores_a_gpu_cannot_give_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from camp2p_overlap.emulation.comm_kernel import NvrtcCommKernels

    _fake_cuda(monkeypatch, _FakeCompiledKernel())
    with pytest.raises(ValueError, match="the GPU has 132 SMs"):
        NvrtcCommKernels(3, 132, torch.device("cpu"))


@pytest.mark.parametrize("drop_refs", [False, True], ids=["session", "control-refs-dropped"])
def test_ffn_outputs_stay_referenced_until_c_waited_their_e2a(
    site: Any, monkeypatch: pytest.MonkeyPatch, drop_refs: bool
) -> None:
    """The ownership rule that replaces ``record_stream``, as reference
    lifetimes (what decides when the caching allocator may hand a block out
    again): an FFN output, allocated on C and read by E2A on K_s, is still
    referenced when a later FFN of the same layer starts (C has not yet waited
    an event K_s recorded after that E2A), is let go at the stage's next
    receive, and nothing is left after the step. The control drops the
    session's references and must show the output gone too early. On CUDA the
    same rule is tested through the allocator itself (gpu tests)."""
    import weakref

    from camp2p_overlap.emulation.kernel_world import TimedModel

    dev = HostDeviceModule()
    use_host_device_module(monkeypatch, dev)
    spec_stages = (0, 1, 2)
    spec = WorldSpec(
        layers=2, stage_ids=spec_stages, tokens=8, shape=MoEShape(hidden=32, ffn=64, experts=2, top_k=1),
        link=LINK, attn_s=0.0, op_timeout_s=5.0,
    )  # fmt: skip
    dw = build_device_world(
        spec, "cuda", root=site.root, module=dev, kernels=HostCommKernels(3), device=torch.device("cpu")
    )  # type: ignore[arg-type]
    outs: dict[tuple[int, int], Any] = {}
    alive_at: dict[tuple[int, int], set[tuple[int, int]]] = {}
    orig = TimedModel.compute_ffn_output

    def spy(self: Any, *, hidden_states: torch.Tensor, layer_idx: int) -> Any:
        stage = self.transport.stage_of[id(hidden_states)]
        alive_at[(layer_idx, stage)] = {k for k, ref in outs.items() if ref() is not None}
        out = orig(self, hidden_states=hidden_states, layer_idx=layer_idx)
        outs[(layer_idx, stage)] = weakref.ref(out.routed_output)
        return out

    monkeypatch.setattr(TimedModel, "compute_ffn_output", spy)
    if drop_refs:
        orig_send = StepSession.send

        def send_and_forget(self: Any, call: Any, output: Any, context: Any, stage: Any) -> None:
            orig_send(self, call, output, context, stage)
            self.release_buffers()

        monkeypatch.setattr(StepSession, "send", send_and_forget)
    with _overlap(site):
        dw.world.steps_run = 0
        dw.world.run_step()
    assert set(alive_at) == {(L, s) for L in (0, 1) for s in spec_stages}
    if drop_refs:
        assert (0, 0) not in alive_at[(0, 2)], "the control still held the output: the check cannot fail"
        return
    # FFN(0,2) starts: E2A(0,0) has not been waited by C yet: its input is held.
    assert {(0, 0), (0, 1)} <= alive_at[(0, 2)], alive_at[(0, 2)]
    # FFN(1,0) starts after C waited a_done(1,0), recorded on K_0 after E2A(0,0): released.
    assert (0, 0) not in alive_at[(1, 0)], alive_at[(1, 0)]
    assert all(ref() is None for ref in outs.values()), "the step ended holding FFN outputs"
