"""The emulated device's timing model (``emulation/device/timing.py``):
a kernel launched with a modelled duration holds its stream until its
modelled end, whatever its work took; the streams' modelled clocks chain
through stream order and event waits; a capture keeps the model with its
kernel for every replay; the device counts each modelled kernel, reports
one that overran its model, and each synchronize's lag behind the modelled
timeline. Only lower bounds of wall time are asserted (a hold never ends
early); the modelled times are exact by construction."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from camp2p_overlap.emulation import device
from camp2p_overlap.emulation.device import timing
from camp2p_overlap.emulation.ffn_timing import fixed
from camp2p_overlap.emulation.moe import MoEFFN, MoEShape
from camp2p_overlap.emulation.world import LinkModel, WorldSpec, build_world

MS = 1_000_000


@pytest.fixture(autouse=True)
def _fresh_counts() -> None:
    device.synchronize()
    device.take_timing()


def _starts() -> tuple[list[int], object]:
    """A list the kernels below append their modelled starts to."""
    seen: list[int] = []
    return seen, lambda: seen.append(device.kernel_start_ns())


def test_a_modelled_kernel_holds_its_stream_until_its_modelled_end() -> None:
    s = device.Stream()
    try:
        seen, note = _starts()
        done: list[int] = []
        with device.stream(s):
            device.launch(note, model_s=0.020, kind="ffn")  # work: nothing; model 20 ms
            device.launch(lambda: (note(), time.sleep(0.005)), model_s=0.010, kind="ffn")  # work 5 ms, model 10 ms
            ev = s.record_event()
            device.launch(lambda: done.append(time.perf_counter_ns()))
        t0 = time.perf_counter_ns()
        device.synchronize()
        # The second kernel starts, on the modelled timeline, where the first ended.
        assert seen[1] - seen[0] == 20 * MS
        # The record after them: the modelled end of the second (its wall time is not).
        assert ev.last.model_ns == seen[1] + 10 * MS
        # Held, not skipped: the unmodelled kernel after them ran no earlier.
        assert done[0] >= seen[0] + 30 * MS and time.perf_counter_ns() - t0 >= 25 * MS
        counts = device.take_timing()
        ffn = counts.kinds["ffn"]
        assert ffn.kernels == 2 and ffn.modelled_ns == 30 * MS
        assert all(w >= 0 for w in ffn.work_ns) and max(ffn.work_ns) >= 5 * MS
    finally:
        s.close()


def test_a_kernel_without_a_model_is_not_held_or_counted() -> None:
    s = device.Stream()
    try:
        with device.stream(s):
            device.launch(lambda: None)
        t0 = time.perf_counter_ns()
        device.synchronize()
        assert time.perf_counter_ns() - t0 < 500 * MS
        assert device.take_timing().kinds == {}
    finally:
        s.close()


def test_a_wait_carries_the_modelled_time_to_the_waiting_stream() -> None:
    """A stream that waits on an event starts its next kernel at the
    record's modelled time, not when its thread woke up."""
    a, b = device.Stream(), device.Stream()
    try:
        seen, note = _starts()
        ev = device.Event()
        with device.stream(a):
            device.launch(note, model_s=0.015, kind="a2e")
            ev.record()
        with device.stream(b):
            ev.wait()
            device.launch(lambda: (time.sleep(0.002), note()), model_s=0.005, kind="ffn")
        device.synchronize()
        assert seen[1] == ev.last.model_ns == seen[0] + 15 * MS
        assert device.take_timing().kinds["ffn"].modelled_ns == 5 * MS
    finally:
        a.close()
        b.close()


@pytest.mark.alone
def test_hold_until_names_a_kernels_modelled_end_while_it_runs() -> None:
    """A comm kernel's duration depends on what it waited for: it names its
    modelled end itself; what it does after the hold is published then."""
    s = device.Stream()
    try:
        out: list[int] = []

        def kernel() -> None:
            start = device.kernel_start_ns()
            device.hold_until(start + 7 * MS, "e2a")
            out.append(time.perf_counter_ns() - start)

        with device.stream(s):
            device.launch(kernel)
        device.synchronize()
        assert out[0] >= 7 * MS
        e2a = device.take_timing().kinds["e2a"]
        assert e2a.kernels == 1 and e2a.modelled_ns == 7 * MS
        # its own work fits its model (whether the hold woke within the overrun
        # tolerance is the OS's wake-up latency, which a loaded CI machine can
        # exceed: overrun reports are tested with a kernel made to overrun)
        assert len(e2a.work_ns) == 1 and e2a.work_ns[0] < 7 * MS
    finally:
        s.close()


def test_a_kernel_made_to_overrun_is_reported() -> None:
    """Its work (30 ms) is longer than its model (1 ms): one overrun of
    about 29 ms, counted once (the kernel after it, on time, is not)."""
    s = device.Stream()
    try:
        with device.stream(s):
            device.launch(lambda: time.sleep(0.030), model_s=0.001, kind="ffn")
            device.launch(lambda: None, model_s=0.010, kind="e2a")
        device.synchronize()
        counts = device.take_timing()
        ffn, e2a = counts.kinds["ffn"], counts.kinds["e2a"]
        assert ffn.overruns == 1 and 29 * MS - 1 * MS <= ffn.overrun_ns < 1_000 * MS
        assert e2a.kernels == 1 and e2a.overruns == 0  # began late, held less: absorbed
        report = counts.to_dict()
        assert report["overruns"] == 1 and report["overrun_pct"] == 50.0
        assert report["overrun_time_pct"] == pytest.approx(100 * ffn.overrun_ns / (11 * MS), rel=1e-3)
        assert report["over_us"]["max"] >= 28_000 and report["by_kind"]["ffn"]["overruns"] == 1
    finally:
        s.close()


def test_the_ledger_counts_overruns_past_the_tolerance_and_late_starts() -> None:
    """The accounting on given times: run time past the model within the
    tolerance is not an overrun; past it, it is, by that run time; a late
    start is counted apart."""
    ledger = timing.Ledger()
    tol = timing.OVERRUN_TOLERANCE_NS
    ledger.kernel("ffn", 0, 10 * MS, 0, 5 * MS, 10 * MS + tol)  # on time, tolerance spent: not an overrun
    ledger.kernel("ffn", 0, 10 * MS, 0, 12 * MS, 12 * MS)  # ran 2 ms past its model
    ledger.kernel("a2e", 0, 1 * MS, 3 * MS, 3 * MS, 3 * MS + 100)  # began 3 ms late, ran 100 ns
    ledger.sync(4_000)
    counts = ledger.take()
    ffn, a2e = counts.kinds["ffn"], counts.kinds["a2e"]
    assert (ffn.kernels, ffn.overruns, ffn.overrun_ns, ffn.late_starts) == (2, 1, 2 * MS, 0)
    assert (a2e.overruns, a2e.late_starts) == (0, 1)
    assert ffn.work_ns == [5 * MS, 12 * MS] and a2e.work_ns == [0]
    d = counts.to_dict()
    assert d["modelled_us"] == 21_000.0 and d["overrun_us"] == 2_000.0
    assert d["sync_lag_us"]["median"] == 4.0
    assert ledger.take().kinds == {}, "take resets the counts"


def test_a_capture_keeps_the_model_with_its_kernel_for_every_replay() -> None:
    g = device.NPUGraph()
    side = device.Stream()
    seen, note = _starts()
    try:
        with device.graph(g, stream=side):
            device.launch(note, model_s=0.012, kind="ffn")
        assert device.take_timing().kinds == {}, "nothing ran at capture"
        with device.stream(side):
            for _ in range(2):
                t0 = time.perf_counter_ns()
                g.replay()
                device.synchronize()
                assert time.perf_counter_ns() - t0 >= 12 * MS
        ffn = device.take_timing().kinds["ffn"]
        assert ffn.kernels == 2 and ffn.modelled_ns == 24 * MS and len(seen) == 2
    finally:
        g.reset()
        side.close()


def test_a_synchronize_reports_its_lag_behind_the_modelled_timeline() -> None:
    s = device.Stream()
    try:
        with device.stream(s):
            device.launch(lambda: None, model_s=0.003, kind="ffn")
        device.synchronize()
        lag = device.take_timing().sync_lag_ns
        assert len(lag) == 1 and 0 <= lag[0] < 1_000 * MS
        device.synchronize()  # nothing queued: nothing to wait for, no lag
        assert device.take_timing().sync_lag_ns == []
    finally:
        s.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_TIMERSLACK is Linux's")
def test_a_worker_that_holds_lowers_its_timer_slack() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def slack() -> int:
        return int(libc.prctl(30, 0, 0, 0, 0))  # PR_GET_TIMERSLACK: the calling thread's

    s = device.Stream()
    try:
        got: list[int] = []
        with device.stream(s):
            device.launch(lambda: got.append(slack()))
            device.launch(lambda: None, model_s=0.001)
            device.launch(lambda: got.append(slack()))
        device.synchronize()
        assert got[0] > timing.TIMER_SLACK_NS, "a worker that never held keeps the default slack"
        assert got[1] == timing.TIMER_SLACK_NS
        assert slack() > timing.TIMER_SLACK_NS, "the host thread's slack is left alone"
    finally:
        s.close()


def test_kernel_start_and_hold_outside_a_kernel_are_the_hosts() -> None:
    t0 = time.perf_counter_ns()
    assert device.kernel_start_ns() >= t0
    device.hold_until(time.perf_counter_ns() + 2 * MS)
    assert time.perf_counter_ns() - t0 >= 2 * MS
    device.hold()  # no kernel: nothing to hold
    assert device.take_timing().kinds == {}


def test_a_negative_model_is_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        device.launch(lambda: None, model_s=-1.0)


# ---------------------------------------------------------------------------
# the emulation's kernels on the modelled timeline (WorldSpec.timing = "model")


def test_a_modelled_ffn_publishes_its_outputs_at_its_modelled_end() -> None:
    """A reader on another stream that does not wait for the FFN kernel
    reads NaN for the kernel's whole modelled duration (200 ms here), long
    after its arithmetic (well under a millisecond) is done: a device
    kernel's writes are complete when it ends. After a synchronize the
    outputs are the wall-clock kernel's, bit for bit."""
    moe = MoEFFN(MoEShape(hidden=16, ffn=32, experts=2, top_k=1))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    want = moe.combined(x, 0)
    device.synchronize()
    moe.timing = fixed(4, 0.200)
    reader = device.Stream()
    seen: list[bool] = []
    try:
        out = moe.combined(x, 0)
        with device.stream(reader):  # no wait on the FFN's stream
            device.launch(lambda: (time.sleep(0.030), seen.append(bool(torch.isnan(out).all()))))
        device.synchronize()
        assert seen == [True]
        assert torch.equal(out, want)
        assert device.take_timing().kinds["ffn"].modelled_ns == 200 * MS
    finally:
        reader.close()


def test_a_modelled_a2e_waits_for_its_peer_on_the_modelled_timeline() -> None:
    """One stage, serial: each A2E after the first layer starts where the
    E2A before it ended, so its modelled wait for attention is exactly the
    attention time, and its modelled duration that plus its link time."""
    attn_ns, link_ns = 3 * MS, 20 * MS  # a long link: a late worker wake-up stays inside it
    spec = WorldSpec(
        layers=3,
        stage_ids=(0,),
        tokens=4,
        shape=MoEShape(hidden=16, ffn=32, experts=2, top_k=1),
        link=LinkModel(latency_s=link_ns / 1e9, bandwidth_Bps=1e15),
        attn_s=attn_ns / 1e9,
        timing="model",
    )
    world = build_world(spec)
    try:
        device.take_timing()
        world.run_step()
        waits = world.transport.peer_wait_ns
        layers = world.layer_list()
        assert [waits[(L, 0)] for L in layers[1:]] == [attn_ns] * (len(layers) - 1)
        counts = device.take_timing().kinds
        link = round(link_ns + 16 * 4 * 4 / 1e15 * 1e9)
        e2a_link = round(link_ns + 2 * 16 * 4 * 4 / 1e15 * 1e9)
        assert counts["e2a"].modelled_ns == len(layers) * e2a_link
        assert counts["a2e"].modelled_ns == sum(waits.values()) + len(layers) * link
    finally:
        world.close()


def test_each_calibration_run_follows_an_idle_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel after a hold runs slower than one in a tight loop, so each
    timed run of the calibration follows a sleep as long as the run before
    it, at least MIN_GAP_S (emulation/ffn_timing.py)."""
    from camp2p_overlap.emulation import ffn_timing

    events: list[tuple[str, float]] = []
    real_sleep = time.sleep
    monkeypatch.setattr(ffn_timing.time, "sleep", lambda s: (events.append(("sleep", s)), real_sleep(0))[1])
    moe = MoEFFN(MoEShape(hidden=16, ffn=32, experts=2, top_k=1))
    body = moe.kernel_body
    monkeypatch.setattr(moe, "kernel_body", lambda *a: (events.append(("run", 0.0)), body(*a))[1])
    point = ffn_timing.calibrate_point(moe, 4)
    runs = [i for i, (what, _) in enumerate(events) if what == "run"]
    assert len(runs) == ffn_timing.WARMUP + point.runs
    assert all(i > 0 and events[i - 1][0] == "sleep" and events[i - 1][1] >= ffn_timing.MIN_GAP_S for i in runs)
