"""The CPU stream backend: FIFO side streams on worker threads, events as
flags, the host thread as the compute stream, poisoning after a failure."""

from __future__ import annotations

import gc
import itertools
import threading
import time
import weakref
from collections.abc import Iterator

import pytest
import torch

from camp2p_overlap.core.keys import A_DONE, E_DONE, F_DONE, EventKey
from camp2p_overlap.core.overlap.streams import CpuBackend, StreamPoisonedError, make_backend, resolve_backend_name
from camp2p_overlap.core.overlap.streams.cpu import CpuEvent, WorkerStream


@pytest.fixture
def backend() -> Iterator[CpuBackend]:
    b = CpuBackend()
    yield b
    b.close()


def test_side_stream_runs_in_submission_order(backend: CpuBackend) -> None:
    k = backend.new_stream("K0")
    seen: list[int] = []
    handles = [backend.submit(k, lambda i=i: seen.append(i) or i * i) for i in range(50)]
    assert k.drain(timeout=10)
    assert seen == list(range(50))
    assert [h.result() for h in handles] == [i * i for i in range(50)]
    assert all(h.start_ns <= h.end_ns for h in handles)
    assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(handles))


def test_compute_stream_is_the_calling_thread(backend: CpuBackend) -> None:
    c = backend.compute_stream()
    assert c.name == "C"
    h = backend.submit(c, threading.get_ident)
    assert h.done() and h.result() == threading.get_ident()
    bad = backend.submit(c, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.result()
    ev = backend.record(c, EventKey(F_DONE, 0, 0))
    assert ev.query()  # C has reached it: the host is C


def test_event_recorded_on_a_side_stream_completes_when_reached(backend: CpuBackend) -> None:
    k = backend.new_stream("K0")
    gate = threading.Event()
    h = backend.submit(k, lambda: gate.wait(10) and "ran")
    ev = backend.record(k, EventKey(A_DONE, 0, 0))
    assert not ev.query()
    gate.set()
    backend.wait(backend.compute_stream(), ev)  # the host blocks until K0 reaches it
    assert h.done() and h.result() == "ran"
    assert ev.query()


def test_side_stream_waits_an_event_before_later_work(backend: CpuBackend) -> None:
    k = backend.new_stream("K0")
    ev = CpuEvent(EventKey(F_DONE, 0, 0), "C")
    backend.wait(k, ev)
    h = backend.submit(k, lambda: "after")
    assert not k.drain(timeout=0.05)  # stuck behind the unrecorded event
    assert not h.done()
    for _ in range(1000):  # the worker may not have reached the wait yet on a busy box
        if k.current is not None:
            break
        time.sleep(0.005)
    assert k.current == "wait f L0 s0"  # what the stream is doing, by the event's label
    ev.set()
    assert k.drain(timeout=10)
    assert h.result() == "after"


def test_two_side_streams_run_concurrently(backend: CpuBackend) -> None:
    """K0's op can only finish when K1's op runs: serialized streams would
    never complete it (bounded by the waits' timeouts)."""
    k0, k1 = backend.new_stream("K0"), backend.new_stream("K1")
    ping, pong = threading.Event(), threading.Event()
    h0 = backend.submit(k0, lambda: ping.set() or pong.wait(10))
    h1 = backend.submit(k1, lambda: ping.wait(10) and (pong.set() or True))
    assert k0.drain(timeout=15) and k1.drain(timeout=15)
    assert h0.result() is True and h1.result() is True


def test_torch_work_on_a_side_stream(backend: CpuBackend) -> None:
    k = backend.new_stream("K0")
    x = torch.randn(64, 64)
    h = backend.submit(k, lambda: x @ x)
    assert torch.equal(h.result(), x @ x)


def test_failed_op_poisons_the_stream_until_the_next_step(backend: CpuBackend) -> None:
    k = backend.new_stream("K0")
    boom = KeyError("boom")

    def fail() -> None:
        raise boom

    bad = backend.submit(k, fail, label="a2e L0 s0")
    later = backend.submit(k, lambda: "never", label="e2a L0 s0")
    ev = backend.record(k, EventKey(E_DONE, 0, 0))
    backend.wait(backend.compute_stream(), ev)  # records still complete: nothing hangs
    with pytest.raises(KeyError) as info:
        bad.result()
    assert info.value is boom
    with pytest.raises(StreamPoisonedError, match=r"e2a L0 s0 skipped on stream K0: an earlier op failed \(KeyError"):
        later.result()
    assert backend.step_errors([k]) == [boom]
    backend.begin_step([k])
    assert backend.step_errors([k]) == []
    assert backend.submit(k, lambda: "ok").result() == "ok"


def test_release_drops_the_result_not_the_timing(backend: CpuBackend) -> None:
    k = backend.new_stream("K0")
    t = torch.ones(8)
    ref = weakref.ref(t)
    h = backend.submit(k, lambda t=t: t)
    assert h.result() is t
    del t
    h.release()
    assert k.drain(timeout=10)
    gc.collect()
    assert ref() is None
    assert h.done() and h.start_ns is not None and h.end_ns is not None


def test_worker_drops_finished_work(backend: CpuBackend) -> None:
    """The worker thread keeps no reference to an op's closure once it ran."""
    k = backend.new_stream("K0")
    t = torch.ones(8)
    ref = weakref.ref(t)
    backend.submit(k, lambda t=t: None)
    del t
    assert k.drain(timeout=10)
    gc.collect()
    assert ref() is None


def test_close_stops_the_worker_threads() -> None:
    b = CpuBackend()
    streams = [b.new_stream(f"K{i}") for i in range(3)]
    threads = [s.thread for s in streams]
    assert all(t.is_alive() and t in threading.enumerate() for t in threads)
    assert [t.name for t in threads] == [f"camp2p-overlap-stream-K{i}" for i in range(3)]
    b.close()
    assert not any(s.alive for s in streams)
    assert not any(t in threading.enumerate() for t in threads)


def test_drain_times_out_on_a_busy_stream() -> None:
    s = WorkerStream("K9")
    gate = threading.Event()
    try:
        s.put(("wait", _Flag(gate)))
        assert not s.drain(timeout=0.05)
        gate.set()
        assert s.drain(timeout=10)
    finally:
        assert s.stop(timeout=10)


class _Flag:
    def __init__(self, ev: threading.Event) -> None:
        self.ev = ev

    def synchronize(self) -> None:
        self.ev.wait(10)


def test_backend_choice() -> None:
    cpu = torch.device("cpu")
    assert resolve_backend_name("cpu", cpu) == "cpu"
    b = make_backend("cpu")
    assert isinstance(b, CpuBackend)
    b.close()
    assert resolve_backend_name("auto", torch.device("cuda")) == "cuda"
    assert resolve_backend_name("auto", "npu:0") == "npu"


# ---------------------------------------------------------------------------
# Device-like asynchrony: launched kernels, and the log of what streams did


def test_a_kernel_launched_on_the_compute_stream_runs_at_once(backend: CpuBackend) -> None:
    from camp2p_overlap.core.overlap.streams.cpu import launch

    ran: list[str] = []
    h = backend.submit(backend.compute_stream(), lambda: launch(lambda: ran.append("kernel")) or ran.append("op"))
    assert h.done() and ran == ["kernel", "op"]
    launch(lambda: ran.append("outside"))  # no backend at all: at once too
    assert ran[-1] == "outside"


def test_a_failed_kernel_poisons_its_stream_after_the_value_is_out(backend: CpuBackend) -> None:
    from camp2p_overlap.core.overlap.streams.cpu import launch

    k = backend.new_stream("K0")
    gate = threading.Event()

    def kernel() -> None:
        gate.wait(10)
        raise RuntimeError("kernel failed")

    h = backend.submit(k, lambda: launch(kernel) or "value")
    later = backend.submit(k, lambda: "never")
    ev = backend.record(k, EventKey(A_DONE, 0, 0))
    assert h.result() == "value"  # out before its kernel ran (and failed)
    gate.set()
    backend.wait(backend.compute_stream(), ev)  # records still complete
    with pytest.raises(RuntimeError, match="kernel failed"):
        h.result()  # after the wait the error is there
    with pytest.raises(StreamPoisonedError):
        later.result()
    assert [str(e) for e in backend.step_errors([k])] == ["kernel failed"]


def test_the_stream_log_holds_what_each_stream_performed(backend: CpuBackend) -> None:
    k0, k1 = backend.new_stream("K0"), backend.new_stream("K1")
    c = backend.compute_stream()
    assert backend.start_log()
    fork = backend.record(c, EventKey.fork())
    backend.wait(k0, fork)
    a = backend.record(k0, EventKey(A_DONE, 0, 0))
    backend.wait(c, a)
    backend.wait(k1, a)  # queued, performed once K0 reached the record
    j = backend.record(k1, EventKey.join(1))
    backend.wait(c, j)
    log = backend.stop_log()
    got = [(e.stream, e.kind, e.key) for e in log]
    assert sorted(got) == sorted(
        [
            ("C", "record", EventKey("fork")),
            ("K0", "wait", EventKey("fork")),
            ("K0", "record", EventKey("a", 0, 0)),
            ("C", "wait", EventKey("a", 0, 0)),
            ("K1", "wait", EventKey("a", 0, 0)),
            ("K1", "record", EventKey("join", None, 1)),
            ("C", "wait", EventKey("join", None, 1)),
        ]
    )
    assert [e.order for e in log] == sorted(e.order for e in log)
    fired = {e.event: e.end_ns for e in log if e.kind == "record"}
    for w in (e for e in log if e.kind == "wait"):
        assert w.event in fired and w.end_ns >= fired[w.event]  # let go only once its event fired
    assert all(isinstance(e.key, EventKey) for e in log)
    assert {e.event for e in log if e.key == EventKey(A_DONE, 0, 0)} == {a.seq}  # bound to the event itself
    backend.wait(c, backend.record(k0, EventKey(E_DONE, 0, 0)))
    assert backend.stop_log() == []  # closed: nothing more is logged


def test_a_log_left_open_is_closed_by_the_next_step(backend: CpuBackend) -> None:
    k = backend.new_stream("K0")
    c = backend.compute_stream()
    backend.start_log()
    backend.begin_step([k])  # the step that opened it: kept
    backend.wait(c, backend.record(c, EventKey(A_DONE, 0, 0)))
    backend.begin_step([k])  # a later step that did not open it (the first never closed)
    backend.wait(c, backend.record(c, EventKey(A_DONE, 1, 0)))
    assert backend.stop_log() == []
    assert k.log is None
