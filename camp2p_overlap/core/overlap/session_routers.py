"""The session's routers: for one engaged step, each binds a connector
method (a manifest ``route`` target) to the step's session, on the step's
thread only (``connector_routes`` installs them on the instance and removes
them). A serial step's trace routes the same keys to its recorder
(``serial_trace.TRACE_ROUTERS``).

A router is made once per session, with a :class:`RouterBinding` that
holds what it routes to and the thread it serves (``get_ident()`` is
compared on every call): ``ConnectorRoutes.install`` binds it to the
step's callee and thread through :meth:`RouterBinding.bind`, the factory it
is handed, and the step unbinds it when it removes the routes, so that no
router holds the connector between steps.

:class:`KeptSession`: a stream set's session with its routers, kept from
one engaged step to the next of the same decision, so that such a step
makes neither again (a closed session is reopened, its routers bound
afresh).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from threading import get_ident
from types import MethodType
from typing import Any

from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.connector_routes import (
    ROUTER_MARK,
    ConnectorRoutes,
    RouterFactory,
    delete_on_instance,
    held_by_instance,
    replaced_during_step,
    set_on_instance,
)
from camp2p_overlap.core.overlap.session import OverlapSession

Wrapped = Callable[..., Any]


def _unbound(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "camp2p-overlap: a connector route was called after its step ended (a bound method of the "
        "connector taken during a step and called later)"
    )


class RouterBinding:
    """What one router routes to: the callee (the connector's method as the
    instance resolved it when the step began) and the thread it serves."""

    __slots__ = ("callee", "router", "thread")

    def __init__(self) -> None:
        self.callee: Wrapped = _unbound
        #: No thread's id (``get_ident()`` is never 0): every call goes to the callee.
        self.thread = 0
        self.router: Wrapped = _unbound

    def bind(self, callee: Wrapped, thread: int) -> Wrapped:
        """Route to ``callee`` for ``thread``; the router (a ``RouterFactory``)."""
        self.callee = callee
        self.thread = thread
        return self.router


#: Makes a router of a session: ``maker(session, binding) -> router``.
RouterMaker = Callable[[OverlapSession, "RouterBinding"], Wrapped]
#: (attribute, router maker) of each route target.
MakersOf = tuple[tuple[str, RouterMaker], ...]


def _session_recv(session: OverlapSession, binding: RouterBinding) -> Wrapped:
    recv = session.recv
    parse = camp2p.recv_kwargs

    def recv_attn_output(*args: Any, **kwargs: Any) -> Any:
        callee = binding.callee
        if get_ident() != binding.thread:
            return callee(*args, **kwargs)
        # the session calls callee(**kw): the same call (ubatch_idx by name);
        # upstream's call names every argument, and kwargs is this call's own dict
        return recv(callee, kwargs if not args and "ubatch_idx" in kwargs else parse(args, kwargs))

    return recv_attn_output


#: The session's own send (a subclass's may take only the call as one callable).
_BASE_SEND = OverlapSession.send


def _session_send(session: OverlapSession, binding: RouterBinding) -> Wrapped:
    send = session.send
    parts, stage_of = camp2p.send_parts, camp2p.send_stage
    whole = type(session).send is not _BASE_SEND  # a subclass's send: handed the call as one callable

    def send_ffn_output(*args: Any, **kwargs: Any) -> Any:
        callee = binding.callee
        if get_ident() != binding.thread:
            return callee(*args, **kwargs)
        # upstream's call, send_ffn_output(output, context, ubatch_idx=s), read inline
        output, context = (args[0], args[1]) if len(args) >= 2 else parts(args, kwargs)
        if "ubatch_idx" in kwargs:
            stage = kwargs["ubatch_idx"]
            if type(stage) is not int:  # int() only where needed (a numpy or tensor scalar, say)
                stage = int(stage)
        else:
            stage = stage_of(context, kwargs)
        if whole:
            return send(partial(callee, *args, **kwargs), output, context, stage)
        return send(callee, output, context, stage, args, kwargs)  # callee(*args, **kwargs): the call as it came

    return send_ffn_output


#: Each router's maker by key: ``maker(session, binding) -> router``.
ROUTER_MAKERS: dict[str, RouterMaker] = {
    "recv_attn_output": _session_recv,
    "send_ffn_output": _session_send,
}


def _router_factory(maker: RouterMaker, session: OverlapSession) -> RouterFactory:
    return session_router(maker, session).bind


#: The routers a manifest's ``route`` target may name, by key: each binds
#: the connector's method, for one engaged step, to its session (a serial
#: step's trace routes the same keys: ``serial_trace.TRACE_ROUTERS``).
ROUTERS: dict[str, Callable[[OverlapSession], RouterFactory]] = {
    key: partial(_router_factory, maker) for key, maker in ROUTER_MAKERS.items()
}


def session_router(maker: RouterMaker, session: OverlapSession) -> RouterBinding:
    """A router of ``session`` made by ``maker``, marked, with its binding
    (unbound: it routes nothing until :meth:`RouterBinding.bind`)."""
    binding = RouterBinding()
    router = binding.router = maker(session, binding)
    setattr(router, ROUTER_MARK, True)
    return binding


class KeptSession:
    """A session with its routers, one per route target, each with its
    binding; kept on its stream set between steps (when the step allows),
    with what a later step must match to reuse it: the decision it was made
    for (the same object: the decision memo hands the same one back) and
    the installer's route targets it was routed with."""

    __slots__ = (
        "_connector",
        "_connector_routes",
        "_set",
        "_targets",
        "bindings",
        "decision",
        "routers",
        "routes",
        "session",
    )

    def __init__(self, decision: Any, routes: tuple[Any, ...], makers: MakersOf, session: OverlapSession) -> None:
        self.decision = decision
        self.routes = routes
        self.session = session
        self.bindings = tuple(session_router(maker, session) for _, maker in makers)
        self.routers = tuple((attribute, b.bind) for (attribute, _), b in zip(makers, self.bindings, strict=True))
        self._connector_routes = ConnectorRoutes(None)
        #: (attribute, binding) of each target, in manifest order.
        self._targets = tuple((attribute, b) for (attribute, _), b in zip(makers, self.bindings, strict=True))
        #: The targets routed by :meth:`route`'s own loop, and their connector
        #: (None while nothing is routed that way).
        self._set: list[tuple[str, RouterBinding]] = []
        self._connector: Any = None

    def route(self, connector: Any) -> str | None:
        """Route ``connector``'s targets to the session, on this thread:
        None, or why nothing is routed. When every target resolves to its
        class's function bound to ``connector`` (the instance holds none of
        its own, and no other thread's step has routed it), the routers are
        bound and set here; otherwise ``ConnectorRoutes.install`` (checked:
        the step's decision checked the connector) routes them, or says why not."""
        thread = get_ident()
        cls = type(connector)
        done = self._set
        for target in self._targets:
            attribute, binding = target
            callee = getattr(connector, attribute)
            if (
                type(callee) is not MethodType
                or callee.__self__ is not connector
                or getattr(cls, attribute, None) is not callee.__func__
            ):  # not the class's plain function (a router is not one): the general route
                break
            router = binding.router
            binding.callee = callee  # binding.bind(callee, thread), inline
            binding.thread = thread
            set_on_instance(connector, attribute, router)
            self._connector = connector
            done.append(target)
            if getattr(connector, attribute) is not router:  # e.g. a __getattribute__ of its own
                break
        else:
            return None
        self._unset()
        routes = self._connector_routes
        routes.retarget(connector)
        return routes.install(self.routers, checked=True)

    def unroute(self) -> None:
        """Take the routes away, and the callees from the routers."""
        if self._set:
            self._unset()
        else:
            self._connector_routes.remove()
        for binding in self.bindings:  # each drops its callee (and so the connector)
            binding.callee = _unbound
            binding.thread = 0

    def _unset(self) -> None:
        """Take away what :meth:`route`'s own loop set, newest first (a route
        someone replaced during the step is left as they set it)."""
        connector, done = self._connector, self._set
        while done:
            attribute, binding = done.pop()
            router = binding.router
            # what the instance holds, read past a class's __getattribute__ only when that hides it
            if getattr(connector, attribute, None) is router or held_by_instance(connector, attribute) is router:
                delete_on_instance(connector, attribute)
            else:
                replaced_during_step(attribute)
        self._connector = None
