"""Building a patch layer: an engine composed with the overlap runtime its
wrappers share, and the one process-wide layer behind
``camp2p_overlap.apply()``. Nothing here is read on the call path: each
wrapper is bound to its own engine and runtime when the engine applies."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core.engine import PatchEngine
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
