"""The installer: resolves each target of a module, checks its signature against the manifest, wraps the module's
targets all-or-nothing (an optional target missing or changed is left out alone, refusing only its feature), and
removes exactly what it installed, unwrapping only from its registry of every wrap; a wrapper of ours that a
foreign, non-wrapt wrapper covers cannot be removed and is kept as *stuck* until it can."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FunctionType, MethodType, ModuleType
from typing import Any

import wrapt

from camp2p_overlap.core.log import logger
from camp2p_overlap.core.patching.features import FEATURES
from camp2p_overlap.core.patching.manifest import (
    ModuleSpec,
    StackManifest,
    TargetSpec,
    signature_difference,
    signature_of,
)
from camp2p_overlap.core.patching.status_report import TargetState, TargetStatus

#: Set on every wrapper function a camp2p-overlap wrapper factory builds, so
#: an installer recognises wrappers of another engine in the same process.
MARK = "__camp2p_overlap_wrapper__"


@dataclass(eq=False)  # compared by identity
class WrapRecord:
    module: str
    owner: Any
    attribute: str
    original: Any  # the raw __dict__ entry before wrapping
    handle: Any  # what we installed (core.patching.method_wrapper); None: nothing (read, route)
    spec: TargetSpec


class ModuleRefused(Exception):
    """One target of a module cannot be wrapped: the whole module is left alone."""

    def __init__(self, culprit: str, reason: str) -> None:
        super().__init__(f"{culprit}: {reason}")
        self.culprit = culprit
        self.reason = reason

    def statuses(self, mspec: ModuleSpec) -> dict[str, TargetStatus]:
        return {
            t.id: TargetStatus(
                t.id,
                t.action,
                TargetState.REFUSED,
                self.reason if t.id == self.culprit else f"module refused because {self.culprit}: {self.reason}",
            )
            for t in mspec.targets
        }


class _TargetProblem(Exception):
    """Why one target cannot be installed. ``optional_problem``, for a target missing or changed, is what an optional
    target's feature refusal says (``is missing (...)``); None: the module is refused whatever the target."""

    def __init__(self, reason: str, optional_problem: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.optional_problem = optional_problem


RELOADED = "module reloaded since it was wrapped; the next wrapped step or apply() wraps it"
IMPORTED_UNSEEN = "module imported while apply() ran; the next wrapped step or apply() wraps it"


def initializing(module: ModuleType) -> bool:
    """Whether ``module`` is in ``sys.modules`` but still executing."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def live_owner(module: ModuleType, t: TargetSpec) -> Any:
    """The object that holds ``t`` in ``module`` now (None when gone)."""
    owner: Any = module
    for part in t.owner_path:
        owner = vars(owner).get(part)
        if owner is None:
            return None
    return owner


def target_named(manifest: StackManifest, qualname: str) -> TargetSpec | None:
    """``manifest``'s target of that qualname, or None."""
    return next((t for t in manifest.targets() if t.qualname == qualname), None)


def live_namespace(t: TargetSpec) -> Any:
    """The namespace that holds target ``t`` now (its class's or module's ``__dict__``, a live view: what it holds
    is read at each lookup), or None while its module is not imported (or its owner is gone)."""
    module = sys.modules.get(t.module)
    owner = None if module is None else live_owner(module, t)
    return None if owner is None else vars(owner)


def _resolve(t: TargetSpec, module: ModuleType) -> tuple[Any, Any]:
    """(owner, raw ``__dict__`` entry); raises ``LookupError``/``TypeError`` saying why."""
    owner: Any = module
    for part in t.owner_path:
        if part not in vars(owner):
            raise LookupError(f"{part!r} not found in {getattr(owner, '__name__', owner)!r}")
        owner = vars(owner)[part]
    if t.owner_path and not isinstance(owner, type):
        raise TypeError(f"{'.'.join(t.owner_path)} is not a class")
    if t.attribute not in vars(owner):
        where = "class" if isinstance(owner, type) else "module"
        inherited = hasattr(owner, t.attribute)
        raise LookupError(
            f"{t.attribute!r} is not defined in {where} {getattr(owner, '__qualname__', owner.__name__)}"
            + (" itself (only inherited)" if inherited else "")
        )
    return owner, vars(owner)[t.attribute]


def _is_marked(obj: Any) -> bool:
    """Whether ``obj`` is a wrapper a camp2p-overlap installer made (of any engine)."""
    if isinstance(obj, FunctionType):
        return bool(vars(obj).get(MARK, False))
    return bool(getattr(getattr(obj, "_self_wrapper", None), MARK, False))


def _marked_wrapper(original: Any, wrapper: Wrapper, on_class: bool) -> Any:
    """``method_wrapper``, marked as ours when a plain function (a wrapt wrapper is known by its wrapper's mark)."""
    handle = method_wrapper(original, wrapper, on_class=on_class)
    if isinstance(handle, FunctionType):
        vars(handle)[MARK] = True
    return handle


class Installer:
    """Owns every wrap of one engine. Callers hold the engine's lock."""

    def __init__(self) -> None:
        self.records: dict[str, list[WrapRecord]] = {}
        #: Per installed module: the status of each optional target refused alone (nothing installed for it).
        self.optional_refused: dict[str, dict[str, TargetStatus]] = {}
        self.stuck: list[WrapRecord] = []
        self._handles: set[int] = set()

    # -- recognising our wrappers ---------------------------------------
    def handle_of(self, obj: Any) -> Any:
        """Our wrapper behind ``obj`` (itself, or the parent of its bound form), or None."""
        if id(obj) in self._handles:
            return obj
        if isinstance(obj, MethodType) and id(obj.__func__) in self._handles:
            return obj.__func__
        if isinstance(obj, wrapt.BoundFunctionWrapper):
            parent = getattr(obj, "_self_parent", None)
            if parent is not None and id(parent) in self._handles:
                return parent
        return None

    def is_ours(self, obj: Any) -> bool:
        return self.handle_of(obj) is not None

    def claim(self, handle: Any) -> None:
        """Count ``handle`` (a wrapper object) as ours, its bound forms included."""
        self._handles.add(id(handle))

    def routes(self) -> tuple[tuple[Any, TargetSpec], ...]:
        """(class, spec) of every installed ``route`` target, in manifest order."""
        return tuple(
            (r.owner, r.spec) for recs in list(self.records.values()) for r in recs if r.spec.action == "route"
        )

    # -- install --------------------------------------------------------
    def is_current(self, mspec: ModuleSpec, module: ModuleType) -> bool:
        """Whether the module's wraps sit on the classes it holds now (False after a reload replaced them)."""
        recs = self.records.get(mspec.name)
        return bool(recs) and recs[0].owner is live_owner(module, recs[0].spec)

    def needing_install(
        self, manifest: StackManifest | None, waiting: Callable[[ModuleSpec], bool]
    ) -> list[tuple[ModuleSpec, ModuleType, str]]:
        """Imported target modules no hook wrapped, with why: reloaded since they were wrapped (their classes are new
        objects), or imported while they were ``waiting`` for their hook (on another thread, mid-apply)."""
        out = []
        for mspec in manifest.modules if manifest is not None else ():
            module = sys.modules.get(mspec.name)
            if module is None or initializing(module):
                continue
            if self.records.get(mspec.name):
                if not self.is_current(mspec, module):
                    out.append((mspec, module, RELOADED))
            elif waiting(mspec):
                out.append((mspec, module, IMPORTED_UNSEEN))
        return out

    def install(
        self,
        mspec: ModuleSpec,
        module: ModuleType,
        wrappers: Mapping[str, Wrapper],
        required_features: frozenset[str] = frozenset(),
    ) -> dict[str, TargetStatus]:
        """Wrap every 'wrap' target of ``module`` and check every 'read' and 'route' target, or nothing at all; an
        optional target missing or changed is left out alone (refused with its feature), unless its feature is in
        ``required_features`` (then it refuses the module like any other target). Returns each target's status."""
        if self.records.get(mspec.name):
            if self.is_current(mspec, module):
                return self._settled(mspec)  # already wrapped (apply twice, or a fork child)
            self._drop(mspec.name)  # reloaded: its classes are new objects
        self.optional_refused.pop(mspec.name, None)
        try:
            resolved, adopted, left_out = self._check(mspec, module, wrappers, required_features)
            done = self._wrap_all(mspec, resolved, adopted, wrappers)
        except ModuleRefused as refusal:
            return refusal.statuses(mspec)
        self.stuck = [rec for rec in self.stuck if rec not in adopted]
        self.records[mspec.name] = done
        if left_out:
            self.optional_refused[mspec.name] = left_out
        return self._settled(mspec)

    def _settled(self, mspec: ModuleSpec) -> dict[str, TargetStatus]:
        left_out = self.optional_refused.get(mspec.name, {})
        return {
            t.id: left_out.get(t.id)
            or TargetStatus(t.id, t.action, TargetState.WRAPPED if t.action == "wrap" else TargetState.CHECKED)
            for t in mspec.targets
        }

    def _check(
        self, mspec: ModuleSpec, module: ModuleType, wrappers: Mapping[str, Wrapper], required_features: frozenset[str]
    ) -> tuple[list[tuple[TargetSpec, Any, Any]], list[WrapRecord], dict[str, TargetStatus]]:
        """Every target that installs (with its owner and raw entry), the stuck records of ours taken back, and the
        optional targets left out; raises :class:`ModuleRefused` for the first target that refuses the module."""
        resolved: list[tuple[TargetSpec, Any, Any]] = []
        adopted: list[WrapRecord] = []
        left_out: dict[str, TargetStatus] = {}
        for t in mspec.targets:
            try:
                owner, raw, rec = self._check_target(t, module, wrappers)
            except _TargetProblem as problem:
                if t.optional is None or problem.optional_problem is None:
                    raise ModuleRefused(t.id, problem.reason) from None
                if t.optional in required_features:
                    feature = FEATURES[t.optional]
                    raise ModuleRefused(
                        t.id,
                        f"{problem.reason} (in strict mode the configuration asks for {feature.refused}, "
                        f"{feature.setting}, which need it)",
                    ) from None
                reason = FEATURES[t.optional].reason(t.qualname, problem.optional_problem)
                left_out[t.id] = TargetStatus(t.id, t.action, TargetState.REFUSED, reason, feature=t.optional)
                continue
            if rec is not None:
                adopted.append(rec)
            resolved.append((t, owner, raw))
        return resolved, adopted, left_out

    def _check_target(
        self, t: TargetSpec, module: ModuleType, wrappers: Mapping[str, Wrapper]
    ) -> tuple[Any, Any, WrapRecord | None]:
        """(owner, raw entry, our stuck record to take back or None); raises :class:`_TargetProblem` saying why not."""
        try:
            owner, raw = _resolve(t, module)
        except (LookupError, TypeError) as exc:
            raise _TargetProblem(f"missing: {exc}", f"is missing ({exc})") from None
        func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        try:
            ours = wrapt.find_wrapper(raw, predicate=self.is_ours)
            foreign_camp2p = ours is None and wrapt.find_wrapper(raw, predicate=_is_marked) is not None
        except wrapt.WrapperChainTooDeepError as exc:
            raise _TargetProblem(f"changed: {exc}") from None
        if foreign_camp2p:
            raise _TargetProblem("already carries a camp2p-overlap wrapper of another patch engine")
        rec = None
        if ours is not None:
            # Our wrapper is still in the chain (an earlier unpatch could not remove it): take it back, not wrap again.
            handle = self.handle_of(ours)
            rec = next(
                (r for r in self.stuck if r.owner is owner and r.attribute == t.attribute and r.handle is handle), None
            )
            if rec is None:
                raise _TargetProblem("already carries a camp2p-overlap wrapper")
        if not callable(func):
            what = f"{type(raw).__name__} is not callable"
            raise _TargetProblem(f"changed: {what}", f"has changed ({what})")
        try:
            diff = signature_difference(t.signature, signature_of(func))
        except (TypeError, ValueError) as exc:
            diff = f"signature unreadable: {exc}"
        if diff:
            raise _TargetProblem(f"signature changed: {diff}", f"has a changed signature ({diff})")
        if t.action == "wrap" and t.wrapper not in wrappers:
            raise _TargetProblem(f"no wrapper named {t.wrapper!r}")
        if t.action == "route" and t.router not in wrappers:
            raise _TargetProblem(f"no router named {t.router!r}")
        if t.action == "route" and not isinstance(owner, type):
            raise _TargetProblem("changed: a routed target must be a class attribute")
        return owner, raw, rec

    def _wrap_all(
        self,
        mspec: ModuleSpec,
        resolved: list[tuple[TargetSpec, Any, Any]],
        adopted: list[WrapRecord],
        wrappers: Mapping[str, Wrapper],
    ) -> list[WrapRecord]:
        done: list[WrapRecord] = []
        t = mspec.targets[0]
        try:
            for t, owner, raw in resolved:
                if t.action != "wrap":  # checked only: registered, nothing installed
                    done.append(WrapRecord(mspec.name, owner, t.attribute, raw, None, t))
                    continue
                taken = next((r for r in adopted if r.owner is owner and r.attribute == t.attribute), None)
                if taken is not None:
                    taken.spec = t
                    done.append(taken)
                    continue
                wrapper = wrappers[t.wrapper]  # type: ignore[index]
                on_class = isinstance(owner, type)
                handle = wrapt.wrap_object(owner, t.attribute, _marked_wrapper, (wrapper, on_class))
                self.claim(handle)
                done.append(WrapRecord(mspec.name, owner, t.attribute, raw, handle, t))
        except Exception as exc:  # noqa: BLE001 - rolled back and reported
            for rec in reversed(done):
                if rec in adopted or rec.handle is None:
                    continue  # was stuck before (stays so), or nothing was installed
                self._unwrap(rec)
            raise ModuleRefused(t.id, f"wrapping failed: {type(exc).__name__}: {exc}") from None
        return done

    # -- uninstall ------------------------------------------------------
    def uninstall_all(self) -> bool:
        """Remove every wrapper of ours; True when none is left anywhere."""
        ok = self.retry_stuck()
        for name in reversed(list(self.records)):
            for rec in reversed(self.records[name]):
                ok = self._unwrap(rec) and ok
        self.records.clear()
        self.optional_refused.clear()
        return ok

    def retry_stuck(self) -> bool:
        """Try again to remove wrappers an earlier unpatch could not (a foreign, non-wrapt wrapper sat on top); True
        when none is left."""
        if not self.stuck:
            return True
        stuck, self.stuck = self.stuck, []
        for rec in stuck:
            self._unwrap(rec)  # appends to self.stuck again when still blocked
        return not self.stuck

    def _drop(self, name: str) -> None:
        for rec in reversed(self.records.pop(name, [])):
            self._unwrap(rec)

    def _unwrap(self, rec: WrapRecord) -> bool:
        """Remove one wrapper of ours, found through the registry only."""
        if rec.handle is None:
            return True  # a checked target: nothing was installed
        try:
            wrapt.unwrap_object(rec.owner, rec.attribute, rec.handle)
        except wrapt.WrapperNotFoundError:
            current = vars(rec.owner).get(rec.attribute)
            if current is not None and self._holds(current, rec.handle):
                # A foreign wrapper captured a bound form of ours (``orig = Cls.meth`` and a closure calling it).
                return self._stuck(rec, "a foreign wrapper above it calls it through a bound method it captured")
            logger.warning(
                "camp2p-overlap: %s.%s no longer carries our wrapper (replaced by a third party); left as it is",
                rec.module,
                rec.spec.qualname,
            )
        except wrapt.WrapperNotOutermostError as exc:
            return self._stuck(rec, str(exc))
        self._handles.discard(id(rec.handle))
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
            return wrapt.find_wrapper(obj, predicate=lambda e: self.handle_of(e) is handle) is not None
        except wrapt.WrapperChainTooDeepError:
            return True  # cannot tell: assume it is still there


Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]


def method_wrapper(original: Any, wrapper: Wrapper, *, on_class: bool = True) -> Any:
    """What wraps ``original`` (a class's raw ``__dict__`` entry, or with ``on_class`` false a module's function): a
    ``wrapt.FunctionWrapper``, except that a plain function in a class gets a plain function calling ``wrapper(bound
    original, self, args, kwargs)`` as wrapt would, since a ``FunctionWrapper`` builds a bound proxy at every instance
    lookup, at several times the cost (docs/benchmark.md, history, as of 5f75083). Its ``__wrapped__`` is the
    original, so wrapt's chain search, ``unwrap_object`` and ``inspect.signature`` see through it."""
    if not (on_class and isinstance(original, FunctionType)):
        return wrapt.FunctionWrapper(original, wrapper)

    def patched(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        return wrapper(MethodType(original, self), self, args, kwargs)

    return functools.update_wrapper(patched, original)  # name, doc, __wrapped__
