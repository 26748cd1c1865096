"""Child of tests/hardware/test_gpu_validation.py and scripts/gpu_check.sh (a
fresh CUDA context each run): a 3-layer, 2-stage device world on CUDA, run in
the mode of argv[1]: ``ok`` three overlap steps; ``race`` the same with the
FFN stream's wait for its A2E dropped (the sanitizer must see the race);
``graph-ab`` capture with the join (works) and without it (must fail);
``graph-env`` the configuration read from the environment as a vLLM worker
reads it (VLLM_CAMP2P_MULTISTREAM_GRAPH=1; the layout of
VLLM_CAMP2P_MULTISTREAM_LAYOUT, compute-side by default; comm-side captures
only with VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1), captured in that
layout and replayed bitwise. The layout of ``ok``, ``race`` and ``graph-ab``
is the default (compute-side) unless VLLM_CAMP2P_MULTISTREAM_LAYOUT names
another."""

import os
import sys

import torch

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.keys import A_DONE, JOIN
from camp2p_overlap.core.overlap.session import StepSession
from camp2p_overlap.emulation.kernel_world import build_device_world
from camp2p_overlap.emulation.moe import MoEShape
from camp2p_overlap.emulation.standin_patch_layer import emulation_engine, standin_site
from camp2p_overlap.emulation.world import LinkModel, WorldSpec

mode = sys.argv[1]
site = standin_site()
spec = WorldSpec(
    layers=3,
    stage_ids=(0, 1),
    tokens=64,
    shape=MoEShape(hidden=128, ffn=256, experts=2, top_k=1),
    link=LinkModel(latency_s=50e-6, bandwidth_Bps=20e9),
    attn_s=0.0,
)
dw = build_device_world(spec, "cuda", root=site.root)
tokens = {0: 64, 1: 48}
orig_wait = StepSession.wait_event

if mode == "race":
    # Drop the FFN's wait for its A2E (the FFN's stream waits a_done): the FFN
    # reads what the A2E's stream writes (compute-side: F reads C's; comm-side:
    # C reads K_s's).

    def _wait(self, stream, key):
        if key.kind == A_DONE:
            return
        return orig_wait(self, stream, key)

    StepSession.wait_event = _wait


def no_join(self, stream, key):
    # The join's waits dropped: the side streams (F, or K_s) never rejoin C before the forward returns; the caller's
    # stream is made current again as the real join does.
    if key.kind == JOIN:
        return
    return orig_wait(self, stream, key)


layouts = tuple(x for x in os.environ.get("VLLM_CAMP2P_MULTISTREAM_LAYOUT", "compute-side").split(",") if x)


if mode == "graph-env":
    # The graph switch as users set it: the configuration comes from the
    # environment (VLLM_CAMP2P_MULTISTREAM=1, VLLM_CAMP2P_MULTISTREAM_GRAPH=1).
    from camp2p_overlap.emulation.standin_patch_layer import emulated_patch_layer

    dw.world.steps_run = 0
    ref = {k: v.clone() for k, v in dw.world.run_step(tokens).items()}
    torch.cuda.synchronize()
    patch_layer = emulated_patch_layer()
    sessions = []

    class Counted(patch_layer.runtime.session_class):
        def __init__(self, **kw):
            super().__init__(**kw)
            sessions.append(kw["layout"].name)

    patch_layer.runtime.session_class = Counted
    report = patch_layer.engine.apply(manifest=site.manifest, strict=True)
    assert report.engaged, str(report)
    assert patch_layer.engine.config.graph, "VLLM_CAMP2P_MULTISTREAM_GRAPH=1 was not read"
    assert patch_layer.engine.config.layouts == layouts, (patch_layer.engine.config.layouts, layouts)
    dw.world.steps_run = 0
    eager = dw.world.run_step(tokens)
    torch.cuda.synchronize()
    assert set(eager) == set(ref) and all(torch.equal(eager[k], ref[k]) for k in ref), "eager overlap != serial"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the usual warm-up on a side stream before capture
        dw.world.steps_run = 0
        dw.world.run_step(tokens)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    dw.world.steps_run = 0
    before = len(sessions)
    with torch.cuda.graph(g):
        dw.world.run_step(tokens)
    assert len(sessions) == before + 1, (
        "the captured step did not run the overlap session (comm-side captures only with "
        "VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1)"
    )
    assert sessions[-1] == layouts[0], f"captured {sessions[-1]}, not {layouts[0]}"
    captured = dict(dw.world.transport.results)
    for _ in range(3):
        for t in captured.values():
            t.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert set(captured) == set(ref), "replay: (layer, stage) keys differ"
        bad = [k for k in ref if not torch.equal(captured[k], ref[k])]
        assert not bad, f"graph replay differs from the eager serial step at {bad}"
    dw.synchronize()  # raises if an A2E gave up waiting for its peer
    assert patch_layer.engine.unpatch(timeout=30)
    print("GRAPH_ENV_OK", len(sessions), sessions[-1])
    sys.exit(0)

graph = mode == "graph-ab"
with emulation_engine() as engine:
    report = engine.apply(
        # graph_comm_side: a comm-side capture is opted in (compute-side needs no opt-in)
        config=OverlapConfig(
            enabled=True, backend="cuda", graph=graph, graph_comm_side=graph, adaptive=False, layouts=layouts
        ),
        manifest=site.manifest,
        strict=True,
    )
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
        StepSession.wait_event = no_join
        g2 = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g2):  # B: without it, capture must fail
                dw.world.run_step(tokens)
        except Exception as exc:  # noqa: BLE001 - any capture failure is what B expects
            print("CAPTURE_WITHOUT_JOIN_FAILED:", type(exc).__name__, (str(exc).splitlines() or [""])[0])
            sys.exit(0)
        print("CAPTURE_WITHOUT_JOIN_SUCCEEDED")
        sys.exit(3)
    for _ in range(3):
        dw.world.run_step(tokens)
    torch.cuda.synchronize()
print("STEPS_DONE", mode)
