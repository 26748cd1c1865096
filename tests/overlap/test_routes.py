"""Connectors left alone outside a step (``core/overlap/routes.py``):
between steps a connector call runs upstream's method with no frame of
ours; during an engaged step only that step's thread, on that connector
instance, is routed to the session; a user's instance attribute keeps being
the callee and comes back as the very same object; nothing of ours is left
on any class or instance, also after a step that raised."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from functools import partial
from types import FrameType
from typing import Any

import pytest
from support.overlap import apply_cpu, assert_same, run_step, serial_results, world, wrap_model

from camp2p_overlap.core.observe.trace import TraceRecorder
from camp2p_overlap.core.overlap.camp2p import route
from camp2p_overlap.core.overlap.routes import ROUTER_MARK, install_routes, remove_routes
from camp2p_overlap.core.overlap.serial_trace import SerialTrace
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.emulation import device as emulated_device

pytestmark = pytest.mark.usefixtures("standin_stack")
ROUTED = ("recv_attn_output", "send_ffn_output")
PACKAGE_DIR = "camp2p_overlap"


def _our_frames(call: Any) -> list[str]:
    """Every function of this package that ran (as a Python frame) while ``call()`` ran."""
    seen: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and f"/{PACKAGE_DIR}/" in frame.f_code.co_filename.replace("\\", "/"):
            if "/emulation/" not in frame.f_code.co_filename:  # the stand-in's own code is upstream's here
                seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


@pytest.fixture
def applied() -> Iterator[None]:
    PATCH_LAYER.engine.unpatch()
    yield
    assert PATCH_LAYER.engine.unpatch() is True


def _is_router(obj: Any) -> bool:
    """Whether ``obj`` is a router a step installed (install_routes marks each)."""
    return getattr(obj, ROUTER_MARK, False) is True


def test_between_steps_a_connector_call_runs_no_frame_of_ours(applied: None) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    originals = {name: vars(type(w.connector))[name] for name in ROUTED}
    apply_cpu()
    run_step(w)  # an engaged step ran and ended
    assert PATCH_LAYER.runtime.counters.to_dict()["steps"]["overlap"] >= 1
    for name in ROUTED:
        assert vars(type(w.connector))[name] is originals[name]
        assert name not in vars(w.connector)
    probe = type(w.connector).recv_attn_output  # the class's own function, as upstream's loop reaches it
    assert probe is originals["recv_attn_output"]
    frames = _our_frames(lambda: w.connector.recv_attn_output)
    assert frames == []


def test_the_profile_check_sees_a_frame_of_ours(applied: None) -> None:
    """The check above can fail: while a route is in place, a call runs a frame of ours."""
    w = world(layers=2, stage_ids=(0, 1))
    apply_cpu()
    w.connector.recv_attn_output = lambda *a, **k: "payload"  # the callee: no transport needed
    routes: list[Any] = []
    router = partial(partial, route, SerialTrace(TraceRecorder()), "recv_attn_output")
    assert install_routes(w.connector, [("recv_attn_output", router)], routes) is None
    try:
        assert _our_frames(lambda: w.connector.recv_attn_output(0, layer_idx=0)) != []
    finally:
        remove_routes(w.connector, routes)
    assert vars(w.connector)["recv_attn_output"]() == "payload"  # the user's attribute is back


def test_during_an_engaged_step_only_this_instance_is_routed(applied: None) -> None:
    w, other = world(layers=2, stage_ids=(0, 1)), world(layers=2, stage_ids=(0, 1))
    apply_cpu()
    seen: list[tuple[bool, bool]] = []
    compute = w.runner.model.compute_ffn_output

    def spying_compute(**kw: Any) -> Any:  # runs on the loop thread, inside the step
        seen.append(
            (_is_router(vars(w.connector).get("recv_attn_output")), "recv_attn_output" in vars(other.connector))
        )
        return compute(**kw)

    w.runner.model.compute_ffn_output = spying_compute
    run_step(w)
    assert seen == [(True, False)] * 4  # layers x stages: routed here, never on the other connector
    assert "recv_attn_output" not in vars(w.connector) and "send_ffn_output" not in vars(w.connector)


def test_a_step_that_raises_leaves_nothing_on_the_instance(applied: None) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    apply_cpu()

    def failing(**kw: Any) -> Any:
        raise RuntimeError("ffn failed")

    w.runner.model.compute_ffn_output = failing
    with pytest.raises(RuntimeError, match="ffn failed"):
        run_step(w)
    assert not any(name in vars(w.connector) for name in ROUTED)


#: Per layout: the stream each send's kernels go to (the E2A's), and the stream the loop's FFNs run on.
SEND_AND_FFN_STREAMS = {
    "comm-side": (["K0", "K0", "K1", "K1"], ["C"] * 4),
    "compute-side": (["C"] * 4, ["F"] * 4),
}


@pytest.mark.parametrize("layout", list(SEND_AND_FFN_STREAMS))
def test_a_users_instance_attribute_is_kept_and_called_where_the_loop_would(applied: None, layout: str) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    (reference,) = serial_results(w, [None])
    calls: list[str] = []
    ffns: list[str] = []
    bound = w.connector.send_ffn_output

    def users_send(*args: Any, **kwargs: Any) -> Any:
        calls.append(emulated_device.current_stream().name)  # the stream its kernels go to
        return bound(*args, **kwargs)

    w.connector.send_ffn_output = users_send
    wrap_model(w, before=lambda layer: ffns.append(emulated_device.current_stream().name))
    apply_cpu(layouts=(layout,))
    before = PATCH_LAYER.runtime.counters.to_dict()["layout_steps"].get(layout, 0)
    w.steps_run = 0  # the reference's step again
    got = run_step(w)
    assert_same(got, reference)
    assert PATCH_LAYER.runtime.counters.to_dict()["layout_steps"][layout] == before + 1  # the step engaged
    assert len(calls) == 2 * 2  # every send of the loop reached the user's attribute
    sends, ffn = SEND_AND_FFN_STREAMS[layout]
    # Issued on the E2A's stream of the layout (comm-side: the stage's side stream; compute-side: the caller's,
    # in its scope, while the loop's own work runs on F).
    assert sorted(calls) == sends
    assert ffns == ffn
    assert vars(w.connector)["send_ffn_output"] is users_send  # the very same object is back


def test_another_thread_calling_the_routed_instance_gets_the_callee() -> None:
    class Conn:
        def recv(self, x: int) -> tuple[str, int]:
            return ("upstream", x)

    conn = Conn()

    def make(callee: Any, thread: int) -> Any:
        def routed(x: int) -> Any:
            return ("session", x) if threading.get_ident() == thread else callee(x)

        return routed

    routes: list[Any] = []
    assert install_routes(conn, [("recv", make)], routes) is None
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(conn.recv(2)))
    t.start()
    t.join(10)
    assert conn.recv(1) == ("session", 1) and out == [("upstream", 2)]
    remove_routes(conn, routes)
    assert "recv" not in vars(conn) and conn.recv(3) == ("upstream", 3)


def test_routes_refuse_a_slotted_instance_a_data_descriptor_and_a_second_route() -> None:
    class Slotted:
        __slots__ = ()

        def recv(self) -> str:
            return "upstream"

    assert "no instance __dict__" in str(install_routes(Slotted(), [("recv", lambda c, t: c)], []))

    class Described:
        recv = property(lambda self: lambda: "upstream")

    obj = Described()
    reason = install_routes(obj, [("recv", lambda c, t: c)], [])
    assert reason is not None and "descriptor" in reason and "recv" not in vars(obj)

    class Plain:
        def recv(self) -> str:
            return "upstream"

    plain = Plain()
    first: list[Any] = []
    assert install_routes(plain, [("recv", lambda c, t: lambda: "first")], first) is None
    assert "another thread" in str(install_routes(plain, [("recv", lambda c, t: c)], []))
    remove_routes(plain, first)
    assert vars(plain) == {} and plain.recv() == "upstream"


def test_a_route_replaced_during_the_step_is_left_as_it_was_set() -> None:
    class Plain:
        def recv(self) -> str:
            return "upstream"

    plain = Plain()
    routes: list[Any] = []
    assert install_routes(plain, [("recv", lambda c, t: lambda: "routed")], routes) is None
    replacement = lambda: "theirs"  # noqa: E731
    plain.recv = replacement  # type: ignore[method-assign]
    remove_routes(plain, routes)
    assert vars(plain)["recv"] is replacement


def test_a_connector_that_cannot_be_routed_is_a_serial_reason_and_a_plain_one_engages(applied: None) -> None:
    from camp2p_overlap.core.overlap.routes import route_problem

    w = world(layers=2, stage_ids=(0, 1))
    (reference,) = serial_results(w, [None])
    apply_cpu()
    cls = type(w.connector)
    sub = type("DescribedConnector", (cls,), {"send_ffn_output": property(lambda self: None)})
    w.connector.__class__ = sub
    try:
        problem = route_problem(w.connector, ROUTED)
        assert problem is not None and "cannot be routed per instance" in problem
    finally:
        w.connector.__class__ = cls
    assert route_problem(w.connector, ROUTED) is None
    before = PATCH_LAYER.runtime.counters.to_dict()["steps"]["overlap"]
    w.steps_run = 0
    assert_same(run_step(w), reference)
    assert PATCH_LAYER.runtime.counters.to_dict()["steps"]["overlap"] == before + 1


def test_route_hands_each_key_to_its_session_on_the_steps_thread_while_it_is_open() -> None:
    """One router function serves both keys a ``route`` target may name, for an engaged step's session and a serial
    trace alike: on the step's thread while the session is open it hands the call to ``recv``/``send``; else the
    callee runs the call as it was made."""
    from camp2p_overlap.core.overlap.camp2p import SESSION_ROUTERS

    assert set(SESSION_ROUTERS) == {"recv_attn_output", "send_ffn_output"}
    calls: list[Any] = []

    class Session:
        closed = False

        def recv(self, fn: Any, kw: Any) -> Any:
            calls.append(("recv", kw))
            return "payload"

        def send(self, call: Any, output: Any, context: Any, stage: Any) -> Any:
            calls.append(("send", output, context, stage, call()))

    session = Session()
    here = threading.get_ident()
    recv = partial(route, session, "recv_attn_output", lambda *a, **k: ("callee", a, k), here)
    send = partial(route, session, "send_ffn_output", lambda *a, **k: ("callee", a, k), here)
    assert recv(1, layer_idx=2) == "payload"
    send("out", "ctx", ubatch_idx=1)
    assert calls == [
        ("recv", {"layer_idx": 2, "ubatch_idx": 1}),
        ("send", "out", "ctx", 1, ("callee", ("out", "ctx"), {"ubatch_idx": 1})),
    ]
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(recv(0, layer_idx=3)))
    t.start()
    t.join(10)
    assert out == [("callee", (0,), {"layer_idx": 3})]  # another thread: the callee
    session.closed = True
    assert send("o", "c") == ("callee", ("o", "c"), {})  # a closed session: the callee
    assert len(calls) == 2


def _holds_a_dict(obj: Any, attribute: str) -> bool:
    """Whether ``obj``'s attributes sit in a dict object (one holding
    ``attribute``) rather than inline in the object, read through the
    garbage collector so that the reading builds no dict itself."""
    return any(type(r) is dict and attribute in r for r in gc.get_referents(obj))


def test_routing_leaves_the_instance_attributes_inline(applied: None) -> None:
    """CPython 3.11+ keeps an instance's attributes inline until something
    asks for its ``__dict__``; from then on every attribute read of it (the
    connector's methods read many per (layer, stage)) is slower, for the rest
    of the process. Engaged steps (routes set and taken away) and planned
    steps (the route check) must not ask for it."""
    w = world(layers=2, stage_ids=(0, 1))
    if _holds_a_dict(w.connector, "transport"):
        pytest.skip(f"this Python ({sys.version.split()[0]}) keeps instance attributes in a dict from the start")
    apply_cpu()
    for _ in range(3):
        run_step(w)
    assert PATCH_LAYER.runtime.counters.to_dict()["steps"]["overlap"] >= 1
    assert not _holds_a_dict(w.connector, "transport")
    assert not [name for name in ROUTED if _is_router(getattr(w.connector, name))]


def test_an_install_refuses_an_instance_another_step_routed_and_leaves_nothing_set() -> None:
    """Another step routed the instance between a step's decision and its
    install: the install refuses, and nothing of it is left set."""

    class Plain:
        def recv(self) -> str:
            return "upstream"

        def send(self) -> str:
            return "sent"

    plain = Plain()
    first: list[Any] = []
    assert install_routes(plain, [("send", lambda c, t: lambda: "first")], first) is None
    second: list[Any] = []
    reason = install_routes(plain, [("recv", lambda c, t: lambda: "second"), ("send", lambda c, t: c)], second)
    assert reason is not None and "another thread" in reason
    assert "recv" not in vars(plain) and plain.send() == "first"  # the second step's recv route was taken back
    remove_routes(plain, first)
    assert vars(plain) == {} and plain.recv() == "upstream" and plain.send() == "sent"
