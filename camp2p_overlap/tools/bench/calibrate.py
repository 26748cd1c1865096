"""``--timing model``: the FFN's model refined from the run's own steps.

The world calibrates its FFN kernel from isolated runs when it is built
(``emulation/ffn_timing.py``). Before the policies run, the benchmark runs
a few steps of each schedule it is about to measure (serial, and each
layout its policies list: e2a-only, compute-side, comm-side) with the FFN kernel unheld, each
on a patch layer of its own (adaptive engage off, so no policy's learning
sees them), reads each FFN kernel's work from the device's counts, and
sets the model to the margin times the largest quantile of them all and of
the isolated runs (:func:`camp2p_overlap.emulation.ffn_timing.refine_in_run`):
one FFN duration for every policy, long enough for the slowest schedule's
kernels, whose threads compete with the FFN for the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.emulation import device as emulated_device
from camp2p_overlap.emulation.ffn_timing import measuring, refine_in_run
from camp2p_overlap.emulation.standin_patch_layer import emulated_patch_layer

#: FFN kernels measured per schedule (after one warm-up step).
IN_RUN_SAMPLES = 24


def in_run_schedules(policies: Iterable[Any], backend: str) -> dict[str, OverlapConfig | None]:
    """The distinct schedules of ``policies`` (``runner.Policy``: the layouts
    each lists), named ``serial`` or by layout (``e2a-only``, ``a2e-only``,
    ``compute-side``, ``comm-side``), each with adaptive engage off."""
    out: dict[str, OverlapConfig | None] = {"serial": None}
    for policy in policies:
        cfg = policy.config(backend)
        if cfg is None:
            continue
        for layout in policy.layout_objects():
            if layout.name not in out:
                out[layout.name] = OverlapConfig(
                    enabled=True,
                    backend=backend,  # type: ignore[arg-type]
                    layouts=("compute-side",) if layout.ffn_side else ("comm-side",),
                    a2e_on_side_stream=cfg.a2e_on_side_stream,
                    e2a_on_side_stream=cfg.e2a_on_side_stream,
                    adaptive=False,
                )
    return out


def refine_ffn_in_run(
    world: Any,
    schedules: Mapping[str, OverlapConfig | None],
    *,
    manifest: Any,
    sync: Callable[[], None] = lambda: None,
) -> Any:
    """Refine ``world``'s FFN model (module docstring); returns the model
    (None, and nothing run, when the world's FFN has none)."""
    moe = world.runner.model.moe
    base = moe.timing
    if base is None:
        return None
    tokens = world.spec.tokens
    per_step = max(1, len(world.layer_list()) * len(world.spec.stage_ids))
    steps = 1 + math.ceil(IN_RUN_SAMPLES / per_step)
    work: dict[str, list[int]] = {}
    moe.timing = measuring([tokens])
    try:
        for name, cfg in schedules.items():
            patch_layer = emulated_patch_layer() if cfg is not None else None
            if patch_layer is not None:
                patch_layer.engine.apply(config=cfg, manifest=manifest, strict=True)
            try:
                for i in range(steps):
                    emulated_device.take_timing()
                    world.steps_run = i
                    world.run_step()
                    sync()
                    ffn = emulated_device.take_timing().kinds.get("ffn")
                    if i and ffn is not None:  # the first step warms up
                        work.setdefault(name, []).extend(ffn.work_ns)
            finally:
                if patch_layer is not None and not patch_layer.engine.unpatch(timeout=30.0):
                    raise RuntimeError("the calibration's patch engine could not unpatch; see the log")
    finally:
        moe.timing = refine_in_run(base, tokens, work)
    return moe.timing
