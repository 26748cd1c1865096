"""Building a patch layer: an engine composed with the overlap runtime its
wrappers share, and the one process-wide layer behind
``camp2p_overlap.apply()``. Nothing here is read on the call path: each
wrapper is bound to its own engine and runtime when the engine applies."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
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


def build_layer(*, on_unpatch: Callable[[], None] | None = None, **engine_options: Any) -> PatchLayer:
    """A fresh engine (``engine_options``: ``manifest_loader``,
    ``version_check``) with its own runtime: its wrappers, stream sets and
    sessions are its own, and ``unpatch()`` closes them (then calls
    ``on_unpatch``)."""
    runtime = OverlapRuntime()

    def closed() -> None:
        runtime.close()
        if on_unpatch is not None:
            on_unpatch()

    engine = PatchEngine(
        wrapper_factory=functools.partial(make_wrappers, runtime=runtime),
        on_unpatch=closed,
        **engine_options,
    )
    return PatchLayer(engine, runtime)


def _stop_reporting() -> None:
    """On unpatch: the reporter's thread and endpoint end (nothing is counted
    any more); the next step after a new apply starts them again."""
    metrics.stop_reporting()
    RUNTIME.counters.on_first_step = _start_reporting


#: The process-wide layer behind ``camp2p_overlap.apply()``/``unpatch()``/``status()``.
PROCESS = build_layer(on_unpatch=_stop_reporting)
ENGINE = PROCESS.engine
RUNTIME = PROCESS.runtime


def _start_reporting() -> None:
    """On this process's first FFN step: the step metrics (and the opt-in
    endpoint) and the periodic summary, with the applied configuration."""
    try:
        cfg = ENGINE.config
        metrics.start_reporting(
            RUNTIME.counters.to_dict,  # steps and serial reasons: no bucket snapshot per scrape
            port=cfg.metrics_port,
            summary_s=cfg.summary_s,
            mode=cfg.mode,
            rung=rung(cfg),
        )
    except Exception:  # noqa: BLE001 - reporting never breaks a step
        logger.exception("camp2p-overlap: step reporting not started")


RUNTIME.counters.on_first_step = _start_reporting

if hasattr(os, "register_at_fork"):  # a forked worker reports its own steps
    os.register_at_fork(after_in_child=lambda: setattr(RUNTIME.counters, "on_first_step", _start_reporting))
