"""GPU figures that say what they measure, checked on the CPU:

* launch-bound or device-bound: the device world's traced steps carry each
  op's host span next to its device time; the bench reports the share
  (host time to issue / device time) of an FFN and of a step, and flags a
  launch-bound run. On the emulated device an FFN made slow on the host
  (before it is issued) is flagged, one made slow on the device is not;
* the GPU scenario's size: the device FFN issues the same few kernels
  whatever the experts (and equals the sparse CPU block), and the
  ``gpu-ffn-bound`` shapes give, by the estimate docs/validation.md makes,
  an FFN whose device time well exceeds its host time, FFN-bound;
* the sweep caps its contention points at what the device holds (two
  stages: two ops in flight at once), logging and recording what it capped
  or dropped;
* bench and sweep write their JSON as results come, so a run cut short (an
  exception after a part, or SIGKILL) leaves a valid JSON with the parts
  it finished, marked partial;
* a comm kernel that falls back says why: logged once, and in the report's
  ``fallbacks``.

No timing is asserted beyond injected delays that dwarf everything else."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.child import REPO, child_env
from support.host_device_module import HostDeviceModule, use_host_device_module
from support.logs import PackageLogs
from support.tiny_bench import TINY, TINY_PARAMS

from camp2p_overlap.core.observe.trace import TraceOp
from camp2p_overlap.emulation import comm_kernel, kernel_world
from camp2p_overlap.emulation.comm_kernel import HostCommKernels, NvrtcCommKernels
from camp2p_overlap.emulation.kernel_world import DEVICE_FFN_KERNELS, DeviceFFN
from camp2p_overlap.emulation.moe import MoEFFN, MoEShape
from camp2p_overlap.emulation.world import EmulatedModel, LinkModel, WorldSpec
from camp2p_overlap.tools import cli
from camp2p_overlap.tools.bench import runner, sweep, tables
from camp2p_overlap.tools.bench.launch import LAUNCH_BOUND_SHARE, launch_sample, launch_summary, launch_verdict
from camp2p_overlap.tools.bench.runner import SCENARIOS, BenchParams, run_bench
from camp2p_overlap.tools.bench.tables import bench_table

#: The device world on the emulated device, tiny, two policies.
DEVICE_WORLD = BenchParams(
    device="cpu", device_world=True, layers=2, stages=2, tokens=8, hidden=32, ffn=64, experts=2, top_k=1,
    link_latency_us=50.0, link_gbps=8.0, attn_us=50.0, steps=2, warmup=1, reps=1,
    policies=("serial", "compute-side-fixed"),
)  # fmt: skip
#: A delay that dwarfs everything else an FFN of DEVICE_WORLD does (s).
DELAY_S = 0.015


# ---------------------------------------------------------------------------
# launch-bound or device-bound


def _op(kind: str, start: int, end: int, layer: int | None = 0, stage: int | None = 0) -> TraceOp:
    return TraceOp(kind, layer, stage, "C", start, end, 1)


def test_launch_share_arithmetic() -> None:
    """Per traced step: each FFN's (host span, device time), and the step's
    host time from its start to the last op's host end against its device
    time; medians and shares; the verdict at the threshold."""
    ops = [_op("step", 0, 10_000, None, None), _op("a2e", 0, 1_000), _op("ffn", 1_000, 5_000), _op("e2a", 5_000, 9_000)]
    spans = [(100, 9_000), (100, 300), (300, 2_300), (2_300, 2_600)]
    sample = launch_sample(ops, spans)
    assert sample == {"ffn": [(2_000, 4_000)], "step": (2_500, 10_000)}
    assert launch_sample(ops, spans[:-1]) is None, "spans that are not the ops' are no sample"
    other = {"ffn": [(6_000, 4_000), (1_000, 4_000)], "step": (7_500, 10_000)}
    s = launch_summary([sample, other])
    assert s is not None
    assert (s["steps"], s["ffn_samples"]) == (2, 3)
    assert (s["ffn_host_us"], s["ffn_device_us"], s["ffn_share"]) == (2.0, 4.0, 0.5)
    assert (s["step_host_us"], s["step_device_us"], s["step_share"]) == (5.0, 10.0, 0.5)
    assert launch_summary([]) is None and launch_verdict(None, {}) is None
    below = dict(s, ffn_share=round(LAUNCH_BOUND_SHARE - 0.01, 4))
    v = launch_verdict(below, {"serial": below, "overlap": dict(s, step_share=0.3)})
    assert v is not None and v["launch_bound"] is False and v["launch_bound_by"] == []
    assert v["threshold"] == LAUNCH_BOUND_SHARE and v["ffn_share"] == below["ffn_share"]
    at = dict(s, ffn_share=LAUNCH_BOUND_SHARE)
    v = launch_verdict(at, {"serial": s, "overlap": dict(s, step_share=LAUNCH_BOUND_SHARE)})
    assert v is not None and v["launch_bound"] is True
    assert len(v["launch_bound_by"]) == 2 and v["launch_bound_by"][1] == "overlap's step: share 0.80"
    assert "an FFN takes 2 us to issue and 4 us on the device" in v["launch_bound_by"][0]


def _device_bench(monkeypatch: pytest.MonkeyPatch, *, host_delay: float = 0.0, device_delay: float = 0.0) -> Any:
    """DEVICE_WORLD's report with each FFN slowed on the host (before its
    kernel is issued, inside its timing events) or on the device (inside
    its kernel, which the emulated device runs on the stream's worker)."""
    if host_delay:
        issue = EmulatedModel.compute_ffn_output

        def slow_issue(self: Any, **kw: Any) -> Any:
            time.sleep(host_delay)
            return issue(self, **kw)

        monkeypatch.setattr(EmulatedModel, "compute_ffn_output", slow_issue)
    if device_delay:
        compute = DeviceFFN.compute

        def slow_kernel(self: Any, x: torch.Tensor, layer_idx: int) -> Any:
            time.sleep(device_delay)
            return compute(self, x, layer_idx)

        monkeypatch.setattr(DeviceFFN, "compute", slow_kernel)
    return run_bench(DEVICE_WORLD).report


def test_a_device_bound_run_is_reported_so(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _device_bench(monkeypatch, device_delay=DELAY_S)
    m = r["measured"]["launch"]
    assert m is not None and m["steps"] == 2 and m["ffn_samples"] == 2 * 2 * 2  # 2 traced steps x 2 layers x 2 stages
    assert m["ffn_device_us"] >= DELAY_S * 1e6 * 0.9, m
    assert m["ffn_share"] == pytest.approx(m["ffn_host_us"] / m["ffn_device_us"], rel=1e-3, abs=1e-4)
    assert m["ffn_share"] < 0.3 and m["launch_bound"] is False and m["launch_bound_by"] == [], m
    # compute-side engaged on the device world (its timing trace names the FFN's stream after the op's stage)
    assert {p["policy"]: p["engaged"] for p in r["policies"]} == {"serial": False, "compute-side-fixed": True}
    by = {p["policy"]: p["launch"] for p in r["policies"]}
    assert by["serial"]["steps"] == 2 and by["compute-side-fixed"]["steps"] == 1
    for p in by.values():
        assert p["step_device_us"] >= 4 * DELAY_S * 1e6 * 0.9 and p["step_share"] < LAUNCH_BOUND_SHARE, p
        assert p["step_share"] == pytest.approx(p["step_host_us"] / p["step_device_us"], rel=1e-3, abs=1e-4)
    text = bench_table(r)
    assert "launch share (host time to issue / device time" in text and "device-bound" in text
    assert "LAUNCH-BOUND" not in text


def test_a_launch_bound_run_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _device_bench(monkeypatch, host_delay=DELAY_S)
    m = r["measured"]["launch"]
    assert m["ffn_host_us"] >= DELAY_S * 1e6 and m["ffn_share"] >= LAUNCH_BOUND_SHARE, m
    assert m["launch_bound"] is True and "an FFN takes" in m["launch_bound_by"][0], m
    assert r["outputs_equal"] is True
    text = bench_table(r)
    assert "LAUNCH-BOUND: an FFN takes" in text and "the host's launch rate" in text


def test_the_device_ffn_issues_the_same_few_kernels_whatever_the_experts() -> None:
    """Its experts are batched (two GEMMs), so the kernels per call (aten
    ops that are not views) do not grow with the experts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.kernels = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if not func.is_view:
                self.kernels += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for experts in (2, 8):
        ffn = DeviceFFN(MoEShape(hidden=32, ffn=48, experts=experts, top_k=2), seed=0, device=torch.device("cpu"))
        x = torch.randn(5, 32, dtype=torch.bfloat16)
        with Count() as c:
            ffn.compute(x, 0)
        counts[experts] = c.kernels
    assert counts[2] == counts[8] == DEVICE_FFN_KERNELS, counts


def test_the_device_ffn_equals_the_sparse_block() -> None:
    """The batched dense arithmetic is the MoE block's: in float32 it equals
    the sparse CPU block (the top-k experts only, per token) to rounding."""
    shape = MoEShape(hidden=48, ffn=80, experts=8, top_k=2)
    dense = DeviceFFN(shape, seed=3, device=torch.device("cpu"), dtype=torch.float32)
    sparse = MoEFFN(shape, seed=3)
    x = torch.randn(37, 48, generator=torch.Generator().manual_seed(1))
    for layer in range(4):
        (r1, s1), (r2, s2) = dense.compute(x, layer), sparse.compute(x, layer)
        assert s1 is not None and s2 is not None
        torch.testing.assert_close(r1, r2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5)


#: An H200's figures for the estimate (docs/validation.md, "Sizing gpu-ffn-bound").
H200 = {"sustained_tflops": 650.0, "peak_tflops": 989.0, "hbm_tbps": 4.0, "peak_hbm_tbps": 4.8}
#: Host time per eager torch op, pessimistic (5-10 us on a datacenter CPU).
HOST_US_PER_KERNEL = 8.0


def _ffn_estimate(p: dict[str, Any], tflops: float, tbps: float) -> float:
    """Seconds of device time of one dense FFN of ``p``: every expert and the
    shared one on every token, and the element-wise passes over the gate/up
    block (SiLU, the gate product, the routing weights: 3.5 blocks moved)."""
    t, h, f, e = p["tokens"], p["hidden"], p["ffn"], p["experts"]
    flops = 6 * t * h * f * (e + 1)
    block = t * e * 2 * f * 2  # bf16
    return flops / (tflops * 1e12) + 3.5 * block / (tbps * 1e12)


def test_the_gpu_scenario_is_device_bound_and_ffn_bound_by_estimate() -> None:
    """The reasoning of docs/validation.md as arithmetic: an FFN's device
    time well exceeds its host time (share at most 0.25 at a sustained rate,
    pessimistic host), and the run is FFN-bound even at the GPU's peak."""
    p = SCENARIOS["gpu-ffn-bound"]
    f = _ffn_estimate(p, H200["sustained_tflops"], H200["hbm_tbps"])
    host = DEVICE_FFN_KERNELS * HOST_US_PER_KERNEL * 1e-6
    assert 0.7e-3 < f < 1.5e-3 and host / f <= 0.25, (f, host)
    link = LinkModel(latency_s=p["link_latency_us"] * 1e-6, bandwidth_Bps=p["link_gbps"] * 1e9 / 8)
    a = link.seconds(p["tokens"] * p["hidden"] * 2)  # A2E: the hidden states
    e = link.seconds(2 * p["tokens"] * p["hidden"] * 2)  # E2A: the routed and the shared outputs
    attn = p["attn_us"] * 1e-6
    for f_at in (f, _ffn_estimate(p, H200["peak_tflops"], H200["peak_hbm_tbps"])):
        assert f_at > a + e and p["stages"] * f_at >= a + f_at + e + attn, (f_at, a, e)
    assert 0.25 <= (a + e) / f <= 0.6, "communication is not negligible"


# ---------------------------------------------------------------------------
# the sweep's contention points: what the device holds


def test_contention_points_are_capped_at_what_the_device_holds() -> None:
    run, changes, most = sweep.cap_comm_core_points((0, 8, 32, 96), 132, 2)
    assert most == 65 and run == [(0, 0), (8, 8), (32, 32), (96, 65)]
    assert [(c["asked"], c["ran"], c["action"]) for c in changes] == [(96, 65, "capped")]
    assert "96 x 2 concurrent op(s) needs 192 of the device's 132" in changes[0]["why"]
    run, changes, _ = sweep.cap_comm_core_points((0, 65, 96, 128), 132, 2)
    assert run == [(0, 0), (65, 65)] and [(c["asked"], c["action"]) for c in changes] == [
        (96, "dropped"),
        (128, "dropped"),
    ]
    assert sweep.cap_comm_core_points((0, 8, 200), None, 3) == ([(0, 0), (8, 8), (200, 200)], [], None)
    assert sweep.cap_comm_core_points((0, 64), 132, 3)[0] == [(0, 0), (64, 43)]


def test_the_sweep_runs_capped_points_logs_and_records_them(monkeypatch: pytest.MonkeyPatch, logs: PackageLogs) -> None:
    """A device of 3 cores and 2 stages: each op at most 1 core. Point 4 runs
    at 1, point 9 is dropped (1 runs already); said in the log, the JSON and
    under the tables. The JSON is written after the calibration and after
    each point, partial until the end."""
    monkeypatch.setattr(sweep, "comm_core_capacity", lambda device: (3, "a fake device of 3 cores"))
    params = runner.resolve_params({**TINY_PARAMS, "reps": 1})
    writes: list[dict[str, Any]] = []
    result = sweep.run_sweep(
        params,
        ratios=(),
        stage_counts=(),
        work_tokens=(),
        comm_cores=(0, 4, 9),
        on_result=lambda partial: writes.append(json.loads(json.dumps(partial, allow_nan=False))),
    )
    assert [(p["asked_comm_cores"], p["comm_cores"]) for p in result["comm_core_points"]] == [(0, 0), (4, 1)]
    assert result["comm_core_points"][1]["report"]["params"]["comm_cores"] == 1
    assert result["comm_core_limit"] == {
        "capacity": 3,
        "source": "a fake device of 3 cores",
        "concurrent_ops": 2,
        "max_per_op": 1,
    }
    assert [(c["asked"], c["ran"], c["action"]) for c in result["comm_core_changes"]] == [
        (4, 1, "capped"),
        (9, None, "dropped"),
    ]
    assert len(logs.texts("contention point 4 capped", logging.WARNING)) == 1
    assert len(logs.texts("contention point 9 dropped", logging.WARNING)) == 1
    text = sweep.sweep_markdown(result)
    assert "| 1 (asked 4) |" in text
    assert "Contention point 4 run at 1 (a fake device of 3 cores)" in text and "Contention point 9 dropped" in text
    assert [w["progress"] for w in writes] == ["calibration", "contention point 1 of 2", "contention point 2 of 2"]
    assert all(w["partial"] for w in writes) and [len(w["comm_core_points"]) for w in writes] == [0, 1, 2]
    assert result["partial"] is False and result["progress"] == "done"


# ---------------------------------------------------------------------------
# results as they come


def test_a_sweep_cut_by_an_error_leaves_the_points_it_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    js = tmp_path / "s.json"
    calls = []
    real = sweep.run_bench

    def bench(params: Any, **kw: Any) -> Any:
        calls.append(params)
        if len(calls) == 3:  # the calibration, the first point, then the second point fails
            raise RuntimeError("cut here (test)")
        return real(params, **kw)

    monkeypatch.setattr(sweep, "run_bench", bench)
    args = ["sweep", *TINY, "--reps", "1", "--ratios", "0.5,1,2", "--stage-counts", "", "--comm-core-points", "none"]
    with pytest.raises(RuntimeError, match="cut here"):
        cli.main([*args, "--work-tokens", "none", "--json", str(js)])
    data = json.loads(js.read_text())
    assert data["partial"] is True and data["progress"] == "ratio point 1 of 3"
    assert [p["target_ratio"] for p in data["ratio_points"]] == [0.5]
    assert data["ratio_points"][0]["report"]["outputs_equal"] is True
    assert not list(tmp_path.glob("*.tmp")), "the write is a renamed temporary file"


def test_a_sweep_killed_partway_leaves_valid_json(tmp_path: Path) -> None:
    """SIGKILL in a fresh interpreter once a point is written: the file is
    valid JSON with the finished points, marked partial."""
    js = tmp_path / "s.json"
    ratios = "0.25,0.5,0.75,1,1.25,1.5,1.75,2,2.5,3"
    argv = [*TINY, "--reps", "1", "--ratios", ratios, "--stage-counts", "", "--comm-core-points", "none"]
    cmd = [sys.executable, "-m", "camp2p_overlap.tools.cli", "sweep", *argv, "--work-tokens", "none", "--json", str(js)]
    proc = subprocess.Popen(cmd, env=child_env(), cwd=str(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if js.exists() and json.loads(js.read_text())["ratio_points"]:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the sweep ended before it could be killed"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    data = json.loads(js.read_text())
    assert data["partial"] is True and data["progress"].startswith("ratio point ")
    assert 1 <= len(data["ratio_points"]) < 10
    assert all(p["report"]["outputs_equal"] for p in data["ratio_points"])


def test_bench_writes_each_policy_as_it_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager bench writes its JSON after each policy and each repetition;
    cut by an error in the third policy, it leaves the first two measured."""
    js = tmp_path / "b.json"
    writes: list[dict[str, Any]] = []
    real_write, real_config = tables.write_json, runner._config_for

    def write(path: Any, data: Any) -> None:
        writes.append(json.loads(json.dumps(data, allow_nan=False)))
        real_write(path, data)

    def config(policy: str, backend: str, **kw: Any) -> Any:
        if policy == "overlap":
            raise RuntimeError("cut here (test)")
        return real_config(policy, backend, **kw)

    monkeypatch.setattr(tables, "write_json", write)
    monkeypatch.setattr(runner, "_config_for", config)
    with pytest.raises(RuntimeError, match="cut here"):
        cli.main(["bench", *TINY, "--json", str(js)])
    assert [w["progress"] for w in writes] == ["repetition 1 of 2: serial done", "repetition 1 of 2: e2a-only done"]
    data = json.loads(js.read_text())
    assert data == writes[-1] and data["partial"] is True
    samples = {p["policy"]: p["samples"] for p in data["policies"]}
    assert samples == {"serial": 2, "e2a-only": 2, "overlap": 0, "compute-side-fixed": 0, "comm-side-fixed": 0}
    by = {p["policy"]: p for p in data["policies"]}
    assert by["e2a-only"]["speedup"] is not None and by["overlap"]["speedup"] is None


# ---------------------------------------------------------------------------
# fallbacks say why


class _NoNvrtc:
    def __init__(self, *args: Any) -> None:
        raise RuntimeError("no NVRTC here (test)")


def _world_spec(**kw: Any) -> WorldSpec:
    return WorldSpec(
        layers=2,
        stage_ids=(0, 1),
        tokens=8,
        shape=MoEShape(hidden=32, ffn=64, experts=2, top_k=1),
        link=LinkModel(latency_s=50e-6, bandwidth_Bps=1e9),
        op_timeout_s=5.0,
        **kw,
    )


def test_a_comm_kernel_that_falls_back_says_why(monkeypatch: pytest.MonkeyPatch, logs: PackageLogs) -> None:
    """No CUDA comm kernel can be built (forced): the world runs calibrated
    delays, and the reason is in the world's fallbacks, the bench report's,
    the table, and the log (once for two builds)."""
    from camp2p_overlap.emulation.standin_patch_layer import release_site, standin_site

    monkeypatch.setattr(kernel_world, "NvrtcCommKernels", _NoNvrtc)
    dev = HostDeviceModule()
    use_host_device_module(monkeypatch, dev)
    real_build = kernel_world.build_device_world

    def build(spec: Any, kind: str, *, root: str) -> Any:
        return real_build(spec, kind, root=root, module=dev, device=torch.device("cpu"))  # type: ignore[arg-type]

    site = standin_site()
    try:
        for _ in range(2):
            dw = build(_world_spec(), "cuda", root=site.root)
            dw.close()
    finally:
        release_site(site)
    (fb,) = dw.fallbacks
    assert fb["what"] == "the emulated CAM comm kernel" and fb["reason"] == "no NVRTC here (test)"
    assert fb["instead"].startswith(f"calibrated {dw.kernels.method} of the link time"), fb
    assert dw.kernels.kind.startswith(dw.kernels.method)
    assert len(logs.texts("the emulated CAM comm kernel is not used (no NVRTC here (test))", logging.WARNING)) == 1

    monkeypatch.setattr(kernel_world, "build_device_world", build)
    params = BenchParams(
        device="cuda", layers=2, stages=2, tokens=8, hidden=32, ffn=64, experts=2, top_k=1,
        link_latency_us=50.0, link_gbps=8.0, attn_us=50.0, steps=1, warmup=1, reps=1,
        policies=("serial", "compute-side-fixed"),
    )  # fmt: skip
    report = run_bench(params).report
    assert report["fallbacks"] == [fb] and report["attn_modeled"] is False
    assert "FALLBACK: the emulated CAM comm kernel is not used (no NVRTC here (test))" in bench_table(report)


def test_a_comm_kernel_launcher_that_falls_back_says_why(monkeypatch: pytest.MonkeyPatch, logs: PackageLogs) -> None:
    """torch's NVRTC launcher fails, CuPy's is taken (both stand-ins): the
    first one's reason is kept in the kernel's and the world's fallbacks
    and logged once."""
    props = SimpleNamespace(
        multi_processor_count=132, shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(comm_kernel, "_COMPILED", {})

    def no_torch_launcher(self: Any) -> Any:
        raise RuntimeError("torch has no _compile_kernel (test)")

    monkeypatch.setattr(NvrtcCommKernels, "_torch_launcher", no_torch_launcher)
    monkeypatch.setattr(NvrtcCommKernels, "_cupy_launcher", lambda self: lambda args: None)
    monkeypatch.setattr(NvrtcCommKernels, "selftest", lambda self: None)
    k = NvrtcCommKernels(3, 0, torch.device("cpu"))
    assert k.kind == "nvrtc (cupy.RawKernel)"
    assert k.fallbacks == [
        {
            "what": "comm kernel launcher nvrtc (torch.cuda._compile_kernel)",
            "reason": "RuntimeError: torch has no _compile_kernel (test)",
            "instead": "nvrtc (cupy.RawKernel)",
        }
    ]
    NvrtcCommKernels(3, 0, torch.device("cpu"))
    assert len(logs.texts("comm kernel launcher nvrtc (torch.cuda._compile_kernel) failed", logging.WARNING)) == 1
    # build_device_world passes a kernel's own fallbacks on.
    from camp2p_overlap.emulation.standin_patch_layer import release_site, standin_site

    site = standin_site()
    try:
        dw = kernel_world.build_device_world(
            _world_spec(), "cuda", root=site.root, module=HostDeviceModule(), kernels=k, device=torch.device("cpu")
        )  # type: ignore[arg-type]
        dw.close()
    finally:
        release_site(site)
    assert dw.fallbacks == k.fallbacks
    assert HostCommKernels(3).fallbacks == []
