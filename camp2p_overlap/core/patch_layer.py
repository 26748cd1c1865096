"""Building a patch layer: an engine composed with the overlap runtime its
wrappers share, and :data:`PATCH_LAYER`, the one process-wide patch layer behind
``camp2p_overlap.apply()``. Each wrapper is bound to its own engine and
runtime when the engine applies; tests and the benchmark build their own
patch layers with :func:`build_patch_layer`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core.fork import after_fork_in_child
from camp2p_overlap.core.log import logger
from camp2p_overlap.core.observe import metrics
from camp2p_overlap.core.overlap.plan import layouts_of, rung
from camp2p_overlap.core.overlap.runtime import OverlapRuntime
from camp2p_overlap.core.overlap.step import make_wrappers
from camp2p_overlap.core.patching.lifecycle import PatchEngine


@dataclass(frozen=True)
class PatchLayer:
    """One patch layer: its lifecycle engine and the runtime its wrappers share."""

    engine: PatchEngine
    runtime: OverlapRuntime


def build_patch_layer(*, on_unpatch: Callable[[], None] | None = None, **engine_options: Any) -> PatchLayer:
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
        wrapper_factory=functools.partial(make_wrappers, runtime=runtime), on_unpatch=closed, **engine_options
    )
    return PatchLayer(engine, runtime)


def reset_reporting() -> None:
    """On unpatch: the reporter's thread and endpoint end (nothing is counted
    any more); the next step after a new apply starts them again."""
    metrics.stop_reporting()
    PATCH_LAYER.runtime.counters.on_first_step = _start_reporting


#: The process-wide patch layer behind ``camp2p_overlap.apply()``/``unpatch()``/``status()``/``stats()``.
PATCH_LAYER = build_patch_layer(on_unpatch=reset_reporting)


def _start_reporting() -> None:
    """On this process's first FFN step: the step metrics (and the opt-in
    endpoint) and the periodic summary, with the applied configuration: its
    mode, rung and the layouts an engaged step runs (``mode_info``)."""
    try:
        cfg = PATCH_LAYER.engine.config
        metrics.start_reporting(
            PATCH_LAYER.runtime.counters.to_dict,  # steps and serial reasons: no bucket snapshot per scrape
            port=cfg.metrics_port,
            addr=cfg.metrics_addr,
            summary_s=cfg.summary_s,
            mode=cfg.mode,
            rung=rung(cfg),
            graph=cfg.graph,
            layouts=[layout.name for layout in layouts_of(cfg)],
        )
    except Exception:  # noqa: BLE001 - reporting never breaks a step
        logger.exception("camp2p-overlap: step reporting not started")


PATCH_LAYER.runtime.counters.on_first_step = _start_reporting

# a forked worker reports its own steps
after_fork_in_child(lambda: setattr(PATCH_LAYER.runtime.counters, "on_first_step", _start_reporting))
