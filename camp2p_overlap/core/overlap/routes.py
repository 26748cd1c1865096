"""Connector routes (docs/design.md, "Connectors left alone outside a step"): the connector instance's calls,
routed to one step for that step's duration and on that step's thread only. The manifest's ``route`` targets are
signature-checked at import; nothing of ours is installed on their class. An engaged step (or a serial step while a
trace recorder is active) sets one router per route target on the connector *instance* (:func:`install_routes`)
and removes it in a ``finally`` (:func:`remove_routes`). The callee is what the instance resolved to when the step
began: its own attribute if it carried one (a monkeypatch, put back as the very same object), else the class's
attribute bound to it, so a foreign wrapper on the class stays in the call chain.

Limit: a bound method taken from the instance before the step began bypasses the route; the step then sees no
receive, runs the loop's order on the compute stream and logs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from threading import get_ident
from types import MethodType
from typing import Any

from camp2p_overlap.core.log import log_once

#: Set on every router function, so a step recognises an instance that
#: another step (on another thread) has routed.
ROUTER_MARK = "__camp2p_overlap_router__"

Wrapped = Callable[..., Any]
#: Builds the router of one target: ``make(callee, thread_id) -> router``.
MakeRouter = Callable[[Wrapped, int], Wrapped]

_MISSING = object()

# Never ``vars(instance)``: on CPython 3.11+ asking for an instance's
# ``__dict__`` moves its attributes off the fast inline path for good (and
# upstream's connector methods read many per (layer, stage)). Going through
# ``object`` also bypasses a ``__setattr__`` of the class (a data descriptor
# of that name is refused before: route_problem).
_set_on_instance = object.__setattr__
_delete_on_instance = object.__delattr__
_get_on_instance = object.__getattribute__


def route_problem(instance: Any, attributes: Iterable[str]) -> str | None:
    """Why ``instance``'s class cannot have ``attributes`` routed per instance
    (no instance ``__dict__``, or a data descriptor of that name on the class,
    which wins over the instance attribute), or None; the same every step."""
    cls = type(instance)
    if not cls.__dictoffset__:  # read off the class: vars(instance) would build the instance's dict
        return f"connector {cls.__name__} has no instance __dict__ to route its calls through"
    for attribute in attributes:
        if hasattr(type(_class_attribute(cls, attribute)), "__set__"):
            return f"connector {cls.__name__}.{attribute} cannot be routed per instance (a data descriptor)"
    return None


#: Why a step may not route a connector now (asked on every step: it may pass).
ROUTED_ELSEWHERE = "the connector's calls are routed to a step on another thread"


def _class_attribute(cls: type, attribute: str) -> Any:
    """``attribute`` in the first ``__dict__`` along ``cls``'s MRO that holds
    it, without calling a descriptor; None when none does."""
    for klass in cls.__mro__:
        found = vars(klass).get(attribute, _MISSING)
        if found is not _MISSING:
            return found
    return None


def _binds_equal(held: Any, instance: Any, found: Any) -> bool:
    """Whether ``found`` equals the class attribute ``held`` as bound to ``instance`` (False when ``held`` binds to
    nothing, or an odd ``__eq__`` or ``__get__`` raises: the value is then kept as the instance's)."""
    get = getattr(type(held), "__get__", None)
    if get is None:
        return False
    try:
        return (found == get(held, instance, type(instance))) is True
    except Exception:  # noqa: BLE001 - an odd __eq__ or __get__
        return False


def _held_by_instance(instance: Any, attribute: str) -> Any:
    """``attribute`` of ``instance`` past a class ``__getattribute__``, or None."""
    try:
        return _get_on_instance(instance, attribute)
    except AttributeError:
        return None


#: What :func:`install_routes` set on an instance, for :func:`remove_routes`: (attribute, our router, what the instance
#: held of its own before, or ``_MISSING``).
Installed = list[tuple[str, Any, Any]]


def install_routes(
    instance: Any, routers: Sequence[tuple[str, MakeRouter]], installed: Installed, *, checked: bool = False
) -> str | None:
    """Route each ``(attribute, make)`` of ``instance``, listing each route set in ``installed``; None when every
    route is in place, else why none is (nothing left set). ``checked``: the caller found :func:`route_problem` None
    for this class (an engaged step's runner facts)."""
    if not checked:
        problem = route_problem(instance, [attribute for attribute, _ in routers])
        if problem is not None:
            return problem
    thread = get_ident()
    cls = type(instance)
    for attribute, make in routers:
        callee = before = getattr(instance, attribute)
        # What the instance holds of its own (put back by remove_routes), or _MISSING when the name resolves to its
        # class's attribute: the class's function bound to the instance (the common case), the class's attribute
        # itself, or a value equal to it as the class would bind it (the route is then deleted, and the name
        # resolves the same). A bound method is never a router (a router is an instance attribute).
        if type(callee) is MethodType:
            if callee.__self__ is instance and callee.__func__ is getattr(cls, attribute, None):
                before = _MISSING
        elif getattr(callee, ROUTER_MARK, False) is True:  # a router of another thread's step
            remove_routes(instance, installed)
            return ROUTED_ELSEWHERE
        if before is not _MISSING:  # a monkeypatch, a foreign wrapper, a descriptor: the class's raw attribute
            held = _class_attribute(cls, attribute)
            if held is not None and (callee is held or _binds_equal(held, instance, callee)):
                before = _MISSING
        router = make(callee, thread)
        setattr(router, ROUTER_MARK, True)
        installed.append((attribute, router, before))
        _set_on_instance(instance, attribute, router)
        if getattr(instance, attribute) is not router:  # e.g. a __getattribute__ of its own
            remove_routes(instance, installed)
            return f"connector {cls.__name__}.{attribute} cannot be routed per instance"
    return None


def remove_routes(instance: Any, installed: Installed) -> None:
    """Put back what ``instance`` held, newest first, emptying ``installed``. A route that someone replaced during
    the step is left as they set it (logged once)."""
    while installed:
        attribute, router, before = installed.pop()
        if getattr(instance, attribute, None) is not router and _held_by_instance(instance, attribute) is not router:
            log_once(
                logging.WARNING,
                f"route-replaced:{attribute}",
                "camp2p-overlap: connector attribute %s was replaced during a step; left as it was set",
                attribute,
            )
            continue
        if before is _MISSING:
            _delete_on_instance(instance, attribute)
        else:
            _set_on_instance(instance, attribute, before)
