"""The patch engine: one owner of apply/unpatch, a registry of every wrap,
post-import hooks that wait for the target modules, all-or-nothing per
module, rollback on failure, and exact restore."""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import wrapt

from camp2p_overlap.core.config import ConfigError, OverlapConfig, load_config, strict_requested
from camp2p_overlap.core.log import logger
from camp2p_overlap.core.manifest import (
    ManifestError,
    ModuleSpec,
    StackManifest,
    TargetSpec,
    load_manifest,
    signature_difference,
    signature_of,
)
from camp2p_overlap.core.versions import VersionCheck, check_vllm, installed_version


class PatchRefused(RuntimeError):
    """Raised instead of logging when strict mode is on."""


class TargetState(str, enum.Enum):
    NOT_IMPORTED = "not-imported-yet"
    WRAPPED = "wrapped"
    CHECKED = "checked"  # a 'read' target that matched the manifest
    REFUSED = "refused"
    INACTIVE = "inactive"  # the layer is not applied


@dataclass(frozen=True)
class TargetStatus:
    target: str
    action: str
    state: TargetState
    reason: str = ""

    def to_dict(self) -> dict[str, str]:
        return {
            "target": self.target,
            "action": self.action,
            "state": self.state.value,
            "reason": self.reason,
        }


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
        return tuple(t for t in self.targets if t.state is TargetState.REFUSED)

    @property
    def engaged(self) -> bool:
        """Applied, and every target is wrapped or checked."""
        return self.applied and all(t.state in (TargetState.WRAPPED, TargetState.CHECKED) for t in self.targets)

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
        }

    def __str__(self) -> str:
        head = (
            f"camp2p-overlap pid={self.pid} stack={self.stack} vllm={self.vllm_version} "
            f"wrapt={self.wrapt_version} applied={self.applied}: {self.reason}"
        )
        rows = [f"  {t.target}: {t.state.value}" + (f" ({t.reason})" if t.reason else "") for t in self.targets]
        return "\n".join([head, *rows])


@dataclass(eq=False)  # compared by identity
class WrapRecord:
    module: str
    owner: Any
    attribute: str
    original: Any  # the raw __dict__ entry before wrapping
    handle: Any  # the wrapt FunctionWrapper we installed
    spec: TargetSpec


def _wrapt_version() -> str:
    return installed_version("wrapt") or getattr(wrapt, "__version__", "?")


def _is_class(obj: Any) -> bool:
    return isinstance(obj, type)


def _initializing(module: ModuleType) -> bool:
    """Whether ``module`` is in ``sys.modules`` but still executing."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class PatchEngine:
    """Owns the patch state of one process."""

    def __init__(
        self,
        *,
        manifest_loader: Callable[[], StackManifest] = load_manifest,
        version_check: Callable[[str], VersionCheck] = check_vllm,
    ) -> None:
        self._manifest_loader = manifest_loader
        self._version_check = version_check
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self.generation = 0
        self.applied = False
        self.unpatching = False
        self.config: OverlapConfig = OverlapConfig()
        self.manifest: StackManifest | None = None
        self.records: dict[str, list[WrapRecord]] = {}
        self.stuck: list[WrapRecord] = []
        self._status: dict[str, TargetStatus] = {}
        self._hooks_pending: set[str] = set()
        self._reason = "apply() was not called"
        self._vllm_version: str | None = None
        self._active_steps: dict[int, int] = {}
        self._logged_generation = -1
        self._our_handles: set[int] = set()
        if hasattr(os, "register_at_fork"):
            ref = weakref.WeakMethod(self._after_fork_in_child)
            os.register_at_fork(after_in_child=lambda: (m := ref()) is not None and m())

    def _after_fork_in_child(self) -> None:
        """Only the forking thread survives a fork: the steps other threads
        were running are gone (unpatch must not wait for them), and a lock
        one of them held would stay held forever."""
        me = threading.get_ident()
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        mine = self._active_steps.get(me)
        self._active_steps = {me: mine} if mine else {}
        self.unpatching = False

    # ------------------------------------------------------------------
    # public
    def apply(
        self,
        *,
        strict: bool | None = None,
        config: OverlapConfig | None = None,
        manifest: StackManifest | None = None,
    ) -> PatchReport:
        with self._lock:
            try:
                cfg = config if config is not None else load_config()
            except ConfigError as exc:
                if strict if strict is not None else strict_requested():
                    raise
                if self.applied:
                    logger.error("camp2p-overlap: apply() ignored (already applied): %s", exc)
                    return self._report_locked()
                self._reason = f"configuration error: {exc}"
                self._status = {}
                logger.error("camp2p-overlap: not applied: %s", exc)
                return self._report_locked()
            strict = cfg.strict if strict is None else strict
            if not cfg.enabled:
                if self.applied:
                    self._reason = "applied earlier; the switch is now off (call unpatch() to remove)"
                    return self._report_locked()
                self._reason = "switched off (VLLM_CAMP2P_MULTISTREAM is not set to on)"
                self._status = {}
                logger.info("camp2p-overlap: %s; nothing patched (pid %d)", self._reason, os.getpid())
                return self._report_locked(enabled=False)
            if self.applied:
                return self._report_locked()
            try:
                man = manifest if manifest is not None else self._manifest_loader()
            except (ManifestError, OSError) as exc:
                self._reason = f"manifest error: {exc}"
                if strict:
                    raise PatchRefused(self._reason) from exc
                logger.error("camp2p-overlap: not applied: %s", self._reason)
                return self._report_locked()
            vc = self._version_check(man.vllm)
            self._vllm_version = vc.found
            if not vc.ok:
                self.manifest = man
                self.config = cfg
                self._reason = f"refused: {vc.reason}"
                self._status = {
                    t.id: TargetStatus(t.id, t.action, TargetState.REFUSED, vc.reason) for t in man.targets()
                }
                self._log_final()
                if strict:
                    raise PatchRefused(vc.reason)
                return self._report_locked()

            self.manifest = man
            self.config = cfg
            self.applied = True
            self.generation += 1
            self._reason = "applied"
            self._status = {
                t.id: TargetStatus(t.id, t.action, TargetState.NOT_IMPORTED, "waiting for import")
                for t in man.targets()
            }
            for mspec in man.modules:
                module = sys.modules.get(mspec.name)
                if module is not None:
                    self._patch_module(mspec, module)
                elif mspec.name not in self._hooks_pending:
                    self._hooks_pending.add(mspec.name)
                    wrapt.register_post_import_hook(self._on_import, mspec.name)
            report = self._report_locked()
            self._log_final()
            if report.refused and strict:
                self._unpatch_locked()
                raise PatchRefused(str(report))
            return report

    def unpatch(self, *, timeout: float = 30.0) -> bool:
        """Restore every original. Waits up to ``timeout`` seconds for steps
        already running wrapped to finish (new steps run the original
        meanwhile). Returns whether the layer is now fully removed."""
        me = threading.get_ident()
        with self._idle:
            if not self.applied and not self.records:
                return self._retry_stuck_locked()
            if self._active_steps.get(me):
                logger.error(
                    "camp2p-overlap: unpatch() called from inside a running FFN step on "
                    "this thread; refused (it would mix wrapped and original calls)"
                )
                return False
            self.unpatching = True
            try:
                drained = self._idle.wait_for(lambda: not self._active_steps, timeout)
                if not drained:
                    logger.error(
                        "camp2p-overlap: unpatch() refused: %d step(s) still running after %.1f s",
                        sum(self._active_steps.values()),
                        timeout,
                    )
                    return False
                if not self.applied and not self.records:
                    # Another thread finished the unpatch while this one waited.
                    return self._retry_stuck_locked()
                return self._unpatch_locked()
            finally:
                self.unpatching = False

    def is_applied(self) -> bool:
        with self._lock:
            return self.applied

    def status(self) -> PatchReport:
        with self._lock:
            self._check_reloads()
            return self._report_locked()

    # ------------------------------------------------------------------
    # used by the wrappers
    def step_enter(self) -> bool:
        """Count a step in if the layer is applied and not being removed."""
        with self._lock:
            if not self.applied or self.unpatching:
                return False
            me = threading.get_ident()
            self._active_steps[me] = self._active_steps.get(me, 0) + 1
            return True

    def step_exit(self) -> None:
        with self._idle:
            me = threading.get_ident()
            n = self._active_steps.get(me, 0) - 1
            if n <= 0:
                self._active_steps.pop(me, None)
            else:
                self._active_steps[me] = n
            if not self._active_steps:
                self._idle.notify_all()

    def stack_complete(self) -> str | None:
        """None when every target is wrapped/checked, else why not."""
        with self._lock:
            self._check_reloads()
            for st in self._status.values():
                if st.state not in (TargetState.WRAPPED, TargetState.CHECKED):
                    return f"{st.target} is {st.state.value}" + (f": {st.reason}" if st.reason else "")
            return None if self._status else "no targets"

    def owner_of(self, qualname: str) -> Any:
        """The live owner object (class or module) of a target by qualname."""
        with self._lock:
            for recs in self.records.values():
                for r in recs:
                    if r.spec.qualname == qualname:
                        return r.owner
        return None

    def read_target(self, qualname: str) -> Any:
        """A 'read' target's live object (e.g. ``_ffn_layer_indices``)."""
        man = self.manifest
        if man is None:
            return None
        for t in man.targets():
            if t.qualname == qualname:
                obj: Any = sys.modules.get(t.module)
                for part in t.qualname.split("."):
                    obj = getattr(obj, part, None)
                return obj
        return None

    def is_ours(self, obj: Any) -> bool:
        """Whether ``obj`` is a wrapper this engine installed (or a bound
        form of one, as ``Cls.method`` returns it)."""
        return self._handle_of(obj) is not None

    def _handle_of(self, obj: Any) -> Any:
        if id(obj) in self._our_handles:
            return obj
        if isinstance(obj, wrapt.BoundFunctionWrapper):
            parent = getattr(obj, "_self_parent", None)
            if parent is not None and id(parent) in self._our_handles:
                return parent
        return None

    # ------------------------------------------------------------------
    # internals (lock held)
    def _on_import(self, module: ModuleType) -> None:
        with self._lock:
            self._hooks_pending.discard(module.__name__)
            if not self.applied or self.manifest is None:
                return  # unpatched since the hook was registered
            try:
                mspec = self.manifest.module(module.__name__)
            except KeyError:
                return
            # wrapt calls the hook at the end of the module's execution, while
            # the import system still marks the module as initializing.
            self._patch_module(mspec, module, from_hook=True)
            self._log_final()
            if self.config.strict and any(self._status[t.id].state is TargetState.REFUSED for t in mspec.targets):
                raise PatchRefused(str(self._report_locked()))

    def _refuse_module(self, mspec: ModuleSpec, culprit: str, reason: str) -> None:
        for t in mspec.targets:
            why = reason if t.id == culprit else f"module refused because {culprit}: {reason}"
            self._status[t.id] = TargetStatus(t.id, t.action, TargetState.REFUSED, why)

    def _resolve(self, t: TargetSpec, module: ModuleType) -> tuple[Any, Any]:
        """(owner, raw __dict__ entry) or raise LookupError/TypeError with why."""
        owner: Any = module
        for part in t.owner_path:
            if part not in vars(owner):
                raise LookupError(f"{part!r} not found in {getattr(owner, '__name__', owner)!r}")
            owner = vars(owner)[part]
        if t.owner_path and not _is_class(owner):
            raise TypeError(f"{'.'.join(t.owner_path)} is not a class")
        if t.attribute not in vars(owner):
            where = "class" if _is_class(owner) else "module"
            inherited = hasattr(owner, t.attribute)
            raise LookupError(
                f"{t.attribute!r} is not defined in {where} {getattr(owner, '__qualname__', owner.__name__)}"
                + (" itself (only inherited)" if inherited else "")
            )
        return owner, vars(owner)[t.attribute]

    def _patch_module(self, mspec: ModuleSpec, module: ModuleType, *, from_hook: bool = False) -> None:
        if self.records.get(mspec.name):
            if self.records[mspec.name][0].owner is self._live_owner(self.records[mspec.name][0], module):
                return  # already wrapped (apply twice, or a fork child)
            # The module was reloaded: its classes are new objects.
            self._drop_records(mspec.name)
        if not from_hook and _initializing(module):
            # Another thread is still executing the module: its classes may not
            # exist yet. Its post-import hook, or the next status check, wraps it.
            for t in mspec.targets:
                self._status[t.id] = TargetStatus(
                    t.id, t.action, TargetState.NOT_IMPORTED, "module is still being imported"
                )
            return
        from camp2p_overlap.core.wrappers import WRAPPERS

        resolved: list[tuple[TargetSpec, Any, Any]] = []
        adopted: list[WrapRecord] = []
        for t in mspec.targets:
            try:
                owner, raw = self._resolve(t, module)
            except (LookupError, TypeError) as exc:
                self._refuse_module(mspec, t.id, f"missing: {exc}")
                return
            func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            try:
                ours = wrapt.find_wrapper(raw, predicate=self.is_ours)
            except wrapt.WrapperChainTooDeepError as exc:
                self._refuse_module(mspec, t.id, f"changed: {exc}")
                return
            if ours is not None:
                # Our wrapper is still in the chain: an earlier unpatch could
                # not remove it (a foreign, non-wrapt wrapper sits above it).
                # Take it back instead of wrapping a second time.
                rec = self._stuck_record(owner, t.attribute, self._handle_of(ours))
                if rec is None:
                    self._refuse_module(mspec, t.id, "already carries a camp2p-overlap wrapper")
                    return
                adopted.append(rec)
            if not callable(func):
                self._refuse_module(mspec, t.id, f"changed: {type(raw).__name__} is not callable")
                return
            try:
                diff = signature_difference(t.signature, signature_of(func))
            except (TypeError, ValueError) as exc:
                diff = f"signature unreadable: {exc}"
            if diff:
                self._refuse_module(mspec, t.id, f"signature changed: {diff}")
                return
            if t.action == "wrap" and t.wrapper not in WRAPPERS:
                self._refuse_module(mspec, t.id, f"no wrapper named {t.wrapper!r}")
                return
            resolved.append((t, owner, raw))

        done: list[WrapRecord] = []
        try:
            for t, owner, raw in resolved:
                if t.action != "wrap":
                    continue
                taken = next((r for r in adopted if r.owner is owner and r.attribute == t.attribute), None)
                if taken is not None:
                    taken.spec = t
                    done.append(taken)
                    continue
                handle = wrapt.wrap_function_wrapper(owner, t.attribute, WRAPPERS[t.wrapper])
                self._our_handles.add(id(handle))
                done.append(WrapRecord(mspec.name, owner, t.attribute, raw, handle, t))
        except Exception as exc:  # noqa: BLE001 - rolled back and reported
            for rec in reversed(done):
                if rec in adopted:
                    self.stuck.append(rec)  # was stuck before; stays so
                else:
                    self._unwrap(rec)
            self._refuse_module(mspec, t.id, f"wrapping failed: {type(exc).__name__}: {exc}")
            return
        for rec in adopted:
            if rec in self.stuck:
                self.stuck.remove(rec)
        self.records[mspec.name] = done
        for t, _, _ in resolved:
            state = TargetState.WRAPPED if t.action == "wrap" else TargetState.CHECKED
            self._status[t.id] = TargetStatus(t.id, t.action, state, "")

    def _stuck_record(self, owner: Any, attribute: str, handle: Any) -> WrapRecord | None:
        for rec in self.stuck:
            if rec.owner is owner and rec.attribute == attribute and rec.handle is handle:
                return rec
        return None

    def _live_owner(self, rec: WrapRecord, module: ModuleType) -> Any:
        owner: Any = module
        for part in rec.spec.owner_path:
            owner = vars(owner).get(part)
            if owner is None:
                return None
        return owner

    def _check_reloads(self) -> None:
        """A module reloaded since it was wrapped has new, unwrapped classes:
        wrap them again (hooks do not fire on reload)."""
        if not self.applied or self.manifest is None:
            return
        for mspec in self.manifest.modules:
            recs = self.records.get(mspec.name)
            module = sys.modules.get(mspec.name)
            if module is None or _initializing(module):
                continue
            if recs and recs[0].owner is not self._live_owner(recs[0], module):
                self._patch_module(mspec, module)
            elif not recs and any(
                self._status.get(t.id) is not None and self._status[t.id].state is TargetState.NOT_IMPORTED
                for t in mspec.targets
            ):
                # Imported while apply() ran on another thread, before its hook existed.
                self._patch_module(mspec, module)
                self._log_final()

    def _drop_records(self, name: str) -> None:
        for rec in reversed(self.records.pop(name, [])):
            self._unwrap(rec)

    def _unwrap(self, rec: WrapRecord) -> bool:
        """Remove one wrapper of ours, found through the registry only."""
        try:
            wrapt.unwrap_object(rec.owner, rec.attribute, rec.handle)
        except wrapt.WrapperNotFoundError:
            current = vars(rec.owner).get(rec.attribute)
            if current is not None and self._holds(current, rec.handle):
                # A foreign wrapper captured a bound form of ours (e.g.
                # ``orig = Cls.meth`` and a closure calling it).
                return self._stuck(rec, "a foreign wrapper above it calls it through a bound method it captured")
            logger.warning(
                "camp2p-overlap: %s.%s no longer carries our wrapper (replaced by a third party); left as it is",
                rec.module,
                rec.spec.qualname,
            )
        except wrapt.WrapperNotOutermostError as exc:
            return self._stuck(rec, str(exc))
        self._our_handles.discard(id(rec.handle))
        return True

    def _stuck(self, rec: WrapRecord, why: str) -> bool:
        logger.error(
            "camp2p-overlap: cannot remove our wrapper from %s.%s: %s; it stays installed "
            "and passes every call straight through to the original",
            rec.module,
            rec.spec.qualname,
            why,
        )
        if rec not in self.stuck:
            self.stuck.append(rec)
        return False

    def _holds(self, obj: Any, handle: Any) -> bool:
        """Whether ``handle`` (or a bound form of it) is in ``obj``'s chain."""
        try:
            return wrapt.find_wrapper(obj, predicate=lambda e: self._handle_of(e) is handle) is not None
        except wrapt.WrapperChainTooDeepError:
            return True  # cannot tell: assume it is still there

    def _retry_stuck_locked(self) -> bool:
        """Try again to remove wrappers an earlier unpatch could not (a
        foreign, non-wrapt wrapper sat on top); True when none is left."""
        if not self.stuck:
            return True
        stuck, self.stuck = self.stuck, []
        for rec in stuck:
            self._unwrap(rec)  # appends to self.stuck again when still blocked
        return not self.stuck

    def _unpatch_locked(self) -> bool:
        ok = self._retry_stuck_locked()
        for name in reversed(list(self.records)):
            for rec in reversed(self.records[name]):
                ok = self._unwrap(rec) and ok
        self.records.clear()
        self.applied = False
        self.generation += 1
        self._status = {
            t.id: TargetStatus(t.id, t.action, TargetState.INACTIVE, "unpatched")
            for t in (self.manifest.targets() if self.manifest else ())
        }
        self._reason = "unpatched" if ok else "unpatched; some wrappers could not be removed (see log)"
        from camp2p_overlap.core import wrappers

        wrappers.close_stream_sets()
        logger.info("camp2p-overlap: %s (pid %d)", self._reason, os.getpid())
        return ok

    def _report_locked(self, *, enabled: bool | None = None) -> PatchReport:
        return PatchReport(
            enabled=self.config.enabled if enabled is None else enabled,
            applied=self.applied,
            stack=self.manifest.name if self.manifest else None,
            vllm_version=self._vllm_version,
            wrapt_version=_wrapt_version(),
            reason=self._reason,
            targets=tuple(self._status.values()),
        )

    def _log_final(self) -> None:
        """The one line per process: once every target is settled (wrapped,
        checked or refused), or at once on a refusal."""
        if self._logged_generation == self.generation:
            return
        states = [t.state for t in self._status.values()]
        if TargetState.REFUSED in states:
            self._log_outcome(logging.WARNING)
        elif TargetState.NOT_IMPORTED not in states:
            self._log_outcome(logging.INFO)
        else:
            return
        self._logged_generation = self.generation

    def _log_outcome(self, level: int, module: str | None = None) -> None:
        report = self._report_locked()
        outcomes = "; ".join(
            f"{t.target.rsplit('.', 2)[-2] if '.' in t.target else t.target}.{t.target.rsplit('.', 1)[-1]}="
            f"{t.state.value}" + (f" ({t.reason})" if t.state is TargetState.REFUSED else "")
            for t in report.targets
        )
        logger.log(
            level,
            "camp2p-overlap %s: pid=%d vllm=%s wrapt=%s stack=%s%s: %s",
            report.reason,
            report.pid,
            report.vllm_version,
            report.wrapt_version,
            report.stack,
            f" on import of {module}" if module else "",
            outcomes,
        )


#: The process-wide engine behind ``camp2p_overlap.apply()``.
ENGINE = PatchEngine()
