"""What the patch engine tells its callers: the state of each target, the
report ``apply()``/``status()`` return, and the one log line per process."""

from __future__ import annotations

import enum
import functools
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import wrapt

from camp2p_overlap.core.log import logger
from camp2p_overlap.core.patching.manifest import TargetSpec
from camp2p_overlap.core.patching.versions import installed_version


class TargetState(str, enum.Enum):
    NOT_IMPORTED = "not-imported-yet"
    WRAPPED = "wrapped"
    CHECKED = "checked"  # a 'read' target that matched the manifest
    REFUSED = "refused"
    INACTIVE = "inactive"  # the patch layer is not applied


#: States in which a target is ready for the overlap.
READY = (TargetState.WRAPPED, TargetState.CHECKED)


@dataclass(frozen=True)
class TargetStatus:
    target: str
    action: str
    state: TargetState
    reason: str = ""
    #: For an optional target refused alone (its module installed): the
    #: feature refused with it (``reason`` says why); None otherwise.
    feature: str | None = None

    @property
    def ready(self) -> bool:
        """Wrapped, checked, or an optional target refused alone (only its feature is refused)."""
        return self.state in READY or self.refuses_feature_only

    @property
    def refuses_feature_only(self) -> bool:
        return self.state is TargetState.REFUSED and self.feature is not None

    def to_dict(self) -> dict[str, str]:
        return {"target": self.target, "action": self.action, "state": self.state.value, "reason": self.reason}

    def short(self) -> str:
        """``Owner.attribute=state`` for log lines, with the reason when refused
        (an optional target refused alone names its feature instead)."""
        name = ".".join(self.target.rsplit(".", 2)[-2:])
        if self.refuses_feature_only:
            return f"{name}={self.state.value} ({self.feature} only)"
        return f"{name}={self.state.value}" + (f" ({self.reason})" if self.state is TargetState.REFUSED else "")


@dataclass(frozen=True)
class PatchReport:
    """What ``apply()``/``status()`` found, per target."""

    enabled: bool
    applied: bool
    stack: str | None
    vllm_version: str | None
    wrapt_version: str
    reason: str
    targets: tuple[TargetStatus, ...] = ()
    pid: int = field(default_factory=os.getpid)

    @property
    def refused(self) -> tuple[TargetStatus, ...]:
        """Every refused target, an optional one refused alone included."""
        return tuple(t for t in self.targets if t.state is TargetState.REFUSED)

    @property
    def required_refused(self) -> tuple[TargetStatus, ...]:
        """The refusals that keep the patch layer from engaging (all but the optional ones)."""
        return tuple(t for t in self.refused if not t.refuses_feature_only)

    @property
    def features_refused(self) -> dict[str, str]:
        """``feature -> reason`` of every optional feature refused."""
        return refused_features(self.targets)

    @property
    def engaged(self) -> bool:
        """Applied, and every target :attr:`~TargetStatus.ready`."""
        return self.applied and all(t.ready for t in self.targets)

    @staticmethod
    def unready_of(targets: Iterable[TargetStatus]) -> str | None:
        """Why not every target is ready (the first that is not), or None when all are."""
        seen = False
        for t in targets:
            seen = True
            if not t.ready:
                return f"{t.target} is {t.state.value}" + (f": {t.reason}" if t.reason else "")
        return None if seen else "no targets"

    def to_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "applied": self.applied,
            "engaged": self.engaged,
            "stack": self.stack,
            "vllm_version": self.vllm_version,
            "wrapt_version": self.wrapt_version,
            "reason": self.reason,
            "pid": self.pid,
            "targets": [t.to_dict() for t in self.targets],
            "features_refused": self.features_refused,
        }

    def outcome_line(self) -> str:
        """The one log line per process (``apply``'s settled outcome)."""
        outcomes = "; ".join(t.short() for t in self.targets)
        return (
            f"camp2p-overlap {self.reason}: pid={self.pid} vllm={self.vllm_version} "
            f"wrapt={self.wrapt_version} stack={self.stack}: {outcomes}"
        )

    def __str__(self) -> str:
        head = (
            f"camp2p-overlap pid={self.pid} stack={self.stack} vllm={self.vllm_version} "
            f"wrapt={self.wrapt_version} applied={self.applied}: {self.reason}"
        )
        rows = [f"  {t.target}: {t.state.value}" + (f" ({t.reason})" if t.reason else "") for t in self.targets]
        return "\n".join([head, *rows])


@functools.cache
def wrapt_version() -> str:
    return installed_version("wrapt") or getattr(wrapt, "__version__", "?")


def refused_features(targets: Iterable[TargetStatus]) -> dict[str, str]:
    """``feature -> reason`` of every optional target refused alone (a feature's first reason)."""
    out: dict[str, str] = {}
    for t in targets:
        if t.refuses_feature_only:
            out.setdefault(t.feature, t.reason)  # type: ignore[arg-type]
    return out


def statuses(targets: Iterable[TargetSpec], state: TargetState, reason: str = "") -> dict[str, TargetStatus]:
    """The same state and reason for every target given."""
    return {t.id: TargetStatus(t.id, t.action, state, reason) for t in targets}


class StatusBoard:
    """The patch layer's current outcome: why it is in its state, the status of
    every target of the stack in use, and whether the outcome's one log line
    has been written."""

    def __init__(self) -> None:
        self.reason = "apply() was not called"
        self.targets: dict[str, TargetStatus] = {}
        self._logged = False

    def settle(self, reason: str, targets: dict[str, TargetStatus] | None = None) -> None:
        """A new outcome (its line is logged once, when every target is settled)."""
        self.reason, self.targets, self._logged = reason, dict(targets or {}), False

    def update(self, changed: Mapping[str, TargetStatus]) -> None:
        self.targets.update(changed)

    def any_in(self, targets: Iterable[TargetSpec], state: TargetState) -> bool:
        return any((st := self.targets.get(t.id)) is not None and st.state is state for t in targets)

    def any_required_refused(self, targets: Iterable[TargetSpec]) -> bool:
        """Whether one of ``targets`` is refused, not as an optional target refused alone."""
        return any(
            (st := self.targets.get(t.id)) is not None and st.state is TargetState.REFUSED and st.feature is None
            for t in targets
        )

    def features_refused(self) -> dict[str, str]:
        return refused_features(self.targets.values())

    def log_when_settled(self, report: PatchReport) -> None:
        """The one line per outcome: once no target waits for its import, or at
        once on a refusal (an optional target's has a warning of its own)."""
        refused = any(t.state is TargetState.REFUSED and not t.refuses_feature_only for t in self.targets.values())
        waiting = any(t.state is TargetState.NOT_IMPORTED for t in self.targets.values())
        if self._logged or (not refused and waiting):
            return
        logger.log(logging.WARNING if report.required_refused else logging.INFO, "%s", report.outcome_line())
        self._logged = True
