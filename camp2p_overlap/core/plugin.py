"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` once in every process it starts (front-end,
engine core, each worker) and does NOT catch what a plugin function raises,
so this never raises.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from camp2p_overlap.core.env_vars import TABLE
from camp2p_overlap.core.log import logger

#: The entry-point name (``VLLM_PLUGINS`` filters by exact name).
ENTRY_POINT_NAME = "camp2p_overlap"


def register_env_vars() -> list[str]:
    """Make our ``VLLM_CAMP2P_*`` names known to vLLM's environment registry
    (``vllm.envs``, when already imported, as it is when vLLM loads plugins),
    so vLLM's unknown-variable check neither warns nor, with
    ``--fail-on-environ-validation``, fails. Returns the names added."""
    envs = sys.modules.get("vllm.envs")
    registry: Any = getattr(envs, "environment_variables", None) if envs else None
    if not isinstance(registry, dict):
        return []
    added = []
    for name in (v.name for v in TABLE):
        if name not in registry:
            registry[name] = lambda name=name: os.environ.get(name)
            added.append(name)
    return added


def register() -> None:
    """Entry point: register our env names with vLLM, then ``apply()`` when
    switched on. Never raises (unless strict mode asks for it)."""
    from camp2p_overlap.core.config import strict_requested
    from camp2p_overlap.core.patch_layer import PATCH_LAYER

    try:
        register_env_vars()
    except Exception:  # noqa: BLE001 - never break vLLM's start-up
        logger.exception("camp2p-overlap: could not register environment variables with vLLM")
    try:
        PATCH_LAYER.engine.apply()
    except Exception:
        if strict_requested():
            raise
        logger.exception("camp2p-overlap: apply() failed; vLLM continues unpatched")
