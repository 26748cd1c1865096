"""One import hook that sees every execution of a watched module's body, a reload's included: wrapt's post-import
hooks fire once, but a reload runs the body again and makes new class objects no hook wraps. For a watched name this
``sys.meta_path`` finder returns the other finders' spec with its loader wrapped, which calls the watch's callbacks
after the body ran; so the engine learns of a reload when it happens and a step only reads ``PatchEngine.unready``.

The finder is added once per process and never removed (a finder other
code holds could not be taken back safely); a name is watched while an
engine is applied, and every callback re-checks its engine's state.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from camp2p_overlap.core.fork import after_fork_in_child, held_weakly_if_bound

Callback = Callable[[ModuleType], None]


class _NotifyingLoader:
    """A loader that runs ``inner``'s ``exec_module`` and then calls
    ``notify`` with the module; every other attribute is ``inner``'s."""

    def __init__(self, inner: Any, notify: Callback) -> None:
        self._inner = inner
        self._notify = notify

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        inner = self._inner
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = inner
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "loader", None) is self:
            spec.loader = inner
        inner.exec_module(module)
        self._notify(module)


class ReexecWatch:
    """The meta path finder: watched names and their callbacks (held weakly
    when they are bound methods, so a watch keeps no engine alive)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: dict[str, list[Callable[[], Callback | None]]] = {}
        self._busy = threading.local()
        self._added = False

    # -- watching ---------------------------------------------------------
    def watch(self, names: Sequence[str], callback: Callback) -> None:
        """Call ``callback(module)`` after each execution of the body of a
        module in ``names`` (an import or a reload)."""
        ref = held_weakly_if_bound(callback)
        with self._lock:
            for name in names:
                refs = self._callbacks.setdefault(name, [])
                if not any(r() == callback for r in refs):
                    refs.append(ref)
            if not self._added:
                sys.meta_path.insert(0, self)  # type: ignore[arg-type]
                self._added = True

    def unwatch(self, callback: Callback) -> None:
        """Stop calling ``callback`` (for every name)."""
        with self._lock:
            for name in list(self._callbacks):
                kept = [r for r in self._callbacks[name] if r() not in (None, callback)]
                if kept:
                    self._callbacks[name] = kept
                else:
                    del self._callbacks[name]

    def watched(self) -> list[str]:
        with self._lock:
            return sorted(self._callbacks)

    # -- the finder -------------------------------------------------------
    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in self._callbacks:  # the common case: one dict lookup
            return None
        busy: set[str] = self._busy.__dict__.setdefault("names", set())
        if fullname in busy:
            return None  # the search below asked us again
        busy.add(fullname)
        try:
            spec = _find_elsewhere(self, fullname, path, target)
        finally:
            busy.discard(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _NotifyingLoader(spec.loader, self._notify)
        return spec

    def _new_lock(self) -> None:
        self._lock = threading.Lock()  # a forked child: a lock held by a thread that is gone would stay held

    def _notify(self, module: ModuleType) -> None:
        with self._lock:
            callbacks = [r() for r in self._callbacks.get(module.__name__, ())]
        for callback in callbacks:
            if callback is not None:
                callback(module)


def _find_elsewhere(me: ReexecWatch, fullname: str, path: Any, target: ModuleType | None) -> ModuleSpec | None:
    """The spec the other finders of ``sys.meta_path`` give, in their order."""
    for finder in list(sys.meta_path):
        if finder is me:
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


#: The process's one watch.
REEXEC_WATCH = ReexecWatch()
after_fork_in_child(REEXEC_WATCH._new_lock)
