"""Connector routes: the connector instance's calls, routed to one step for
that step's duration and on that step's thread only.

The manifest's ``route`` targets (the CAMP2P connector's receive and send)
are signature-checked at import, and nothing of ours is installed on their
class. An engaged step (or a serial step while a trace recorder is active)
sets one router per route target as an attribute of the connector *instance*
and removes it before the step returns or raises:

* between steps a connector call is upstream's method, with no frame of
  ours; other connector instances are never touched;
* a call from another thread during the step goes straight to the callee;
* the callee is what the instance resolved to when the step began: its own
  attribute of that name if it carried one (a user's or a test's
  monkeypatch, put back as the very same object afterwards), else the
  class's attribute bound to it, so a foreign wrapper on the class stays in
  the call chain.

Limit: a bound method captured from the instance before the step began
(``recv = connector.recv_attn_output``) bypasses the route; the step then
sees no receive, runs the loop's order on the compute stream and logs it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from types import MethodType
from typing import Any

from camp2p_overlap.core.log import log_once

#: Set on every router function, so a step recognises an instance that
#: another step (on another thread) has routed.
ROUTER_MARK = "__camp2p_overlap_router__"

#: Builds the router of one target: ``make(callee, thread_id) -> router``.
RouterFactory = Callable[[Callable[..., Any], int], Callable[..., Any]]

_MISSING = object()


def is_router(obj: Any) -> bool:
    return getattr(obj, ROUTER_MARK, False) is True


def route_problem(instance: Any, attributes: Iterable[str]) -> str | None:
    """Why ``instance``'s ``attributes`` cannot be routed per instance, or
    None: it needs an instance ``__dict__``, no data descriptor of that name
    on its class (it would win over the instance attribute), and no route
    of another thread's step already in place."""
    cls = type(instance)
    if not cls.__dictoffset__:  # read off the class: vars(instance) would build the instance's dict
        return f"connector {cls.__name__} has no instance __dict__ to route its calls through"
    attributes = tuple(attributes)
    for attribute in attributes:
        if getattr(getattr(instance, attribute, None), ROUTER_MARK, False) is True:  # is_router(), inline
            return "the connector's calls are routed to a step on another thread"
    key = (cls, attributes)
    if key in _ROUTABLE:
        return None
    for attribute in attributes:
        if hasattr(type(_class_attribute(cls, attribute)), "__set__"):
            return f"connector {cls.__name__}.{attribute} cannot be routed per instance (a data descriptor)"
    if len(_ROUTABLE) >= _ROUTABLE_KEPT:
        _ROUTABLE.clear()
    _ROUTABLE.add(key)
    return None


#: (class, attributes) found with no data descriptor of those names: the
#: classes are not walked again on every step. A descriptor set on such a
#: class later is still caught: :meth:`ConnectorRoutes.install` checks that
#: the instance resolves each attribute to its router, and refuses if not.
_ROUTABLE: set[tuple[type, tuple[str, ...]]] = set()
_ROUTABLE_KEPT = 64


def _class_attribute(cls: type, attribute: str) -> Any:
    """What an instance of ``cls`` finds for ``attribute`` on its class (the
    first ``__dict__`` along its MRO that holds it), without calling a
    descriptor; None when no class holds it. ``inspect.getattr_static``'s
    answer for an instance attribute lookup, at a fraction of its cost."""
    for klass in cls.__mro__:
        found = vars(klass).get(attribute, _MISSING)
        if found is not _MISSING:
            return found
    return None


# The instance's own attributes are read, set and deleted without
# ``vars(instance)``: on CPython 3.11 and later an instance keeps its
# attributes inline until something asks for its ``__dict__``, and from then
# on every attribute read of that instance (upstream's connector methods
# read many, on every (layer, stage)) takes the slower dictionary path for
# the rest of the process. Setting and deleting through ``object`` keeps
# them inline, and bypasses a ``__setattr__`` of the class as writing the
# dict did (a data descriptor of that name is refused before: route_problem).
set_on_instance = object.__setattr__
delete_on_instance = object.__delattr__
_get_on_instance = object.__getattribute__


def _own_attribute(instance: Any, cls: type, attribute: str, found: Any) -> Any:
    """What ``instance`` holds of its own under ``attribute`` (``found``,
    what it resolves the name to now), or :data:`_MISSING` when ``found`` is
    its class's attribute (bound to it). The class's is told from its own by
    value: a bound method equals another binding of the same function to the
    same instance. An instance that holds such a binding of its class's
    method as its own is taken as holding nothing: the route then deletes
    it, and the instance resolves the name to the same method again."""
    held = _class_attribute(cls, attribute)
    if held is None:
        return found
    if found is held:
        return _MISSING
    get = getattr(type(held), "__get__", None)
    if get is None:
        return found
    try:
        same = found == get(held, instance, cls)
    except Exception:  # noqa: BLE001 - an odd __eq__ or __get__: the value is kept as the instance's
        return found
    return _MISSING if same is True else found


class ConnectorRoutes:
    """The routers of one step on one connector instance. :meth:`install`
    sets them (all or none), :meth:`remove` takes them away exactly."""

    __slots__ = ("_instance", "_set")

    def __init__(self, instance: Any) -> None:
        self._instance = instance
        #: (attribute, our router, what the instance held of its own before, or _MISSING)
        self._set: list[tuple[str, Any, Any]] = []

    def retarget(self, instance: Any) -> None:
        """Route ``instance`` from now on (nothing may be routed now)."""
        if self._set:
            raise RuntimeError("connector routes are still installed")
        self._instance = instance

    def install(self, routers: Sequence[tuple[str, RouterFactory]], *, checked: bool = False) -> str | None:
        """Route each ``(attribute, factory)``; None when every route is in
        place, else why none is (nothing is left set). ``checked``: the
        caller has just found :func:`route_problem` None for these
        attributes (the engaged step's decision), and only whether another
        thread's step has routed them since is checked again."""
        instance = self._instance
        if not checked:
            problem = route_problem(instance, [attribute for attribute, _ in routers])
            if problem is not None:
                return problem
        thread = threading.get_ident()
        cls = type(instance)
        for attribute, make in routers:
            callee = getattr(instance, attribute)
            if (
                type(callee) is MethodType
                and callee.__self__ is instance
                and getattr(cls, attribute, None) is callee.__func__
            ):  # the common case: the class's plain function, bound to the instance (a router is not one)
                before = _MISSING
            else:
                if checked and getattr(callee, ROUTER_MARK, False) is True:  # is_router(callee), inline
                    self.remove()
                    return "the connector's calls are routed to a step on another thread"
                before = _own_attribute(instance, cls, attribute, callee)
            router = make(callee, thread)
            setattr(router, ROUTER_MARK, True)
            set_on_instance(instance, attribute, router)
            self._set.append((attribute, router, before))
            if getattr(instance, attribute) is not router:  # e.g. a __getattribute__ of its own
                self.remove()
                return f"connector {type(instance).__name__}.{attribute} cannot be routed per instance"
        return None

    def remove(self) -> None:
        """Put back what the instance held, newest first. A route that
        someone replaced during the step is left as they set it."""
        instance = self._instance
        while self._set:
            attribute, router, before = self._set.pop()
            if getattr(instance, attribute, None) is not router and held_by_instance(instance, attribute) is not router:
                replaced_during_step(attribute)
                continue
            if before is _MISSING:
                delete_on_instance(instance, attribute)
            else:
                set_on_instance(instance, attribute, before)


def held_by_instance(instance: Any, attribute: str) -> Any:
    """What ``instance`` resolves ``attribute`` to, read past a
    ``__getattribute__`` of its class (a route is set on the instance and
    taken back from it, whatever the class shows); None when nothing."""
    try:
        return _get_on_instance(instance, attribute)
    except AttributeError:
        return None


def replaced_during_step(attribute: str) -> None:
    """Log (once) that a route was replaced during its step: it is left as
    it was set, not removed."""
    log_once(
        logging.WARNING,
        f"route-replaced:{attribute}",
        "camp2p-overlap: connector attribute %s was replaced during a step; left as it was set",
        attribute,
    )
