"""Per-process step counters: how many FFN steps ran each path, and why
the serial ones did. ``camp2p_overlap.stats()`` reports them; their shape
is documented in the README ("Reading stats()") and kept stable for
exporters."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: The paths a step can take: an engaged step counts under its rollout mode
#: (``overlap``, ``parity``, ``reorder``; see VLLM_CAMP2P_MULTISTREAM_MODE),
#: any other under ``serial`` with its reason.
PATHS = ("overlap", "parity", "reorder", "serial")
ENGAGED = ("overlap", "parity", "reorder")


class StepCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps = dict.fromkeys(PATHS, 0)
        self._serial_reasons: dict[str, int] = {}
        #: Called once, after the first step is counted (the process-wide
        #: layer starts its metrics and summary there: only processes that
        #: run FFN steps report).
        self.on_first_step: Callable[[], None] | None = None

    def _first(self) -> None:
        hook, self.on_first_step = self.on_first_step, None
        if hook is not None:
            hook()

    def overlap(self) -> None:
        self.engaged("overlap")

    def engaged(self, mode: str) -> None:
        """An engaged step of rollout ``mode``."""
        if mode not in ENGAGED:
            raise ValueError(f"{mode!r} is not an engaged path ({', '.join(ENGAGED)})")
        with self._lock:
            self._steps[mode] += 1
        if self.on_first_step is not None:
            self._first()

    def serial(self, reason: str) -> None:
        with self._lock:
            self._steps["serial"] += 1
            self._serial_reasons[reason] = self._serial_reasons.get(reason, 0) + 1
        if self.on_first_step is not None:
            self._first()

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"steps": dict(self._steps), "serial_reasons": dict(self._serial_reasons)}
