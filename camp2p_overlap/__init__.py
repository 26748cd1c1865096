"""camp2p-overlap: FFN-side CAMP2P A2E/E2A multi-stream overlap for vLLM +
afd-plugin (vLLM 0.19.1 with afd-plugin 0.19.1rc1, vLLM 0.26.0 with
afd-plugin main), as a version-guarded, reversible patch layer.

Importing this package imports no vLLM, afd-plugin or torch_npu module.
"""

from __future__ import annotations

from typing import Any

from camp2p_overlap.core.config import ConfigError, OverlapConfig, load_config
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.core.patching.lifecycle import PatchRefused
from camp2p_overlap.core.patching.status_report import PatchReport, TargetState, TargetStatus
from camp2p_overlap.core.plugin import register

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "OverlapConfig",
    "PatchRefused",
    "PatchReport",
    "TargetState",
    "TargetStatus",
    "__version__",
    "apply",
    "is_applied",
    "load_config",
    "register",
    "stats",
    "status",
    "unpatch",
]


def apply(*, strict: bool | None = None) -> PatchReport:
    """Arrange the wrapping of every target of the supported stack, if
    ``VLLM_CAMP2P_MULTISTREAM`` is on. Idempotent and thread-safe; imports no
    target module (post-import hooks wrap each when it is imported). Never
    raises unless strict mode is on (``strict=True`` or
    ``VLLM_CAMP2P_MULTISTREAM_STRICT=1``)."""
    return PATCH_LAYER.engine.apply(strict=strict)


def unpatch(*, timeout: float = 30.0) -> bool:
    """Restore every original object exactly. Steps already running wrapped
    finish first (up to ``timeout`` seconds); new ones run the original.
    Idempotent. Returns whether everything was removed."""
    return PATCH_LAYER.engine.unpatch(timeout=timeout)


def is_applied() -> bool:
    return PATCH_LAYER.engine.is_applied()


def status() -> PatchReport:
    """Per target: not-imported-yet / wrapped / checked / refused (with why),
    or inactive after ``unpatch()``."""
    return PATCH_LAYER.engine.status()


def stats() -> dict[str, Any]:
    """This process's FFN steps as a JSON-able dict: ``steps`` per path
    (``overlap``, ``parity``, ``reorder``, ``serial``), ``serial_reasons``
    (reason -> steps), and ``buckets``: per runner and shape bucket the
    adaptive decision, the overlap and serial medians in ms and the sample
    counts. The shape is documented in the README ("Reading stats()")."""
    return PATCH_LAYER.runtime.stats()
