"""The patch engine, the one lifecycle object of a process's patch layer (shaped like OpenTelemetry's
``BaseInstrumentor``): ``apply()`` reads the configuration, picks the stack whose pinned versions are installed,
binds the wrappers to this engine and installs them (now, or from a post-import hook); ``unpatch()`` drains the
running steps, removes exactly what was installed and calls the on-unpatch hook. The jobs live beside it: the
installer, the step gate and the status report (``core/patching/``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import wrapt

from camp2p_overlap.core.config import ConfigError, OverlapConfig, load_config, strict_requested
from camp2p_overlap.core.fork import after_fork_in_child
from camp2p_overlap.core.log import logger
from camp2p_overlap.core.patching.features import FEATURES, requested_features
from camp2p_overlap.core.patching.gate import StepGate
from camp2p_overlap.core.patching.installer import Installer, Wrapper, initializing
from camp2p_overlap.core.patching.manifest import (
    ManifestError,
    ModuleSpec,
    StackManifest,
    load_manifests,
    select_stack,
    stack_version_check,
)
from camp2p_overlap.core.patching.reexec_watch import REEXEC_WATCH
from camp2p_overlap.core.patching.status_report import PatchReport, StatusBoard, TargetState, statuses, wrapt_version
from camp2p_overlap.core.patching.versions import VersionCheck

#: :attr:`PatchEngine.unready` while the engine is not applied.
NOT_APPLIED = "the layer is not applied"


class PatchRefused(RuntimeError):
    """Raised instead of logging when strict mode is on."""


class PatchEngine:
    """Owns the patch state of one process (or of one benchmark policy)."""

    def __init__(
        self,
        *,
        wrapper_factory: Callable[[PatchEngine], Mapping[str, Wrapper]],
        on_unpatch: Callable[[], None] = lambda: None,
        manifest_loader: Callable[[], Sequence[StackManifest]] = load_manifests,
        version_check: Callable[[StackManifest], VersionCheck] = stack_version_check,
    ) -> None:
        self._wrapper_factory = wrapper_factory
        self._on_unpatch = on_unpatch
        self._manifest_loader = manifest_loader
        #: The version gate each apply() judges a stack with (the emulation
        #: and tests replace it to accept an emulated stack).
        self.version_check = version_check
        self._lock = threading.RLock()
        self.gate = StepGate()
        self.installer = Installer()
        self.applied = False
        self.config = OverlapConfig()
        self.manifest: StackManifest | None = None
        self._wrappers: Mapping[str, Wrapper] = {}
        self.board = StatusBoard()
        #: Modules with a post-import hook not fired yet (a hook fires once).
        self._hooks_pending: set[str] = set()
        self._vllm_version: str | None = None
        #: Strict mode as the last apply() resolved it (its argument, else the configuration).
        self._strict = False
        #: The optional features strict mode makes required (those the
        #: configuration asks for): their targets refuse their module.
        self._required_features: frozenset[str] = frozenset()
        #: ``feature -> reason`` of every optional feature refused now; a new
        #: dict on each change, so a step reads it without the lock.
        self._feature_refusals: dict[str, str] = {}
        #: Why a step may not engage now (None: every target is ready): all a step reads of the lifecycle, set by
        #: apply(), unpatch(), refresh(), the post-import hook and the re-execution watch (a reload).
        self.unready: str | None = NOT_APPLIED
        #: Moves on every apply, unpatch, install and refresh: a runner's steps then read targets and config again.
        self.generation = 0
        after_fork_in_child(self._new_lock)  # a lock held by a thread that is gone would stay held

    def _new_lock(self) -> None:
        self._lock = threading.RLock()

    # -- lifecycle ---------------------------------------------------------
    def apply(
        self, *, strict: bool | None = None, config: OverlapConfig | None = None, manifest: StackManifest | None = None
    ) -> PatchReport:
        with self._lock:
            try:
                cfg = config if config is not None else load_config()
            except ConfigError as exc:
                if strict if strict is not None else strict_requested():
                    raise
                if not self.applied:
                    self.board.settle(f"configuration error: {exc}", {})
                logger.error(
                    "camp2p-overlap: %s: %s",
                    "apply() ignored (already applied)" if self.applied else "not applied",
                    exc,
                )
                return self.report()
            strict = cfg.strict if strict is None else strict
            if self.applied:
                if not cfg.enabled:
                    self.board.reason = "applied earlier; the switch is now off (call unpatch() to remove)"
                self.refresh()
                return self.report()
            self.config = cfg
            self._strict = strict
            self._required_features = requested_features(cfg) if strict else frozenset()
            if not cfg.enabled:
                self.board.settle("switched off (VLLM_CAMP2P_MULTISTREAM is not set to on)", {})
                logger.info("camp2p-overlap: %s; nothing patched (pid %d)", self.board.reason, os.getpid())
                return self.report(enabled=False)
            try:
                man, vc = select_stack((manifest,) if manifest else self._manifest_loader(), self.version_check)
            except (ManifestError, OSError) as exc:
                self.board.settle(f"manifest error: {exc}", {})
                return self._refusal(strict, exc)
            self.manifest, self._vllm_version = man, vc.found
            if not vc.ok:
                self.board.settle(f"refused: {vc.reason}", statuses(man.targets(), TargetState.REFUSED, vc.reason))
                return self._refusal(strict)
            self._wrappers = self._wrapper_factory(self)  # bound to this engine, once per apply
            self.applied = True
            self.board.settle("applied", statuses(man.targets(), TargetState.NOT_IMPORTED, "waiting for import"))
            self.gate.open()
            # Watched before the modules are looked at: an import from now on,
            # and any later reload, reaches _on_import.
            REEXEC_WATCH.watch([m.name for m in man.modules], self._on_import)
            for mspec in man.modules:
                module = sys.modules.get(mspec.name)
                if module is not None:
                    self._install(mspec, module)
                elif mspec.name not in self._hooks_pending:  # a hook cannot be removed: one pending per module
                    self._hooks_pending.add(mspec.name)
                    wrapt.register_post_import_hook(self._on_import, mspec.name)
            self.board.log_when_settled(self.report())
            self._settle_readiness()
            report = self.report()
            if report.required_refused and strict:
                self._remove()
                raise PatchRefused(str(report))
            return report

    def unpatch(self, *, timeout: float = 30.0) -> bool:
        """Restore every original. Waits up to ``timeout`` seconds for steps
        already running wrapped (new steps run the original meanwhile).
        Returns whether the patch layer is now fully removed."""
        with self._lock:
            if not self.applied:
                return self.installer.retry_stuck()
            if self.gate.running_here():
                logger.error(
                    "camp2p-overlap: unpatch() called from inside a running FFN step on "
                    "this thread; refused (it would mix wrapped and original calls)"
                )
                return False
        try:
            drained = self.gate.drain(timeout)  # without the lock: running steps may still take it
            with self._lock:
                if not drained:
                    logger.error(
                        "camp2p-overlap: unpatch() refused: %d step(s) still running after %.1f s",
                        self.gate.running(),
                        timeout,
                    )
                    return False
                if not self.applied:  # another thread finished the unpatch meanwhile
                    return self.installer.retry_stuck()
                return self._remove()
        finally:
            self.gate.end_drain()

    def refresh(self) -> None:
        """Wrap what no hook saw: a target module reloaded since it was
        wrapped, or imported on another thread while ``apply()`` ran, before
        its hook existed (``status()`` never refreshes)."""
        self.refresh_and_report_unready()

    def refresh_and_report_unready(self) -> str | None:
        """:meth:`refresh` (what a wrapped step calls), then why the stack is
        not ready to engage (the first target neither wrapped nor checked), or None."""
        with self._lock:
            if not self.applied or self.manifest is None:
                return self._unready(())
            missed = self.installer.needing_install(self.manifest, self._waiting)
            for mspec, module, _ in missed:
                self._install(mspec, module)
            if missed:
                self.board.log_when_settled(self.report())
            return self._settle_readiness()

    # -- reading -----------------------------------------------------------
    def is_applied(self) -> bool:
        with self._lock:
            return self.applied

    def is_ours(self, obj: Any) -> bool:
        """Whether ``obj`` is a wrapper this engine installed (or its bound form)."""
        return self.installer.is_ours(obj)

    def feature_refusal(self, feature: str) -> str | None:
        """Why optional ``feature`` (a key of ``core.patching.features.FEATURES``)
        is refused, or None: a target only it needs is missing or changed in an
        installed module. Set on install, cleared by ``unpatch()``; lock-free."""
        return self._feature_refusals.get(feature)

    def features_refused(self) -> dict[str, str]:
        """``feature -> reason`` of every optional feature refused now."""
        return dict(self._feature_refusals)

    @property
    def wrappers(self) -> Mapping[str, Wrapper]:
        """The wrappers (and routers) the last ``apply()`` bound to this
        engine, by their manifest name; empty while unpatched."""
        return self._wrappers

    def status(self) -> PatchReport:
        """The state of every target; a module reloaded since it was wrapped
        shows as waiting until :meth:`refresh` wraps it again."""
        with self._lock:
            return self.report()

    def _unready(self, pending: Iterable[tuple[ModuleSpec, Any, str]]) -> str | None:
        for mspec, _, why in pending:
            return f"{mspec.targets[0].id} is {TargetState.NOT_IMPORTED.value}: {why}"
        return PatchReport.unready_of(self.board.targets.values())

    def report(self, *, enabled: bool | None = None) -> PatchReport:
        targets = dict(self.board.targets)
        for mspec, _, why in self.installer.needing_install(self.manifest, self._waiting) if self.applied else ():
            targets.update(statuses(mspec.targets, TargetState.NOT_IMPORTED, why))
        return PatchReport(
            enabled=self.config.enabled if enabled is None else enabled,
            applied=self.applied,
            stack=self.manifest.name if self.manifest else None,
            vllm_version=self._vllm_version,
            wrapt_version=wrapt_version(),
            reason=self.board.reason,
            targets=tuple(targets.values()),
        )

    # -- internals (lock held) ---------------------------------------------
    def _on_import(self, module: ModuleType) -> None:
        """A target module's body ran: its first import (wrapt's post-import
        hook) or any later one, a reload included (the re-execution watch).
        Both may call it for one import: installing is idempotent."""
        with self._lock:
            self._hooks_pending.discard(module.__name__)
            if not self.applied or self.manifest is None:
                return  # unpatched since the hook was registered
            try:
                mspec = self.manifest.module(module.__name__)
            except KeyError:
                return  # another stack's module
            # Both hooks run at the end of the module's execution, while the
            # import system still marks the module as initializing.
            self._install(mspec, module, from_hook=True)
            self.board.log_when_settled(self.report())
            self._settle_readiness()
            if self._strict and self.board.any_required_refused(mspec.targets):
                raise PatchRefused(str(self.report()))

    def _settle_readiness(self) -> str | None:
        """Recompute :attr:`unready` from the targets now (lock held)."""
        self.generation += 1
        if not self.applied or self.manifest is None:
            self.unready = NOT_APPLIED
        else:
            self.unready = self._unready(self.installer.needing_install(self.manifest, self._waiting))
        return self.unready

    def _install(self, mspec: ModuleSpec, module: ModuleType, *, from_hook: bool = False) -> None:
        if not from_hook and initializing(module):
            # Another thread still executes the module: its classes may not
            # exist yet. Its post-import hook, or refresh(), wraps it.
            self.board.update(statuses(mspec.targets, TargetState.NOT_IMPORTED, "module is still being imported"))
            return
        self.generation += 1
        self.board.update(self.installer.install(mspec, module, self._wrappers, self._required_features))
        self._note_feature_refusals()

    def _note_feature_refusals(self) -> None:
        """Take the optional features refused now from the board; log each
        new (or changed) reason once, at WARNING, and a feature no longer
        refused (its module was reloaded with the target back) at INFO."""
        now = self.board.features_refused()
        before, self._feature_refusals = self._feature_refusals, now
        for feature, reason in now.items():
            if before.get(feature) != reason:
                logger.warning("camp2p-overlap: %s", reason)
        for feature in before.keys() - now.keys():
            needed = [t for t in self.manifest.targets() if t.optional == feature] if self.manifest else []
            if needed and all((st := self.board.targets.get(t.id)) is not None and st.ready for t in needed):
                logger.info(
                    "camp2p-overlap: %s are no longer refused: %s installed again",
                    FEATURES[feature].refused,
                    ", ".join(t.qualname for t in needed),
                )

    def _waiting(self, mspec: ModuleSpec) -> bool:
        return self.board.any_in(mspec.targets, TargetState.NOT_IMPORTED)

    def _remove(self) -> bool:
        ok = self.installer.uninstall_all()
        self.generation += 1
        self.applied = False
        self.unready = NOT_APPLIED
        REEXEC_WATCH.unwatch(self._on_import)
        self.gate.close()
        targets = self.manifest.targets() if self.manifest else ()
        reason = "unpatched" if ok else "unpatched; some wrappers could not be removed (see log)"
        self.board.settle(reason, statuses(targets, TargetState.INACTIVE, "unpatched"))
        self._feature_refusals = {}
        self._wrappers = {}
        self._on_unpatch()
        logger.info("camp2p-overlap: %s (pid %d)", self.board.reason, os.getpid())
        return ok

    def _refusal(self, strict: bool, cause: BaseException | None = None) -> PatchReport:
        if self.board.targets:
            self.board.log_when_settled(self.report())
        else:
            logger.error("camp2p-overlap: not applied: %s", self.board.reason)
        if strict:
            raise PatchRefused(self.board.reason.removeprefix("refused: ")) from cause
        return self.report()
