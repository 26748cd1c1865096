"""Building a patch layer: an engine composed with the overlap runtime its
wrappers share, and the one process-wide layer behind
``camp2p_overlap.apply()``. Nothing here is read on the call path: each
wrapper is bound to its own engine and runtime when the engine applies."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core import metrics
from camp2p_overlap.core.engine import PatchEngine
from camp2p_overlap.core.log import logger
from camp2p_overlap.core.rollout import rung
from camp2p_overlap.core.runtime import OverlapRuntime
from camp2p_overlap.core.wrappers import make_wrappers


@dataclass(frozen=True)
class PatchLayer:
    engine: PatchEngine
    runtime: OverlapRuntime


def build_layer(**engine_options: Any) -> PatchLayer:
    """A fresh engine (``engine_options``: ``manifest_loader``,
    ``version_check``) with its own runtime: its wrappers, stream sets and
    sessions are its own, and ``unpatch()`` closes them."""
    runtime = OverlapRuntime()
    engine = PatchEngine(
        wrapper_factory=functools.partial(make_wrappers, runtime=runtime),
        on_unpatch=runtime.close,
        **engine_options,
    )
    return PatchLayer(engine, runtime)


#: The process-wide layer behind ``camp2p_overlap.apply()``/``unpatch()``/``status()``.
PROCESS = build_layer()
ENGINE = PROCESS.engine
RUNTIME = PROCESS.runtime


def _start_reporting() -> None:
    """On this process's first FFN step: the step metrics (and the opt-in
    endpoint) and the periodic summary, with the applied configuration."""
    try:
        cfg = ENGINE.config
        metrics.start_reporting(
            RUNTIME.stats, port=cfg.metrics_port, summary_s=cfg.summary_s, mode=cfg.mode, rung=rung(cfg)
        )
    except Exception:  # noqa: BLE001 - reporting never breaks a step
        logger.exception("camp2p-overlap: step reporting not started")


RUNTIME.counters.on_first_step = _start_reporting

if hasattr(os, "register_at_fork"):  # a forked worker reports its own steps
    os.register_at_fork(after_in_child=lambda: setattr(RUNTIME.counters, "on_first_step", _start_reporting))
