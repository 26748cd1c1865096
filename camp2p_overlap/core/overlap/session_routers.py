"""The session's routers: for one engaged step, each binds a connector
method (a manifest ``route`` target) to the step's session, on the step's
thread only (``connector_routes`` installs them on the instance and removes
them). A serial step's trace routes the same keys to its recorder
(``serial_trace.TRACE_ROUTERS``).

Each factory binds what it routes to, and a router serves only the thread
that installed it (``get_ident()`` is compared on every call). A factory is
``partial(router_of, session)``: ``ROUTERS[key](session)`` builds it, and
calling it builds the router, with no frame of ours but the router maker's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from threading import get_ident
from typing import Any

from camp2p_overlap.core.overlap import camp2p
from camp2p_overlap.core.overlap.connector_routes import RouterFactory
from camp2p_overlap.core.overlap.session import OverlapSession

Wrapped = Callable[..., Any]


def _session_recv(session: OverlapSession, callee: Wrapped, thread: int) -> Wrapped:
    recv = session.recv
    parse = camp2p.recv_kwargs

    def recv_attn_output(*args: Any, **kwargs: Any) -> Any:
        if get_ident() != thread:
            return callee(*args, **kwargs)
        # the session calls callee(**kw): the same call (ubatch_idx by name);
        # upstream's call names every argument, and kwargs is this call's own dict
        return recv(callee, kwargs if not args and "ubatch_idx" in kwargs else parse(args, kwargs))

    return recv_attn_output


def _session_send(session: OverlapSession, callee: Wrapped, thread: int) -> Wrapped:
    send = session.send
    parts, stage_of = camp2p.send_parts, camp2p.send_stage

    def send_ffn_output(*args: Any, **kwargs: Any) -> Any:
        if get_ident() != thread:
            return callee(*args, **kwargs)
        # upstream's call, send_ffn_output(output, context, ubatch_idx=s), read inline
        output, context = (args[0], args[1]) if len(args) >= 2 else parts(args, kwargs)
        stage = int(kwargs["ubatch_idx"]) if "ubatch_idx" in kwargs else stage_of(context, kwargs)
        return send(partial(callee, *args, **kwargs), output, context, stage)

    return send_ffn_output


#: Each router's maker by key: ``maker(session, callee, thread) -> router``.
ROUTER_MAKERS: dict[str, Callable[[OverlapSession, Wrapped, int], Wrapped]] = {
    "recv_attn_output": _session_recv,
    "send_ffn_output": _session_send,
}

#: The routers a manifest's ``route`` target may name, by key: each binds
#: the connector's method, for one engaged step, to its session (a serial
#: step's trace routes the same keys: ``serial_trace.TRACE_ROUTERS``).
ROUTERS: dict[str, Callable[[OverlapSession], RouterFactory]] = {
    key: partial(partial, maker) for key, maker in ROUTER_MAKERS.items()
}
