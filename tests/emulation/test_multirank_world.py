"""The multi-rank world: A attention ranks and F FFN ranks, each a process,
over gloo on loopback (``camp2p_overlap/emulation/ranks.py``). Every FFN rank
is patched by the entry point and runs the same steps engaged and, after
``unpatch()``, serially; every attention rank receives bitwise-equal outputs
in both phases, with a MoE all-to-all among the FFN ranks inside each FFN
compute and a TP all-reduce among the attention ranks after each E2A.

The plain tier runs small worlds (2 attention ranks, 1 or 2 FFN ranks); the
slow tier (``-m slow``) 2 and 4 FFN ranks by both layouts, graphs on and off."""

from __future__ import annotations

from pathlib import Path

import pytest

from camp2p_overlap.emulation.ranks import CAPTURE, STEP, WARMUP, RanksSpec, WorldResult, run_world
from camp2p_overlap.emulation.ranks_roles import step_path

pytest.importorskip("torch.distributed")

#: Every world is bounded: its processes are killed (by pid) past this.
WORLD_TIMEOUT_S = 150.0
#: Every gloo op of a world is bounded by this.
OP_TIMEOUT_S = 40.0


def _gloo() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")


def _run(tmp_path: Path, **kw) -> WorldResult:
    _gloo()
    spec = RanksSpec(timeout_s=OP_TIMEOUT_S, **kw)
    return run_world(spec, tmp_path, timeout_s=WORLD_TIMEOUT_S)


def expected_paths(spec: RanksSpec, ffn_rank: int) -> list[str]:
    """What each plan entry runs on ``ffn_rank`` in the overlap phase with adaptive engage off."""
    capture = {"compute-side": "overlap", "comm-side": "serial"}[spec.layout]  # comm-side: no GRAPH_COMM_SIDE
    if spec.graphs and spec.graph_mode == "adaptive":
        capture = "overlap+serial" if spec.layout == "compute-side" else "serial"
    captured: set[int] = set()
    out = []
    for kind, step in spec.plan():
        multi = len(spec.stage_ids(step)) > 1
        if kind == CAPTURE:
            captured.add(step)
            out.append(f"capture:{capture}")
        elif kind == STEP and any(_same_key(spec, ffn_rank, step, c) for c in captured):
            replayed = "overlap" if capture.startswith("overlap") else "serial"
            out.append(f"replay:{replayed}")
        else:
            out.append(spec.layout if multi else "serial")
    return out


def _same_key(spec: RanksSpec, ffn_rank: int, a: int, b: int) -> bool:
    """Steps ``a`` and ``b`` have the same graph key on ``ffn_rank`` (its peers' counts per stage)."""
    return all(spec.schedule(a, r) == spec.schedule(b, r) for r in spec.peers_of(ffn_rank))


def check(res: WorldResult, *, adaptive_off: bool = True) -> None:
    spec = res.spec
    diag = res.diagnostics()
    assert not res.timed_out, f"the world did not finish within {WORLD_TIMEOUT_S} s{diag}"
    for att in res.attention.values():  # a mismatch first: it says more than a return code
        assert att is None or (att["errors"], att["mismatched"]) == ([], []), (att, diag)
    assert all(rc == 0 for rc in res.returncodes.values()), f"return codes {res.returncodes}{diag}"
    plan = spec.plan()
    messages = sum(len(spec.stage_ids(step)) * spec.layers for kind, step in plan if kind != CAPTURE)

    # Every attention rank received every message in both phases, bitwise equal.
    for a, att in res.attention.items():
        assert att is not None, diag
        assert att["errors"] == [], att["errors"]
        assert att["ffn_rank"] == spec.ffn_of(a)
        assert att["messages"] == {"overlap": messages, "serial": messages}, att
        assert att["mismatched"] == [] and att["same_keys"] and att["equal"] is True, att
    assert res.equal == dict.fromkeys(range(spec.attn_ranks), True)

    # Every FFN rank was patched by the entry point (the runner's loop wrapped), ran every entry, unpatched.
    for f, ffn in res.ffn.items():
        assert ffn is not None, diag
        assert ffn["error"] is None, ffn["error"]
        assert ffn["peers"] == spec.peers_of(f)
        assert ffn["applied_by_entry_point"] is True
        report = ffn["report"]
        assert report["engaged"] is True, report
        states = {t["target"].rsplit(".", 1)[-1]: t["state"] for t in report["targets"]}
        assert states["_ffn_forward"] == "wrapped", states
        assert ffn["unpatched"] is True
        assert [s["entry"] for s in ffn["steps"]] == list(range(len(plan))) * 2
        assert all(s["seconds"] > 0 for s in ffn["steps"])

    paths = res.paths("overlap")
    assert set(paths) == set(range(spec.ffn_ranks))
    # The steps engaged (not all serial), and the serial phase ran unpatched.
    for f, p in paths.items():
        assert any(x != "serial" and not x.startswith("capture") for x in p), p
        if adaptive_off:
            assert p == expected_paths(spec, f), (f, p)
    for p in res.paths("serial").values():
        assert all(x in ("unpatched", "replay:unpatched") for x in p), p


# ---------------------------------------------------------------------------
# the plain tier
def test_two_attention_ranks_one_ffn_rank_many_to_one(tmp_path: Path) -> None:
    check(_run(tmp_path, attn_ranks=2, ffn_ranks=1, layers=2, steps=5))


def test_equal_mapping_two_ffn_ranks_comm_side_three_stages(tmp_path: Path) -> None:
    """A == F: attention a <-> FFN a; the MoE all-to-all spans both FFN ranks."""
    check(_run(tmp_path, attn_ranks=2, ffn_ranks=2, mapping="equal", layout="comm-side", stages=3, steps=5, layers=2))


def test_graphs_captured_and_replayed_with_attention_ranks_sending_different_counts(tmp_path: Path) -> None:
    res = _run(tmp_path, attn_ranks=2, ffn_ranks=1, graphs=True, vary_tokens=True, layers=2, steps=6)
    check(res)
    (paths,) = res.paths().values()
    assert "replay:overlap" in paths and "compute-side" in paths, paths
    (ffn,) = res.ffn.values()
    assert any(s["kind"] == WARMUP for s in ffn["steps"])
    # The two peers' counts differ somewhere: the FFN gathered them in peer order.
    assert any(len(set(c)) > 1 for s in ffn["steps"] for c in s["tokens"].values())


def test_model_timing_a_straggler_slows_every_ffn_rank_through_the_all_to_all(tmp_path: Path) -> None:
    """``timing="model"``: each FFN kernel holds its stream for its modelled
    time; FFN rank 1 is 1.5x slower. The MoE all-to-all couples the ranks, so
    FFN rank 0's engaged steps take at least rank 1's modelled FFN time."""
    ffn_s, slow, layers = 4e-3, 1.5, 2
    res = _run(
        tmp_path,
        attn_ranks=2,
        ffn_ranks=2,
        mapping="equal",
        layers=layers,
        steps=3,
        timing="model",
        ffn_model_s=ffn_s,
        straggler={1: slow},
        noise_s={0: 1e-3},
    )
    check(res)
    spec = res.spec
    for f in range(2):
        steps = [s for s in res.ffn[f]["steps"] if s["phase"] == "overlap" and s["kind"] == STEP]
        for s in steps:
            floor = layers * len(s["stages"]) * ffn_s * slow
            assert s["seconds"] >= 0.95 * floor, (f, s, floor)
        assert res.ffn[f]["timing"]["by_kind"]["ffn"]["kernels"] > 0
    assert spec.straggler == {1: slow}


def test_the_spec_maps_ranks_as_camp2p_does_and_refuses_what_does_not_map() -> None:
    s = RanksSpec(attn_ranks=4, ffn_ranks=2)
    assert [s.ffn_of(a) for a in range(4)] == [0, 0, 1, 1]
    assert s.peers_of(1) == [2, 3]
    e = RanksSpec(attn_ranks=4, ffn_ranks=4, mapping="equal")
    assert [e.ffn_of(a) for a in range(4)] == [0, 1, 2, 3]
    for bad in (
        {"attn_ranks": 4, "ffn_ranks": 2, "mapping": "equal"},
        {"attn_ranks": 2, "ffn_ranks": 4},
        {"attn_ranks": 1},
        {"layout": "sideways"},
        {"stages": 4},
    ):
        with pytest.raises(ValueError):
            RanksSpec(**bad)
    # Every rank steps on the same stage ids; counts differ only with vary_tokens.
    v = RanksSpec(attn_ranks=4, ffn_ranks=1, vary_tokens=True, tokens=50)
    assert all(v.schedule(3, a).keys() == v.schedule(3, 0).keys() for a in range(4))
    assert len({tuple(v.schedule(0, a).values()) for a in range(4)}) > 1
    assert len({tuple(s.schedule(0, a).values()) for a in range(4)}) == 1
    assert RanksSpec.from_json(v.to_json()) == v
    g = RanksSpec(graphs=True, graph_keys=1, steps=3)
    assert g.plan() == [(WARMUP, 0), (CAPTURE, 0), (STEP, 0), (STEP, 1), (STEP, 2)]


def test_a_world_past_its_timeout_is_killed_process_by_process(tmp_path: Path) -> None:
    """The launcher's bound: past ``timeout_s`` every process still running is
    killed by its own pid and waited for; the result says it timed out."""
    _gloo()
    res = run_world(RanksSpec(attn_ranks=2, ffn_ranks=1, steps=200, timeout_s=60), tmp_path, timeout_s=2.0)
    assert res.timed_out
    assert set(res.returncodes) == {"attn0", "attn1", "ffn0"}
    assert all(rc is not None and rc != 0 for rc in res.returncodes.values()), res.returncodes
    assert not res.ok


def test_step_path_reads_the_stats_deltas() -> None:
    zero = {"steps": {"overlap": 0, "serial": 0}, "layout_steps": {}, "graph_replays": {"overlap": 0, "serial": 0}}
    after = {**zero, "steps": {"overlap": 1, "serial": 0}, "layout_steps": {"comm-side": 1}}
    assert step_path(zero, after) == "comm-side"
    assert step_path(zero, {**zero, "steps": {"overlap": 0, "serial": 1}}) == "serial"
    assert step_path(zero, {**zero, "graph_replays": {"overlap": 0, "serial": 1}}) == "replay:serial"
    assert step_path(zero, zero) == "unpatched"


# ---------------------------------------------------------------------------
# the slow tier
@pytest.mark.slow
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("layout", ["compute-side", "comm-side"])
@pytest.mark.parametrize(
    "attn_ranks,ffn_ranks,mapping", [(4, 2, "many-to-one"), (4, 4, "equal")], ids=["4x2-many-to-one", "4x4-equal"]
)
def test_many_ffn_ranks_both_layouts_graphs_on_and_off(
    tmp_path: Path, attn_ranks: int, ffn_ranks: int, mapping: str, layout: str, graphs: bool
) -> None:
    check(
        _run(
            tmp_path,
            attn_ranks=attn_ranks,
            ffn_ranks=ffn_ranks,
            mapping=mapping,
            layout=layout,
            graphs=graphs,
            vary_tokens=True,
            layers=2,
            steps=6,
        )
    )


@pytest.mark.slow
def test_adaptive_graphs_four_attention_ranks_one_ffn_rank_three_stages(tmp_path: Path) -> None:
    check(_run(tmp_path, attn_ranks=4, ffn_ranks=1, graphs=True, graph_mode="adaptive", stages=3, steps=6, layers=2))


@pytest.mark.slow
def test_adaptive_engage_with_a_straggler_and_noise_stays_bitwise_equal(tmp_path: Path) -> None:
    """Adaptive on: the FFN ranks may choose differently per step; the MoE
    all-to-all checks its pairing and the outputs stay equal to serial."""
    res = _run(
        tmp_path,
        attn_ranks=2,
        ffn_ranks=2,
        mapping="equal",
        adaptive=True,
        reprobe_every=4,
        steps=12,
        layers=2,
        timing="model",
        straggler={0: 1.3},
        noise_s={1: 2e-3},
    )
    check(res, adaptive_off=False)


@pytest.mark.slow
def test_every_attention_ranks_outputs_depend_on_every_ffn_rank(tmp_path: Path) -> None:
    """Equal mapping, 2x2: attention rank 0 talks only to FFN rank 0, yet
    what it receives at layer 0 (before any attention all-reduce could carry
    FFN rank 1's output over) changes when FFN rank 1's weights change: the
    MoE all-to-all feeds every output. And attention rank 1's, the same way."""
    kw = {"attn_ranks": 2, "ffn_ranks": 2, "mapping": "equal", "layers": 2, "steps": 3}
    base = _run(tmp_path / "base", **kw)
    other = _run(tmp_path / "other", **kw, ffn_seed={1: 12345})
    check(base)
    check(other)
    for a in range(2):
        assert base.attention[a]["layer_digests"][0] != other.attention[a]["layer_digests"][0], a
    again = _run(tmp_path / "again", **kw)
    assert [again.attention[a]["digest"] for a in range(2)] == [base.attention[a]["digest"] for a in range(2)]
