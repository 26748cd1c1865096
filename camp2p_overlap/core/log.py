"""The package logger: under vLLM's ``vllm`` namespace when vLLM is
installed (so vLLM's logging config formats it), else a standard logger.

Finding out does not import vLLM.
"""

from __future__ import annotations

import importlib.util
import logging
import threading

_NAME_WITH_VLLM = "vllm.camp2p_overlap"
_NAME_WITHOUT_VLLM = "camp2p_overlap"

_once_lock = threading.Lock()
_once_seen: set[tuple[str, str]] = set()


def _vllm_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


logger = logging.getLogger(_NAME_WITH_VLLM if _vllm_installed() else _NAME_WITHOUT_VLLM)


def log_once(level: int, key: str, msg: str, *args: object) -> bool:
    """Log ``msg`` once per process for each distinct ``(key, msg % args)``.

    Returns whether it logged.
    """
    text = msg % args if args else msg
    with _once_lock:
        if (key, text) in _once_seen:
            return False
        _once_seen.add((key, text))
    logger.log(level, "%s", text)
    return True


def reset_log_once() -> None:
    """Forget what was logged once (tests)."""
    with _once_lock:
        _once_seen.clear()
