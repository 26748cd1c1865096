"""Real process boundaries: the attention peer and the FFN runner are two
processes talking over torch.distributed point-to-point (gloo, loopback).
The FFN process is patched through the entry-point path (vLLM's plugin
loader, or ``register()`` as it would call it) and runs the same steps with
the overlap engaged and, after ``unpatch()``, serially; the attention
process receives bitwise-equal outputs in both phases.

See ``camp2p_overlap/emulation/gloo.py`` for the protocol."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from camp2p_overlap.emulation.gloo import MAX_STAGES, STEP_SCHEDULES, run_pair

pytest.importorskip("torch.distributed")

PAIR_TIMEOUT_S = 150.0


#: The thread of the emulated device's default stream (the compute stream).
COMPUTE_THREAD = "camp2p-emulated-device-default-stream"


def _vllm_installed() -> bool:
    """Without importing vLLM here (``find_spec("vllm.plugins")`` would: its
    logging config would then change this test process for every later test)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _check(tmp_path: Path, *, steps: int, layers: int, one_group: int, layout: str) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    res = run_pair(
        {"steps": steps, "layers": layers, "timeout_s": 40, "one_group": one_group},
        tmp_path,
        timeout_s=PAIR_TIMEOUT_S,
        extra_env={"VLLM_CAMP2P_MULTISTREAM_LAYOUT": layout},
    )
    diag = f"\n--- attention log ---\n{res.logs[0][-3000:]}\n--- ffn log ---\n{res.logs[1][-3000:]}"
    assert not res.timed_out, f"the pair did not finish within {PAIR_TIMEOUT_S} s{diag}"
    assert res.returncodes == (0, 0), f"return codes {res.returncodes}{diag}"
    att, ffn = res.attention, res.ffn
    assert att is not None and ffn is not None, diag

    # The attention side received every message in both phases, bitwise equal.
    expected_msgs = sum(len(STEP_SCHEDULES[i % len(STEP_SCHEDULES)]) for i in range(steps)) * layers
    assert att["errors"] == [], att["errors"]
    assert att["messages"] == {"overlap": expected_msgs, "serial": expected_msgs}
    assert att["same_keys"] and att["mismatched"] == [] and att["equal"] is True

    # The FFN side was patched by the entry point, before the targets were imported.
    if _vllm_installed():
        assert ffn["plugins_loaded_by"] == "vllm.plugins.load_general_plugins()"
    assert ffn["applied_by_entry_point"] is True
    assert ffn["report"]["engaged"] is True, ffn["report"]
    assert ffn["error"] is None, ffn["error"]

    # Overlap phase: multi-stage steps ran their A2E/E2A on the stage's side
    # stream in comm-side, on the compute stream in compute-side (and nothing
    # else); one-stage steps went down the serial gate. Serial phase (after
    # unpatch): no wrapper left, nothing traced.
    comm_side = layout == "comm-side"
    by_phase: dict[str, list[dict]] = {"overlap": [], "serial": []}
    for s in ffn["steps"]:
        by_phase[s["phase"]].append(s)
    assert [s["step"] for s in by_phase["overlap"]] == list(range(steps))
    assert [s["step"] for s in by_phase["serial"]] == list(range(steps))
    for s in by_phase["overlap"]:
        want = [f"K{i}" for i in s["stages"]] if len(s["stages"]) > 1 and comm_side else ["C"]
        assert s["comm_streams"] == want, s
    assert all(s["comm_streams"] == [] for s in by_phase["serial"])

    # Which threads did the gloo sends and receives (kernels of the emulated
    # device): in comm-side the side-stream thread of each stage while the
    # overlap was on (stage 0 and 2 never run alone in STEP_SCHEDULES), in
    # compute-side and after unpatch only the compute stream's (the device's
    # default stream).
    th = ffn["threads"]
    if comm_side:
        for stage in (0, 2):
            for kind in ("a2e", "e2a"):
                assert th["overlap"][f"{kind} s{stage}"] == [f"camp2p-overlap-stream-K{stage}"], th
        assert set(th["overlap"]["a2e s1"]) == {"camp2p-overlap-stream-K1", COMPUTE_THREAD}
    else:
        assert all(v == [COMPUTE_THREAD] for v in th["overlap"].values()), th["overlap"]
    assert {k for k in th["serial"]} == {f"{kind} s{s}" for kind in ("a2e", "e2a") for s in range(MAX_STAGES)}
    assert all(v == [COMPUTE_THREAD] for v in th["serial"].values()), th["serial"]
    assert ffn["unpatched"] is True
    assert ffn["stream_threads_left"] == []


@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
def test_ffn_and_attention_as_processes_over_gloo_per_stage_groups(tmp_path: Path, layout: str) -> None:
    """One gloo group per stage, as CAMP2P has one HCCL group per stage."""
    _check(tmp_path, steps=12, layers=3, one_group=0, layout=layout)


def test_gloo_p2p_from_several_stage_threads_on_one_group(tmp_path: Path) -> None:
    """All stages on the default group, distinct tags: gloo point-to-point
    from the concurrent side-stream threads of one group (comm-side) stays correct."""
    _check(tmp_path, steps=12, layers=3, one_group=1, layout="comm-side")
