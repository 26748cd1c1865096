"""FFN ranks that decide together, as processes (docs/design.md, "Many FFN ranks"): in the multi-rank world
(``camp2p_overlap/emulation/ranks.py``) every FFN rank runs the same path at every step over learning, probes and
re-probes, with noisy ranks, a straggler and attention ranks sending different counts; a configuration that differs,
or a rank without the layer, sends every rank down upstream's path within the group timeout, outputs bitwise equal.
Every world is bounded in time and its processes are ended by their own pids (``run_world``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from camp2p_overlap.emulation.ranks import RanksSpec, WorldResult, run_world

pytest.importorskip("torch.distributed")

WORLD_TIMEOUT_S = 200.0
OP_TIMEOUT_S = 40.0
GROUP_TIMEOUT = {"VLLM_CAMP2P_MULTISTREAM_GROUP_TIMEOUT_S": "3"}


def _run(tmp_path: Path, grace_s: float = 10.0, **kw) -> WorldResult:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    spec = RanksSpec(**{"timeout_s": OP_TIMEOUT_S, **kw})
    return run_world(spec, tmp_path, timeout_s=WORLD_TIMEOUT_S, grace_s=grace_s)


def _assert_ran(res: WorldResult) -> None:
    assert not res.timed_out, res.diagnostics()
    assert res.ok, res.diagnostics()
    assert all(res.equal.values()), res.equal


def _coherent(res: WorldResult) -> list[str]:
    paths = res.paths()
    first = paths[0]
    for rank, p in paths.items():
        differing = [i for i, (a, b) in enumerate(zip(first, p, strict=True)) if a != b]
        assert not differing, f"FFN rank {rank} ran another path than rank 0 at steps {differing[:10]}"
    return first


def test_two_noisy_ffn_ranks_run_the_same_path_at_every_step(tmp_path: Path) -> None:
    res = _run(
        tmp_path,
        attn_ranks=2,
        ffn_ranks=2,
        mapping="equal",
        layers=3,
        steps=48,
        adaptive=True,
        reprobe_every=4,
        timing="model",
        link_model_s=5e-5,  # the overlap gains a few per cent: a close call, which each rank's noise would decide
        noise_s={0: 0.001, 1: 0.001},
        vary_tokens=True,
    )
    _assert_ran(res)
    paths = _coherent(res)
    assert {"serial", "compute-side"} <= set(paths), paths  # learning and probes ran both
    groups = [f["stats"]["group"] for f in res.ffn.values()]
    assert [g["rank"] for g in groups] == [0, 1] and all(g["size"] == 2 and g["state"] == "ok" for g in groups)
    assert len({g["exchanges"] for g in groups}) == 1 and groups[0]["exchanges"] >= 2


@pytest.mark.slow
@pytest.mark.parametrize("layouts", ["compute-side", "compute-side,comm-side"])
def test_four_ffn_ranks_a_straggler_and_noise_run_the_same_path_at_every_step(tmp_path: Path, layouts: str) -> None:
    res = _run(
        tmp_path,
        attn_ranks=4,
        ffn_ranks=4,
        mapping="equal",
        layers=3,
        steps=64,
        adaptive=True,
        reprobe_every=8,
        timing="model",
        layout=layouts,
        straggler={2: 1.3},
        noise_s={0: 0.0005, 1: 0.001, 3: 0.0005},
        vary_tokens=True,
    )
    _assert_ran(res)
    _coherent(res)


def test_a_rank_whose_configuration_differs_sends_every_rank_down_upstreams_path(tmp_path: Path) -> None:
    res = _run(
        tmp_path,
        attn_ranks=2,
        ffn_ranks=2,
        mapping="equal",
        steps=8,
        adaptive=True,
        extra_env={0: GROUP_TIMEOUT, 1: {**GROUP_TIMEOUT, "VLLM_CAMP2P_MULTISTREAM_MODE": "parity"}},
    )
    _assert_ran(res)
    for rank, paths in res.paths().items():
        assert set(paths) == {"serial"}, (rank, paths)
        stats = res.ffn[rank]["stats"]
        assert stats["group"]["state"] == "broken"
        (reason,) = [r for r in stats["serial_reasons"] if r.startswith("FFN rank group")]
        assert "mode" in reason and "parity" in reason and "overlap" in reason, reason


def test_a_rank_without_the_layer_neither_hangs_nor_corrupts_the_others(tmp_path: Path) -> None:
    res = _run(
        tmp_path,
        attn_ranks=2,
        ffn_ranks=2,
        mapping="equal",
        steps=8,
        adaptive=True,
        extra_env={0: GROUP_TIMEOUT, 1: {"VLLM_CAMP2P_MULTISTREAM": "0"}},
    )
    _assert_ran(res)
    patched = res.ffn[0]["stats"]
    assert set(res.paths()[0]) == {"serial"}
    assert "no answer from rank(s) [1]" in (patched["group"]["broken"] or "")
    assert not res.ffn[1]["stats"]["steps"].get("overlap")  # rank 1 ran upstream's code throughout


WATCHDOG = {"VLLM_CAMP2P_MULTISTREAM_WATCHDOG_S": "4"}


@pytest.mark.parametrize("patched", [True, False], ids=["with-the-layer", "without-the-layer"])
def test_an_ffn_rank_that_dies_mid_step_ends_every_process_as_without_the_layer(tmp_path: Path, patched: bool) -> None:
    """FFN rank 1 exits inside its FFN of step 3: its peers' MoE collective fails (at the latest at gloo's 15 s
    timeout), and every FFN process ends with an error of its own, with the layer as without it: none hangs, none
    needs the launcher's kill."""
    off = {} if patched else {"VLLM_CAMP2P_MULTISTREAM": "0"}
    res = _run(
        tmp_path,
        attn_ranks=2,
        ffn_ranks=2,
        mapping="equal",
        steps=8,
        adaptive=True,
        timeout_s=15.0,
        fault={1: ("exit", 3)},
        grace_s=60.0,  # the survivors end by themselves
        extra_env={0: {**GROUP_TIMEOUT, **off}, 1: {**GROUP_TIMEOUT, **off}},
    )
    assert not res.timed_out, res.diagnostics()
    assert res.returncodes["ffn1"] == 17
    assert res.returncodes["ffn0"] not in (0, None, -9), res.diagnostics()
    steps = res.ffn[0]["steps"] if res.ffn.get(0) else []
    assert len([s for s in steps if s["phase"] == "overlap"]) <= 4  # it stopped at the dead rank's step


def test_a_hung_ffn_rank_is_named_in_the_others_stall_report(tmp_path: Path) -> None:
    """FFN rank 1 stops whole (SIGSTOP: its heartbeat too) inside its FFN of step 3: rank 0's watchdog reports
    the stall, naming rank 1 as the peer that stopped answering and the op rank 0 is blocked in; the world ends
    bounded (the launcher kills the stopped rank by its pid)."""
    res = _run(
        tmp_path,
        attn_ranks=2,
        ffn_ranks=2,
        mapping="equal",
        steps=8,
        adaptive=True,
        timeout_s=25.0,
        fault={1: ("stop", 3)},
        extra_env={0: {**GROUP_TIMEOUT, **WATCHDOG}, 1: {**GROUP_TIMEOUT, **WATCHDOG}},
    )
    log = res.logs["ffn0"]
    assert "has not finished after" in log, res.diagnostics()
    assert "FFN rank group: this is FFN rank 0 of 2" in log and "this rank is blocked in" in log
    assert "FFN peers that stopped answering: rank(s) 1" in log, log[-3000:]
    assert res.returncodes["ffn0"] not in (0, None) or res.timed_out
