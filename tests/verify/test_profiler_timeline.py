"""Device timelines from a profiler trace: the parser (Kineto-style Chrome
trace JSON -> per-stream kernel timelines -> the checker's TraceOps), the
annotating session's ``camp2p:`` ranges, and ``bench --profile-trace``.

On CPU the trace comes from a simulated device (streams with a device clock
that honours event waits) driven by the real (annotating) session through
the real device backend, written in Kineto's shape; torch.profiler on CPU checks the
host side (ranges). The GPU run is the ``gpu``-marked test at the end."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from camp2p_overlap.core.keys import A_DONE, F_DONE, EventKey, OpKey
from camp2p_overlap.core.observe.trace import ExpectedSchedule
from camp2p_overlap.core.overlap.plan import COMM_SIDE, COMPUTE_SIDE, Layout, StepPlan
from camp2p_overlap.core.overlap.runtime import OverlapRuntime
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.core.overlap.streams import StreamBackend
from camp2p_overlap.core.overlap.streams.streamset import StreamSet
from camp2p_overlap.tools.bench import profile
from camp2p_overlap.verify import annotated_backend, profiler_timeline
from camp2p_overlap.verify.annotated_backend import AnnotatingSession
from camp2p_overlap.verify.edges import check_step
from camp2p_overlap.verify.profiler_timeline import TimelineError, parse

LAYERS = (0, 1, 2)
STAGES = (0, 1)
EXPECTED = ExpectedSchedule(LAYERS, STAGES, True, True)
#: By layout: the layout, what the checker expects, and the streams of the device timeline.
LAYOUTS = {
    "comm-side": (COMM_SIDE, EXPECTED, {"C", "F", "K0", "K1"}),
    "compute-side": (COMPUTE_SIDE, ExpectedSchedule(LAYERS, STAGES, False, False, True), {"C", "F", "K0", "K1"}),
}


class SimDevice:
    """``torch.cuda``'s stream/event API over a simulated device: each
    stream has a clock; a kernel starts when its stream is free and after
    its launch; ``wait_event`` holds the stream until the event's time. It
    writes what Kineto would: host ranges, launch calls and kernels tied by
    correlation ids."""

    def __init__(self, comm_ns: int = 200_000, ffn_ns: int = 50_000) -> None:
        self.__name__ = "simdev"
        self.comm_ns, self.ffn_ns = comm_ns, ffn_ns
        self.host_ns = 1_000_000
        self.corr = itertools.count(1)
        self.events: list[dict[str, Any]] = []
        sim = self
        ids = itertools.count(7)

        class Stream:
            def __init__(self, device: Any = None) -> None:
                self.sid = next(ids)
                self.ready = 0

            def wait_event(self, ev: Any) -> None:
                self.ready = max(self.ready, ev.time)

            def synchronize(self) -> None:
                pass

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.time = 0

            def record(self, stream: Any = None) -> None:
                self.time = (stream or sim.current).ready

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                pass

        self.Stream, self.Event = Stream, Event
        self.current = Stream()

    def current_stream(self) -> Any:
        return self.current

    def set_stream(self, s: Any) -> None:
        self.current = s

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev

    def synchronize(self) -> None:
        pass

    def _tick(self) -> int:
        self.host_ns += 1000
        return self.host_ns

    def launch(self, name: str, dur_ns: int) -> None:
        t, c, s = self._tick(), next(self.corr), self.current
        start = max(s.ready, t + 2000)
        s.ready = start + dur_ns
        launch = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1}
        self.events.append(launch | {"ts": t / 1e3, "dur": 0.2, "args": {"correlation": c}})
        kernel = {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": s.sid}
        args = {"stream": s.sid, "correlation": c, "device": 0}
        self.events.append(kernel | {"ts": start / 1e3, "dur": dur_ns / 1e3, "args": args})

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        t0 = self._tick()
        try:
            yield
        finally:
            t1 = self._tick()
            host = {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1}
            self.events.append(host | {"ts": t0 / 1e3, "dur": (t1 - t0) / 1e3})

    def trace(self) -> dict[str, Any]:
        return {"traceEvents": list(self.events), "displayTimeUnit": "ms"}


class _Ctx:
    """A received payload (its own context)."""


def _loop(session: StepSession, sim: SimDevice) -> None:
    """Upstream's loop shape, with device work for each op."""

    def recv(*, ubatch_idx: int, layer_idx: int) -> _Ctx:
        sim.launch("a2e_copy", sim.comm_ns)
        return _Ctx()

    try:
        for L in LAYERS:
            for s in STAGES:
                payload = session.recv(recv, {"ubatch_idx": s, "layer_idx": L})
                sim.launch("moe_gemm", sim.ffn_ns)
                sim.launch("silu_mul", sim.ffn_ns // 5)
                session.send(lambda: sim.launch("e2a_copy", sim.comm_ns), None, payload, s)
    finally:
        session.close()


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run one annotated, profiled step of a session class on the simulated
    device; return its parsed timeline."""

    def run(
        session_class: type = StepSession, marker_kernels: int = 1, layout: Layout = COMM_SIDE, **sim_kw: Any
    ) -> tuple[profiler_timeline.DeviceTimeline, SimDevice]:
        sim = SimDevice(**sim_kw)

        def marker() -> None:  # the marker's kernels: a fill then "marker", as two-kernel markers are
            for _ in range(marker_kernels - 1):
                sim.launch("marker_fill", 1000)
            sim.launch("marker", 1000)

        monkeypatch.setattr(annotated_backend, "profiler_range", sim.range)
        monkeypatch.setattr(profile, "profiler_range", sim.range)
        sset = StreamSet(StreamBackend("cuda", sim), STAGES)  # type: ignore[arg-type]
        runtime = OverlapRuntime()  # the steps make their sessions of its session class, as a runner's do
        runtime.session_class = session_class

        def step() -> None:
            plan = StepPlan(LAYERS, STAGES)
            session = runtime.session_class(connector=object(), plan=plan, streamset=sset, layout=layout)
            assert isinstance(session, AnnotatingSession) and isinstance(session, session_class)
            _loop(session, sim)

        profile.profiled_step(step, mod=sim, runtime=runtime, streamset=sset, launch=marker)
        assert runtime.session_class is session_class  # the annotating class is off again
        return parse(json.loads(json.dumps(sim.trace()))), sim

    return run


@pytest.mark.parametrize("layout", ["comm-side", "compute-side"])
@pytest.mark.parametrize("marker_kernels", [1, 2], ids=["one-kernel-marker", "two-kernel-marker"])
def test_a_correct_step_holds_every_edge_on_device_times(
    simulated: Any, tmp_path: Any, marker_kernels: int, layout: str
) -> None:
    lay, expected, streams = LAYOUTS[layout]
    timeline, _ = simulated(marker_kernels=marker_kernels, layout=lay)
    assert set(timeline.names.values()) == streams  # every stream of the runner is marked, used or not
    per = timeline.per_stream()
    marker_names = {"marker", "marker_fill"} if marker_kernels == 2 else {"marker"}
    ffn, comm = {"moe_gemm", "silu_mul"}, {"a2e_copy", "e2a_copy"}
    if lay.ffn_side:  # compute-side: the FFN on F, A2E and E2A on C; K_s idle
        want = {"C": comm, "F": ffn, "K0": set(), "K1": set()}
    else:
        want = {"C": ffn, "F": set(), "K0": comm, "K1": comm}
    for name, kernels in want.items():
        assert {a.name for a in per[name]} == {*marker_names, *kernels}, name
    ops = timeline.trace_ops(step=3)
    kinds = {(o.kind, o.layer, o.stage, o.stream) for o in ops}
    for L in LAYERS:
        for s in STAGES:
            assert {(k, L, s, expected.stream_for(k, s)) for k in ("a2e", "ffn", "e2a")} <= kinds
    assert [o.kind for o in ops].count("step") == 1
    res = check_step(ops, expected, source="device")
    assert res.ok, str(res)
    # The timing is real overlap: some FFN ran while a comm op worked on another stream.
    ffns = [o for o in ops if o.kind == "ffn"]
    comms = [o for o in ops if o.kind in ("a2e", "e2a")]
    assert any(f.start_ns < c.end_ns and c.start_ns < f.end_ns for f in ffns for c in comms)

    summary = profile.write_profile(timeline, str(tmp_path / "p.json"), layers=LAYERS, stages=STAGES, layout=lay)
    assert summary["edges_ok"] and summary["ops"] == 3 * len(LAYERS) * len(STAGES)
    # The two fences and the stream marker, each marker_kernels kernels, and two kernels per FFN (comm-side) or
    # per A2E and E2A (compute-side).
    assert summary["streams"]["C"] == 3 * marker_kernels + 2 * len(LAYERS) * len(STAGES)
    assert summary["unnamed_streams"] == []
    events = json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert tracks == streams
    assert any(e.get("cat") == "kernel" and e["name"] == "moe_gemm" for e in events)


def test_a_fence_is_every_kernel_its_marker_launched(simulated: Any) -> None:
    """A marker of two kernels (``torch.ones(1).mul_(2)`` on CUDA: a fill and
    a multiply) fences from its first kernel's start to its last one's end:
    the step span starts after the whole begin fence and ends before the
    end fence, and the step is found (it was not while a fence had to be
    exactly one kernel)."""
    timeline, _ = simulated(marker_kernels=2)
    fences = {}
    for name in ("step-begin", "step-end"):
        kernels = [a for a, who in zip(timeline.activities, timeline.owner, strict=True) if who == ("marker", name)]
        assert [a.name for a in kernels] == ["marker_fill", "marker"], kernels
        fences[name] = (kernels[0].start_ns, kernels[-1].end_ns)
        assert timeline.fence(name) == fences[name]
    (step,) = [o for o in timeline.trace_ops() if o.kind == "step"]
    assert (step.start_ns, step.end_ns) == (fences["step-begin"][1], fences["step-end"][0])
    assert check_step(timeline.trace_ops(), EXPECTED, source="device").ok


def test_the_profilers_marker_is_one_op_that_allocates_nothing() -> None:
    """The marker ``bench --profile-trace`` launches: one in-place op on a
    tensor made beforehand (one kernel on CUDA), not a factory call and an
    op (two kernels). Checked on CPU through the operators it dispatches."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    launch = profile.marker(torch.device("cpu"))
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        launch()
    assert [e.name for e in prof.events()] == ["aten::fill_"]
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:  # the control: the old marker is two ops
        torch.ones(1).mul_(2)
    names = [e.name for e in prof.events()]
    assert "aten::ones" in names and "aten::mul_" in names, names


class NoFfnWaitForA2E(StepSession):
    """The FFN's stream does not wait a_done (C in comm-side, F in compute-side)."""

    def wait_event(self, stream: Any, key: EventKey) -> None:
        if key.kind == A_DONE:
            return
        super().wait_event(stream, key)


class NoE2AWaitForFFN(StepSession):
    """The E2A's stream does not wait f_done (K_s in comm-side, C in compute-side)."""

    def wait_event(self, stream: Any, key: EventKey) -> None:
        if key.kind == F_DONE:
            return
        super().wait_event(stream, key)


class NoJoin(StepSession):
    def join(self) -> None:
        return


@pytest.mark.parametrize(
    ("broken", "sim_kw", "layout", "message"),
    [
        (NoFfnWaitForA2E, {}, "comm-side", "ffn(L0,s0) started"),
        (NoE2AWaitForFFN, {"comm_ns": 10_000, "ffn_ns": 300_000}, "comm-side", "e2a(L0,s0) started"),
        (NoJoin, {}, "comm-side", "ran outside the step (fork/join)"),
        (NoFfnWaitForA2E, {}, "compute-side", "ffn(L0,s0) started"),
        (NoE2AWaitForFFN, {"comm_ns": 10_000, "ffn_ns": 300_000}, "compute-side", "e2a(L0,s0) started"),
    ],
)
def test_a_missing_wait_shows_in_device_times(
    simulated: Any, broken: type, sim_kw: dict, layout: str, message: str
) -> None:
    lay, expected, _ = LAYOUTS[layout]
    assert check_step(simulated(layout=lay, **sim_kw)[0].trace_ops(), expected, source="device").ok  # the control
    timeline, _ = simulated(broken, layout=lay, **sim_kw)
    res = check_step(timeline.trace_ops(), expected, source="device")
    assert not res.ok
    assert message in str(res)


# ---------------------------------------------------------------------------
# The parser on hand-written traces


def _x(name: str, cat: str, pid: Any, tid: Any, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_parser_links_kernels_by_correlation_and_by_flow_events() -> None:
    events = [
        _x("camp2p:stream K0", "user_annotation", 1, 1, 10.0, 5.0),
        _x("cudaLaunchKernel", "cuda_runtime", 1, 1, 12.0, 1.0, correlation=5),
        _x("marker", "kernel", 0, 9, 20.0, 1.0, stream=9, correlation=5),
        _x("camp2p:a2e L2 s0", "user_annotation", 1, 1, 30.0, 5.0),
        # An NPU-shaped task: a stream id under "Stream Id", tied by a flow.
        {"ph": "s", "cat": "HostToDevice", "id": 77, "pid": 1, "tid": 1, "ts": 31.5},
        _x("aclnnCopy", "npu", 2, 9, 40.25, 2.5, **{"Stream Id": 9, "Task Type": "AI_VECTOR_CORE"}),
        {"ph": "f", "cat": "HostToDevice", "id": 77, "pid": 2, "tid": 9, "ts": 40.25, "bp": "e"},
        # A device copy of a host range is not a host range.
        _x("camp2p:a2e L2 s0", "gpu_user_annotation", 0, 9, 40.0, 3.0),
        # A kernel nobody launched from a camp2p range, on a stream not marked.
        _x("cudaLaunchKernel", "cuda_runtime", 1, 1, 50.0, 1.0, correlation=6),
        _x("other", "kernel", 0, 3, 60.0, 1.0, stream=3, correlation=6),
    ]
    tl = parse({"traceEvents": events})
    assert [r.name for r in tl.ranges] == ["stream K0", "a2e L2 s0"]
    assert tl.names == {"9": "K0"}
    (op,) = [o for o in tl.trace_ops() if o.kind == "a2e"]
    assert (op.layer, op.stage, op.stream, op.start_ns, op.end_ns) == (2, 0, "K0", 40_250, 42_750)
    assert set(tl.per_stream()) == {"K0", "stream 3"}
    assert tl.owner[-1] is None


def test_a_fence_entered_twice_or_that_reached_no_device_gives_no_step() -> None:
    def fenced(ts: float, name: str, corr: int) -> list[dict[str, Any]]:
        return [
            _x(f"camp2p:{name}", "user_annotation", 1, 1, ts, 3.0),
            _x("cudaLaunchKernel", "cuda_runtime", 1, 1, ts + 1.0, 0.5, correlation=corr),
            _x("fill", "kernel", 0, 7, ts + 5.0, 1.0, stream=7, correlation=corr),
        ]

    once = [*fenced(10.0, "step-begin", 1), *fenced(50.0, "step-end", 2)]
    (step,) = [o for o in parse(once).trace_ops() if o.kind == "step"]
    assert (step.start_ns, step.end_ns) == (16_000, 55_000)
    twice = [*once, *fenced(90.0, "step-end", 3)]
    assert parse(twice).fence("step-end") is None
    assert not [o for o in parse(twice).trace_ops() if o.kind == "step"]
    unlaunched = [*fenced(10.0, "step-begin", 1), _x("camp2p:step-end", "user_annotation", 1, 1, 50.0, 3.0)]
    assert parse(unlaunched).fence("step-end") is None


def test_parser_refuses_what_is_not_a_trace() -> None:
    with pytest.raises(TimelineError, match="no traceEvents"):
        parse({"events": []})
    empty = parse([])
    assert empty.trace_ops() == [] and empty.per_stream() == {}


def test_host_ranges_from_torch_profiler_on_cpu(tmp_path: Any) -> None:
    """What the annotating session writes, read back from a real torch.profiler
    trace: the ranges (names, one host thread, µs -> ns); CPU ops are not
    taken for device kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from camp2p_overlap.verify.annotated_backend import (
        event_range_name,
        op_range_name,
        parse_event_range,
        profiler_range,
    )

    x = torch.ones(64, 64)
    f_done = EventKey(F_DONE, 0, 1)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        with profiler_range(op_range_name(OpKey("a2e", 0, 1).label())):
            x @ x
        with profiler_range(event_range_name("record", "C", f_done)):
            pass
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    tl = profiler_timeline.load(str(path))
    names = [r.name for r in tl.ranges]
    assert names == ["a2e L0 s1", "record C f L0 s1"]
    # Read back as the keys they were made from, with no parsing of a repr.
    assert OpKey.parse(names[0]) == OpKey("a2e", 0, 1)
    assert parse_event_range(names[1]) == ("record", "C", f_done)
    a, r = tl.ranges
    assert a.thread == r.thread and a.start_ns < a.end_ns <= r.start_ns
    assert tl.activities == []  # no device activity on CPU


def test_capture_profiles_and_reads_back_the_trace() -> None:
    """The tool's capture path (torch.profiler, Chrome trace export, load):
    on CPU the CUDA activity is switched off, the host ranges remain."""
    import warnings

    def work() -> int:
        with profile.profiler_range("camp2p:e2a L1 s0"):
            torch.ones(8).mul_(2)
        return 7

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available, disabling CUDA profiling"
        result, raw = profile.capture("cuda", work)
    assert result == 7
    assert [r.name for r in parse(raw).ranges] == ["e2a L1 s0"]


def test_profile_trace_is_refused_on_cpu(tmp_path: Any) -> None:
    from camp2p_overlap.tools.cli import main

    assert main(["bench", "--profile-trace", str(tmp_path / "p.json"), "--steps", "1"]) == 2
    assert not (tmp_path / "p.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the device profiler reads CUDA kernels)")
def test_profiled_cuda_step_holds_every_edge(tmp_path: Any) -> None:
    from camp2p_overlap.tools.bench.runner import BenchParams, run_bench

    path = tmp_path / "profile.json"
    params = BenchParams(device="cuda", layers=3, stages=2, steps=2, warmup=1, reps=1, policies=("serial", "overlap"))
    run = run_bench(params, profile_trace=str(path))
    prof = run.report["profile"]
    assert prof["edges_ok"], prof["edge_violations"]
    assert prof["outputs_equal"] is True
    assert {"C", "K0", "K1"} <= set(prof["streams"]) and prof["unnamed_streams"] == []
    assert prof["ops"] == 3 * 3 * 2
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e.get("name") == "thread_name"} >= {"C", "K0", "K1"}
