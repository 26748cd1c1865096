"""The emulated device behind ``make_backend("cpu")``: every stream, the
compute stream included, is a worker thread running its kernels, records
and waits in FIFO order while the host only enqueues; waits bind to an
event's latest record when enqueued; a failed kernel poisons its stream;
the stream log holds what each stream performed."""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from camp2p_overlap.core.keys import A_DONE, E_DONE, F_DONE, EventKey
from camp2p_overlap.core.overlap.adaptive import BucketKey, StepTimings
from camp2p_overlap.core.overlap.streams import (
    BackendUnavailable,
    StreamBackend,
    StreamPoisonedError,
    make_backend,
    resolve_backend_name,
)
from camp2p_overlap.emulation import device as dev
from camp2p_overlap.emulation.device import worker

BOUND_S = 10.0  # generous: how long a test waits for what must happen soon


@pytest.fixture(autouse=True)
def _device_left_idle() -> Iterator[None]:
    yield
    assert dev.drain_all(timeout=BOUND_S), "a stream was left blocked"
    dev.take_errors()  # errors a test left behind do not reach the next one
    assert worker.hooks.capture is None


@pytest.fixture
def backend() -> Iterator[StreamBackend]:
    b = make_backend("cpu")
    assert isinstance(b, StreamBackend)
    yield b
    b.close()


@pytest.fixture
def streams() -> Iterator[Callable[[str], dev.Stream]]:
    """Module streams made directly (closed at the end)."""
    made: list[dev.Stream] = []

    def make(name: str) -> dev.Stream:
        s = dev.Stream()
        s.name = name
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def until(pred: Callable[[], bool], timeout: float = BOUND_S) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def gate_on(s: Any) -> threading.Event:
    """Block stream ``s`` with a kernel until the returned gate is set."""
    gate = threading.Event()
    with dev.stream(s):
        dev.launch(lambda: gate.wait(BOUND_S) or None)
    return gate


def record(backend: StreamBackend, stream: Any, k: EventKey) -> Any:
    """Record the pooled event of ``k`` on ``stream``, as the session does."""
    ev = backend.event(k)
    ev.record(stream)
    return ev


def key(kind: str, layer: int = 0, stage: int = 0) -> EventKey:
    return EventKey(kind, layer, stage)


# ---------------------------------------------------------------------------
# order, asynchrony, events


def test_a_side_stream_runs_its_kernels_in_launch_order(backend: StreamBackend) -> None:
    k = backend.new_stream("K0")
    seen: list[tuple[int, threading.Thread]] = []

    def op(i: int) -> int:
        dev.launch(lambda: seen.append((i, threading.current_thread())))
        return i * i

    handles = [backend.submit(k, lambda i=i: op(i), label=f"op{i}") for i in range(50)]
    assert k.drain(timeout=BOUND_S)
    assert [i for i, _ in seen] == list(range(50))
    assert {t for _, t in seen} == {k.thread}
    assert [h.result() for h in handles] == [i * i for i in range(50)]
    assert all(h.done() and h.start_ns <= h.end_ns for h in handles)
    assert all(a.end_ns <= b.start_ns and a.order < b.order for a, b in itertools.pairwise(handles))


def test_the_compute_stream_is_a_worker_too(backend: StreamBackend) -> None:
    c = backend.compute_stream()
    assert c.name == "C" and c is dev.current_stream()
    assert c.thread is not threading.current_thread()
    gate = gate_on(c)
    ran: list[threading.Thread] = []
    try:
        h = backend.submit(
            c, lambda: dev.launch(lambda: ran.append(threading.current_thread())) or "value", label="ffn"
        )
        ev = record(backend, c, key(F_DONE))
        assert h.result() == "value"  # the host returned at once ...
        assert not h.done() and ran == []  # ... the kernel runs later, on C
        assert not ev.query()
    finally:
        gate.set()
    assert c.drain(timeout=BOUND_S)
    assert ran == [c.thread]
    assert h.done() and ev.query()


def test_a_host_error_in_an_op_is_its_result_and_poisons_nothing(backend: StreamBackend) -> None:
    c = backend.compute_stream()
    bad = backend.submit(c, lambda: 1 / 0)
    assert bad.done()
    with pytest.raises(ZeroDivisionError):
        bad.result()
    assert isinstance(bad.exception(), ZeroDivisionError)
    assert backend.peek_errors([c]) == [] and c.poisoned is None


def test_an_event_completes_when_its_stream_reaches_it(backend: StreamBackend) -> None:
    k = backend.new_stream("K0")
    gate = gate_on(k)
    h = backend.submit(k, lambda: dev.launch(lambda: None) or "ran")
    ev = record(backend, k, key(A_DONE))
    try:
        assert not ev.query() and not h.done()
    finally:
        gate.set()
    ev.synchronize()
    assert ev.query() and h.done() and h.result() == "ran"
    never = dev.Event()
    assert never.query()  # never recorded: complete, as on a device
    k.wait_event(never)  # and a wait on it waits for nothing
    assert k.drain(timeout=BOUND_S)


def test_a_wait_holds_its_stream_until_the_record_fires(backend: StreamBackend) -> None:
    k0, k1 = backend.new_stream("K0"), backend.new_stream("K1")
    gate = gate_on(k0)
    ran: list[str] = []
    try:
        ev = record(backend, k0, key(F_DONE))
        k1.wait_event(ev)  # the host does not block
        backend.submit(k1, lambda: dev.launch(lambda: ran.append("after")))
        assert not k1.drain(timeout=0.05)  # stuck behind the wait
        assert until(lambda: k1.current == "wait")  # what the stream is doing
        assert ran == [] and not k1.query()
    finally:
        gate.set()
    assert k1.drain(timeout=BOUND_S)
    assert ran == ["after"] and k1.query() and k1.current is None


def test_a_wait_binds_to_the_latest_record_when_it_is_enqueued(streams: Callable[[str], dev.Stream]) -> None:
    """Re-recording an event after a wait was enqueued does not change what
    that wait waits for; a wait enqueued after it waits for the new record."""
    k0, k1, k2, k3 = (streams(f"K{i}") for i in range(4))
    ev = dev.Event()
    ev.key = key(A_DONE)
    log = dev.StreamLog()
    previous = dev.set_log(log)
    gate0, gate2 = gate_on(k0), gate_on(k2)
    try:
        ev.record(k0)
        first = ev.last
        ev.wait(k1)  # bound to the record on K0
        ev.record(k2)  # the event's latest record is now K2's
        second = ev.last
        ev.wait(k3)  # bound to the record on K2
        assert first is not second
        gate0.set()
        assert k1.drain(timeout=BOUND_S)  # let go by K0's record ...
        assert not ev.query()  # ... though the latest record has not fired
        assert not k3.drain(timeout=0.05)  # K3 waits for K2's
    finally:
        gate0.set()
        gate2.set()
        dev.set_log(previous)
    assert k3.drain(timeout=BOUND_S) and ev.query()
    waits = {e.stream: e.event for e in log.entries() if e.kind == "wait"}
    assert waits == {"K1": first.seq, "K3": second.seq}


def test_two_side_streams_run_concurrently(backend: StreamBackend) -> None:
    """K0's kernel can only finish when K1's runs: serialized streams would
    never complete it (bounded by the waits' timeouts)."""
    k0, k1 = backend.new_stream("K0"), backend.new_stream("K1")
    ping, pong = threading.Event(), threading.Event()
    got: dict[str, bool] = {}

    def k0_kernel() -> None:
        ping.set()
        got["k0"] = pong.wait(BOUND_S)

    def k1_kernel() -> None:
        got["k1"] = ping.wait(BOUND_S)
        pong.set()

    backend.submit(k0, lambda: dev.launch(k0_kernel))
    backend.submit(k1, lambda: dev.launch(k1_kernel))
    assert k0.drain(timeout=2 * BOUND_S) and k1.drain(timeout=2 * BOUND_S)
    assert got == {"k0": True, "k1": True}


def test_torch_work_on_a_side_stream_fills_its_output_later(backend: StreamBackend) -> None:
    k = backend.new_stream("K0")
    x = torch.randn(64, 64)
    gate = gate_on(k)

    def op() -> torch.Tensor:
        out = torch.zeros(64, 64)
        dev.launch(lambda: torch.matmul(x, x, out=out), writes=[out])
        return out

    try:
        h = backend.submit(k, op)
        out = h.result()
        assert torch.count_nonzero(out) == 0  # allocated, not filled yet
    finally:
        gate.set()
    assert k.drain(timeout=BOUND_S)
    assert torch.equal(out, x @ x)


# ---------------------------------------------------------------------------
# asynchronous errors


def test_a_failed_kernel_poisons_its_stream_until_the_next_step(backend: StreamBackend) -> None:
    k, other = backend.new_stream("K0"), backend.new_stream("K1")
    boom = KeyError("boom")
    ran: list[str] = []

    def fail() -> None:
        raise boom

    bad = backend.submit(k, lambda: dev.launch(fail) or "value", label="a2e L0 s0")
    later = backend.submit(k, lambda: dev.launch(lambda: ran.append("never")), label="e2a L0 s0")
    k.wait_event(record(backend, other, key(F_DONE)))  # waits on the poisoned stream still fire
    ev = record(backend, k, key(E_DONE))  # and so do its records
    other.wait_event(ev)
    backend.submit(other, lambda: dev.launch(lambda: ran.append("other")))
    assert k.drain(timeout=BOUND_S) and other.drain(timeout=BOUND_S)  # nothing hangs
    assert ev.query()
    assert bad.result() == "value"  # the host's value: kernel errors are asynchronous
    assert bad.done() and bad.exception() is boom
    assert later.done() and isinstance(later.exception(), StreamPoisonedError)
    assert str(later.exception()).startswith("e2a L0 s0 skipped on stream K0: an earlier kernel failed (KeyError")
    assert ran == ["other"]
    assert k.poisoned is boom and k.errors == [boom]
    assert backend.peek_errors([k]) == [boom] and backend.peek_errors([other]) == []
    assert backend.peek_errors([k]) == [boom]  # peeking does not take
    backend.take_errors([k])
    assert backend.peek_errors([k]) == [] and k.poisoned is None
    h = backend.submit(k, lambda: dev.launch(lambda: ran.append("ok")))
    assert k.drain(timeout=BOUND_S)
    assert ran == ["other", "ok"] and h.exception() is None


def test_take_errors_takes_them_and_lifts_the_poison(streams: Callable[[str], dev.Stream]) -> None:
    k = streams("K0")
    boom = ValueError("boom")

    def fail() -> None:
        raise boom

    with dev.stream(k):
        dev.launch(fail)
    assert k.drain(timeout=BOUND_S)
    assert dev.peek_errors([k]) == [boom]
    assert dev.take_errors([k]) == [boom]
    assert dev.peek_errors([k]) == [] and k.poisoned is None
    ran: list[bool] = []
    with dev.stream(k):
        dev.launch(lambda: ran.append(True))
    assert k.drain(timeout=BOUND_S) and ran == [True]


def test_device_synchronize_raises_the_first_asynchronous_error_and_clears_it(
    streams: Callable[[str], dev.Stream],
) -> None:
    """Six streams fail one after the other, in the reverse of the order
    they were made: synchronize raises the one that failed first."""
    ks = [streams(f"K{i}") for i in range(6)]
    previous: dev.Event | None = None
    for i, s in enumerate(reversed(ks)):
        if previous is not None:
            s.wait_event(previous)

        def fail(i: int = i) -> None:
            raise RuntimeError(f"failure {i}")

        with dev.stream(s):
            dev.launch(fail)
        previous = s.record_event()
    with pytest.raises(RuntimeError, match=r"^failure 0$"):
        dev.synchronize()
    assert all(s.poisoned is None and s.errors == [] for s in ks)
    dev.synchronize()  # cleared: nothing raised again


# ---------------------------------------------------------------------------
# what streams keep, and their threads


def test_release_drops_the_result_not_the_timing(backend: StreamBackend) -> None:
    k = backend.new_stream("K0")
    t = torch.ones(8)
    ref = weakref.ref(t)
    h = backend.submit(k, lambda t=t: dev.launch(lambda: None) or t)
    assert h.result() is t
    del t
    h.release()
    assert k.drain(timeout=BOUND_S)
    gc.collect()
    assert ref() is None
    assert h.result() is None
    assert h.done() and h.start_ns is not None and h.end_ns is not None and h.start_ns <= h.end_ns


def test_a_worker_drops_finished_work(streams: Callable[[str], dev.Stream]) -> None:
    """The worker keeps no reference to a kernel's closure once it ran."""
    k = streams("K0")
    gate = gate_on(k)
    t = torch.ones(8)
    ref = weakref.ref(t)
    with dev.stream(k):
        dev.launch(lambda t=t: None)
    del t
    gc.collect()
    try:
        assert ref() is not None  # queued: its kernel holds it
    finally:
        gate.set()
    assert until(k.query)  # no drain: the kernel stays the last item the worker took
    gc.collect()
    assert ref() is None


def test_close_stops_the_worker_threads() -> None:
    b = make_backend("cpu")
    ks = [b.new_stream(f"K{i}") for i in range(3)]
    threads = [s.thread for s in ks]
    assert all(t.is_alive() and t in threading.enumerate() for t in threads)
    assert [t.name for t in threads] == [f"camp2p-overlap-stream-K{i}" for i in range(3)]
    b.close()
    assert not any(s.alive for s in ks)
    assert not any(t in threading.enumerate() for t in threads)
    with pytest.raises(RuntimeError, match="stream K0 is closed"):
        ks[0].launch(lambda: None)
    assert dev.drain_all(timeout=BOUND_S)  # a device synchronize skips closed streams


def test_a_stream_nobody_holds_is_collected_and_its_thread_stops() -> None:
    s = dev.Stream()
    thread = s.thread
    ref = weakref.ref(s)
    s.launch(lambda: None)
    assert s.drain(timeout=BOUND_S)
    del s
    gc.collect()
    assert ref() is None
    thread.join(BOUND_S)
    assert not thread.is_alive()
    assert dev.drain_all(timeout=BOUND_S)


def test_drain_times_out_on_a_busy_stream(streams: Callable[[str], dev.Stream]) -> None:
    k = streams("K9")
    gate = gate_on(k)
    try:
        assert not k.drain(timeout=0.05)
        assert not k.query()
    finally:
        gate.set()
    assert k.drain(timeout=BOUND_S) and k.query()


# ---------------------------------------------------------------------------
# idle streams cost nothing: records fire on the host, synchronize skips them


def running_on(s: dev.Stream) -> tuple[threading.Event, torch.Tensor]:
    """A kernel running on ``s`` (started, its FIFO empty) that fills the
    returned buffer once the returned gate is set."""
    gate, started = threading.Event(), threading.Event()
    buf = torch.zeros(4)

    def kernel() -> None:
        started.set()
        gate.wait(BOUND_S)
        buf.fill_(1.0)

    with dev.stream(s):
        dev.launch(kernel, writes=[buf])
    assert started.wait(BOUND_S)
    return gate, buf


def test_a_record_on_a_stream_running_a_kernel_fires_after_that_kernel(
    streams: Callable[[str], dev.Stream],
) -> None:
    """The stream's FIFO is empty while its kernel runs: the stream is not
    idle, so the record is queued; a wait on it orders a reader after the
    kernel (it would read the buffer's zeros otherwise)."""
    k, reader = streams("K0"), streams("K1")
    gate, buf = running_on(k)
    seen: list[torch.Tensor] = []
    try:
        assert k.current == "kernel" and not k.query()
        before = k.puts
        ev = k.record_event()
        assert k.puts == before + 1  # queued behind the kernel, not fired on the host
        assert not ev.query()
        reader.wait_event(ev)
        with dev.stream(reader):
            dev.launch(lambda: seen.append(buf.clone()))
        assert not reader.drain(timeout=0.05)  # held by the wait
        assert seen == []
    finally:
        gate.set()
    assert reader.drain(timeout=BOUND_S)
    assert ev.query() and len(seen) == 1 and torch.equal(seen[0], torch.ones(4))


def test_a_record_on_an_idle_stream_is_complete_at_once_and_a_wait_on_it_queues_nothing(
    streams: Callable[[str], dev.Stream],
) -> None:
    k, other = streams("K0"), streams("K1")
    with dev.stream(k):
        dev.launch(lambda: None)
    assert k.drain(timeout=BOUND_S) and other.drain(timeout=BOUND_S)
    puts = (k.puts, other.puts)
    timed = dev.Event(enable_timing=True)
    ev = k.record_event(timed)
    assert ev.query()  # at once: no worker had to run
    assert (k.puts, other.puts) == puts
    other.wait_event(ev)  # bound to a record that has fired: holds nothing
    assert other.puts == puts[1]
    ran: list[str] = []
    with dev.stream(other):
        dev.launch(lambda: ran.append("after"))
    assert other.drain(timeout=BOUND_S) and ran == ["after"]
    end = dev.Event(enable_timing=True)
    end.record(other)
    assert timed.elapsed_time(end) >= 0.0  # timed on the host clock, as the queued path times it


def test_with_a_stream_log_open_a_record_on_an_idle_stream_is_performed_by_the_stream(
    streams: Callable[[str], dev.Stream],
) -> None:
    k, other = streams("K0"), streams("K1")
    assert k.drain(timeout=BOUND_S)
    log = dev.StreamLog()
    previous = dev.set_log(log)
    try:
        puts = (k.puts, other.puts)
        ev = k.record_event()
        assert k.puts == puts[0] + 1  # queued: the stream performs (and logs) it
        assert k.drain(timeout=BOUND_S)
        assert ev.query()
        other.wait_event(ev)  # fired already, and still logged as the stream performs it
        assert other.puts == puts[1] + 1
        assert other.drain(timeout=BOUND_S)
    finally:
        dev.set_log(previous)
    assert [(e.stream, e.kind, e.event) for e in log.entries()] == [
        ("K0", "record", ev.last.seq),
        ("K1", "wait", ev.last.seq),
    ]


def test_every_waiter_on_one_record_goes_when_it_fires(streams: Callable[[str], dev.Stream]) -> None:
    """Streams and host threads waiting on one record are all let go when
    it fires, and one whose bound passes first is told it has not fired."""
    k, *waiters = (streams(f"K{i}") for i in range(4))
    gate = gate_on(k)
    ev = k.record_event()
    rec = ev.last
    ran: list[str] = []
    host: list[bool] = []
    try:
        for w in waiters:
            w.wait_event(ev)
            with dev.stream(w):
                dev.launch(lambda name=w.name: ran.append(name))
        # Unbounded waits: each must be handed the gate (daemon threads, so
        # that a waiter left blocked fails the test instead of hanging it).
        threads = [threading.Thread(target=lambda: host.append(rec.wait()), daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        assert not rec.wait(0.05) and not rec.done
        assert until(lambda: all(w.current == "wait" for w in waiters))
        assert ran == [] and host == []
    finally:
        gate.set()
    for t in threads:
        t.join(BOUND_S)
    assert host == [True, True, True]
    assert all(w.drain(timeout=BOUND_S) for w in waiters)
    assert sorted(ran) == ["K1", "K2", "K3"]
    assert rec.done and rec.wait(0) and ev.query()


def test_synchronize_puts_nothing_on_idle_streams(streams: Callable[[str], dev.Stream]) -> None:
    ks = [streams(f"K{i}") for i in range(6)]
    for k in ks:
        with dev.stream(k):
            dev.launch(lambda: None)
    dev.synchronize()
    puts = [k.puts for k in ks]
    done = [k._w.done_count for k in ks]
    for _ in range(10):
        dev.synchronize()
        assert dev.drain_all(timeout=BOUND_S)
        assert all(k.drain(timeout=BOUND_S) for k in ks)
    assert [k.puts for k in ks] == puts  # no record put, no thread woken
    assert [k._w.done_count for k in ks] == done
    gate = gate_on(ks[2])  # a busy stream is drained: one record, behind its work
    try:
        assert not dev.drain_all(timeout=0.05)
        assert [k.puts - p for k, p in zip(ks, puts, strict=True)] == [0, 0, 2, 0, 0, 0]  # the gate, the record
    finally:
        gate.set()
    assert dev.drain_all(timeout=BOUND_S)


def test_synchronize_waits_for_the_work_a_closed_stream_still_runs(streams: Callable[[str], dev.Stream]) -> None:
    """Work queued before a close still runs (close stops the thread after
    it): a device synchronize waits for it and for the thread's end."""
    k = dev.Stream()
    gate = gate_on(k)
    ran: list[str] = []
    with dev.stream(k):
        dev.launch(lambda: (time.sleep(0.05), ran.append("after")))
    assert not k.close(timeout=0)  # told to stop; its thread still runs the gate
    assert k.alive and k.closed
    gate.set()
    dev.synchronize()
    assert ran == ["after"] and not k.alive


# ---------------------------------------------------------------------------
# backend choice and the module


def test_backend_choice() -> None:
    cpu = torch.device("cpu")
    assert resolve_backend_name("cpu", cpu) == "cpu"
    b = make_backend("cpu")
    try:
        assert isinstance(b, StreamBackend) and b.name == "cpu"
        assert b.mod is dev
        assert isinstance(b.new_stream("K0"), dev.Stream)
        assert b.is_capturing() is False
    finally:
        b.close()
    assert resolve_backend_name("auto", torch.device("cuda")) == "cuda"
    assert resolve_backend_name("auto", "npu:0") == "npu"
    with pytest.raises(BackendUnavailable, match="only when"):
        resolve_backend_name("auto", cpu)  # auto never picks the emulated device
    with pytest.raises(BackendUnavailable, match="asked for but the runner's device is 'cpu'"):
        resolve_backend_name("cuda", cpu)


def test_the_public_path_is_the_same_module_and_installs_as_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    from camp2p_overlap.emulation import device

    assert device.Stream is dev.Stream and device.Event is dev.Event and device.launch is dev.launch
    assert device.NPUGraph is device.CUDAGraph is dev.Graph
    assert device.is_available() and device.device_count() == 1
    before = getattr(torch, "npu", None)
    if before is not None and before is not device:
        pytest.skip("a real torch.npu (torch_npu) is loaded: the emulated device must stay off")
    try:
        assert device.as_torch_npu() is device
        assert device.as_torch_npu() is device  # idempotent
        assert torch.npu is device and device.is_torch_npu()  # type: ignore[attr-defined]
        device.remove_torch_npu()
        assert getattr(torch, "npu", None) is None and not device.is_torch_npu()
        monkeypatch.setattr(torch, "npu", SimpleNamespace(), raising=False)
        with pytest.raises(RuntimeError, match="real device module"):
            device.as_torch_npu()
        device.remove_torch_npu()  # not ours: left alone
        assert isinstance(torch.npu, SimpleNamespace)  # type: ignore[attr-defined]
    finally:
        monkeypatch.undo()
        if before is device:
            device.as_torch_npu()
        else:
            device.remove_torch_npu()


def test_event_takes_the_device_modules_arguments() -> None:
    """``Event(enable_timing, blocking, interprocess, external)``, in
    ``torch.cuda.Event``'s order; ``external`` (off by default) is what a
    graph replay reads (tests/emulation/test_capture_rules.py)."""
    import inspect

    ours = list(inspect.signature(dev.Event.__init__).parameters)[1:]
    assert ours == ["enable_timing", "blocking", "interprocess", "external"]
    cuda_event = getattr(getattr(torch, "cuda", None), "Event", None)
    if cuda_event is not None:
        assert list(inspect.signature(cuda_event.__new__).parameters)[1:] == ours
    assert dev.Event().external is False and dev.Event(external=True).external is True
    assert dev.Event(True, False, False, True).external is True and dev.Event(True).enable_timing
    assert dev.current_stream().record_event().external is False  # a stream's own event


# ---------------------------------------------------------------------------
# timing


def test_elapsed_time_needs_timing_events_that_completed(streams: Callable[[str], dev.Stream]) -> None:
    k = streams("K0")
    start, end = dev.Event(enable_timing=True), dev.Event(enable_timing=True)
    start.record(k)
    with dev.stream(k):
        dev.launch(lambda: time.sleep(0.02))
    end.record(k)
    end.synchronize()
    ms = start.elapsed_time(end)
    assert 19.0 <= ms < 60_000.0
    plain = dev.Event()
    plain.record(k)
    plain.synchronize()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        start.elapsed_time(plain)
    with pytest.raises(RuntimeError, match="recorded and have completed"):
        start.elapsed_time(dev.Event(enable_timing=True))  # never recorded
    gate = gate_on(k)
    late = dev.Event(enable_timing=True)
    late.record(k)
    try:
        with pytest.raises(RuntimeError, match="recorded and have completed"):
            start.elapsed_time(late)  # not reached yet
    finally:
        gate.set()
    late.synchronize()
    assert start.elapsed_time(late) >= ms


def test_step_timing_reads_the_events_by_query_only(backend: StreamBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sync(*_: Any, **__: Any) -> None:
        raise AssertionError("step timing must never synchronize")

    queries: list[bool] = []
    real_query = dev.Event.query

    def counted(self: dev.Event) -> bool:
        done = real_query(self)
        queries.append(done)
        return done

    monkeypatch.setattr(dev.Event, "synchronize", no_sync)
    monkeypatch.setattr(dev.Stream, "synchronize", no_sync)
    monkeypatch.setattr(dev, "synchronize", no_sync)
    monkeypatch.setattr(dev.Event, "query", counted)
    c = backend.compute_stream()
    seen: list[float] = []
    adaptive = SimpleNamespace(record=lambda key, path, seconds, step=0: seen.append(seconds))
    timings = StepTimings(SimpleNamespace(adaptive=adaptive))
    bucket = BucketKey("timing-test", 2, 2, 8)
    gate = gate_on(c)
    try:
        launch = lambda: dev.launch(lambda: time.sleep(0.01))  # noqa: E731
        timings.timed(bucket, "overlap", backend, lambda: backend.submit(c, launch))
        assert seen == [] and queries == [False]  # C has not reached the end event: read later
        (pair,) = [entry[3] for entry in timings._pending]
    finally:
        gate.set()
    assert c.drain(timeout=BOUND_S)
    timings.read_ready()
    assert len(seen) == 1 and 0.009 <= seen[0] < 60.0 and queries == [False, True]
    assert backend.timing_events == [pair]  # the events went back to the pool


# ---------------------------------------------------------------------------
# the stream log


def test_the_stream_log_holds_what_each_stream_performed(backend: StreamBackend) -> None:
    k0, k1 = backend.new_stream("K0"), backend.new_stream("K1")
    c = backend.compute_stream()
    assert backend.start_log()
    fork = record(backend, c, EventKey.fork())
    k0.wait_event(fork)
    backend.submit(k0, lambda: dev.launch(lambda: None), label="a2e L0 s0")
    a = record(backend, k0, key(A_DONE))
    a_record = a.last
    c.wait_event(a)
    k1.wait_event(a)  # queued; performed once K0 reached the record
    backend.submit(k1, lambda: dev.launch(lambda: None), label="e2a L0 s1")
    j = record(backend, k1, EventKey.join(1))
    c.wait_event(j)
    log = backend.stop_log()
    dev.synchronize()
    entries = log.entries()
    per_stream = {name: [(e.kind, e.key, e.label) for e in entries if e.stream == name] for name in ("C", "K0", "K1")}
    assert per_stream == {
        "C": [("record", EventKey.fork(), ""), ("wait", key(A_DONE), ""), ("wait", EventKey.join(1), "")],
        "K0": [("wait", EventKey.fork(), ""), ("kernel", None, "a2e L0 s0"), ("record", key(A_DONE), "")],
        "K1": [("wait", key(A_DONE), ""), ("kernel", None, "e2a L0 s1"), ("record", EventKey.join(1), "")],
    }
    assert len(entries) == 9
    assert [e.order for e in entries] == sorted(e.order for e in entries)  # in execution order
    fired = {e.event: e.end_ns for e in entries if e.kind == "record"}
    waits = [e for e in entries if e.kind == "wait"]
    for w in waits:
        assert w.event in fired and w.end_ns >= fired[w.event]  # let go only once its record fired
    assert {w.event for w in waits if w.key == key(A_DONE)} == {a_record.seq}  # bound to that record
    for e in entries:
        if e.kind == "kernel":
            assert 0 <= e.launched_ns <= e.start_ns <= e.end_ns
    c.wait_event(record(backend, k0, key(E_DONE)))  # after the log was stopped
    dev.synchronize()
    assert len(log.entries()) == 9
    assert backend.stop_log() == []  # none open


# ---------------------------------------------------------------------------
# fork


def _forked_child_checks(parent_side: dev.Stream, parent_default: dev.Stream) -> str:
    try:
        parent_side.launch(lambda: None)
        return "an inherited stream accepted a kernel"
    except RuntimeError as exc:
        if "belongs to the parent process" not in str(exc):
            return f"unclear error: {exc}"
    try:
        parent_side.drain(timeout=1)
        return "an inherited stream accepted a drain"
    except RuntimeError:
        pass
    fresh = dev.default_stream()
    if fresh is parent_default or dev.current_stream() is not fresh or not fresh.alive:
        return "the child did not get a fresh default stream"
    ran: list[str] = []
    dev.launch(lambda: ran.append("default"))
    side = dev.Stream()
    with dev.stream(side):
        dev.launch(lambda: ran.append("side"))
    side.wait_event(fresh.record_event())
    dev.synchronize()
    if sorted(ran) != ["default", "side"]:
        return f"the child's streams ran {ran}"
    if not dev.drain_all(timeout=BOUND_S):
        return "drain_all waited on an inherited stream"
    return "ok"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_refuses_inherited_streams_and_gets_a_fresh_default_stream(
    streams: Callable[[str], dev.Stream],
) -> None:
    parent_side = streams("K0")
    parent_default = dev.default_stream()
    dev.synchronize()  # every worker idle at the fork
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running pytest's teardown
        status = 1
        try:
            os.close(read_fd)
            message = _forked_child_checks(parent_side, parent_default)
            os.write(write_fd, message.encode())
            status = 0 if message == "ok" else 1
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(write_fd, repr(exc).encode())
        finally:
            os._exit(status)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as r:
        message = r.read().decode()
    _, status = os.waitpid(pid, 0)
    assert message == "ok"
    assert os.waitstatus_to_exitcode(status) == 0
    assert parent_side.alive and dev.default_stream() is parent_default  # the parent is untouched
    with dev.stream(parent_side):
        dev.launch(lambda: None)
    assert parent_side.drain(timeout=BOUND_S)
