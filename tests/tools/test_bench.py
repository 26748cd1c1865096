"""The benchmark (``camp2p-overlap bench`` / ``sweep``): the emulation runs
in seconds at tiny sizes; the JSON has the documented schema; outputs equal
the serial run's (the report's flag, and an independent check); the trace
and plot files are what they claim to be. No timing is asserted."""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.child import run_cli
from support.overlap import SHAPE, apply_cpu, assert_same
from support.tiny_bench import TINY, TINY_PARAMS

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.overlap.graphs import VariantGraph
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.core.patch_layer import PATCH_LAYER, PatchLayer
from camp2p_overlap.core.patching.lifecycle import PatchRefused
from camp2p_overlap.core.patching.manifest import load_manifest
from camp2p_overlap.emulation import device, standins
from camp2p_overlap.emulation import device as emulated_device
from camp2p_overlap.emulation import standin_patch_layer as emulation
from camp2p_overlap.emulation.moe import MoEShape
from camp2p_overlap.emulation.standin_patch_layer import emulated_patch_layer, emulated_version_check, emulation_engine
from camp2p_overlap.emulation.world import EmulatedModel, LinkModel, WorldSpec, build_world
from camp2p_overlap.tools import cli
from camp2p_overlap.tools.bench.runner import (
    DEFAULT_POLICIES,
    ETA_MIN_HIDEABLE,
    GRAPH_COMM_ON_THE_EMULATED_NPU,
    POLICIES,
    SCENARIOS,
    TOOL_SWITCH_INTERVAL_S,
    BenchParams,
    resolve_params,
    run_bench,
)
from camp2p_overlap.tools.bench.tables import bench_table

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny benchmark run through ``main(argv)`` writing every output."""
    out = tmp_path_factory.mktemp("bench")
    paths = {"json": out / "b.json", "trace": out / "t.json", "plot": out / "p.png"}
    patch_layers: list[PatchLayer] = []
    real_build = emulation.build_patch_layer
    emulation.build_patch_layer = lambda **kw: patch_layers.append(real_build(**kw)) or patch_layers[-1]  # type: ignore[assignment]
    try:
        rc = cli.main(
            ["bench", *TINY, "--json", str(paths["json"]), "--trace", str(paths["trace"]), "--plot", str(paths["plot"])]
        )
    finally:
        emulation.build_patch_layer = real_build  # type: ignore[assignment]
    return {
        "rc": rc,
        "paths": paths,
        "report": json.loads(paths["json"].read_text()),
        "patch_layers": patch_layers,
        "finder_left": [f for f in sys.meta_path if isinstance(f, standins.StandinFinder)],
    }


# ---------------------------------------------------------------------------
# the JSON report: every documented key (docs/benchmark.md)

TOP_KEYS = {
    "schema": str,
    "version": str,
    "partial": bool,
    "progress": str,
    "device": str,
    "backend": str,
    "world": str,
    "scenario": (str, type(None)),
    "graph": bool,
    "graph_pool": (dict, type(None)),
    "skipped_policies": list,
    "attention": str,
    "stand_in_root": str,
    "comm_model": str,
    "fallbacks": list,
    "attn_modeled": bool,
    "timing": dict,
    "params": dict,
    "ffn_layers": int,
    "stages": list,
    "measured": dict,
    "policies": list,
    "layouts_compared": (dict, type(None)),
    "contention": (dict, type(None)),
    "outputs_equal": bool,
    "env": dict,
    "wall_s": float,
    "run": dict,
}
PARAM_KEYS = {f for f in BenchParams.__dataclass_fields__}
MEASURED_KEYS = {
    "source": str,
    "samples": int,
    "f_us": float,
    "stages": list,
    "attn_us": float,
    "comm_over_ffn": float,
    "ffn_bound": bool,
    "floor_per_layer_us": float,
    "floor_terms": dict,
    "floor_fill_drain_per_layer_us": float,
    "floor_fill_drain_terms": dict,
    "launch": (dict, type(None)),
}
FILL_DRAIN_KEYS = {"fill_us": float, "drain_us": float, "layers": int, "compute_us": float, "group_chain_us": float}
POLICY_KEYS = {
    "policy": str,
    "layouts": (list, type(None)),
    "a2e_side_stream": bool,
    "e2a_side_stream": bool,
    "ffn_side_stream": bool,
    "layout_steps": dict,
    "samples": int,
    "per_layer_us": dict,
    "adaptive": bool,
    "learning": (dict, type(None)),
    "speedup": float,
    "speedup_ci95": (list, type(None)),
    "eta": (float, type(None)),
    "eta_ci95": (list, type(None)),
    "eta_fill_drain": (float, type(None)),
    "eta_fill_drain_ci95": (list, type(None)),
    "noisy": bool,
    "noise": list,
    "outputs_equal": bool,
    "compared_steps": int,
    "mismatches": list,
    "engaged": bool,
    "replays": int,
    "captured_variants": int,
    "capture": (dict, type(None)),
    "graph_choice": (dict, type(None)),
    "edges_checked": bool,
    "edges_ok": (bool, type(None)),
    "edge_violations": list,
    "peer_cycle_ok": (bool, type(None)),
    "peer_cycle_checked_steps": int,
    "peer_cycle_violations": list,
    "launch": (dict, type(None)),
    "timing": (dict, type(None)),
}
#: ``timing`` (the run's timing model, docs/benchmark.md "Timing model").
TIMING_KEYS = {
    "model": str,
    "why": str,
    "error_pct": float,
    "ffn": (dict, type(None)),
    "ffn_model": (str, type(None)),
    "comm_model": (str, type(None)),
    "attn_us": float,
    "counts": (dict, type(None)),
    "noisy": bool,
    "noise": list,
}
#: ``timing.counts`` and each policy's ``timing``: its modelled kernels against the model.
TIMING_COUNT_KEYS = {
    "kernels": int,
    "modelled_us": float,
    "overruns": int,
    "overrun_pct": (float, type(None)),
    "overrun_us": float,
    "overrun_time_pct": (float, type(None)),
    "late_starts": int,
    "tolerance_us": float,
    "over_us": dict,
    "start_lag_us": dict,
    "sync_lag_us": dict,
    "by_kind": dict,
}
TIMING_KIND_KEYS = {
    "kernels": int,
    "modelled_us": float,
    "overruns": int,
    "overrun_us": float,
    "late_starts": int,
    "work_us": dict,
}
SAMPLE_KEYS = {"samples", "median", "p90", "p99", "max"}
FFN_MODEL_KEYS = {
    "fixed": bool,
    "rated": bool,
    "rate": dict,
    "hold": float,
    "quantile": float,
    "margin": float,
    "points": list,
}
FFN_POINT_KEYS = {
    "tokens": int,
    "runs": int,
    "median_us": float,
    "quantile_us": float,
    "model_us": float,
    "rated_us": float,
    "calibrated_why": str,
    "in_run_quantile_us": dict,
}
#: A graph run's per-policy ``capture``.
CAPTURE_KEYS = {
    "graphs": int,
    "pools": list,
    "seconds": float,
    "pool_bytes": (int, type(None)),
    "device_free_bytes": (int, type(None)),
    "allocated_bytes": (int, type(None)),
    "second_variant_bytes": (int, type(None)),
}
#: A graph run's ``graph_pool``.
GRAPH_POOL_KEYS = {"pool": str, "pools_seen": list, "one_pool": bool, "graphs": int, "memory": str}
ENV_KEYS = {
    "python": str,
    "torch": str,
    "torch_threads": int,
    "cpu_count": int,
    "machine": str,
    "switch_interval_s": float,
}


def _check_keys(obj: dict[str, Any], spec: dict[str, Any], where: str) -> None:
    assert set(obj) == set(spec), f"{where}: keys {sorted(obj)} != documented {sorted(spec)}"
    for key, typ in spec.items():
        assert isinstance(obj[key], typ), f"{where}.{key} = {obj[key]!r} is not {typ}"


def _check_timing_counts(counts: dict[str, Any], where: str) -> None:
    _check_keys(counts, TIMING_COUNT_KEYS, where)
    for key in ("over_us", "start_lag_us", "sync_lag_us"):
        assert set(counts[key]) == SAMPLE_KEYS, f"{where}.{key}"
    assert set(counts["by_kind"]) == {"ffn", "a2e", "e2a"}, f"{where}.by_kind"
    for kind, k in counts["by_kind"].items():
        _check_keys(k, TIMING_KIND_KEYS, f"{where}.by_kind.{kind}")
        assert set(k["work_us"]) == SAMPLE_KEYS
    assert counts["kernels"] == sum(k["kernels"] for k in counts["by_kind"].values())
    assert counts["overruns"] == sum(k["overruns"] for k in counts["by_kind"].values())


def test_bench_json_has_the_documented_schema(bench_files: dict[str, Any]) -> None:
    assert bench_files["rc"] == 0
    r = bench_files["report"]
    _check_keys(r, TOP_KEYS, "report")
    assert r["schema"] == "camp2p-overlap/bench/v1"
    assert r["partial"] is False and r["progress"] == "done"
    assert r["device"] == "cpu" and r["backend"] == "cpu" and r["world"] == "host"
    assert r["graph"] is False and r["skipped_policies"] == [] and r["graph_pool"] is None
    assert r["attention"] == "per-stage" and r["contention"] is None
    assert r["stand_in_root"] == standins.REAL_ROOT
    assert set(r["params"]) == PARAM_KEYS
    assert r["params"]["layers"] == 2 and r["params"]["reps"] == 2
    assert r["params"]["policies"] == list(DEFAULT_POLICIES) and r["params"]["comm_cores_sweep"] == []
    assert r["ffn_layers"] == 2 and r["stages"] == [0, 1]
    _check_keys(r["measured"], MEASURED_KEYS, "measured")
    assert [s["stage"] for s in r["measured"]["stages"]] == [0, 1]
    for s in r["measured"]["stages"]:
        _check_keys(s, {"stage": int, "a_us": float, "e_us": float}, "measured.stages[]")
    _check_keys(r["measured"]["floor_terms"], {"stages_x_f_us": float, "group_cycle_us": float}, "floor_terms")
    _check_keys(r["measured"]["floor_fill_drain_terms"], FILL_DRAIN_KEYS, "floor_fill_drain_terms")
    # The host world: nothing fell back, and no host/device split to measure (the FFN runs on the caller's thread).
    assert r["fallbacks"] == [] and r["measured"]["launch"] is None
    assert all(p["launch"] is None for p in r["policies"])
    assert [p["policy"] for p in r["policies"]] == [
        "serial",
        "e2a-only",
        "overlap",
        "compute-side-fixed",
        "comm-side-fixed",
    ]
    layouts = {p["policy"]: p["layouts"] for p in r["policies"]}
    assert layouts == {
        "serial": None,
        "e2a-only": ["e2a-only"],
        "overlap": ["compute-side"],
        "compute-side-fixed": ["compute-side"],
        "comm-side-fixed": ["comm-side"],
    }
    streams = {p["policy"]: (p["a2e_side_stream"], p["e2a_side_stream"], p["ffn_side_stream"]) for p in r["policies"]}
    assert streams == {
        "serial": (False, False, False),
        "e2a-only": (False, True, False),
        "overlap": (False, False, True),
        "compute-side-fixed": (False, False, True),
        "comm-side-fixed": (True, True, False),
    }
    for p in r["policies"]:
        _check_keys(p, POLICY_KEYS, f"policies[{p['policy']}]")
        assert p["adaptive"] is (p["policy"] == "overlap")
        # every timed step, by the path it ran: a fixed policy its layout, serial the serial path
        assert sum(p["layout_steps"].values()) == p["samples"], p
        if not p["adaptive"]:
            assert p["layout_steps"] == {(p["layouts"] or ["serial"])[0]: p["samples"]}, p
        if p["policy"] == "serial":  # noisy only when its kernels overran the timing model
            assert p["speedup_ci95"] is None and p["eta_ci95"] is None and p["eta_fill_drain_ci95"] is None
            assert all("timing model's error" in n for n in p["noise"])
        else:
            lo, hi = p["speedup_ci95"]
            assert lo <= hi and all(isinstance(x, float) for x in (lo, hi))
            assert p["noisy"] is bool(p["noise"])
        _check_keys(p["per_layer_us"], {"median": float, "p90": float, "min": float, "mean": float}, "per_layer_us")
        # 2 reps x 2 timed steps (adaptive overlap still learns in this tiny
        # run: its timed learning steps stand in, flagged)
        assert p["samples"] == 4
        if p["adaptive"]:
            learn = p["learning"]
            assert learn["decision"] is None and learn["steps"] == 2 * (1 + 2)
            assert sum(learn["paths"].values()) == learn["steps"] and learn["extra_us_per_layer"] is None
            assert p["noisy"] and any("still learning" in n for n in p["noise"])
        else:
            assert p["learning"] is None
        assert p["replays"] == 0 and p["captured_variants"] == 0, "an eager run captures nothing"
        assert p["capture"] is None
        _check_timing_counts(p["timing"], f"policies[{p['policy']}].timing")
        assert p["timing"]["kernels"] > 0, "every policy ran modelled kernels"
    t = r["timing"]
    _check_keys(t, TIMING_KEYS, "timing")
    assert t["model"] == "model" and t["why"] == "the default on the CPU's emulated device"
    _check_timing_counts(t["counts"], "timing.counts")
    assert t["counts"]["kernels"] == sum(p["timing"]["kernels"] for p in r["policies"])
    assert t["noisy"] is bool(t["noise"])
    _check_keys(t["ffn"], FFN_MODEL_KEYS, "timing.ffn")
    assert t["ffn"]["fixed"] is False
    (point,) = t["ffn"]["points"]
    _check_keys(point, FFN_POINT_KEYS, "timing.ffn.points[]")
    assert point["tokens"] == 16
    assert set(point["in_run_quantile_us"]) == {"serial", "e2a-only", "compute-side", "comm-side"}
    if point["calibrated_why"]:  # this machine could not hold the rating
        slowest = max(point["quantile_us"], *point["in_run_quantile_us"].values())
        assert point["model_us"] == pytest.approx(slowest * t["ffn"]["margin"], rel=1e-3)
    else:
        assert point["model_us"] == point["rated_us"] and t["ffn"]["rated"] is True
    _check_keys(r["env"], ENV_KEYS, "env")
    assert r["env"]["torch_threads"] == 1
    assert r["env"]["switch_interval_s"] == TOOL_SWITCH_INTERVAL_S, "the bench command sets the tools' interval"
    assert set(r["run"]) == {"command", "commit", "date"}
    paths = bench_files["paths"]
    argv = ["bench", *TINY, "--json", paths["json"], "--trace", paths["trace"], "--plot", paths["plot"]]
    assert r["run"]["command"] == shlex.join(["camp2p-overlap", *map(str, argv)]), "the command as run"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r["run"]["date"])


def test_report_values_are_consistent(bench_files: dict[str, Any]) -> None:
    """Speedup, floor and eta follow their documented formulas from the
    reported numbers; f, a and e were measured (positive)."""
    r = bench_files["report"]
    m = r["measured"]
    assert m["f_us"] > 0 and all(s["a_us"] > 0 and s["e_us"] > 0 for s in m["stages"])
    # 2 reps x 2 traced serial steps x 2 layers x 2 stages
    assert m["samples"] == 16
    S = len(r["stages"])
    cycle = max(s["a_us"] + m["f_us"] + s["e_us"] + m["attn_us"] for s in m["stages"])
    assert m["floor_terms"]["stages_x_f_us"] == pytest.approx(S * m["f_us"], abs=0.01)
    assert m["floor_terms"]["group_cycle_us"] == pytest.approx(cycle, abs=0.01)
    assert m["floor_per_layer_us"] == pytest.approx(max(S * m["f_us"], cycle), abs=0.01)
    assert m["comm_over_ffn"] == pytest.approx(max(s["a_us"] + s["e_us"] for s in m["stages"]) / m["f_us"], rel=1e-3)
    # The fill/drain floor: the step's first A2E (stage 0's) and last E2A (the last stage's) around its L*S FFNs,
    # and each stage's chain over the step without the attention after its last E2A; per layer.
    L = r["ffn_layers"]
    fd = m["floor_fill_drain_terms"]
    first, last = m["stages"][0], m["stages"][-1]
    assert (fd["layers"], fd["fill_us"], fd["drain_us"]) == (L, first["a_us"], last["e_us"])
    compute = (first["a_us"] + L * S * m["f_us"] + last["e_us"]) / L
    chain = max(L * (s["a_us"] + m["f_us"] + s["e_us"]) + (L - 1) * m["attn_us"] for s in m["stages"]) / L
    assert fd["compute_us"] == pytest.approx(compute, abs=0.01) and fd["group_chain_us"] == pytest.approx(
        chain, abs=0.01
    )
    assert m["floor_fill_drain_per_layer_us"] == pytest.approx(max(compute, chain), abs=0.01)
    serial = r["policies"][0]
    t_s = serial["per_layer_us"]["median"]
    assert serial["speedup"] == 1.0 and serial["eta"] is None and serial["eta_fill_drain"] is None
    for p in r["policies"][1:]:
        t_p = p["per_layer_us"]["median"]
        assert p["speedup"] == pytest.approx(t_s / t_p, rel=1e-3)
        for key, floor in (("eta", m["floor_per_layer_us"]), ("eta_fill_drain", m["floor_fill_drain_per_layer_us"])):
            if t_s - floor > ETA_MIN_HIDEABLE * t_s:
                assert p[key] == pytest.approx((t_s - t_p) / (t_s - floor), rel=1e-3, abs=1e-3), key
            else:
                assert p[key] is None, key
        assert p["per_layer_us"]["min"] <= p["per_layer_us"]["median"] <= p["per_layer_us"]["p90"]


def test_outputs_equal_and_overlap_engaged(bench_files: dict[str, Any]) -> None:
    r = bench_files["report"]
    assert r["outputs_equal"] is True
    by = {p["policy"]: p for p in r["policies"]}
    assert by["serial"]["engaged"] is False
    assert by["e2a-only"]["engaged"] is True
    assert by["compute-side-fixed"]["engaged"] is True and by["comm-side-fixed"]["engaged"] is True
    # adaptive engage is still learning in this tiny run: either path is right
    for p in r["policies"]:
        assert p["outputs_equal"] is True and p["mismatches"] == []
        assert p["edges_checked"] is True and p["edges_ok"] is True, p["edge_violations"]
    # serial: reps after the first and the traced steps; others: every timed and traced step
    assert by["serial"]["compared_steps"] == 2 + 2 * 2
    for name in ("overlap", "compute-side-fixed", "comm-side-fixed"):
        assert by[name]["compared_steps"] == 2 * (2 + 1), name


def test_bench_leaves_the_process_as_it_found_it(bench_files: dict[str, Any]) -> None:
    assert bench_files["finder_left"] == []
    assert not PATCH_LAYER.engine.is_applied() and len(PATCH_LAYER.engine.installer.records) == 0
    # Each policy ran on an engine of its own (kept over the repetitions,
    # so adaptive engage learns once), and so did each patched schedule the
    # FFN's timing model was refined on (e2a-only, compute-side, comm-side:
    # built first), all unpatched with their streams closed.
    patch_layers = bench_files["patch_layers"]
    assert len(patch_layers) == len(DEFAULT_POLICIES) + 3, (len(patch_layers), len(DEFAULT_POLICIES))
    assert len({id(p.engine) for p in patch_layers}) == len(patch_layers)
    assert all(not p.engine.is_applied() and not p.runtime.runners.stream_sets() for p in patch_layers)


def test_trace_is_chrome_trace_event_json_with_a_track_per_stream(bench_files: dict[str, Any]) -> None:
    data = json.loads(bench_files["paths"]["trace"].read_text())
    events = data["traceEvents"]
    assert isinstance(events, list) and events
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(processes.values()) == sorted(DEFAULT_POLICIES)
    threads: dict[str, dict[int, str]] = {name: {} for name in processes.values()}
    for e in events:
        if e["ph"] == "M" and e["name"] == "thread_name":
            threads[processes[e["pid"]]][e["tid"]] = e["args"]["name"]
    assert sorted(threads["serial"].values()) == ["C"]
    assert sorted(threads["comm-side-fixed"].values()) == ["C", "K0", "K1"]
    assert sorted(threads["compute-side-fixed"].values()) == ["C", "F"]
    assert sorted(threads["overlap"].values()) in (["C"], ["C", "F"])  # adaptive: either path
    assert sorted(threads["e2a-only"].values()) == ["C", "K0", "K1"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans
    for e in spans:
        assert e["tid"] in threads[processes[e["pid"]]], "a span on an unnamed track"
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        assert {"name", "cat", "pid", "tid"} <= set(e)
    # one step per policy; comm-side-fixed's A2E ran on the side streams, compute-side-fixed's on C and its FFN on F
    for name, pid in ((n, p) for p, n in processes.items()):
        assert len([e for e in spans if e["pid"] == pid and e["cat"] == "step"]) == 1, name

    def tracks(policy: str, cat: str) -> set[str]:
        pid = next(p for p, n in processes.items() if n == policy)
        return {threads[policy][e["tid"]] for e in spans if e["pid"] == pid and e["cat"] == cat}

    assert tracks("comm-side-fixed", "a2e") == {"K0", "K1"} and tracks("comm-side-fixed", "ffn") == {"C"}
    assert tracks("compute-side-fixed", "a2e") == {"C"} and tracks("compute-side-fixed", "e2a") == {"C"}
    assert tracks("compute-side-fixed", "ffn") == {"F"}


def test_plot_is_a_png(bench_files: dict[str, Any]) -> None:
    data = bench_files["paths"]["plot"].read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000


# ---------------------------------------------------------------------------
# outputs: an independent check, and the flag can fail


def _tiny_spec() -> WorldSpec:
    return WorldSpec(
        layers=3,
        stage_ids=(0, 1),
        tokens=16,
        shape=MoEShape(hidden=64, ffn=128, experts=4, top_k=2),
        link=LinkModel(latency_s=50e-6, bandwidth_Bps=1e9),
        attn_s=50e-6,
        op_timeout_s=10.0,
    )


def test_overlap_outputs_equal_serial_outputs_independently() -> None:
    """Without the benchmark's code paths: the serial run (engine unpatched)
    and the overlap run (emulation engine applied) of the same step ids give
    bitwise equal outputs, and the overlap really engaged."""
    world = build_world(_tiny_spec())
    serial = {}
    for sid in (5, 6):
        world.steps_run = sid
        serial[sid] = world.run_step()
    engaged: list[bool] = []

    class Counted(StepSession):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            engaged.append(True)

    patch_layer = emulated_patch_layer()
    patch_layer.runtime.session_class = Counted
    patch_layer.engine.apply(config=OverlapConfig(enabled=True, backend="cpu", adaptive=False), strict=True)
    try:
        for sid in (5, 6):
            world.steps_run = sid
            out = world.run_step()
            assert len(out) == 3 * 2
            assert_same(out, serial[sid], f"step {sid}")
    finally:
        assert patch_layer.engine.unpatch(timeout=10)
    assert engaged == [True, True]


def _perturb_the_ffn_under_a2e_side_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Add 1e-3 to the routed FFN output while a session with A2E or the FFN
    on a side stream is active (comm-side or compute-side, not e2a-only; in
    the benchmark's own patch layers): on the device, as a kernel after the
    FFN's, so it changes what the FFN wrote."""
    original = EmulatedModel.compute_ffn_output
    patch_layers: list[PatchLayer] = []
    real_build = emulation.build_patch_layer
    monkeypatch.setattr(
        emulation, "build_patch_layer", lambda **kw: patch_layers.append(real_build(**kw)) or patch_layers[-1]
    )

    def perturbed(self: EmulatedModel, *, hidden_states: torch.Tensor, layer_idx: int) -> Any:
        out = original(self, hidden_states=hidden_states, layer_idx=layer_idx)
        sessions = [s for p in patch_layers if (s := p.runtime.active_session()) is not None]
        if sessions and (sessions[0].layout.a2e_side or sessions[0].layout.ffn_side):
            routed = out.routed_output
            emulated_device.launch(lambda: routed.add_(1e-3), writes=(routed,))
        return out

    monkeypatch.setattr(EmulatedModel, "compute_ffn_output", perturbed)


def test_outputs_flag_fails_when_the_overlap_changes_a_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Perturb the FFN only while an overlap session is active: the report
    must say the outputs differ, and the command must exit non-zero."""
    _perturb_the_ffn_under_a2e_side_sessions(monkeypatch)
    run = run_bench(resolve_params({**TINY_PARAMS, "reps": 1}))
    by = {p["policy"]: p for p in run.report["policies"]}
    assert by["serial"]["outputs_equal"] is True
    assert by["e2a-only"]["outputs_equal"] is True
    assert by["overlap"]["outputs_equal"] is False and by["overlap"]["mismatches"]
    assert run.report["outputs_equal"] is False
    from camp2p_overlap.tools.bench.tables import bench_table, problems

    assert any("outputs differ" in p for p in problems(run.report))
    assert "FAILED: overlap: outputs differ" in bench_table(run.report)


def test_with_a_real_afd_plugin_the_stand_ins_move_to_the_alias_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """When afd_plugin is importable, the benchmark never shadows it: the
    stand-ins live under ALIAS_ROOT and the manifest is rebased onto it."""
    monkeypatch.setattr(standins, "real_afd_plugin_installed", lambda: True)
    run = run_bench(resolve_params({**TINY_PARAMS, "reps": 1}))
    r = run.report
    assert r["stand_in_root"] == standins.ALIAS_ROOT
    assert not any(name == "afd_plugin" or name.startswith("afd_plugin.") for name in sys.modules)
    by = {p["policy"]: p for p in r["policies"]}
    assert by["compute-side-fixed"]["engaged"] is True and by["e2a-only"]["engaged"] is True
    assert by["comm-side-fixed"]["engaged"] is True
    assert r["outputs_equal"] is True


# ---------------------------------------------------------------------------
# engines of the emulation


def test_emulation_engines_are_fresh_and_unpatched_on_the_way_out() -> None:
    with emulation_engine() as engine, emulation_engine() as other:
        assert engine is not PATCH_LAYER.engine and other is not PATCH_LAYER.engine and other is not engine
    with pytest.raises(ValueError, match="boom"):
        with emulation_engine() as engine:
            world = build_world(_tiny_spec())
            engine.apply(config=OverlapConfig(enabled=True, backend="cpu", adaptive=False), strict=True)
            assert engine.is_applied()
            raise ValueError("boom")
    assert not engine.is_applied(), "the emulation engine is unpatched on the way out"
    assert not PATCH_LAYER.engine.is_applied()
    runner_cls = type(world.runner)
    assert not hasattr(vars(runner_cls)["_ffn_forward"], "__wrapped__")


def test_a_second_engine_refuses_targets_another_engine_wrapped() -> None:
    """Two engines never stack wrappers on one class: the second refuses."""
    world = build_world(_tiny_spec())
    cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False)
    with emulation_engine() as first, emulation_engine() as second:
        assert first.apply(config=cfg, strict=True).engaged
        with pytest.raises(PatchRefused, match="another patch engine"):
            second.apply(config=cfg, strict=True)
        assert not second.is_applied() and first.status().engaged
        assert first.is_ours(vars(type(world.runner))["_ffn_forward"])


def test_emulation_engine_refuses_when_the_process_engine_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    build_world(_tiny_spec())
    monkeypatch.setattr(PATCH_LAYER.engine, "version_check", emulated_version_check)
    PATCH_LAYER.engine.apply(config=OverlapConfig(enabled=True, backend="cpu", adaptive=False), strict=True)
    try:
        with pytest.raises(RuntimeError, match="process-wide camp2p-overlap patch layer is applied"):
            with emulation_engine():
                pass
    finally:
        PATCH_LAYER.engine.unpatch(timeout=10)


def test_emulated_version_check_accepts_without_consulting_vllm() -> None:
    vc = emulated_version_check(load_manifest())
    assert vc.ok and vc.supported == "0.19.1" and vc.found == "emulated"


# ---------------------------------------------------------------------------
# parameters, scenarios, errors


def test_scenario_preset_and_explicit_override() -> None:
    preset = SCENARIOS["ffn-bound"]
    p = resolve_params({}, "ffn-bound")
    assert p.scenario == "ffn-bound"
    for key, value in preset.items():
        assert getattr(p, key) == value
    q = resolve_params({"layers": 3, "link_gbps": 2.5, "policies": ["serial", "overlap"]}, "ffn-bound")
    assert q.layers == 3 and q.link_gbps == 2.5 and q.policies == ("serial", "overlap")
    assert q.hidden == preset["hidden"] and q.attn_us == preset["attn_us"]
    d = resolve_params({})
    assert d == BenchParams()
    assert d.threads == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stages", "4"], "out of range 1..3"),
        (["--policies", "overlap"], "must include serial"),
        (["--top-k", "9", "--experts", "4"], "larger than --experts"),
        (["--link-gbps", "0"], "--link-gbps must be a positive number"),
    ],
)
def test_bench_rejects_bad_parameters(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_unknown_policy_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--policies", "serial,fast"])
    assert exc.value.code == 2
    assert "unknown policy fast" in capsys.readouterr().err


def test_device_cuda_without_a_gpu_errors_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present; see test_bench_on_cuda")
    assert cli.main(["bench", "--device", "cuda", *TINY]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: torch.cuda reports no CUDA device (torch.cuda.is_available() is False)" in err


def test_device_world_imports_without_a_device() -> None:
    from camp2p_overlap.emulation import kernel_world

    assert hasattr(kernel_world, "build_device_world")
    if not torch.cuda.is_available():
        with pytest.raises(kernel_world.DeviceUnavailable, match=r"torch\.cuda\.is_available"):
            kernel_world.build_device_world(_tiny_spec(), "cuda")
    with pytest.raises(kernel_world.DeviceUnavailable, match=r"--device tpu: no device module for 'tpu'"):
        kernel_world.require_device("tpu")


def test_help_documents_the_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for needle in ("eta", "floor", "serial run's trace", "--scenario", "ffn-bound", "only the ratios carry over"):
        assert needle in text
    for needle in ("fill/drain", "--comm-cores-sweep", "--attention", "compute-side-fixed", "comm-side-fixed"):
        assert needle in text, needle
    for name in POLICIES:  # every policy's help, its name at the start of a line
        assert re.search(rf"^  {re.escape(name)} ", text, re.M), name


# ---------------------------------------------------------------------------
# sweep, and the console entry point in a fresh interpreter


def test_sweep_writes_markdown_plot_and_json(tmp_path: Path) -> None:
    md, png, js = tmp_path / "s.md", tmp_path / "s.png", tmp_path / "s.json"
    args = ["sweep", *TINY, "--reps", "1", "--ratios", "0.5,2", "--stage-counts", "1,2", "--comm-core-points", "none"]
    work = ["--work-tokens", "1,4", "--work-hidden", "16"]
    rc = cli.main([*args, *work, "--md", str(md), "--plot", str(png), "--json", str(js)])
    assert rc == 0
    text = md.read_text()
    assert "communication / FFN compute" in text and "number of stages" in text and "work per (layer, stage)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert len(rows) == 3 + 2 + 2 + 2  # three headers, 2 ratio rows, 2 stage rows, 2 work rows
    assert [r.split(" | ")[0] for r in rows[-2:]] == ["| 16 / 1", "| 16 / 4"]
    # both layouts at every point, each with its speedup's spread and both etas
    for header in (rows[0], rows[3], rows[-3]):
        for name in ("compute-side-fixed", "comm-side-fixed", "overlap"):
            assert f"{name} speedup [95% CI] / eta / eta f/d" in header, (name, header)
        assert "| floor | fill/drain floor |" in header
    assert "e2a-only" not in rows[-3] and "e2a-only speedup" in rows[0]
    cells = re.compile(r"\d+\.\d\dx(?: \[[^\]]+\])? / (?:-?[\d.]+|-) / (?:-?[\d.]+|-)")
    assert [len(cells.findall(row)) for row in rows[1:3]] == [4, 4], rows[1:3]  # each ratio point, 4 policies
    assert all(row.count(" | ") == rows[0].count(" | ") for row in rows[1:3]), "a row's cells are not the header's"
    assert "Adaptive `overlap` at its slowest:" in text
    assert "only the ratios" in text.lower()
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    data = json.loads(js.read_text())
    assert data["partial"] is False and data["progress"] == "done" and data["fallbacks"] == []
    assert data["run"]["command"].startswith("camp2p-overlap sweep ") and set(data["run"]) == {
        "command",
        "commit",
        "date",
    }
    assert set(data["env"]) == set(ENV_KEYS) and data["env"]["torch_threads"] == 1
    assert data["comm_core_points"] == [] and data["comm_core_changes"] == []
    assert [p["target_ratio"] for p in data["ratio_points"]] == [0.5, 2.0]
    assert [p["stages"] for p in data["stage_points"]] == [1, 2]
    assert [(p["hidden"], p["tokens"]) for p in data["work_points"]] == [(16, 1), (16, 4)]
    for p in data["work_points"]:
        r = p["report"]
        assert [q["policy"] for q in r["policies"]] == ["serial", "overlap", "compute-side-fixed", "comm-side-fixed"]
        assert r["params"]["link_latency_us"] == 0 and r["params"]["attn_us"] == 0 and r["params"]["steps"] >= 8
        assert r["outputs_equal"] is True
    one_stage = data["stage_points"][0]["report"]
    assert all(p["outputs_equal"] for p in one_stage["policies"])
    assert not any(p["engaged"] for p in one_stage["policies"]), "one stage: nothing to overlap, serial path"
    bandwidths = [p["report"]["params"]["link_gbps"] for p in data["ratio_points"]]
    assert bandwidths[0] > bandwidths[1], "a higher communication ratio means a slower modeled link"


def test_bench_in_a_fresh_interpreter(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    res = run_cli("bench", *TINY, "--reps", "1", "--json", str(out), timeout=120)
    assert res.returncode == 0, res.stderr
    assert "per-layer median" in res.stdout and "overlap" in res.stdout
    assert "Absolute CPU times say nothing about an NPU" in res.stdout
    assert json.loads(out.read_text())["outputs_equal"] is True


@pytest.mark.gpu
def test_bench_on_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--device", "cuda", *TINY, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["backend"] == "cuda"
    by = {p["policy"]: p for p in r["policies"]}
    assert by["compute-side-fixed"]["engaged"] is True and by["comm-side-fixed"]["engaged"] is True
    assert r["outputs_equal"] is True


@pytest.mark.gpu
def test_bench_on_cuda_with_contention_models_the_peer(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--device", "cuda", *TINY, "--comm-cores", "4", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["attn_modeled"] is True and r["comm_model"].startswith("nvrtc"), r["comm_model"]
    assert "4 SM(s) held per op" in r["comm_model"]
    assert r["outputs_equal"] is True
    assert all(p["peer_cycle_ok"] is True for p in r["policies"])


@pytest.mark.parametrize(
    ("step_ms", "expected"),
    [
        (2.5, (36, 8)),  # small work: many short blocks, 8 x 36 steps (0.72 s)
        (10.0, (9, 8)),  # blocks of about 0.09 s, 8 of them
        (40.0, (8, 3)),  # at least the benchmark's own 8 steps x 3 repetitions
        (200.0, (8, 3)),
    ],
)
def test_work_points_run_short_interleaved_blocks(
    monkeypatch: pytest.MonkeyPatch, step_ms: float, expected: tuple[int, int]
) -> None:
    """A work point's blocks (timed steps per policy and repetition) and
    repetitions follow its serial step time: with wall-clock kernels a
    serial probe's; with modelled ones the model's, and no probe runs."""
    from dataclasses import replace

    from camp2p_overlap.tools.bench import sweep
    from camp2p_overlap.tools.bench.runner import BenchRun, resolve_params

    params = replace(resolve_params({"layers": 4}, "ffn-bound"), steps=8, warmup=2, reps=3, comm_ratio=None)
    per_layer_us = step_ms * 1e3 / params.layers
    probes: list[Any] = []

    def fake_bench(p: Any) -> BenchRun:
        probes.append(p)
        return BenchRun({"policies": [{"policy": "serial", "per_layer_us": {"median": per_layer_us}}]}, {})

    monkeypatch.setattr(sweep, "run_bench", fake_bench)
    wall = replace(params, timing="wall")
    assert sweep.work_run(wall, sweep.WORK_TIMED_S) == expected
    (probe,) = probes
    assert probe.policies == ("serial",) and probe.reps == 1
    # modelled: the FFN's rating and the link model give the step (no link, no attention here)
    modelled = replace(params, link_latency_us=0.0, link_gbps=1e9, attn_us=0.0)
    assert modelled.timing_mode()[0] == "model"
    per_kernel_s = step_ms * 1e-3 / (modelled.layers * modelled.stages)
    monkeypatch.setattr(sweep, "rated_shape_s", lambda shape, tokens: per_kernel_s)
    step_s = sweep.modelled_serial_step_s(modelled)
    assert step_s == pytest.approx(step_ms * 1e-3, rel=1e-3)
    assert sweep.work_run(modelled, sweep.WORK_TIMED_S) == expected
    assert len(probes) == 1, "a modelled work point ran a probe"


# ---------------------------------------------------------------------------
# graph mode: World.capture, bench --graph, sweep --graph

#: A --graph run's policies on --device cpu (the default set less e2a-only and comm-side-fixed, whose comm on side
#: streams the emulated device refuses to capture while it stands in for torch.npu).
GRAPH_POLICIES = ["serial", "overlap", "compute-side-fixed"]
GRAPH_SKIPPED = ["e2a-only", "comm-side-fixed"]
GRAPH_CHOICE_KEYS = {
    "decision": (str, type(None)),
    "replays": dict,
    "timed_replays": dict,
    "serial_median_ms": (float, type(None)),
    "overlap_median_ms": (float, type(None)),
    "samples": dict,
    "capture_failures": dict,
}


def _graph_world() -> Any:
    return build_world(WorldSpec(layers=3, stage_ids=(0, 1), tokens=8, shape=SHAPE, op_timeout_s=10.0, graph=True))


@pytest.mark.usefixtures("standin_stack")
@pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])
def test_world_capture_replays_bitwise_equal_to_eager_serial(overlapped: bool) -> None:
    """WorldSpec.graph installs the emulated device as torch.npu and builds
    the runner on upstream's graph path; World.capture runs warm-up then
    capture; run_step replays the key (the graph's replay count moves) and
    every replay equals the eager serial step of the same step id, with
    the patch layer applied and after it is unpatched; take_graph hands the key
    back to eager steps."""
    was_npu = device.is_torch_npu()
    w = _graph_world()
    graph = None
    try:
        assert device.is_torch_npu() and w.runner.use_aclgraph
        serial = {}
        for sid in (3, 4):  # nothing captured yet: eager serial steps
            w.steps_run = sid
            serial[sid] = w.run_step()
        if overlapped:
            apply_cpu(graph=True)
        graph = w.capture(warmups=1)
        side = {name for name, _, _ in graph.nodes()} & {"K0", "K1", "F"}
        assert side == ({"F"} if overlapped else set()), side  # compute-side: the FFN on the runner's side stream
        assert w.capture() is graph, "one graph per key: a second capture keeps the first"
        for n, sid in enumerate((4, 3), start=1):
            w.steps_run = sid
            assert_same(w.run_step(), serial[sid], f"replay of step {sid}, layer applied")
            assert graph.replays == n
        if overlapped:
            assert PATCH_LAYER.engine.unpatch(timeout=10)
        for n, sid in enumerate((3, 4, 3), start=3):
            w.steps_run = sid
            assert_same(w.run_step(), serial[sid], f"replay of step {sid}, layer unpatched")
            assert graph.replays == n
        entry = w.take_graph()
        assert entry is not None and entry["graph"] is graph and w.take_graph() is None
        w.steps_run = 4
        assert_same(w.run_step(), serial[4], "eager again after take_graph")
        assert graph.replays == 5, "a taken graph is not replayed"
        w.put_graph(entry)
        w.steps_run = 4
        assert_same(w.run_step(), serial[4], "replay after put_graph")
        assert graph.replays == 6
    finally:
        if graph is not None:
            graph.reset()
        w.close()
    assert device.is_torch_npu() is was_npu, "World.close removes the torch.npu that build_world installed"


def test_world_capture_needs_the_graph_path() -> None:
    w = build_world(_tiny_spec())
    assert not w.runner.use_aclgraph and not w.installed_torch_npu
    with pytest.raises(RuntimeError, match="use_aclgraph"):
        w.capture()


@pytest.fixture(scope="module")
def graph_bench(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny ``bench --graph`` run through ``main(argv)``."""
    out = tmp_path_factory.mktemp("graph") / "g.json"
    was_npu = device.is_torch_npu()
    rc = cli.main(["bench", *TINY, "--graph", "--json", str(out)])
    return {"rc": rc, "report": json.loads(out.read_text()), "was_npu": was_npu, "npu_after": device.is_torch_npu()}


def _assert_replays_honour_the_model(r: dict[str, Any]) -> None:
    """Each fixed policy's counts are its replays' only (2 reps x (1 warm-up
    + 2 timed) replays x 2 layers x 2 stages of FFN, A2E and E2A kernels),
    each FFN held to the model captured with it."""
    (point,) = r["timing"]["ffn"]["points"]
    for p in r["policies"]:
        kinds = p["timing"]["by_kind"]
        assert set(kinds) == {"ffn", "a2e", "e2a"}, p["policy"]
        ffn = kinds["ffn"]
        assert ffn["modelled_us"] == pytest.approx(ffn["kernels"] * point["model_us"], rel=1e-3)
        if p["policy"] in ("e2a-only", "compute-side-fixed", "comm-side-fixed"):
            assert ffn["kernels"] == kinds["a2e"]["kernels"] == kinds["e2a"]["kernels"] == 6 * 2 * 2, p["policy"]


def test_bench_graph_json_schema_and_bitwise_replays(graph_bench: dict[str, Any]) -> None:
    assert graph_bench["rc"] == 0
    r = graph_bench["report"]
    _check_keys(r, TOP_KEYS, "report")
    _check_keys(r["env"], ENV_KEYS, "env")
    assert r["graph"] is True and r["params"]["graph"] is True and r["world"] == "host"
    # adaptive overlap runs in graph mode (both variants); comm on side streams is not captured on the emulated NPU
    assert [s["policy"] for s in r["skipped_policies"]] == GRAPH_SKIPPED
    assert all(s["why"] == GRAPH_COMM_ON_THE_EMULATED_NPU for s in r["skipped_policies"])
    _check_keys(r["graph_pool"], GRAPH_POOL_KEYS, "graph_pool")
    assert r["graph_pool"]["one_pool"] is True and r["graph_pool"]["graphs"] == 4, r["graph_pool"]
    assert [p["policy"] for p in r["policies"]] == GRAPH_POLICIES
    assert r["outputs_equal"] is True
    for p in r["policies"]:
        _check_keys(p, POLICY_KEYS, f"policies[{p['policy']}]")
        adaptive = p["policy"] == "overlap"
        # 2 reps x 2 timed replays; one graph (one key) each, two variants for adaptive overlap
        assert p["replays"] == 4 and p["samples"] == 4, p
        assert p["captured_variants"] == (2 if adaptive else 1), p
        _check_keys(p["capture"], CAPTURE_KEYS, f"policies[{p['policy']}].capture")
        assert p["capture"]["graphs"] == p["captured_variants"] and p["capture"]["pools"] == [r["graph_pool"]["pool"]]
        assert p["outputs_equal"] is True and p["mismatches"] == [] and p["adaptive"] is adaptive
        assert p["engaged"] is (p["policy"] != "serial")
        assert (p["graph_choice"] is not None) is adaptive
    _assert_replays_honour_the_model(r)
    by = {p["policy"]: p for p in r["policies"]}
    # every replay (2 reps x (1 warm-up + 2 timed)) against the eager serial step;
    # serial also its 2 reps x 2 traced eager steps
    for name in ("overlap", "compute-side-fixed"):
        assert by[name]["compared_steps"] == 6, by[name]
        assert by[name]["edges_checked"] is False and by[name]["edges_ok"] is None, "replays leave no trace"
        assert by[name]["speedup_ci95"] is not None
    assert by["serial"]["compared_steps"] == 6 + 4
    assert by["serial"]["edges_checked"] is True and by["serial"]["edges_ok"] is True
    assert by["serial"]["peer_cycle_ok"] is True
    choice = by["overlap"]["graph_choice"]
    _check_keys(choice, GRAPH_CHOICE_KEYS, "graph_choice")
    assert choice["decision"] in ("learning", "serial", "overlap") and choice["capture_failures"] == {}
    assert set(choice["replays"]) == set(choice["timed_replays"]) == {"serial", "overlap"}
    # Its graph counted its own replays only (6), not the fixed graphs' that
    # replayed while its patch layer was applied; 4 of them timed.
    assert sum(choice["replays"].values()) == 6 and sum(choice["timed_replays"].values()) == 4, choice
    assert all(choice["replays"][v] >= choice["timed_replays"][v] for v in ("serial", "overlap"))
    assert choice["replays"]["serial"] >= 1 and choice["replays"]["overlap"] >= 1, "learning replays both"
    assert r["measured"]["samples"] == 16 and r["measured"]["f_us"] > 0
    assert graph_bench["npu_after"] is graph_bench["was_npu"], "the run removes the torch.npu it installed"
    assert not device.capture_in_progress()
    assert not PATCH_LAYER.engine.is_applied()


@pytest.mark.usefixtures("standin_stack")
def test_fixed_graphs_replay_unchanged_while_the_adaptive_graph_layer_is_applied() -> None:
    """The scheme of bench --graph: a fixed overlap graph captured under its
    own patch layer, unpatched; then adaptive overlap's key captured with both
    variants, its patch layer kept applied. The fixed graph's replays are bitwise
    the eager serial steps and go past the applied layer entirely (no eager
    step, no replay counted there); the adaptive graph's replays count on
    its own key; unpatch restores upstream's graph in its entry."""
    w = _graph_world()
    fixed_patch_layer, adaptive_patch_layer = emulated_patch_layer(), emulated_patch_layer()
    graphs: list[Any] = []
    try:
        serial = {}
        for sid in range(1, 9):
            w.steps_run = sid
            serial[sid] = w.run_step()
        fixed_patch_layer.engine.apply(
            strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, graph="1")
        )
        try:
            fixed = w.capture()
            fixed_entry = w.take_graph()
        finally:
            assert fixed_patch_layer.engine.unpatch(timeout=10)
        graphs.append(fixed)
        assert "F" in {name for name, _, _ in fixed.nodes()}  # compute-side: the FFN on its side stream
        adaptive_patch_layer.engine.apply(
            strict=True, config=OverlapConfig(enabled=True, backend="cpu", adaptive=True, graph="adaptive")
        )
        try:
            chooser = w.capture()
            adaptive_entry = w.take_graph()
            assert isinstance(chooser, VariantGraph) and adaptive_entry is not None
            upstream = chooser.captured.upstream
            graphs.append(upstream)
            before = adaptive_patch_layer.runtime.stats()
            (g_before,) = before["graphs"]
            w.put_graph(fixed_entry)
            for n, sid in enumerate(range(1, 9), start=1):
                w.steps_run = sid
                assert_same(w.run_step(), serial[sid], f"fixed graph's replay of step {sid}, adaptive layer applied")
                assert fixed.replays == n
            after = adaptive_patch_layer.runtime.stats()
            assert after["steps"] == before["steps"], "no eager step went through the applied layer"
            assert after["graphs"] == [g_before], "nor did its graph count a replay"
            assert chooser.captured.replays == {"serial": 0, "overlap": 0}
            w.take_graph()
            w.put_graph(adaptive_entry)
            for sid in range(1, 9):
                w.steps_run = sid
                assert_same(w.run_step(), serial[sid], f"adaptive graph's replay of step {sid}")
            assert sum(chooser.captured.replays.values()) == 8 and fixed.replays == 8
            (g_after,) = adaptive_patch_layer.runtime.stats()["graphs"]
            assert g_after["replays"] == chooser.captured.replays
            w.take_graph()
        finally:
            assert adaptive_patch_layer.engine.unpatch(timeout=10)
        assert adaptive_entry["graph"] is upstream, "unpatch puts upstream's serial graph back"
    finally:
        for graph in graphs:
            graph.reset()
        w.close()


def test_bench_graph_table_says_what_it_measured(graph_bench: dict[str, Any]) -> None:
    from camp2p_overlap.tools.bench.tables import bench_table

    text = bench_table(graph_bench["report"])
    assert "graph mode (--graph)" in text
    for name in GRAPH_SKIPPED:
        assert f"not run: {name}: its layout puts CAM comm (A2E/E2A) on side streams" in text
    choice = next(p for p in graph_bench["report"]["policies"] if p["policy"] == "overlap")["graph_choice"]
    assert f"overlap's graph (serial and overlap variants, chosen per replay): decision {choice['decision']}" in text
    assert "FAILED" not in text


def test_bench_graph_fails_when_the_adaptive_graph_has_one_variant(graph_bench: dict[str, Any]) -> None:
    from camp2p_overlap.tools.bench.tables import problems

    report = json.loads(json.dumps(graph_bench["report"]))
    (p,) = [p for p in report["policies"] if p["policy"] == "overlap"]
    p["captured_variants"] = 1
    p["graph_choice"]["capture_failures"] = {"CaptureViolation: boom": 1}
    assert problems(report) == ["overlap: its decode graph's overlap variant was not captured (CaptureViolation: boom)"]


def test_bench_graph_outputs_flag_fails_when_a_captured_step_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Perturb the FFN only while a session with A2E on side streams is
    active (compute-side-fixed's warm-up and capture): its replays must differ
    from the eager serial steps, and the report must say so."""
    _perturb_the_ffn_under_a2e_side_sessions(monkeypatch)
    run = run_bench(resolve_params({**TINY_PARAMS, "reps": 1, "graph": True}))
    by = {p["policy"]: p for p in run.report["policies"]}
    assert by["serial"]["outputs_equal"] is True
    assert by["compute-side-fixed"]["outputs_equal"] is False and by["compute-side-fixed"]["mismatches"]
    # adaptive overlap: its serial variant is upstream's capture (no session), its overlap variant differs
    replays = by["overlap"]["graph_choice"]["replays"]
    assert by["overlap"]["captured_variants"] == 2 and replays["overlap"] >= 1, replays
    assert by["overlap"]["outputs_equal"] is False and by["overlap"]["mismatches"]
    assert run.report["outputs_equal"] is False


def test_bench_graph_reports_a_failed_second_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adaptive overlap's key keeps upstream's graph when the patch layer's second
    capture fails: one variant, no decision, the reason, and a failed run."""
    from camp2p_overlap.core.overlap import graphs
    from camp2p_overlap.tools.bench.tables import problems

    monkeypatch.setattr(graphs.GraphCapture, "second", lambda self, *a, **kw: self.failed("injected: no second graph"))
    run = run_bench(resolve_params({**TINY_PARAMS, "reps": 1, "graph": True}))
    (p,) = [p for p in run.report["policies"] if p["policy"] == "overlap"]
    assert p["captured_variants"] == 1 and p["engaged"] is False and p["outputs_equal"] is True
    choice = p["graph_choice"]
    assert choice["decision"] is None and choice["capture_failures"] == {"injected: no second graph": 1}
    assert choice["timed_replays"] == {"serial": 0, "overlap": 0} and p["replays"] == 2
    assert problems(run.report) == [
        "overlap: its decode graph's overlap variant was not captured (injected: no second graph)"
    ]


def test_bench_graph_on_npu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--device", "npu", "--graph", *TINY]) == 2
    err = capsys.readouterr().err
    assert "--device npu: --graph runs on --device cuda (CUDA graphs) and --device cpu" in err


def test_bench_graph_on_cuda_passes_validation_and_stops_only_for_the_device(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: test_bench_graph_on_cuda runs it")
    assert cli.main(["bench", "--device", "cuda", "--graph", *TINY]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: torch.cuda reports no CUDA device" in err and "--graph" not in err, err


def test_device_world_with_comm_cores_on_the_cpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--device-world", "--comm-cores", "2", *TINY]) == 2
    assert "--comm-cores needs --device cuda" in capsys.readouterr().err


def test_sweep_graph_measures_work_points_in_graph_mode_too(tmp_path: Path) -> None:
    md, js = tmp_path / "s.md", tmp_path / "s.json"
    args = ["sweep", *TINY, "--reps", "1", "--ratios", "", "--stage-counts", "", "--comm-core-points", "none"]
    rc = cli.main([*args, "--work-tokens", "2", "--work-hidden", "16", "--graph", "--md", str(md), "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert data["graph"] is True and data["env"]["switch_interval_s"] == TOOL_SWITCH_INTERVAL_S
    (pt,) = data["work_points"]
    eager, graph = pt["report"], pt["graph_report"]
    assert eager["graph"] is False
    assert [p["policy"] for p in eager["policies"]] == ["serial", "overlap", "compute-side-fixed", "comm-side-fixed"]
    assert graph["graph"] is True
    assert [p["policy"] for p in graph["policies"]] == ["serial", "overlap", "compute-side-fixed"]
    assert graph["params"]["steps"] == eager["params"]["steps"] and graph["params"]["reps"] == eager["params"]["reps"]
    assert graph["outputs_equal"] is True
    assert [s["policy"] for s in graph["skipped_policies"]] == ["comm-side-fixed"]
    assert {p["policy"]: p["captured_variants"] for p in graph["policies"]} == {
        "serial": 1,
        "overlap": 2,
        "compute-side-fixed": 1,
    }
    (adaptive,) = [p for p in graph["policies"] if p["policy"] == "overlap"]
    assert adaptive["graph_choice"]["decision"] in ("learning", "serial", "overlap")
    assert sum(adaptive["graph_choice"]["timed_replays"].values()) == adaptive["replays"] > 0
    text = md.read_text()
    assert "The same work points in graph mode" in text
    assert "Adaptive `overlap`'s graph at its slowest: " in text and "goal of at least 0.97x" in text
    rows = [line for line in text.splitlines() if line.startswith("| 16 / 2 ")]
    assert len(rows) == 2, "the work point in the eager table and in the graph table"
    assert "Not run here: `comm-side-fixed`: its layout puts CAM comm (A2E/E2A) on side streams" in text


# ---------------------------------------------------------------------------
# graph mode on the device world: the --device cuda code path on the emulated
# device (static attention buffers, results read after the replay, the peer
# as device work), whose capture rules the emulated device enforces

DEVICE_GRAPH = {**TINY_PARAMS, "graph": True, "device_world": True}


@pytest.fixture(scope="module")
def device_graph_bench(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny ``bench --graph --device-world --json`` through ``main(argv)``,
    with every JSON write (partial reports, then the final one) and every
    graph capture of the emulated device (its pool, whether it ended) seen."""
    from camp2p_overlap.emulation.device.capture import Graph
    from camp2p_overlap.tools.bench import tables

    out = tmp_path_factory.mktemp("device-graph") / "g.json"
    writes: list[dict[str, Any]] = []
    captures: list[dict[str, Any]] = []
    real_write, real_begin, real_end = tables.write_json, Graph.capture_begin, Graph.capture_end

    def write(path: Any, data: Any) -> None:
        writes.append(json.loads(json.dumps(data, allow_nan=False)))  # strict JSON, as written
        real_write(path, data)

    def begin(self: Any, pool: Any = None, capture_error_mode: str = "global") -> None:
        captures.append({"graph": id(self), "pool": pool, "ended": False})
        real_begin(self, pool=pool, capture_error_mode=capture_error_mode)

    def end(self: Any) -> None:
        real_end(self)
        next(c for c in reversed(captures) if c["graph"] == id(self))["ended"] = True

    was_npu = device.is_torch_npu()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tables, "write_json", write)
        mp.setattr(Graph, "capture_begin", begin)
        mp.setattr(Graph, "capture_end", end)
        rc = cli.main(["bench", *TINY, "--graph", "--device-world", "--json", str(out)])
    return {
        "rc": rc,
        "report": json.loads(out.read_text()),
        "writes": writes,
        "captures": captures,
        "npu_restored": device.is_torch_npu() is was_npu,
    }


def test_device_world_graph_replays_are_bitwise_the_eager_serial_steps(device_graph_bench: dict[str, Any]) -> None:
    assert device_graph_bench["rc"] == 0
    r = device_graph_bench["report"]
    assert r["device"] == "cpu" and r["backend"] == "cpu" and r["world"] == "device" and r["graph"] is True
    assert r["comm_model"].startswith("host reference") and r["attn_modeled"] is True
    assert r["outputs_equal"] is True
    by = {p["policy"]: p for p in r["policies"]}
    assert list(by) == GRAPH_POLICIES
    assert [s["policy"] for s in r["skipped_policies"]] == GRAPH_SKIPPED
    for name, p in by.items():
        # 2 reps x 2 timed replays; every replay (2 reps x (1 warm-up + 2 timed)) against the eager serial
        # step of its step id; serial's graph also its 2 reps x 2 eager traced steps
        assert p["replays"] == 4 and p["samples"] == 4, p
        assert p["compared_steps"] == 6 + (4 if name == "serial" else 0), p
        assert p["outputs_equal"] is True and p["mismatches"] == [], p
        assert p["engaged"] is (name != "serial"), p
    assert by["serial"]["peer_cycle_ok"] is True and by["serial"]["peer_cycle_checked_steps"] == 4
    assert r["timing"]["model"] == "model" and r["timing"]["comm_model"] is not None
    _assert_replays_honour_the_model(r)
    choice = by["overlap"]["graph_choice"]
    assert choice["capture_failures"] == {} and sum(choice["timed_replays"].values()) == 4, choice
    assert device_graph_bench["npu_restored"], "the run removes the torch.npu it installed"
    assert not device.capture_in_progress() and not PATCH_LAYER.engine.is_applied()


def test_device_world_graph_captures_each_policy_once_in_one_pool(device_graph_bench: dict[str, Any]) -> None:
    r = device_graph_bench["report"]
    pool = r["graph_pool"]
    _check_keys(pool, GRAPH_POOL_KEYS, "graph_pool")
    assert pool["one_pool"] is True and pool["pools_seen"] == [pool["pool"]] and pool["graphs"] == 4, pool
    assert pool["memory"].startswith("not measured: the emulated device keeps no memory pool")
    for p in r["policies"]:
        c = p["capture"]
        _check_keys(c, CAPTURE_KEYS, f"policies[{p['policy']}].capture")
        assert c["graphs"] == p["captured_variants"] == (2 if p["policy"] == "overlap" else 1), p
        assert c["pools"] == [pool["pool"]] and c["seconds"] > 0, c
        assert c["pool_bytes"] is None and c["device_free_bytes"] is None and c["allocated_bytes"] is None
    # Independently, what the emulated device saw: 4 captures (serial and compute-side-fixed once each,
    # adaptive overlap's two variants), each ended (no violation), each into the same pool.
    caps = device_graph_bench["captures"]
    assert len(caps) == 4 and all(c["ended"] for c in caps), caps
    assert len({c["graph"] for c in caps}) == 4, "a graph captured twice"
    assert {repr(c["pool"]) for c in caps} == {pool["pool"]}, caps


def test_device_world_graph_run_writes_partial_reports_as_it_goes(device_graph_bench: dict[str, Any]) -> None:
    """--json is written after the captures and after each repetition (strict
    JSON, "partial": true), then the final report: a run cut short leaves
    what it measured."""
    writes = device_graph_bench["writes"]
    assert [w["progress"] for w in writes] == ["captures", "repetition 1 of 2", "repetition 2 of 2", "done"]
    assert [w["partial"] for w in writes] == [True, True, True, False]
    captured, first = writes[0], writes[1]
    _check_keys(captured, TOP_KEYS, "partial report")
    assert all(p["samples"] == 0 and p["speedup"] is None for p in captured["policies"])
    assert all(p["capture"] is not None for p in captured["policies"]) and captured["graph_pool"]["one_pool"]
    # After the first repetition: replay times, speedups and bitwise checks; eta waits for serial's traced
    # steps, which adaptive overlap's held layer defers to the end.
    assert all(p["samples"] == 2 and p["speedup"] is not None for p in first["policies"]), first["policies"]
    assert first["measured"]["f_us"] is None and all(p["eta"] is None for p in first["policies"])
    assert writes[-1] == device_graph_bench["report"]


def test_device_world_results_are_snapshots_and_inputs_follow_the_step_id() -> None:
    """The device world's static buffers, eagerly and under replay: each
    step id's attention inputs are its own (two ids give different
    outputs), a step's results are a snapshot (a later step does not change
    them), and a graph replayed for another step id gives that id's eager
    outputs (its inputs were copied in before the replay, not captured)."""
    from camp2p_overlap.emulation.kernel_world import EMULATED, build_device_world
    from camp2p_overlap.emulation.standin_patch_layer import release_site, standin_site

    site = standin_site()
    spec = WorldSpec(layers=3, stage_ids=(0, 1), tokens=8, shape=SHAPE, op_timeout_s=10.0, graph=True)
    dw = build_device_world(spec, EMULATED, root=site.root)
    graph = None
    try:
        w = dw.world

        def step(sid: int) -> dict:
            w.steps_run = sid - 1
            out = w.run_step()
            dw.synchronize()
            return out

        first = step(3)
        kept = {k: v.clone() for k, v in first.items()}
        second = step(4)
        assert any(not torch.equal(first[k], second[k]) for k in first), "the inputs do not depend on the step id"
        assert_same(first, kept, "a later step changed an earlier step's results")
        w.steps_run = 2
        graph = w.capture(warmups=1)  # a warm-up at step id 3, the capture at 4
        dw.synchronize()
        for sid, ref in ((3, first), (4, second), (3, first)):
            assert_same(step(sid), ref, f"replay for step id {sid}")
        assert graph.replays == 3
    finally:
        if graph is not None:
            graph.reset()
        dw.close()
        release_site(site)


def test_device_world_host_read_inside_the_capture_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check that would catch a regression: the same device-world graph
    run, with one host read of a device buffer in the A2E (the peer's
    record, which the comm kernel writes) injected. Eager steps read it
    freely; inside the capture the emulated device raises CaptureViolation
    and the run fails with it."""
    from camp2p_overlap.emulation.kernel_world import DeviceTransport

    real_a2e = DeviceTransport.a2e
    reads = {"eager": 0}

    def a2e_reading_the_peer_on_the_host(self: DeviceTransport, **kw: Any) -> Any:
        out = real_a2e(self, **kw)
        int(self.rec[0, kw["stage"], 0, 2])  # a host read of what this step's comm kernel writes
        reads["eager"] += 1
        return out

    monkeypatch.setattr(DeviceTransport, "a2e", a2e_reading_the_peer_on_the_host)
    was_npu = device.is_torch_npu()
    with pytest.raises(emulated_device.CaptureViolation, match="host read of a tensor a captured kernel writes"):
        run_bench(resolve_params({**DEVICE_GRAPH, "reps": 1}))
    assert reads["eager"] >= 2 * 2 * 3, "the eager reference steps read it (outside any capture)"
    assert not device.capture_in_progress() and device.is_torch_npu() is was_npu
    assert not PATCH_LAYER.engine.is_applied()


def test_capture_memory_is_measured_around_the_capture_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device gives memory figures (CUDA), each policy's capture
    reports what its capture step alone added: pool bytes and allocated
    bytes after minus before, free bytes before minus after; the report
    names the source. Here a fake meter, read before and after each capture
    step, stands in for torch.cuda's."""
    from camp2p_overlap.tools.bench import runner

    real_handle = runner._device_handle
    reads: list[str] = []

    def handle_with_a_meter(params: Any, root: str) -> Any:
        h = real_handle(params, root)

        def meter(pool: Any) -> dict[str, int | None]:
            reads.append(repr(pool))
            n = len(reads)  # each read: 1 MiB more in the pool and allocated, 3 MiB less free
            return {"pool": n << 20, "allocated": n << 20, "free": (1 << 34) - 3 * n * (1 << 20)}

        h.memory = meter
        return h

    monkeypatch.setattr(runner, "_device_handle", handle_with_a_meter)
    r = run_bench(resolve_params({**DEVICE_GRAPH, "reps": 1, "policies": ["serial", "compute-side-fixed"]})).report
    assert len(reads) == 4 and len(set(reads)) == 1, reads  # before and after each of the two captures, one pool
    for p in r["policies"]:
        c = p["capture"]
        assert (c["pool_bytes"], c["allocated_bytes"], c["device_free_bytes"]) == (1 << 20, 1 << 20, 3 << 20), c
    assert r["graph_pool"]["memory"].startswith("pool_bytes: what the capture added to the segments of the one")


def test_cuda_memory_counts_the_segments_of_the_graph_pool_only() -> None:
    from types import SimpleNamespace

    from camp2p_overlap.tools.bench.runner import _cuda_memory

    calls: list[str] = []
    segments = [
        {"total_size": 2 << 20, "segment_pool_id": (0, 7)},
        {"total_size": 4 << 20, "segment_pool_id": (0, 0)},  # the default pool
        {"total_size": 20 << 20, "segment_pool_id": (0, 7)},
        {"total_size": 8 << 20, "segment_pool_id": (0, 9)},  # another graph pool
    ]
    mod = SimpleNamespace(
        synchronize=lambda: calls.append("sync"),
        empty_cache=lambda: calls.append("empty_cache"),
        mem_get_info=lambda: (123 << 20, 140 << 30),
        memory_allocated=lambda: 5 << 20,
        memory_snapshot=lambda: segments,
    )
    got = _cuda_memory(mod)((0, 7))
    assert got == {"free": 123 << 20, "allocated": 5 << 20, "pool": 22 << 20}
    assert calls == ["sync", "empty_cache"], "measured after a synchronize and empty_cache"


@pytest.mark.gpu
def test_bench_graph_on_cuda(tmp_path: Path) -> None:
    """``bench --device cuda --graph``: every policy captured with
    torch.cuda.CUDAGraph in the runner's one pool, replays bitwise equal to
    the eager serial steps, the capture memory measured."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False")
    out = tmp_path / "g.json"
    assert cli.main(["bench", "--device", "cuda", "--graph", *TINY, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["world"] == "device" and r["backend"] == "cuda" and r["partial"] is False
    # on cuda every policy is captured: comm on side streams too (graph_comm_side); 6 graphs with overlap's two
    assert r["outputs_equal"] is True and r["graph_pool"]["one_pool"] is True and r["graph_pool"]["graphs"] == 6
    assert r["skipped_policies"] == []
    by = {p["policy"]: p for p in r["policies"]}
    assert by["serial"]["engaged"] is False
    for name in ("e2a-only", "compute-side-fixed", "comm-side-fixed"):
        assert by[name]["engaged"] is True, name
    assert by["overlap"]["captured_variants"] == 2, by["overlap"]["graph_choice"]
    for p in r["policies"]:
        assert isinstance(p["capture"]["pool_bytes"], int) and p["capture"]["pool_bytes"] >= 0, p["capture"]
        assert p["peer_cycle_ok"] is not False


def test_adaptive_overlap_is_reported_at_its_steady_state_and_its_learning_apart() -> None:
    """Once adaptive engage decides, the policy's figures are its steps after
    the decision; the learning steps (warm-ups included) are reported apart
    with their paths and their cost against the steady state."""
    params = resolve_params({**TINY_PARAMS, "steps": 14, "reps": 1, "policies": ("serial", "overlap")})
    run = run_bench(params)
    (p,) = [p for p in run.report["policies"] if p["policy"] == "overlap"]
    learn = p["learning"]
    assert learn["decision"] in ("compute-side", "serial"), learn
    # both paths learned: min_samples (3) each, plus the dropped first overlap step
    assert set(learn["paths"]) == {"compute-side", "serial"}
    assert learn["paths"]["compute-side"] >= 4 and learn["paths"]["serial"] >= 3
    assert sum(learn["paths"].values()) == learn["steps"]
    timed_learning = learn["steps"] - params.warmup
    assert p["samples"] == params.steps - timed_learning > 0  # the steady state only
    assert isinstance(learn["extra_us_per_layer"], float)
    assert not any("still learning" in n for n in p["noise"])
    table = bench_table(run.report)
    assert f"its row is its steady state, after it decided {learn['decision']}" in table


# ---------------------------------------------------------------------------
# the layouts side by side, the fill/drain floor, the contention model on and
# off, coupled attention, the comm-heavy preset


def test_each_policy_configures_its_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    """Every policy's patch layer config: the layouts it lists (the rung they make), adaptive engage, and in
    graph mode the comm-side opt-in exactly where comm runs on side streams."""
    from camp2p_overlap.core.overlap.plan import rung

    cfg = {name: p.config("cpu") for name, p in POLICIES.items()}
    assert cfg.pop("serial") is None
    rungs = {name: (rung(c), c.adaptive) for name, c in cfg.items()}
    assert rungs == {
        "e2a-only": ("e2a-only", False),
        "overlap": ("compute-side", True),
        "compute-side-fixed": ("compute-side", False),
        "comm-side": ("comm-side", True),
        "comm-side-fixed": ("comm-side", False),
        "both": ("compute-side,comm-side", True),
    }
    graph = {name: p.config("cpu", graph=True) for name, p in POLICIES.items() if p.layouts is not None}
    assert {name: c.graph_comm_side for name, c in graph.items()} == {
        "e2a-only": True,
        "overlap": False,
        "compute-side-fixed": False,
        "comm-side": True,
        "comm-side-fixed": True,
        "both": False,  # a decode graph captures the first listed layout: compute-side
    }
    assert {name: c.graph for name, c in graph.items()} == {
        name: "adaptive" if POLICIES[name].adaptive else "1" for name in graph
    }
    assert all(not c.graph_comm_side and c.graph == "0" for c in cfg.values()), "eager configs capture nothing"
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *TINY, "--policies", "serial,overlap-fixed"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "overlap-fixed is now compute-side-fixed" in err, err


def test_what_a_run_leaves_out_and_why() -> None:
    from dataclasses import replace

    from camp2p_overlap.tools.bench.runner import COUPLED_COMPUTE_SIDE, GRAPH_ONE_ADAPTIVE, policy_skips

    every = resolve_params({**TINY_PARAMS, "policies": list(POLICIES)})
    assert policy_skips(every) == {}
    npu = GRAPH_COMM_ON_THE_EMULATED_NPU
    one = GRAPH_ONE_ADAPTIVE.format(held="overlap")
    assert policy_skips(replace(every, graph=True)) == {
        "e2a-only": npu,
        "comm-side": npu,
        "comm-side-fixed": npu,
        "both": one,
    }
    # on cuda comm on side streams is captured (graph_comm_side); still one adaptive policy's layer held
    assert policy_skips(replace(every, graph=True, device="cuda")) == {"comm-side": one, "both": one}
    coupled = policy_skips(replace(every, attention="coupled"))
    assert coupled == dict.fromkeys(("overlap", "compute-side-fixed", "both"), COUPLED_COMPUTE_SIDE)


def test_the_fill_drain_floor_counts_the_steps_first_a2e_and_last_e2a() -> None:
    """The issue's main job: f 50.02 ms, a 8.47 ms, e 16.33 ms, 6 layers x 2 stages, attention 0.5 ms. Today's
    floor per layer is S*f = 100.04 ms, and adaptive overlap's 104.29 ms reads as eta 0.92; the floor that
    counts the step's first A2E and last E2A is (a_0 + 12 f + e_1) / 6 = 104.17 ms, against which it is 1.00."""
    from camp2p_overlap.tools.bench.runner import _eta, _fill_drain_terms, _floor_terms

    f, a, e = 50.02e-3, {0: 8.47e-3, 1: 8.48e-3}, {0: 16.34e-3, 1: 16.33e-3}
    today = max(_floor_terms(f, a, e, (0, 1), 0.5e-3))
    compute, chain = _fill_drain_terms(f, a, e, (0, 1), 0.5e-3, 6)
    assert today == pytest.approx(100.04e-3)
    assert compute == pytest.approx((8.47 + 12 * 50.02 + 16.33) / 6 * 1e-3)  # stage 0's A2E, stage 1's E2A
    assert chain == pytest.approx((6 * (8.47 + 50.02 + 16.34) + 5 * 0.5) / 6 * 1e-3)
    assert _eta(150.09e-3, 104.29e-3, today) == pytest.approx(0.915, abs=1e-3)
    assert _eta(150.09e-3, 104.29e-3, max(compute, chain)) == pytest.approx(0.997, abs=1e-3)
    # a stage group's chain leaves out the attention after the step's last E2A: with one layer it is a+f+e
    assert _fill_drain_terms(f, a, e, (0, 1), 0.5e-3, 1)[1] == pytest.approx(8.47e-3 + f + 16.34e-3)


def test_layouts_compared_takes_the_better_layout_and_measures_the_adaptive_ones_against_it() -> None:
    from camp2p_overlap.tools.bench.runner import layouts_compared

    def p(name: str, us: float, adaptive: bool = False, layouts: list[str] | None = None) -> dict[str, Any]:
        return {"policy": name, "per_layer_us": {"median": us}, "adaptive": adaptive, "layouts": layouts}

    pols = [
        p("serial", 400.0),
        p("compute-side-fixed", 250.0),
        p("comm-side-fixed", 225.0),
        p("overlap", 252.0, True, ["compute-side"]),
        p("both", 230.0, True, ["compute-side", "comm-side"]),
    ]
    lc = layouts_compared(pols)
    assert lc is not None and lc["better"] == "comm-side" and lc["tolerance"] == 0.03
    assert lc["layouts"] == {
        "compute-side": {"policy": "compute-side-fixed", "per_layer_us": 250.0},
        "comm-side": {"policy": "comm-side-fixed", "per_layer_us": 225.0},
    }
    by = {a["policy"]: a for a in lc["adaptive"]}
    assert by["both"]["vs_better"] == pytest.approx(225 / 230, abs=1e-4) and by["both"]["within_tolerance"] is True
    assert by["overlap"]["vs_better"] == pytest.approx(225 / 252, abs=1e-4)
    assert by["overlap"]["within_tolerance"] is False
    # no fixed comm-side: its adaptive policy stands for it; neither: nothing to compare
    alt = layouts_compared([*pols[:2], p("comm-side", 240.0, True, ["comm-side"]), pols[3]])
    assert alt is not None and alt["layouts"]["comm-side"]["policy"] == "comm-side" and alt["better"] == "comm-side"
    assert layouts_compared(pols[:2]) is None


@pytest.fixture(scope="module")
def both_layouts_run() -> dict[str, Any]:
    """A tiny run with both layouts fixed and listed together (``both``), long enough for ``both`` to decide."""
    params = resolve_params(
        {
            **TINY_PARAMS,
            "steps": 16,
            "reps": 1,
            "policies": ["serial", "compute-side-fixed", "comm-side-fixed", "both"],
        }
    )
    return run_bench(params).report


def test_both_layouts_listed_learns_each_and_says_what_it_ran(both_layouts_run: dict[str, Any]) -> None:
    r = both_layouts_run
    by = {p["policy"]: p for p in r["policies"]}
    both = by["both"]
    assert both["layouts"] == ["compute-side", "comm-side"] and both["adaptive"] is True
    learn = both["learning"]
    assert set(learn["paths"]) == {"compute-side", "comm-side", "serial"}
    # each layout: min_samples (3) and its dropped first step; serial: min_samples
    assert learn["paths"]["compute-side"] >= 4 and learn["paths"]["comm-side"] >= 4 and learn["paths"]["serial"] >= 3
    assert learn["decision"] in ("compute-side", "comm-side", "serial"), learn
    assert set(both["layout_steps"]) <= {"compute-side", "comm-side", "serial"}
    assert sum(both["layout_steps"].values()) == both["samples"] > 0
    assert by["compute-side-fixed"]["layout_steps"] == {"compute-side": 16}
    assert by["comm-side-fixed"]["layout_steps"] == {"comm-side": 16}
    # the traced step's edges were checked against the layout it ran
    assert all(p["edges_ok"] is True for p in r["policies"]), [p["edge_violations"] for p in r["policies"]]
    assert r["outputs_equal"] is True
    lc = r["layouts_compared"]
    fixed = {k: by[f"{k}-fixed"]["per_layer_us"]["median"] for k in ("compute-side", "comm-side")}
    assert lc["better"] == min(fixed, key=fixed.__getitem__)
    (entry,) = lc["adaptive"]
    assert entry["policy"] == "both"
    assert entry["vs_better"] == pytest.approx(min(fixed.values()) / both["per_layer_us"]["median"], abs=1e-3)
    text = bench_table(r)
    words = " ".join(text.split())
    assert "layouts side by side: compute-side " in words and f"the better is {lc['better']}" in words
    assert "both (compute-side, comm-side listed): its timed steps ran " in words
    assert re.search(r"^comm-side-fixed +K_s/K_s/C ", text, re.M) and re.search(r"^both +C/C/F ", text, re.M)


def test_an_adaptive_step_in_a_layout_it_does_not_list_is_an_edge_violation() -> None:
    """The edge check of an adaptive policy's traced step follows the path it chose, one it lists or serial;
    anything else is flagged (and a fixed policy's must be its own layout)."""
    from camp2p_overlap.tools.bench.runner import _expected_layout

    assert _expected_layout("both", "comm-side", True) == ("comm-side", None)
    assert _expected_layout("overlap", "serial", True) == ("serial", None)
    layout, wrong = _expected_layout("overlap", "comm-side", True)
    assert layout == "comm-side" and wrong is not None and "which overlap does not list (compute-side)" in wrong
    assert _expected_layout("comm-side-fixed", "compute-side", True) == ("comm-side", None)
    assert _expected_layout("comm-side-fixed", "serial", False) == ("serial", None)  # the gate: one stage


def test_comm_cores_sweep_reports_the_contention_model_off_and_on(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    policies = "serial,compute-side-fixed,comm-side-fixed"
    argv = ["bench", *TINY, "--reps", "1", "--policies", policies, "--comm-cores-sweep", "0,1", "--json", str(out)]
    assert cli.main(argv) == 0
    r = json.loads(out.read_text())
    _check_keys(r, TOP_KEYS, "report")
    c = r["contention"]
    assert set(c) == {"values", "timing", "runs", "reports"} and c["values"] == [0, 1]
    assert r["params"]["comm_cores_sweep"] == [0, 1] and r["params"]["comm_cores"] == 0
    assert [run["comm_cores"] for run in c["runs"]] == [0, 1]
    assert [run["timing"] for run in c["runs"]] == ["wall", "wall"], "both runs on the same (wall-clock) timing"
    assert c["runs"][0]["comm_model"].startswith("time.sleep") and c["runs"][1]["comm_model"].startswith("busy-wait")
    assert r["timing"]["model"] == "wall" and c["timing"].startswith("every run on wall-clock kernels")
    (other,) = c["reports"]
    assert other["params"]["comm_cores"] == 1 and other["contention"] is None
    for run, report in zip(c["runs"], (r, other), strict=True):
        assert [p["policy"] for p in run["policies"]] == ["serial", "compute-side-fixed", "comm-side-fixed"]
        assert run["policies"][1]["per_layer_us"] == report["policies"][1]["per_layer_us"]["median"]
        assert run["floor_fill_drain_per_layer_us"] == report["measured"]["floor_fill_drain_per_layer_us"]
    assert r["outputs_equal"] is True and all(p["engaged"] for p in other["policies"][1:])
    text = bench_table(r)
    assert "Contention model side by side (--comm-cores-sweep;" in text
    assert "--comm-cores 0" in text and "--comm-cores 1" in text and "busy-wait on 1 core(s)" in text
    # a problem of another run fails the whole report
    from camp2p_overlap.tools.bench.tables import problems

    other["policies"][2]["outputs_equal"] = False
    other["policies"][2]["mismatches"] = ["rep 0 step 1: output of (layer 0, stage 0) differs"]
    assert problems(r) == ["--comm-cores 1: comm-side-fixed: outputs differ from the serial run (rep 0 step 1: "
                           "output of (layer 0, stage 0) differs)"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--comm-cores", "1", "--comm-cores-sweep", "0,1"], "give --comm-cores or --comm-cores-sweep, not both"),
        (["--comm-cores-sweep", "0,0"], "--comm-cores-sweep names a value twice"),
        (["--comm-cores-sweep", "0,99"], "--comm-cores-sweep 99 is out of range 0..64 on cpu"),
        (["--timing", "model", "--comm-cores-sweep", "0,1"], "--timing model excludes --comm-cores"),
        (["--attention", "coupled", "--graph"], "--attention coupled runs on the host world only"),
        (["--attention", "coupled", "--device-world"], "--attention coupled runs on the host world only"),
    ],
)
def test_contention_and_attention_flags_refuse_what_cannot_run(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", *TINY, *args]) == 2
    assert message in capsys.readouterr().err


def test_coupled_attention_leaves_compute_side_out_and_says_why() -> None:
    from camp2p_overlap.tools.bench.runner import COUPLED_COMPUTE_SIDE

    params = resolve_params(
        {**TINY_PARAMS, "reps": 1, "attention": "coupled", "policies": [*DEFAULT_POLICIES, "comm-side"]}
    )
    r = run_bench(params).report
    assert r["attention"] == "coupled"
    assert r["skipped_policies"] == [
        {"policy": "overlap", "why": COUPLED_COMPUTE_SIDE},
        {"policy": "compute-side-fixed", "why": COUPLED_COMPUTE_SIDE},
    ]
    by = {p["policy"]: p for p in r["policies"]}
    assert list(by) == ["serial", "e2a-only", "comm-side-fixed", "comm-side"]
    assert by["comm-side-fixed"]["engaged"] is True and by["e2a-only"]["engaged"] is True
    assert r["outputs_equal"] is True and all(p["edges_ok"] is True for p in r["policies"])
    assert all(p["peer_cycle_ok"] is True for p in r["policies"])
    assert r["layouts_compared"] is None, "no compute-side policy ran"
    text = bench_table(r)
    assert "not run: compute-side-fixed: with coupled attention" in text and "attention coupled" in text


def test_the_coupled_reason_holds_compute_side_stalls_until_the_op_timeout() -> None:
    """What the coupled skip says, shown: under coupled attention compute-side's step fails at the op timeout
    (A2E(L1, s0) on C waits for stage 1's E2A of L0, which C holds behind it), bounded, not hung; comm-side's
    completes, bitwise equal to serial."""
    from dataclasses import replace

    from camp2p_overlap.emulation.coupled import couple_stages
    from camp2p_overlap.emulation.world import PeerTimeoutError

    world = build_world(replace(_tiny_spec(), op_timeout_s=1.0))
    couple_stages(world)
    world.steps_run = 3
    serial = world.run_step()
    for layout, stalls in (("compute-side", True), ("comm-side", False)):
        patch_layer = emulated_patch_layer()
        cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False, layouts=(layout,))
        patch_layer.engine.apply(config=cfg, strict=True)
        try:
            world.steps_run = 3
            t0 = time.perf_counter()
            if stalls:
                with pytest.raises(PeerTimeoutError, match=r"a2e\(L1\) of stage 0: attention waits for e2a\(L0\)"):
                    world.run_step()
                assert time.perf_counter() - t0 < 20.0
            else:
                assert_same(world.run_step(), serial, f"{layout} under coupled attention")
        finally:
            assert patch_layer.engine.unpatch(timeout=10)


def test_the_comm_heavy_preset_puts_both_layouts_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    p = resolve_params({}, "comm-heavy")
    assert p.comm_ratio is not None and p.comm_ratio >= 1.0, "communication at or above the FFN"
    assert p.policies == ("serial", "overlap", "compute-side-fixed", "comm-side", "comm-side-fixed", "both")
    assert p.stages == 2 and p.timing_mode()[0] == "model"
    assert resolve_params({"policies": ["serial", "both"]}, "comm-heavy").policies == ("serial", "both")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "comm-heavy" in text and "communication above the FFN" in text


def _report_before_layouts(report: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``report`` as a run from before the layouts wrote it: no layouts' fields (ffn_side_stream,
    layout_steps, eta_fill_drain, the fill/drain floor and its noise notes, layouts_compared, contention,
    attention), and the fixed overlap policy named overlap-fixed."""
    old = json.loads(json.dumps(report))
    for key in ("layouts_compared", "contention", "attention"):
        del old[key]
    for key in ("floor_fill_drain_per_layer_us", "floor_fill_drain_terms"):
        del old["measured"][key]
    for p in old["policies"]:
        for key in ("layouts", "ffn_side_stream", "layout_steps", "eta_fill_drain", "eta_fill_drain_ci95"):
            del p[key]
        p["noise"] = [n for n in p["noise"] if "fill/drain" not in n]
        if p["policy"] == "compute-side-fixed":
            p["policy"] = "overlap-fixed"
    return old


def test_a_report_from_before_the_layouts_renders(bench_files: dict[str, Any]) -> None:
    """``camp2p-overlap docs`` renders the reports in docs/results/ until they are rerun: a report without the
    layouts' fields (no ffn_side_stream, layout_steps, eta_fill_drain, fill/drain floor, layouts_compared,
    contention, attention; the policy named overlap-fixed) renders as before, without the new columns."""
    old = _report_before_layouts(bench_files["report"])
    text = bench_table(old)
    assert "eta f/d" not in text and "fill/drain" not in text and "layouts side by side" not in text
    assert re.search(r"^overlap-fixed +C/C/C ", text, re.M), "the FFN on C when the report does not say"
    assert "overlap (adaptive) vs overlap-fixed:" in text and "FAILED" not in text


def test_the_headline_names_the_layouts_and_both_etas(bench_files: dict[str, Any]) -> None:
    """docs' headline quotes a report with the layouts named by their layout, each eta against both floors; a
    report from before them as it was."""
    from dataclasses import replace

    from support.child import REPO

    from camp2p_overlap.tools import docgen

    res = docgen.load_results(REPO)
    new = bench_files["report"]
    before = _report_before_layouts(new)
    res_before = replace(res, reports={**res.reports, "bench": before}, runs={**res.runs, "bench": before["run"]})
    old = docgen.headline_figures(res_before)
    assert "`overlap` " in old and "(compute-side, adaptive)" not in old and "against the fill/drain floor" not in old
    res = replace(res, reports={**res.reports, "bench": new}, runs={**res.runs, "bench": new["run"]})
    text = docgen.headline_figures(res)
    assert "`overlap` (compute-side, adaptive)" in text
    assert "`compute-side-fixed` " in text and "`comm-side-fixed` " in text and "`overlap-fixed`" not in text
    with_eta = [p for p in new["policies"] if p["eta"] is not None and p["eta_fill_drain"] is not None]
    assert with_eta, "the tiny run has something hideable"
    p = with_eta[0]
    assert f"(eta {p['eta']:.2f}; {p['eta_fill_drain']:.2f} against the fill/drain floor)" in text
