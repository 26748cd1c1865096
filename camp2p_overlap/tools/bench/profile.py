"""``bench --profile-trace PATH`` on ``--device cuda|npu``: one overlapped
step under the device profiler (``torch.profiler`` with Kineto on CUDA,
``torch_npu.profiler`` on an NPU), read back as per-stream kernel timelines
(``verify/profiler_timeline.py``), checked by the edge checker on device times,
and written as Chrome/Perfetto trace JSON (one track per stream: C, F, K0,
K1, ..., each op's span over its kernels).

The step runs through a fresh emulated patch layer in the users' default
layout (compute-side; ``layout`` names another) and adaptive engage off,
after one warm-up step (which creates
the side streams and their pooled events outside the profile), and its
outputs are compared bitwise with the serial run of the same step id."""

from __future__ import annotations

import glob
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.keys import COMPUTE_STREAM
from camp2p_overlap.core.observe.trace import ExpectedSchedule
from camp2p_overlap.core.overlap.plan import Layout, layouts_of
from camp2p_overlap.core.overlap.streams import device_module
from camp2p_overlap.core.overlap.streams.streamset import StreamSet
from camp2p_overlap.emulation.standin_patch_layer import emulated_patch_layer
from camp2p_overlap.verify.annotated_backend import RANGE_PREFIX, SessionClassHolder, annotating, profiler_range
from camp2p_overlap.verify.edges import check_step
from camp2p_overlap.verify.profiler_timeline import DeviceTimeline, parse

#: The step id of the profiled step (its own: the attention inputs depend on it).
PROFILE_STEP_ID = 10_000


def marker(device: Any) -> Callable[[], None]:
    """One tiny kernel on the current stream (names a stream, or fences the
    step): an in-place fill of a one-element tensor made here, before the
    profile, so that a launch allocates nothing and is a single kernel
    (``torch.ones(...).mul_(2)`` is two on CUDA: a fill and a multiply)."""
    buf = torch.zeros(1, device=device)

    def launch() -> None:
        buf.fill_(1.0)

    return launch


def mark_streams(mod: Any, streams: Mapping[str, Any], launch: Callable[[], None]) -> None:
    """A marker launch per stream inside ``camp2p:stream <name>``: how the
    trace's device stream ids get our names."""
    for name, stream in streams.items():
        with mod.stream(stream), profiler_range(f"{RANGE_PREFIX}stream {name}"):
            launch()


def fence(name: str, launch: Callable[[], None]) -> None:
    """A marker launch on the current stream (C) inside ``camp2p:<name>``
    (the timeline takes every kernel it launched as the fence)."""
    with profiler_range(f"{RANGE_PREFIX}{name}"):
        launch()


def profiled_step(
    run_step: Callable[[], Any],
    *,
    mod: Any,
    runtime: SessionClassHolder,
    streamset: StreamSet,
    launch: Callable[[], None],
) -> Any:
    """The step between two fences, every stream of ``streamset`` marked, its
    ops, records and waits annotated (``runtime``'s steps make annotating
    sessions for the step: ``verify/annotated_backend.py``)."""
    side = {k.name: k for k in (*streamset.streams.values(), streamset.ffn)}
    mark_streams(mod, {COMPUTE_STREAM: streamset.backend.compute_stream(), **side}, launch)
    with annotating(runtime):
        fence("step-begin", launch)
        out = run_step()
        fence("step-end", launch)
    mod.synchronize()
    return out


def capture(kind: str, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run ``fn`` under the device profiler; its result and the Chrome trace."""
    with tempfile.TemporaryDirectory(prefix="camp2p-profile-") as tmp:
        if kind == "npu":
            import torch_npu  # type: ignore[import-not-found]

            prof_mod = torch_npu.profiler
            activities = [prof_mod.ProfilerActivity.CPU, prof_mod.ProfilerActivity.NPU]
            with prof_mod.profile(activities=activities, on_trace_ready=prof_mod.tensorboard_trace_handler(tmp)):
                result = fn()
            found = sorted(glob.glob(os.path.join(tmp, "**", "trace_view.json"), recursive=True))
            if not found:
                raise RuntimeError(f"torch_npu.profiler wrote no trace_view.json under {tmp}")
            path = found[-1]
        else:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                result = fn()
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            return result, json.load(f)


def profile_device_step(
    world: Any,
    *,
    kind: str,
    manifest: Any,
    layers: Sequence[int],
    stages: Sequence[int],
    path: str,
    layout: str = "compute-side",
) -> dict[str, Any]:
    """Profile one overlapped step of ``world`` on device ``kind`` in ``layout``; write
    the timelines to ``path``; return what the report says of it."""
    mod = device_module(kind)
    world.steps_run = PROFILE_STEP_ID
    reference = world.run_step()  # the engine is unpatched here: the serial path
    mod.synchronize()
    patch_layer = emulated_patch_layer()
    cfg = OverlapConfig(enabled=True, backend=kind, adaptive=False, layouts=(layout,))  # type: ignore[arg-type]
    patch_layer.engine.apply(config=cfg, manifest=manifest, strict=True)
    try:
        world.steps_run = PROFILE_STEP_ID
        world.run_step()  # warm-up: side streams and events exist before the profile
        mod.synchronize()
        (sset,) = patch_layer.runtime.runners.stream_sets()
        launch = marker(torch.device(kind, mod.current_device()))

        def step() -> Any:
            world.steps_run = PROFILE_STEP_ID
            return world.run_step()

        out, raw = capture(
            kind, lambda: profiled_step(step, mod=mod, runtime=patch_layer.runtime, streamset=sset, launch=launch)
        )
    finally:
        if not patch_layer.engine.unpatch(timeout=30.0):
            raise RuntimeError("the profiling patch engine could not unpatch; see the log")
    (lay,) = layouts_of(cfg)
    return write_profile(parse(raw), path, layers=layers, stages=stages, out=out, reference=reference, layout=lay)


def write_profile(
    timeline: DeviceTimeline,
    path: str,
    *,
    layers: Sequence[int],
    stages: Sequence[int],
    out: Mapping[Any, torch.Tensor] | None = None,
    reference: Mapping[Any, torch.Tensor] | None = None,
    layout: Layout | None = None,
) -> dict[str, Any]:
    """Check ``timeline`` against the schedule of ``layout`` (None: comm-side, A2E and E2A on the side
    streams), write it as Chrome trace JSON, and say what was found (the report's ``profile`` entry)."""
    ops = timeline.trace_ops()
    if layout is None:
        expected = ExpectedSchedule(tuple(layers), tuple(stages), True, True)
    else:
        expected = ExpectedSchedule.of_layout(layers, stages, layout)
    result = check_step(ops, expected, source="device")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": timeline.chrome_trace(), "displayTimeUnit": "ns"}, f)
    equal = None
    if out is not None and reference is not None:
        equal = set(out) == set(reference) and all(torch.equal(out[k].cpu(), reference[k].cpu()) for k in reference)
    per_stream = timeline.per_stream()
    return {
        "path": path,
        "layout": "comm-side" if layout is None else layout.name,
        "streams": {name: len(acts) for name, acts in sorted(per_stream.items())},
        "unnamed_streams": sorted(n for n in per_stream if n.startswith("stream ")),
        "ops": sum(1 for o in ops if o.kind in ("a2e", "ffn", "e2a")),
        "edges_ok": result.ok,
        "edge_violations": result.violations,
        "outputs_equal": equal,
    }
