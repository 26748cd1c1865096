"""GPU validation of the schedule with real CUDA streams and events (marker
``gpu``; skipped without a CUDA device). Run by ``scripts/gpu_check.sh``.

The emulated FFN rank on the device (``emulation/device_world.py``): dense
bf16 MoE compute on the compute stream, A2E/E2A as device copies plus a
busy-wait kernel of the modeled link time on whatever stream the patch
layer puts them. Checked here:

* the overlap's outputs are bitwise those of the serial path;
* the device-time trace shows communication of one stage running while
  another stage's FFN computes (and the serial run shows none);
* under ``TORCH_CUDA_SANITIZER=1`` the overlapped steps report no race,
  while the same steps with the A2E->FFN edge removed do (so the sanitizer
  run is able to fail);
* the forward captured in a CUDA graph (graph switch on) replays with the
  outputs of the eager step; with the join removed, capture fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _overlap_util import assert_same

from camp2p_overlap.core.config import OverlapConfig

REPO = Path(__file__).resolve().parent.parent
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

STAGES = (0, 1, 2)
TOKENS = {0: 256, 1: 192, 2: 128}


def _spec(**kw: Any) -> Any:
    from camp2p_overlap.emulation.moe import MoEShape
    from camp2p_overlap.emulation.world import LinkModel, WorldSpec

    kw.setdefault("layers", 6)
    kw.setdefault("stage_ids", STAGES)
    kw.setdefault("tokens", 256)
    kw.setdefault("shape", MoEShape(hidden=1024, ffn=2048, experts=4, top_k=2))
    kw.setdefault("link", LinkModel(latency_s=200e-6, bandwidth_Bps=20e9))
    kw.setdefault("attn_s", 0.0)
    return WorldSpec(**kw)


@pytest.fixture
def site() -> Iterator[Any]:
    from camp2p_overlap.emulation.engine import release_site, standin_site

    s = standin_site()
    yield s
    release_site(s)


@contextlib.contextmanager
def overlap_on(site: Any, **overrides: Any) -> Iterator[Any]:
    """The patch layer applied for the CUDA backend. The benchmark's engine
    is used so the check does not depend on which vLLM the GPU box has."""
    from camp2p_overlap.emulation.engine import emulation_engine

    with emulation_engine() as engine:
        cfg = OverlapConfig(enabled=True, backend="cuda", **overrides)
        report = engine.apply(config=cfg, manifest=site.manifest, strict=True)
        assert report.engaged, str(report)
        yield engine


def _step(dw: Any, n: int) -> dict:
    dw.world.steps_run = n - 1
    out = dw.world.run_step(TOKENS)
    dw.synchronize()
    return out


def test_cuda_overlap_is_bitwise_serial_and_the_trace_overlaps(site: Any) -> None:
    from camp2p_overlap.core.trace import overlaps
    from camp2p_overlap.emulation.device_world import build_device_world

    dw = build_device_world(_spec(), "cuda", root=site.root)
    _step(dw, 1)  # warm-up (kernels, allocator)
    dw.timing.active = True
    serial = {n: _step(dw, n) for n in (2, 3, 4)}
    serial_ops = dw.timing.resolve()
    dw.timing.active = False
    with overlap_on(site):
        _step(dw, 1)  # warm-up: creates the side streams outside any capture
        dw.timing.active = True
        got = {n: _step(dw, n) for n in (2, 3, 4)}
        ops = dw.timing.resolve()
        dw.timing.active = False
    for n in serial:
        assert_same(got[n], serial[n], f"step {n}: overlap outputs differ from the serial path")
    assert len(got[2]) == 6 * len(STAGES)

    comm = [o for o in ops if o.kind in ("a2e", "e2a")]
    ffn = [o for o in ops if o.kind == "ffn"]
    assert {o.stream for o in comm} == {f"K{s}" for s in STAGES}
    assert {o.stream for o in ffn} == {"C"}
    hidden = [(c, f) for c in comm for f in ffn if c.step == f.step and c.stage != f.stage and overlaps(c, f)]
    assert hidden, "no A2E/E2A ran on the device while another stage's FFN computed"
    cross = [(a, b) for a in comm for b in comm if a.step == b.step and a.stage < b.stage and overlaps(a, b)]
    assert cross, "no two stages' communication ran at the same time"
    # Control: the serial path runs everything on C, one op after another.
    assert {o.stream for o in serial_ops} == {"C"}
    s_comm = [o for o in serial_ops if o.kind in ("a2e", "e2a")]
    s_ffn = [o for o in serial_ops if o.kind == "ffn"]
    assert not [(c, f) for c in s_comm for f in s_ffn if overlaps(c, f)]


# ---------------------------------------------------------------------------
# subprocess checks (sanitizer, failing capture): a fresh CUDA context each
_CHILD = textwrap.dedent(
    """
    import sys, torch
    from camp2p_overlap.emulation.engine import emulation_engine, standin_site
    from camp2p_overlap.core.config import OverlapConfig
    from camp2p_overlap.emulation.device_world import build_device_world
    from camp2p_overlap.emulation.moe import MoEShape
    from camp2p_overlap.emulation.world import LinkModel, WorldSpec
    from camp2p_overlap.core.session import OverlapSession

    mode = sys.argv[1]
    site = standin_site()
    spec = WorldSpec(layers=3, stage_ids=(0, 1), tokens=64, shape=MoEShape(hidden=128, ffn=256, experts=2, top_k=1),
                     link=LinkModel(latency_s=50e-6, bandwidth_Bps=20e9), attn_s=0.0)
    dw = build_device_world(spec, "cuda", root=site.root)
    tokens = {0: 64, 1: 48}

    if mode == "race":
        # Drop edge 3 (FFN on C waits for its A2E): C reads what K_s writes.
        orig_wait = OverlapSession._wait
        def _wait(self, stream, key):
            if stream is self.C and isinstance(key, tuple) and key[0] == "a":
                return
            return orig_wait(self, stream, key)
        OverlapSession._wait = _wait
    def no_join(self):
        # Edge 7 dropped: K_s never rejoins C before the forward returns.
        for refs in self._f_refs.values():
            refs.clear()
        self._inflight.clear()

    graph = mode == "graph-ab"
    with emulation_engine() as engine:
        report = engine.apply(config=OverlapConfig(enabled=True, backend="cuda", graph=graph), manifest=site.manifest,
                              strict=True)
        assert report.engaged, str(report)
        dw.world.steps_run = 0
        if mode == "graph-ab":
            dw.world.run_step(tokens)  # eager warm-up: streams and events exist before capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):  # A: with the join, capture works
                dw.world.run_step(tokens)
            torch.cuda.synchronize()
            print("CAPTURE_WITH_JOIN_OK")
            OverlapSession._join = no_join
            g2 = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g2):  # B: without it, capture must fail
                    dw.world.run_step(tokens)
            except Exception as exc:
                print("CAPTURE_WITHOUT_JOIN_FAILED:", type(exc).__name__, (str(exc).splitlines() or [""])[0])
                sys.exit(0)
            print("CAPTURE_WITHOUT_JOIN_SUCCEEDED")
            sys.exit(3)
        for n in range(3):
            dw.world.run_step(tokens)
        torch.cuda.synchronize()
    print("STEPS_DONE", mode)
    """
)


def _child(mode: str, *, sanitizer: bool, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CAMP2P")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    if sanitizer:
        env["TORCH_CUDA_SANITIZER"] = "1"
    else:
        env.pop("TORCH_CUDA_SANITIZER", None)
    return subprocess.run(
        [sys.executable, "-c", _CHILD, mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=str(REPO),
    )


def test_cuda_sanitizer_reports_no_race_for_the_overlap() -> None:
    res = _child("ok", sanitizer=True)
    out = res.stdout + res.stderr
    assert "CSAN detected" not in out, out[-4000:]
    assert res.returncode == 0 and "STEPS_DONE ok" in res.stdout, out[-4000:]


def test_cuda_sanitizer_catches_a_missing_edge() -> None:
    """The control: without the FFN's wait on its A2E the sanitizer reports
    a data race, so the clean run above means something."""
    res = _child("race", sanitizer=True)
    out = res.stdout + res.stderr
    assert "CSAN detected a possible data race" in out, out[-4000:]


def test_cuda_graph_capture_replays_the_eager_outputs(site: Any) -> None:
    from camp2p_overlap.emulation.device_world import build_device_world

    dw = build_device_world(_spec(layers=4, stage_ids=(0, 1)), "cuda", root=site.root)
    tokens = {0: 256, 1: 160}

    def eager(n: int) -> dict:
        dw.world.steps_run = n - 1
        out = dw.world.run_step(tokens)
        dw.synchronize()
        return out

    serial = eager(5)
    with overlap_on(site, graph=True):
        # Eager warm-up: creates the side streams and events outside capture.
        for _ in range(2):
            assert_same(eager(5), serial)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the usual warm-up on a side stream
            eager(5)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        dw.world.steps_run = 4
        with torch.cuda.graph(g):
            dw.world.run_step(tokens)
        captured = dict(dw.world.transport.results)  # tensors of the graph's pool
        assert captured.keys() == serial.keys()
        for _ in range(3):
            for t in captured.values():
                t.zero_()
            g.replay()
            torch.cuda.synchronize()
            assert_same(captured, serial, "graph replay differs from the eager step")
        # Eager steps still work after capture, with the same outputs.
        assert_same(eager(5), serial)


def test_cuda_graph_capture_fails_when_a_side_stream_is_not_joined() -> None:
    """A/B in one fresh process: the same capture succeeds with the join and
    fails once the join is removed."""
    res = _child("graph-ab", sanitizer=False)
    out = res.stdout + res.stderr
    assert "CAPTURE_WITH_JOIN_OK" in res.stdout, out[-4000:]
    assert "CAPTURE_WITHOUT_JOIN_FAILED" in res.stdout, out[-4000:]
    assert res.returncode == 0, out[-4000:]
