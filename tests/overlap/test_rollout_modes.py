"""The rollout modes (VLLM_CAMP2P_MULTISTREAM_MODE), the rungs of the
ladder they and the layouts (VLLM_CAMP2P_MULTISTREAM_LAYOUT) set, and the
HCCL group check: ``parity`` makes upstream's calls in upstream's order,
``reorder`` the overlap's issue order, both on the calling thread, both
bitwise equal to serial; each engaged step counts under its mode; against
an attention side that couples the stages, ``reorder`` and the default
``compute-side`` layout (every A2E/E2A on one stream in the overlap's
order) are caught by the watchdog and the op timeout, never a silent hang,
while ``comm-side`` completes; stages that share an HCCL group run serially
in every mode."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from support.logs import PackageLogs
from support.overlap import (
    Schedule,
    SessionSpy,
    assert_same,
    bounded,
    overlap_issue_order,
    run_step,
    serial_results,
    upstream_order,
    world,
)

import camp2p_overlap
from camp2p_overlap.core import config, env_vars
from camp2p_overlap.core.config import ConfigError, OverlapConfig, load_config
from camp2p_overlap.core.env_vars import ENV_MODE
from camp2p_overlap.core.overlap import camp2p, plan
from camp2p_overlap.core.overlap.plan import rung
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.emulation.coupled import couple_stages
from camp2p_overlap.emulation.faults import run_step_bounded
from camp2p_overlap.emulation.world import PeerTimeoutError, ProtocolError, World


def _apply(**overrides: Any) -> None:
    PATCH_LAYER.engine.unpatch(timeout=10)
    overrides.setdefault("adaptive", False)
    report = PATCH_LAYER.engine.apply(strict=True, config=OverlapConfig(enabled=True, backend="cpu", **overrides))
    assert report.engaged, str(report)


def record_calls(w: World) -> list[tuple[str, int, int, int]]:
    """Every A2E/E2A the connector makes on ``w``'s transport, in call
    order, with the thread that made it: (kind, layer, stage, thread id)."""
    calls: list[tuple[str, int, int, int]] = []
    transport = w.transport
    for kind in ("a2e", "e2a"):
        original = getattr(type(transport), kind).__get__(transport)

        def recorded(*, _kind: str = kind, _original: Any = original, **kw: Any) -> Any:
            calls.append((_kind, kw["layer"], kw["stage"], threading.get_ident()))
            return _original(**kw)

        setattr(transport, kind, recorded)
    return calls


SCHEDS = [Schedule(4, (0, 1, 2), (5, 9, 3), 1), Schedule(3, (0, 2), (7, 4), 2), Schedule(2, (1, 2), (8, 8), 3)]


def _steps() -> dict[str, int]:
    return dict(camp2p_overlap.stats()["steps"])


# ---------------------------------------------------------------------------
# configuration
@pytest.mark.parametrize("bad", ["fast", "serial", "overlap2", "1", "parity,reorder"])
def test_bad_mode_values_are_refused_with_a_clear_error(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({ENV_MODE: bad})
    text = str(info.value)
    assert ENV_MODE in text and repr(bad) in text
    assert "overlap, reorder, parity" in text


def test_mode_values_and_default() -> None:
    assert load_config({}).mode == "overlap"
    assert load_config({ENV_MODE: " Parity "}).mode == "parity"
    assert load_config({ENV_MODE: "REORDER"}).mode == "reorder"
    assert load_config({ENV_MODE: ""}).mode == "overlap"
    with pytest.raises(ConfigError, match=ENV_MODE):
        OverlapConfig().with_overrides(mode="bogus")
    assert ENV_MODE in config.ENV_VARS


def test_bad_mode_makes_apply_refuse_not_raise(logs: PackageLogs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_vars.ENV_SWITCH, "1")
    monkeypatch.setenv(ENV_MODE, "turbo")
    report = PATCH_LAYER.engine.apply()
    assert not report.applied and not PATCH_LAYER.engine.is_applied()
    assert any(ENV_MODE in m and "'turbo'" in m for m in logs.texts(level=40)), logs.messages
    with pytest.raises(ConfigError, match="turbo"):
        PATCH_LAYER.engine.apply(strict=True)


def test_rungs() -> None:
    on = OverlapConfig(enabled=True)
    comm = on.with_overrides(layouts=("comm-side",))
    assert rung(OverlapConfig()) == "off"
    assert rung(on) == "compute-side"  # the default layout
    assert rung(on.with_overrides(mode="parity")) == "parity"
    assert rung(on.with_overrides(mode="reorder", a2e_on_side_stream=False)) == "reorder"
    assert rung(comm.with_overrides(mode="reorder")) == "reorder"  # the layouts refine overlap only
    assert rung(comm) == "comm-side"
    assert rung(on.with_overrides(layouts=("compute-side", "comm-side"))) == "compute-side,comm-side"
    assert rung(on.with_overrides(layouts=("comm-side", "compute-side"))) == "comm-side,compute-side"  # as listed
    # The direction switches refine comm-side: one off is off the ladder, both off leave nothing to engage.
    assert rung(comm.with_overrides(a2e_on_side_stream=False)) == "e2a-only"
    assert rung(comm.with_overrides(e2a_on_side_stream=False)) == "a2e-only"
    assert rung(comm.with_overrides(a2e_on_side_stream=False, e2a_on_side_stream=False)) == "none"
    # compute-side ignores them (its A2E/E2A are on the caller's stream whatever they say).
    refined = {(False, True): "e2a-only", (True, False): "a2e-only", (False, False): None}
    for (a2e, e2a), comm_side in refined.items():
        switched = {"a2e_on_side_stream": a2e, "e2a_on_side_stream": e2a}
        assert rung(on.with_overrides(**switched)) == "compute-side", switched
        both = on.with_overrides(layouts=("compute-side", "comm-side"), **switched)
        assert rung(both) == ("compute-side" if comm_side is None else f"compute-side,{comm_side}"), switched


def test_the_ladder_is_climbed_in_order_and_each_rung_is_a_setting() -> None:
    assert plan.LADDER == ("parity", "reorder", "compute-side", "comm-side")
    on = OverlapConfig(enabled=True)
    settings = [
        on.with_overrides(mode="parity"),
        on.with_overrides(mode="reorder"),
        on,
        on.with_overrides(layouts=("comm-side",)),
    ]
    assert tuple(rung(cfg) for cfg in settings) == plan.LADDER
    assert tuple(layout.name for cfg in settings for layout in plan.layouts_of(cfg)) == plan.LADDER


# ---------------------------------------------------------------------------
# call order and outputs
def test_parity_calls_equal_the_unpatched_calls_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    w = world(layers=4, stage_ids=(0, 1, 2))
    calls = record_calls(w)
    ref = serial_results(w, SCHEDS)
    serial_calls = [c[:3] for c in calls]
    calls.clear()
    _apply(mode="parity", a2e_on_side_stream=True, e2a_on_side_stream=False)  # switches do not matter here
    spy = SessionSpy(monkeypatch, keep=True)
    before = _steps()
    me = threading.get_ident()
    for i, sched in enumerate(SCHEDS):
        assert_same(run_step(w, sched), ref[i], f"parity step {sched.step}")
    after = _steps()
    assert [c[:3] for c in calls] == serial_calls
    assert serial_calls == [c for s in SCHEDS for c in upstream_order(list(range(s.layers)), s.stages)]
    assert {c[3] for c in calls} == {me}
    assert spy.count == len(SCHEDS)  # the session machinery was engaged
    assert [op for s in spy.kept for op in s.issued_ops] == serial_calls
    assert after["parity"] - before["parity"] == len(SCHEDS)
    assert after["overlap"] == before["overlap"] and after["serial"] == before["serial"]


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_reorder_calls_equal_the_overlap_issue_order_on_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    w = world(layers=4, stage_ids=(0, 1, 2))
    ref = serial_results(w, SCHEDS)
    calls = record_calls(w)
    # The overlap's issue order, as its sessions issued it in either layout (on C or on the side streams K_s).
    _apply(mode="overlap", layouts=(layout,))
    spy = SessionSpy(monkeypatch, keep=True)
    for i, sched in enumerate(SCHEDS):
        assert_same(bounded(lambda sched=sched: run_step(w, sched)), ref[i], f"overlap step {sched.step}")
    overlap_issued = [s.issued_ops for s in spy.kept]
    assert {c[3] for c in calls} != {threading.get_ident()}  # overlap: the device's stream workers made calls
    calls.clear()
    _apply(mode="reorder", a2e_on_side_stream=False)  # the direction switches apply to overlap only
    spy = SessionSpy(monkeypatch, keep=True)
    before = _steps()
    me = threading.get_ident()
    for i, sched in enumerate(SCHEDS):
        assert_same(run_step(w, sched), ref[i], f"reorder step {sched.step}")
    after = _steps()
    expected = [overlap_issue_order(list(range(s.layers)), s.stages) for s in SCHEDS]
    assert overlap_issued == expected
    assert [c[:3] for c in calls] == [c for step in expected for c in step]
    assert {c[3] for c in calls} == {me}
    assert [s.issued_ops for s in spy.kept] == expected
    assert after["reorder"] - before["reorder"] == len(SCHEDS)
    assert after["overlap"] == before["overlap"] and after["serial"] == before["serial"]


def test_overlap_steps_count_under_overlap() -> None:
    w = world(layers=2, stage_ids=(0, 1))
    _apply()
    before = _steps()
    bounded(lambda: run_step(w))
    after = _steps()
    assert after["overlap"] - before["overlap"] == 1
    assert after["parity"] == before["parity"] and after["reorder"] == before["reorder"]


def test_adaptive_engage_does_not_apply_to_parity_and_reorder(monkeypatch: pytest.MonkeyPatch) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    for mode in ("parity", "reorder"):
        _apply(mode=mode, adaptive=True)
        before = _steps()
        for _ in range(4):
            bounded(lambda: run_step(w))
        after = _steps()
        assert after[mode] - before[mode] == 4, (mode, before, after)
        assert after["serial"] == before["serial"]


# ---------------------------------------------------------------------------
# coupled stages: reorder deadlocks (caught), overlap completes
#: With coupled stages: the config of each rung, and whether its step completes.
COUPLED = {
    "reorder": ({"mode": "reorder"}, False),
    "compute-side": ({}, False),  # the default layout
    "comm-side": ({"layouts": ("comm-side",)}, True),
}
COUPLED_OP_TIMEOUT_S = 1.5
COUPLED_WATCHDOG_S = 0.3
#: What a loaded machine may add to a step that ends at the op timeout (the step's own work, thread wake-ups).
COUPLED_SLACK_S = 5.0


@pytest.mark.parametrize("layout", list(COUPLED))
def test_coupled_stages_are_caught_on_one_stream_and_comm_side_completes(logs: PackageLogs, layout: str) -> None:
    """An attention side that sends A2E(L+1, s) only once it has the E2A(L) of every stage. On one stream in the
    overlap's order (``reorder``; ``compute-side``, the default: A2E/E2A on C) A2E(L1, s0) blocks C while
    E2A(L0, s1), which it waits for, is queued behind it: the step cannot complete. The watchdog reports C
    blocked in that A2E, the op timeout ends the step with the attention's error, and the whole step takes at
    most the op timeout plus the watchdog's time (and slack): never a silent hang. ``comm-side`` completes,
    bitwise equal to serial: the lookahead A2E waits on its own stage's stream."""
    overrides, completes = COUPLED[layout]
    w = world(layers=3, stage_ids=(0, 1), tokens=8, op_timeout_s=COUPLED_OP_TIMEOUT_S)
    couple_stages(w)
    ref = run_step_bounded(w, 4, 30.0)  # serial: A2E(L+1) after every stage's E2A(L)
    assert ref.error is None and not ref.hung, ref

    _apply(watchdog_s=COUPLED_WATCHDOG_S if not completes else 20.0, **overrides)
    bound = COUPLED_WATCHDOG_S + COUPLED_OP_TIMEOUT_S + COUPLED_SLACK_S
    out = run_step_bounded(w, 4, bound)
    assert not out.hung, f"{layout}: the step ran past {bound:.1f} s"
    reports = [m for m in logs.messages if "has not finished after" in m]
    if completes:
        assert out.error is None, out
        assert_same(out.results, ref.results, f"{layout} with coupled stages")
        assert reports == []
        return
    assert isinstance(out.error, PeerTimeoutError), out
    assert "a2e(L1) of stage 0: attention waits for e2a(L0) of stage(s) [1]" in str(out.error)
    assert COUPLED_OP_TIMEOUT_S <= out.seconds <= bound, out  # ended by the op timeout, not before
    assert len(reports) == 1, reports
    text = reports[0]
    assert f"has not finished after {COUPLED_WATCHDOG_S} s" in text
    assert "compute stream C is blocked in a2e(L1,s0), issued on the compute stream" in text
    assert "a2e(L1,s0) on C: RUNNING for" in text
    assert "likely missing peer op: a2e(L1,s0) on C" in text
    assert text.count("likely missing peer op") == 1
    assert "e2a(L0,s0) on C: done" in text
    assert "e2a(L0,s1) on C: queued" in text  # what the attention waits for, behind the A2E on C
    if layout == "compute-side":
        # F ran the FFNs of layer 0 and waits for the A2E that blocks C.
        assert "\n  FFN stream: F waits for a2e(L1,s0) on C (event a L1 s0 pending)\n" in text
    else:
        assert "FFN stream:" not in text  # reorder: no FFN stream


# ---------------------------------------------------------------------------
# the HCCL group check
def test_group_of_each_stage_follows_the_connector_rule() -> None:
    assert camp2p.stage_groups(camp2p.comm_names_for(3), (0, 1, 2)) == {0: "afd", 1: "afd1", 2: "afd2"}
    assert camp2p.stage_groups(camp2p.comm_names_for(1), (0, 1)) == {0: "afd", 1: "afd"}
    assert camp2p.stage_groups(camp2p.comm_names_for(2), (0, 1, 3)) == {0: "afd", 1: "afd1", 3: "afd"}
    with pytest.raises(camp2p.GroupError, match="third HCCL group"):
        camp2p.resolve_group(2, camp2p.comm_names_for(2))
    with pytest.raises(camp2p.GroupError, match="negative"):
        camp2p.resolve_group(-1, camp2p.comm_names_for(3))
    with pytest.raises(camp2p.GroupError, match="not initialized"):
        camp2p.resolve_group(0, ("", "", ""))


@pytest.mark.parametrize("mode", ["overlap", "parity", "reorder"])
def test_stages_sharing_a_group_run_serially_in_every_mode(logs: PackageLogs, mode: str) -> None:
    w = world(layers=3, stage_ids=(0, 1), num_ubatches=1)
    assert (w.connector.hccl_comm_name, w.connector.hccl_comm_name2) == ("afd", "afd")
    scheds = [Schedule(3, (0, 1), (6, 6), n) for n in (1, 2)]
    ref = serial_results(w, scheds)
    _apply(mode=mode)
    before = _steps()
    for i, sched in enumerate(scheds):
        assert_same(bounded(lambda sched=sched: run_step(w, sched), 20.0), ref[i], f"{mode} step {sched.step}")
    after = _steps()
    assert after["serial"] - before["serial"] == 2 and after[mode] == before[mode]
    reason = "HCCL group check: stages 0, 1 share HCCL group 'afd'"
    reasons = [r for r in camp2p_overlap.stats()["serial_reasons"] if r.startswith(reason)]
    assert reasons, camp2p_overlap.stats()["serial_reasons"]
    assert len(logs.texts(reason)) == 1


def test_without_the_group_check_the_shared_group_is_driven_from_two_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the check prevents: with it bypassed, two side streams run ops on
    one group at once (the emulation's per-group order check trips; on
    hardware the step deadlocks)."""
    w = world(layers=3, stage_ids=(0, 1), num_ubatches=1, attn_s=0.05, op_timeout_s=2.0)
    monkeypatch.setattr(camp2p, "group_problem", lambda connector, stages: None)
    _apply(layouts=("comm-side",))  # the per-stage side streams (compute-side keeps both stages on C)
    with pytest.raises(ProtocolError, match="still running on afd"):
        bounded(lambda: run_step(w), 20.0)
