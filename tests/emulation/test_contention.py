"""``--comm-cores N``: emulated communication that takes compute. On the CPU a
comm op busy-waits on N cores (the op's thread and N-1 helpers) for its
link time and its wait for the peer, instead of sleeping: the process's CPU
time rises by about the communication time, on as many threads as asked.
Outputs are unchanged. No timing of the schedule is asserted here (that is
the benchmark's job); CPU time is what shows a core was taken."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from support.overlap import SHAPE, Schedule, apply_cpu, assert_same, run_step, serial_results

from camp2p_overlap.core.keys import A2E, COMPUTE_STREAM, E2A, FFN_STREAM, side_stream_name
from camp2p_overlap.core.observe import trace
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.emulation.contention import CoreSpinner
from camp2p_overlap.emulation.world import LinkModel, WorldSpec, build_world
from camp2p_overlap.tools import cli
from camp2p_overlap.tools.bench.runner import BenchParams

WAIT_S = 0.3


def _cpu_during(fn: Any) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) spent by ``fn()``."""
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


@pytest.mark.alone
def test_comm_cores_busy_wait_takes_cpu_time_sleep_does_not() -> None:
    sleeping, spinning = CoreSpinner(0), CoreSpinner(1)
    try:
        cpu_sleep, wall_sleep = _cpu_during(lambda: sleeping.wait(WAIT_S))
        cpu_spin, wall_spin = _cpu_during(lambda: spinning.wait(WAIT_S))
    finally:
        spinning.close()
    assert wall_sleep >= WAIT_S and wall_spin >= WAIT_S
    assert cpu_sleep < 0.05 * WAIT_S, f"a sleeping comm op used {cpu_sleep:.3f} s of CPU"
    # On a shared machine the spinning thread may not get a whole core; it
    # still burns CPU for a good share of the wait, where sleep burns none.
    assert cpu_spin >= 0.25 * WAIT_S, f"a busy comm op used only {cpu_spin:.3f} s of CPU in {wall_spin:.3f} s"
    assert cpu_spin > 10 * cpu_sleep


@pytest.mark.alone
def test_comm_cores_n_keeps_n_threads_busy() -> None:
    spinner = CoreSpinner(3)
    try:
        spinner.wait(WAIT_S)
        per_thread = spinner.last_thread_cpu_s
    finally:
        spinner.close()
    assert len(per_thread) == 3
    assert all(cpu >= 0.05 * WAIT_S for cpu in per_thread), per_thread


@pytest.mark.alone
def test_the_peer_wait_spins_too() -> None:
    """A lookahead A2E waiting for its attention peer holds its cores for
    the whole wait (CAM's kernel spins while it waits): a step whose time is
    mostly attention waits costs CPU time with --comm-cores 1, none without."""
    used = {}
    for cores in (0, 1):
        w = build_world(
            WorldSpec(
                layers=2,
                stage_ids=(0,),
                tokens=4,
                shape=SHAPE,
                link=LinkModel(latency_s=0.0, bandwidth_Bps=1e12),
                attn_s=0.1,
                op_timeout_s=10.0,
                comm_cores=cores,
            )
        )
        try:
            used[cores] = _cpu_during(w.run_step)
        finally:
            w.close()
    (cpu0, wall0), (cpu1, wall1) = used[0], used[1]
    assert wall0 >= 0.2 and wall1 >= 0.2  # two A2Es, each after 0.1 s of attention
    assert cpu1 - cpu0 >= 0.25 * 0.2, f"peer waits took {cpu1 - cpu0:.3f} s more CPU with --comm-cores 1"


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_busy_comm_keeps_outputs_bitwise_and_the_overlap_engaged(patch_layer: PatchLayer, layout: str) -> None:
    w = build_world(
        WorldSpec(
            layers=3,
            stage_ids=(0, 1),
            tokens=8,
            shape=SHAPE,
            link=LinkModel(latency_s=300e-6, bandwidth_Bps=1e9),
            attn_s=200e-6,
            op_timeout_s=10.0,
            comm_cores=2,
        )
    )
    try:
        scheds = [Schedule(3, (0, 1), (8, 5), step=i + 1) for i in range(3)]
        refs = serial_results(w, scheds, patch_layer)
        apply_cpu(patch_layer=patch_layer, layouts=(layout,))
        with trace.recording() as rec:
            for sched, ref in zip(scheds, refs, strict=True):
                assert_same(run_step(w, sched), ref)
        # Engaged: every step's A2E and E2A ran on its stage's side stream (comm-side), or on the compute stream
        # with the FFN on F (compute-side).
        assert len(rec.steps()) == len(scheds)
        comm_side = layout == "comm-side"
        for step in rec.steps():
            ops = rec.ops(step)
            comm = {(o.kind, o.stream) for o in ops if o.kind in (A2E, E2A)}
            want = {(k, side_stream_name(s) if comm_side else COMPUTE_STREAM) for k in (A2E, E2A) for s in (0, 1)}
            assert comm == want, (step, comm)
            assert {o.stream for o in ops if o.kind == "ffn"} == ({COMPUTE_STREAM} if comm_side else {FFN_STREAM})
    finally:
        w.close()


def test_comm_cores_is_validated() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        CoreSpinner(-1)
    with pytest.raises(ValueError, match=r"--comm-cores -1 is out of range"):
        BenchParams(comm_cores=-1).validate()
    with pytest.raises(ValueError, match=r"--comm-cores 9999 is out of range"):
        BenchParams(comm_cores=9999).validate()


def test_bench_and_sweep_take_comm_cores(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = [
        "--layers", "2", "--tokens", "8", "--hidden", "32", "--ffn", "64", "--experts", "2", "--top-k", "1",
        "--attn-us", "100", "--steps", "1", "--warmup", "1", "--reps", "1", "--no-progress",
    ]  # fmt: skip
    out = tmp_path / "b.json"
    assert cli.main(["bench", *tiny, "--link-latency-us", "100", "--comm-cores", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["params"]["comm_cores"] == 1
    assert report["comm_model"].startswith("busy-wait on 1 core")
    assert report["outputs_equal"] is True
    assert all(p["peer_cycle_ok"] is True and p["peer_cycle_checked_steps"] >= 1 for p in report["policies"])
    assert "comm ops: busy-wait on 1 core(s)" in capsys.readouterr().out

    js = tmp_path / "s.json"
    args = ["sweep", *tiny, "--ratios", "", "--stage-counts", "", "--work-tokens", "none"]
    assert cli.main([*args, "--comm-core-points", "0,1", "--json", str(js)]) == 0
    text = capsys.readouterr().out
    assert "cores each communication op keeps busy" in text
    rows = [line for line in text.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 2
    data = json.loads(js.read_text())
    assert [p["comm_cores"] for p in data["comm_core_points"]] == [0, 1]
    assert [p["report"]["params"]["comm_cores"] for p in data["comm_core_points"]] == [0, 1]
    with pytest.raises(SystemExit):
        cli.main([*args, "--comm-core-points", "0,-2"])
