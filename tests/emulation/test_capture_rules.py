"""Graph capture on the emulated device: every capture rule fails when it
is broken, naming the call (from the capturing thread and, for queries and
synchronizes, from any other thread); a violation clears the capture and
leaves a graph that cannot be replayed; a fork/join capture replays with
its edges, re-reading static inputs; a replay records only the events made
with ``external=True`` (any other event recorded in the capture keeps its
pre-capture record, as on CUDA and ACL); as ``torch.npu`` a CAM comm kernel
captured on a stream other than the capture's origin stream fails (as
``torch.cuda``'s stand-in it is allowed)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from camp2p_overlap.emulation import device as dev
from camp2p_overlap.emulation.device import worker
from camp2p_overlap.emulation.device.capture import capture_in_progress
from camp2p_overlap.emulation.device.worker import CaptureViolation

BOUND_S = 10.0  # generous: how long a test waits for what must happen soon
N = 16


@dataclass
class Streams:
    capture: dev.Stream
    s1: dev.Stream
    s2: dev.Stream


@pytest.fixture
def st() -> Iterator[Streams]:
    made = []
    for name in ("cap", "S1", "S2"):
        s = dev.Stream()
        s.name = name
        made.append(s)
    yield Streams(*made)
    if worker.hooks.capture is not None:  # a failed test: do not leak the capture
        worker.hooks.capture.graph.abort()
        pytest.fail("a capture was left in progress")
    dev.drain_all(timeout=BOUND_S)
    dev.take_errors()
    for s in made:
        s.close()


def capture(g: dev.Graph, st: Streams) -> dev.graph:
    return dev.graph(g, stream=st.capture)


def kernel_into(t: torch.Tensor, value: float = 1.0) -> None:
    """Launch a kernel that fills ``t`` on the current stream."""
    dev.launch(lambda: t.fill_(value), writes=[t])


def assert_capture_cleared(st: Streams, failed: dev.Graph) -> None:
    """Nothing is capturing; the failed graph refuses replay; a new capture
    on the same stream works."""
    assert worker.hooks.capture is None and not capture_in_progress()
    with dev.stream(st.capture):
        assert not dev.is_current_stream_capturing()
    assert failed.node_count == 0
    with pytest.raises(RuntimeError, match=r"replay of a graph that captured nothing \(or whose capture failed\)"):
        failed.replay()
    out = torch.zeros(4)
    g = dev.Graph()
    with capture(g, st):
        kernel_into(out, 3.0)
    g.replay()
    dev.synchronize()
    assert torch.equal(out, torch.full((4,), 3.0))


# ---------------------------------------------------------------------------
# the calls a capture forbids, from the capturing thread and from another


@dataclass
class Outside:
    """Things made before the capture, for the forbidden calls to use."""

    st: Streams
    event: dev.Event
    timed: tuple[dev.Event, dev.Event]


@pytest.fixture
def outside(st: Streams) -> Outside:
    event = dev.Event()
    event.record(st.s1)
    t0, t1 = dev.Event(enable_timing=True), dev.Event(enable_timing=True)
    t0.record(st.s1)
    t1.record(st.s1)
    dev.synchronize()
    return Outside(st, event, (t0, t1))


FORBIDDEN: dict[str, Callable[[Outside], object]] = {
    "synchronize()": lambda o: dev.synchronize(),
    "Stream.synchronize()": lambda o: o.st.s1.synchronize(),
    "Event.synchronize()": lambda o: o.event.synchronize(),
    "Event.query()": lambda o: o.event.query(),
    "Stream.query()": lambda o: o.st.s1.query(),
    "Event.elapsed_time()": lambda o: o.timed[0].elapsed_time(o.timed[1]),
    "Stream()": lambda o: dev.Stream(),
}
QUERIES_AND_SYNCS = [c for c in FORBIDDEN if c != "Stream()"]


@pytest.mark.parametrize("call", list(FORBIDDEN))
def test_a_forbidden_call_in_a_capture_fails_naming_the_call(call: str, outside: Outside) -> None:
    FORBIDDEN[call](outside)  # allowed outside a capture
    out = torch.zeros(4)
    g = dev.Graph()
    with pytest.raises(CaptureViolation, match=re.escape(call)) as info:
        with capture(g, outside.st):
            kernel_into(out)
            FORBIDDEN[call](outside)
    assert "graph capture is in progress" in str(info.value)
    assert_capture_cleared(outside.st, g)


def test_a_synchronize_of_the_capturing_stream_itself_fails(st: Streams) -> None:
    g = dev.Graph()
    with pytest.raises(CaptureViolation, match=r"Stream\.synchronize\(\) of cap"):
        with capture(g, st):
            kernel_into(torch.zeros(2))
            dev.current_stream().synchronize()
    assert_capture_cleared(st, g)


@pytest.mark.parametrize("call", QUERIES_AND_SYNCS)
def test_a_query_or_synchronize_from_another_thread_fails_and_invalidates_the_capture(
    call: str, outside: Outside
) -> None:
    """Global capture mode: the rule holds for every thread, and the
    capture it broke cannot end well."""
    got: list[BaseException | None] = []

    def elsewhere() -> None:
        try:
            FORBIDDEN[call](outside)
            got.append(None)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            got.append(exc)

    g = dev.Graph()
    with pytest.raises(CaptureViolation, match=re.escape(call)):
        with capture(g, outside.st):
            kernel_into(torch.zeros(2))
            t = threading.Thread(target=elsewhere)
            t.start()
            t.join(BOUND_S)
            assert len(got) == 1 and isinstance(got[0], CaptureViolation), got
            assert call in str(got[0])
    assert_capture_cleared(outside.st, g)


def test_the_raw_capture_calls_report_a_violation_at_capture_end(outside: Outside) -> None:
    st = outside.st
    g = dev.Graph()
    with dev.stream(st.capture):
        g.capture_begin()
        try:
            kernel_into(torch.zeros(2))
            with pytest.raises(CaptureViolation, match=r"Event\.query\(\)"):
                outside.event.query()
            assert capture_in_progress()  # invalid, but ended only by capture_end
        finally:
            with pytest.raises(CaptureViolation, match=r"Event\.query\(\)"):
                g.capture_end()
    assert_capture_cleared(st, g)


def test_capture_refuses_the_default_stream_and_a_second_capture(st: Streams) -> None:
    g = dev.Graph()
    with dev.stream(dev.default_stream()), pytest.raises(CaptureViolation, match="default stream"):
        g.capture_begin()
    assert not capture_in_progress()
    with pytest.raises(CaptureViolation, match="already in progress"):
        with capture(g, st):
            kernel_into(torch.zeros(2))
            with dev.stream(st.s1):
                dev.Graph().capture_begin()
    assert_capture_cleared(st, g)


# ---------------------------------------------------------------------------
# isolation, host reads, joins


@pytest.mark.parametrize("side", [False, True], ids=["capturing stream", "forked stream"])
def test_a_capturing_stream_waiting_on_an_event_recorded_outside_fails(side: bool, outside: Outside) -> None:
    st = outside.st
    g = dev.Graph()
    with pytest.raises(CaptureViolation, match="waits on an event recorded outside the capture") as info:
        fork = dev.Event()  # events are made before capture
        with capture(g, st):
            kernel_into(torch.zeros(2))
            if side:
                fork.record()
                fork.wait(st.s2)  # S2 now captures too
                outside.event.wait(st.s2)
            else:
                outside.event.wait()
    assert ("stream S2" if side else "stream cap") in str(info.value)
    assert_capture_cleared(st, g)


HOST_READS: dict[str, Callable[[torch.Tensor], object]] = {
    "host_read()": lambda t: dev.host_read(t),
    "Tensor.item()": lambda t: t[0].item(),  # a view reads the same storage
    "Tensor.tolist()": lambda t: t.tolist(),
    "Tensor.__bool__()": lambda t: bool(t[0]),
    "Tensor.__int__()": lambda t: int(t[0]),
    "Tensor.__float__()": lambda t: float(t[0]),
}


@pytest.mark.parametrize("call", list(HOST_READS))
def test_a_host_read_of_a_tensor_a_captured_kernel_writes_fails(call: str, st: Streams) -> None:
    written = torch.zeros(4)
    g = dev.Graph()
    with pytest.raises(CaptureViolation, match=re.escape(call)) as info:
        with capture(g, st):
            kernel_into(written)
            HOST_READS[call](written)
    assert "a host read of a tensor a captured kernel writes" in str(info.value)
    assert_capture_cleared(st, g)


def test_a_host_read_of_a_tensor_no_captured_kernel_writes_is_allowed(st: Streams) -> None:
    written, other = torch.zeros(4), torch.ones(4)
    g = dev.Graph()
    with capture(g, st):
        kernel_into(written, 2.0)
        for read in HOST_READS.values():
            read(other)
    g.replay()
    dev.synchronize()
    assert torch.equal(written, torch.full((4,), 2.0))
    assert dev.host_read(written) is written  # and after the capture, any tensor


def test_a_forked_stream_not_joined_back_fails_at_capture_end(st: Streams) -> None:
    g = dev.Graph()
    fork = dev.Event()
    with pytest.raises(CaptureViolation, match="not joined back") as info:
        with capture(g, st):
            fork.record()
            for s in (st.s1, st.s2):
                with dev.stream(s):
                    fork.wait()
                    kernel_into(torch.zeros(2))
            dev.current_stream().wait_stream(st.s1)  # S1 joined, S2 not
    message = str(info.value)
    assert "stream(s) S2 forked" in message and "S1" not in message
    assert_capture_cleared(st, g)


# ---------------------------------------------------------------------------
# positive: fork/join capture and replay


class ForkJoin:
    """The capturing stream forks S1 and S2, each computes from the static
    input ``x``, and it joins both before combining them into ``out``."""

    def __init__(self, st: Streams) -> None:
        gen = torch.Generator().manual_seed(0)
        self.st = st
        self.x = torch.randn(N, N, generator=gen)
        self.w = torch.randn(N, N, generator=gen)
        self.a, self.b, self.out = torch.zeros(N, N), torch.zeros(N, N), torch.zeros(N, N)
        self.fork, self.e1, self.e2 = dev.Event(), dev.Event(), dev.Event()
        self.ran: list[tuple[str, threading.Thread]] = []

    def _a(self) -> None:
        time.sleep(0.002)  # slow: a missing join edge would read a stale ``a``
        torch.matmul(self.x, self.w, out=self.a)
        self.ran.append(("a", threading.current_thread()))

    def _b(self) -> None:
        torch.sin(self.x, out=self.b)
        self.ran.append(("b", threading.current_thread()))

    def _out(self) -> None:
        torch.add(self.a, self.b, out=self.out)
        self.ran.append(("out", threading.current_thread()))

    def issue(self) -> None:
        self.fork.record()
        with dev.stream(self.st.s1):
            self.fork.wait()
            dev.launch(self._a, writes=[self.a])
            self.e1.record()
        with dev.stream(self.st.s2):
            self.fork.wait()
            dev.launch(self._b, writes=[self.b])
            self.e2.record()
        self.e1.wait()
        self.e2.wait()
        dev.launch(self._out, writes=[self.out])

    def eager(self) -> torch.Tensor:
        with dev.stream(self.st.capture):
            self.issue()
        dev.synchronize()
        return self.out.clone()


def test_a_fork_join_capture_replays_with_the_same_edges_and_outputs(st: Streams) -> None:
    fj = ForkJoin(st)
    inputs = [torch.randn(N, N, generator=torch.Generator().manual_seed(i)) for i in range(1, 6)]
    refs = []
    for x in inputs:
        fj.x.copy_(x)
        refs.append(fj.eager())
    fj.out.zero_()
    fj.ran.clear()
    g = dev.NPUGraph()
    with capture(g, st):
        assert dev.is_current_stream_capturing()
        fj.issue()
    assert fj.ran == []  # captured, not run
    assert [(s, kind) for s, kind, _ in g.nodes()] == [
        ("cap", "record"),
        ("S1", "wait"),
        ("S1", "kernel"),
        ("S1", "record"),
        ("S2", "wait"),
        ("S2", "kernel"),
        ("S2", "record"),
        ("cap", "wait"),
        ("cap", "wait"),
        ("cap", "kernel"),
    ]
    replayer = dev.Stream()  # origin nodes run on the stream current at replay
    replayer.name = "R"
    try:
        for x, ref in zip(inputs, refs, strict=True):
            fj.x.copy_(x)  # static input updated in place before each replay
            fj.ran.clear()
            log = dev.StreamLog()
            previous = dev.set_log(log)
            try:
                with dev.stream(replayer):
                    g.replay()
            finally:
                dev.set_log(previous)
            dev.synchronize()
            assert torch.equal(fj.out, ref)  # bitwise the eager output
            assert sorted(fj.ran[:2]) == [("a", st.s1.thread), ("b", st.s2.thread)]
            assert fj.ran[2] == ("out", replayer.thread)
            entries = log.entries()
            fired = {e.event: e for e in entries if e.kind == "record"}
            joins = [e for e in entries if e.stream == "R" and e.kind == "wait"]
            assert sorted(fired[w.event].stream for w in joins) == ["S1", "S2"]  # the two join edges
            assert all(w.end_ns >= fired[w.event].end_ns for w in joins)
            forks = [e for e in entries if e.stream in ("S1", "S2") and e.kind == "wait"]
            assert forks and all(fired[w.event].stream == "R" for w in forks)  # forked from the replay's stream
        assert g.replays == len(inputs)
    finally:
        replayer.close()


def test_the_side_streams_of_a_replay_run_concurrently(st: Streams) -> None:
    """No edge joins S1 and S2 inside the graph: each kernel can only finish
    when the other runs (bounded by the waits' timeouts)."""
    ping, pong = threading.Event(), threading.Event()
    got: dict[str, bool] = {}

    def k1() -> None:
        ping.set()
        got["s1"] = pong.wait(BOUND_S)

    def k2() -> None:
        got["s2"] = ping.wait(BOUND_S)
        pong.set()

    g = dev.Graph()
    fork = dev.Event()
    with capture(g, st):
        fork.record()
        for s, k in ((st.s1, k1), (st.s2, k2)):
            with dev.stream(s):
                fork.wait()
                dev.launch(k)
        dev.current_stream().wait_stream(st.s1)
        dev.current_stream().wait_stream(st.s2)
    for _ in range(3):
        ping.clear()
        pong.clear()
        got.clear()
        g.replay()
        assert dev.drain_all(timeout=3 * BOUND_S)
        dev.synchronize()
        assert got == {"s1": True, "s2": True}


class Produced:
    """A kernel that fills ``data`` with the value of its replay, held by a
    gate until the test lets it go: while it is held, a kernel that reads
    ``data`` sees the replay before's value (stale), after it this one's."""

    def __init__(self) -> None:
        self.data = torch.zeros(1)
        self.gate = threading.Event()
        self.value = 0.0

    def next_replay(self, value: float) -> None:
        self.gate = threading.Event()
        self.value = value

    def kernel(self) -> None:
        gate, value = self.gate, self.value  # this replay's, read when it runs
        gate.wait(BOUND_S)
        self.data.fill_(value)

    def read_into(self, seen: list[float]) -> None:
        """Launch, on the current stream, a kernel that reads ``data``."""
        dev.launch(lambda: seen.append(float(self.data[0])))


def test_a_replay_leaves_an_event_recorded_in_the_capture_at_its_pre_capture_record(st: Streams) -> None:
    """CUDA and ACL: an event made without ``external=True`` and recorded in
    a capture is an edge inside the graph; a replay never records it. Its
    query, elapsed time and a wait outside the graph see the record it had
    before the capture, so a stream waiting on it after a replay is not
    ordered after the replay's work (it reads stale data), while the
    replay's own wait on it is."""
    p = Produced()
    joined = torch.zeros(1)
    start, done = dev.Event(enable_timing=True), dev.Event(enable_timing=True)
    fork = dev.Event()
    start.record(st.s2)
    with dev.stream(st.s2):
        dev.launch(lambda: time.sleep(0.005))
    done.record(st.s2)
    dev.synchronize()
    before, ms_before = done.last, start.elapsed_time(done)
    g = dev.Graph()
    with capture(g, st):
        fork.record()
        with dev.stream(st.s1):
            fork.wait()
            dev.launch(p.kernel, writes=[p.data])
            done.record()
        done.wait()  # the join: an edge inside the graph, bound to the captured record
        dev.launch(lambda: joined.copy_(p.data), writes=[joined])
    assert done.last is before  # capture end gave it back its record
    waiter = dev.Stream()
    waiter.name = "W"
    seen: list[float] = []
    try:
        for i in range(1, 4):
            p.next_replay(float(i))
            g.replay()
            assert done.last is before  # the replay did not record it
            assert done.query()  # the pre-capture record, long fired, while the replay's S1 is held
            assert start.elapsed_time(done) == ms_before
            done.wait(waiter)  # binds to the pre-capture record
            with dev.stream(waiter):
                p.read_into(seen)
            assert waiter.drain(timeout=BOUND_S)  # not held by the replay's work ...
            assert seen[-1] == float(i - 1)  # ... so it read the data the replay before left
            p.gate.set()
            dev.synchronize()
            assert p.data.item() == float(i)
            assert joined.item() == float(i)  # the replay's own join waited for the replay's record
            assert done.last is before and start.elapsed_time(done) == ms_before
    finally:
        p.gate.set()
        waiter.close()


def test_an_external_event_recorded_in_a_graph_holds_each_replays_record(st: Streams) -> None:
    """``Event(external=True)`` recorded in a capture is an external record
    node: each replay records it, so a wait on it after the replay orders
    after the replay's work, and its query follows that record."""
    p = Produced()
    ext = dev.Event(enable_timing=True, external=True)
    fork, join = dev.Event(), dev.Event()
    ext.record(st.s2)
    dev.synchronize()
    before = ext.last
    g = dev.Graph()
    with capture(g, st):
        fork.record()
        with dev.stream(st.s1):
            fork.wait()
            dev.launch(p.kernel, writes=[p.data])
            ext.record()
            join.record()  # joined by an event without external: an edge inside the graph
        join.wait()
    assert ext.last is before  # not recorded until a replay runs the node
    waiter = dev.Stream()
    waiter.name = "W"
    seen: list[float] = []
    previous = before
    try:
        for i in range(1, 4):
            p.next_replay(float(i))
            g.replay()
            assert ext.last is not previous and ext.last is not before  # this replay's record
            previous = ext.last
            assert not ext.query()  # the replay's S1 is held by the gate
            ext.wait(waiter)
            with dev.stream(waiter):
                p.read_into(seen)
            assert not waiter.drain(timeout=0.02)  # held by the replay's record
            p.gate.set()
            dev.synchronize()
            assert seen[-1] == float(i)  # ordered after the replay's work
            assert ext.query() and ext.last is previous
            assert ext.last.ns > before.ns
    finally:
        p.gate.set()
        waiter.close()


def test_an_event_recorded_before_and_in_a_capture_keeps_its_earlier_record(st: Streams) -> None:
    ev = dev.Event()
    ev.record(st.s2)
    before = ev.last
    g = dev.Graph()
    with capture(g, st):
        kernel_into(torch.zeros(2))
        ev.record()
    assert ev.last is before
    g.replay()
    dev.synchronize()
    assert ev.last is before and ev.query()  # and the replay leaves it there


def test_a_later_capture_waiting_on_an_event_recorded_in_an_earlier_one_sees_its_pre_capture_record(
    st: Streams,
) -> None:
    """After the first capture (and its replays) the event holds the record
    it had before, made outside any capture: a wait on it inside a second
    capture is a capture isolation violation, as on a device."""
    ev = dev.Event()
    ev.record(st.s2)
    dev.synchronize()
    first = dev.Graph()
    with capture(first, st):
        kernel_into(torch.zeros(2))
        ev.record()
        ev.wait()  # inside the same capture: an edge
    first.replay()
    dev.synchronize()
    second = dev.Graph()
    with pytest.raises(CaptureViolation, match="waits on an event recorded outside the capture"):
        with capture(second, st):
            kernel_into(torch.zeros(2))
            ev.wait()
    assert_capture_cleared(st, second)


@pytest.mark.parametrize("where", ["recorded outside", "recorded inside", "forked stream"])
def test_a_wait_in_a_capture_on_an_external_event_fails(where: str, st: Streams) -> None:
    """On a device such a wait is an external wait node, not an edge inside
    the graph (it forks no stream into the capture, orders nothing inside
    it): the emulation refuses it rather than model it."""
    ext = dev.Event(external=True)
    ext.record(st.s2)
    dev.synchronize()
    g = dev.Graph()
    with pytest.raises(CaptureViolation, match="on an event made with external=True") as info:
        with capture(g, st):
            kernel_into(torch.zeros(2))
            if where == "recorded outside":
                ext.wait()
            elif where == "recorded inside":
                ext.record()
                ext.wait()
            else:
                ext.record()
                ext.wait(st.s1)  # would fork S1 into the capture
    assert ("stream S1" if where == "forked stream" else "stream cap") in str(info.value)
    assert_capture_cleared(st, g)


@pytest.mark.parametrize("into", ["origin", "branch"])
def test_a_replay_onto_a_stream_in_a_capture_fails(into: str, st: Streams) -> None:
    """The emulation does not capture a graph launch (a child graph): a
    replay whose origin or branch stream is in a capture in progress is
    refused; onto streams outside the capture it runs (global mode allows
    it), and none of its work enters the capture."""
    out = torch.zeros(4)
    fork = dev.Event()
    made = dev.Graph()
    with capture(made, st):
        fork.record()
        with dev.stream(st.s1):
            fork.wait()
            kernel_into(out, 1.0)
        dev.current_stream().wait_stream(st.s1)
    g = dev.Graph()
    with pytest.raises(CaptureViolation, match=re.escape("Graph.replay() onto stream(s) ")) as info:
        with capture(g, st):
            kernel_into(torch.zeros(2))
            if into == "origin":
                made.replay()  # its origin nodes onto cap, capturing
            else:
                fork.record()
                fork.wait(st.s1)  # S1, the graph's branch, now captures
                with dev.stream(st.s2):
                    made.replay()
    assert ("cap" if into == "origin" else "S1") in str(info.value).split(" in a graph capture")[0]
    assert_capture_cleared(st, g)
    other = torch.zeros(4)
    g = dev.Graph()
    with capture(g, st):
        kernel_into(other, 2.0)
        with dev.stream(st.s2):
            made.replay()  # S2 and S1: neither in the capture
    assert [kind for _, kind, _ in g.nodes()] == ["kernel"]
    dev.synchronize()
    assert torch.equal(out, torch.ones(4))


def test_is_current_stream_capturing_only_on_streams_in_the_capture(st: Streams) -> None:
    assert not dev.is_current_stream_capturing() and not capture_in_progress()
    elsewhere: list[bool] = []
    g = dev.Graph()
    fork = dev.Event()
    with capture(g, st):
        assert dev.is_current_stream_capturing() and capture_in_progress()
        with dev.stream(st.s1):
            assert not dev.is_current_stream_capturing()  # not forked yet
        fork.record()
        with dev.stream(st.s1):
            fork.wait()
            assert dev.is_current_stream_capturing()  # forked
            kernel_into(torch.zeros(2))
        with dev.stream(st.s2):
            assert not dev.is_current_stream_capturing()  # never forked
        t = threading.Thread(target=lambda: elsewhere.append(dev.is_current_stream_capturing()))
        t.start()
        t.join(BOUND_S)
        dev.current_stream().wait_stream(st.s1)
    assert elsewhere == [False]  # another thread's current stream is not in the capture
    assert not dev.is_current_stream_capturing() and not capture_in_progress()
    with dev.stream(st.s1):
        assert not dev.is_current_stream_capturing()


def test_a_graph_with_no_captured_nodes_refuses_replay(st: Streams) -> None:
    with pytest.raises(RuntimeError, match="captured nothing"):
        dev.Graph().replay()
    g = dev.Graph()
    with capture(g, st):
        pass
    assert g.node_count == 0
    with pytest.raises(RuntimeError, match="captured nothing"):
        g.replay()


def test_creating_an_event_during_a_capture_fails(st: Streams) -> None:
    """The project's rule (stricter than CUDA's): events are made before
    capture; the patch layer pools them (docs/design.md, "The emulated device")."""
    g = dev.Graph()
    made: list[BaseException] = []

    def elsewhere() -> None:
        try:
            dev.Event()
        except CaptureViolation as exc:
            made.append(exc)

    with pytest.raises(CaptureViolation, match=r"Event\(\) while a graph capture is in progress"):
        with capture(g, st):
            t = threading.Thread(target=elsewhere)
            t.start()
            t.join()
            dev.Event()
    assert made, "another thread's Event() during the capture was not caught"
    assert not capture_in_progress()
    dev.Event()  # after the capture: allowed


# ---------------------------------------------------------------------------
# CAM comm on the origin stream (as torch.npu only)


def launch_comm(out: torch.Tensor, how: str, stage: int = 0) -> None:
    """Launch a CAM comm kernel filling ``out`` on the current stream:
    ``kind``: launched with the comm kind (``a2e``); ``tracked``: a plain
    kernel inside a tracked op the patch layer labels as an E2A."""
    if how == "kind":
        dev.launch(lambda: out.fill_(5.0), writes=[out], kind="a2e")
    else:
        h = dev.tracked(lambda: kernel_into(out, 5.0), f"e2a L0 s{stage}")
        h.result()  # the host's error, if the launch raised


def capture_comm_on(st: Streams, comm_on: str, how: str, out: torch.Tensor, side_out: torch.Tensor) -> dev.Graph:
    """Capture: fork S1, compute on S1, a comm kernel on ``comm_on``
    (``origin``: the capture stream; ``side``: S1), join S1 back."""
    g = dev.Graph()
    fork = dev.Event()
    with capture(g, st):
        fork.record()
        with dev.stream(st.s1):
            fork.wait()
            kernel_into(side_out, 2.0)  # compute on a forked side stream
            if comm_on == "side":
                launch_comm(out, how)
        if comm_on == "origin":
            launch_comm(out, how)
        dev.current_stream().wait_stream(st.s1)
    return g


@pytest.mark.parametrize("how", ["kind", "tracked"])
def test_as_torch_npu_a_comm_kernel_captured_on_a_forked_side_stream_fails(
    how: str, st: Streams, emulated_torch_npu: None
) -> None:
    """Upstream's NPU graph code (afd-plugin's p2p_hccl connector) keeps
    HCCL/CAM comm on the capture's stream: a comm kernel on a stream forked
    from it is refused at the launch, and the capture is invalid."""
    assert dev.is_torch_npu()
    out, side_out = torch.zeros(4), torch.zeros(4)
    g = dev.Graph()
    fork = dev.Event()
    reached: list[str] = []
    with pytest.raises(CaptureViolation, match="CAM comm kernel") as at_end:
        with capture(g, st):
            fork.record()
            with dev.stream(st.s1):
                fork.wait()
                kernel_into(side_out)
                with pytest.raises(CaptureViolation, match="CAM comm kernel") as at_launch:
                    launch_comm(out, how)
                reached.append("after the launch")
            dev.current_stream().wait_stream(st.s1)  # joined: only the comm rule is broken
    assert reached == ["after the launch"]
    message = str(at_launch.value)
    assert str(at_end.value) == message  # capture end reports the violation made at the launch
    kind = "a2e" if how == "kind" else "e2a"
    assert f"a CAM comm kernel ({kind}) was captured on stream S1, not the capture's origin stream cap" in message
    assert "upstream's NPU graph code" in message and "keeps HCCL/CAM comm on the capture's stream" in message
    assert_capture_cleared(st, g)


@pytest.mark.parametrize("how", ["kind", "tracked"])
def test_as_torch_npu_comm_on_the_origin_stream_and_compute_on_a_side_stream_are_allowed(
    how: str, st: Streams, emulated_torch_npu: None
) -> None:
    assert dev.is_torch_npu()
    out, side_out = torch.zeros(4), torch.zeros(4)
    g = capture_comm_on(st, "origin", how, out, side_out)
    assert [(name, kind) for name, kind, _ in g.nodes() if kind == "kernel"] == [("S1", "kernel"), ("cap", "kernel")]
    with dev.stream(st.capture):
        g.replay()
    dev.synchronize()
    assert torch.equal(out, torch.full((4,), 5.0)) and torch.equal(side_out, torch.full((4,), 2.0))


@pytest.mark.parametrize("how", ["kind", "tracked"])
def test_not_as_torch_npu_a_comm_kernel_on_a_side_stream_is_allowed(how: str, st: Streams) -> None:
    """As ``torch.cuda``'s stand-in (the device not installed as
    ``torch.npu``) the rule is off: comm may be captured on a side stream."""
    assert not dev.is_torch_npu()
    out, side_out = torch.zeros(4), torch.zeros(4)
    g = capture_comm_on(st, "side", how, out, side_out)
    assert [name for name, kind, _ in g.nodes() if kind == "kernel"] == ["S1", "S1"]
    with dev.stream(st.capture):
        g.replay()
    dev.synchronize()
    assert torch.equal(out, torch.full((4,), 5.0)) and torch.equal(side_out, torch.full((4,), 2.0))
