"""The core budget rule (``core/overlap/streams/core_budget.py``): an overlap layout engages only where the CAM
kernels that can spin at once on its streams plus the MoE's collective kernel fit the device's vector cores; where
none fits the step runs upstream's path with a reason that names the numbers; the count is read from the device,
else from the variable, and an NPU whose count is unknown engages nothing."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from support.logs import PackageLogs
from support.overlap import Schedule, apply_cpu, assert_same, bounded, run_step, serial_results, world

import camp2p_overlap
from camp2p_overlap.core.config import OverlapConfig, load_config
from camp2p_overlap.core.overlap import plan
from camp2p_overlap.core.overlap.streams import core_budget
from camp2p_overlap.core.overlap.streams.core_budget import Budget, cores_at_once, fit, read_budget
from camp2p_overlap.emulation.device import cores

pytestmark = pytest.mark.usefixtures("standin_stack")


@pytest.fixture(autouse=True)
def no_budget() -> Iterator[None]:
    yield
    cores.set_core_budget(None)


def budget(vector: int | None, cam: int = 8, moe: int | None = None, applies: bool = True) -> Budget:
    return Budget(vector, "the test", cam, "the test", moe, "the test", applies)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_what_each_layout_holds_at_once(stages: int) -> None:
    cam, moe = 8, 20
    assert cores_at_once(plan.COMPUTE_SIDE, stages, cam, moe) == cam + moe  # C: one CAM kernel; F: the MoE's
    assert cores_at_once(plan.COMM_SIDE, stages, cam, moe) == stages * cam + moe  # one CAM kernel per K_s; C: MoE
    for one_side in (plan.E2A_ONLY, plan.A2E_ONLY):  # C carries a CAM kernel or the MoE's, one at a time
        assert cores_at_once(one_side, stages, cam, moe) == stages * cam + max(cam, moe)
    for one_stream in (plan.REORDER, plan.PARITY):
        assert cores_at_once(one_stream, stages, cam, moe) == max(cam, moe)


def test_the_moe_collective_unknown_is_read_as_the_whole_device() -> None:
    fitting, verdicts = fit((plan.COMPUTE_SIDE, plan.COMM_SIDE), 2, budget(48))
    assert fitting == ()
    text = core_budget.refusal(verdicts)
    assert "compute-side with 2 stage(s): CAM 8 on C + MoE collective 48 on F = 56 vector cores at once" in text
    assert "the device has 48" in text
    assert "comm-side with 2 stage(s): MoE collective 48 on C + CAM 8 on K0 + CAM 8 on K1 = 64" in text


def test_a_declared_moe_count_lets_the_layouts_that_fit_through_in_order() -> None:
    layouts = (plan.COMM_SIDE, plan.COMPUTE_SIDE)
    assert fit(layouts, 2, budget(48, moe=32))[0] == layouts  # 16 + 32 and 8 + 32
    assert fit(layouts, 3, budget(48, moe=32))[0] == (plan.COMPUTE_SIDE,)  # comm-side: 24 + 32 > 48
    assert fit(layouts, 2, budget(40, moe=32))[0] == (plan.COMPUTE_SIDE,)  # exactly 40
    assert fit(layouts, 1, budget(39, moe=32))[0] == ()


def test_an_unknown_count_engages_nothing_and_a_device_without_cam_kernels_has_no_rule() -> None:
    fitting, verdicts = fit((plan.COMPUTE_SIDE,), 2, budget(None))
    assert fitting == () and "VLLM_CAMP2P_MULTISTREAM_VECTOR_CORES" in verdicts[0].text
    assert fit((plan.COMPUTE_SIDE,), 2, budget(None, applies=False))[0] == (plan.COMPUTE_SIDE,)


class _Props:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _mod(props: Any = None, fails: bool = False) -> Any:
    def get_device_properties(index: int) -> Any:
        if fails:
            raise RuntimeError("no device")
        return props

    return SimpleNamespace(__name__="torch.npu", get_device_properties=get_device_properties)


def test_the_count_comes_from_the_device_then_from_the_variable() -> None:
    connector = SimpleNamespace(aiv_num=12)
    cfg = load_config({"VLLM_CAMP2P_MULTISTREAM_VECTOR_CORES": "40", "VLLM_CAMP2P_MULTISTREAM_MOE_CORES": "24"})
    got = read_budget("npu", _mod(_Props(vector_core_num=48)), None, connector, cfg)
    assert (got.vector, got.cam, got.moe, got.applies) == (48, 12, 24, True)
    assert got.vector_from == "torch.npu.get_device_properties(0).vector_core_num"
    got = read_budget("npu", _mod(_Props(cube_core_num=24)), None, connector, cfg)
    assert got.vector == 40 and got.vector_from.startswith("VLLM_CAMP2P_MULTISTREAM_VECTOR_CORES")
    got = read_budget("npu", _mod(fails=True), None, SimpleNamespace(), OverlapConfig())
    assert got.vector is None and got.applies and "failed: RuntimeError: no device" in got.vector_from
    assert got.cam == core_budget.DEFAULT_CAM_CORES and "no aiv_num" in got.cam_from
    got = read_budget("cuda", _mod(_Props(multi_processor_count=132)), None, connector, OverlapConfig())
    assert not got.applies


@pytest.mark.parametrize("bad", ["0", "-3", "many", "4097"])
def test_bad_core_counts_are_refused(bad: str) -> None:
    with pytest.raises(Exception, match="VLLM_CAMP2P_MULTISTREAM_MOE_CORES"):
        load_config({"VLLM_CAMP2P_MULTISTREAM_MOE_CORES": bad})
    with pytest.raises(Exception, match="VLLM_CAMP2P_MULTISTREAM_VECTOR_CORES"):
        load_config({"VLLM_CAMP2P_MULTISTREAM_VECTOR_CORES": bad})


SCHEDS = [Schedule(3, (0, 1), (6, 5), n) for n in (1, 2)]


def _engaged() -> dict[str, int]:
    return dict(camp2p_overlap.stats()["layout_steps"])


def test_a_step_whose_layouts_do_not_fit_runs_upstreams_path_with_the_numbers(logs: PackageLogs) -> None:
    cores.set_core_budget(16)  # the emulated device reports 16 vector cores; CAM 8 (the stand-in's aiv_num)
    w = world(layers=3, stage_ids=(0, 1))
    ref = serial_results(w, SCHEDS)
    apply_cpu(layouts=("compute-side", "comm-side"), moe_cores=12)  # 8 + 12 > 16 and 16 + 12 > 16
    before = dict(camp2p_overlap.stats()["steps"])
    for i, sched in enumerate(SCHEDS):
        assert_same(bounded(lambda sched=sched: run_step(w, sched), 20.0), ref[i], f"step {sched.step}")
    after = camp2p_overlap.stats()
    assert after["steps"]["serial"] - before["serial"] == len(SCHEDS)
    reasons = [r for r in after["serial_reasons"] if r.startswith("core budget: ")]
    assert reasons, after["serial_reasons"]
    assert "compute-side with 2 stage(s): CAM 8 on C + MoE collective 12 on F = 20 vector cores at once" in reasons[0]
    assert "the device has 16 (camp2p_overlap.emulation.device.get_device_properties(0).vector_core_num" in reasons[0]


def test_only_the_layouts_that_fit_engage(logs: PackageLogs) -> None:
    cores.set_core_budget(24)
    w = world(layers=3, stage_ids=(0, 1))
    ref = serial_results(w, SCHEDS)
    apply_cpu(layouts=("comm-side", "compute-side"), moe_cores=12)  # comm-side 16 + 12 > 24; compute-side 20
    before = _engaged()
    for i, sched in enumerate(SCHEDS):
        assert_same(bounded(lambda sched=sched: run_step(w, sched), 20.0), ref[i], f"step {sched.step}")
    after = _engaged()
    assert after.get("compute-side", 0) - before.get("compute-side", 0) == len(SCHEDS)
    assert after.get("comm-side", 0) == before.get("comm-side", 0)
    assert len(logs.texts("core budget: comm-side with 2 stage(s)")) == 1  # once, with its numbers


def test_without_a_core_model_the_emulated_device_has_no_rule() -> None:
    w = world(layers=3, stage_ids=(0, 1))
    ref = serial_results(w, SCHEDS)
    apply_cpu(layouts=("compute-side",))
    before = _engaged()
    for i, sched in enumerate(SCHEDS):
        assert_same(bounded(lambda sched=sched: run_step(w, sched), 20.0), ref[i], f"step {sched.step}")
    assert _engaged()["compute-side"] - before.get("compute-side", 0) == len(SCHEDS)
