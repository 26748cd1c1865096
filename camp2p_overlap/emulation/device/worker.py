"""The emulated device's streams, events and kernels.

Every stream, the default one included, is one worker thread draining a
FIFO: the host only enqueues (a kernel, an event record, a wait) and returns
at once, so the host runs ahead of every stream as it does of a real device.
An event record fires when its stream reaches it; a wait binds, when it is
enqueued, to the event's most recent record (as ``cudaStreamWaitEvent``
does) and holds its stream until that record has fired.

A kernel that raises *poisons* its stream: later kernels queued there are
skipped (records and waits still run, so nothing downstream hangs), and
the error is kept as the stream's asynchronous error until it is taken
(:func:`take_errors`, or a device :func:`synchronize`, which raises it).

While a graph capture is in progress (``capture.py``) work queued on a
capturing stream goes into the graph instead (:data:`hooks`), and the calls
capture forbids raise :class:`CaptureViolation` from any thread.

An idle stream costs nothing, as on a device: a stream is *idle* when
everything put on it has run to its end (decided under its worker's lock,
so a stream still running a kernel is busy though its FIFO is empty). An
event record on an idle stream fires on the host at once, outside a capture
and with no stream log open (a logged record is performed by the stream, as
the log's evidence needs); a wait on a record that has fired queues nothing
(with no log open); and a device synchronize puts nothing on idle streams.
So no worker thread is woken for work it has nothing to do for.

At interpreter exit (an :mod:`atexit` hook, see :func:`shut_down`) the
device stops every worker: queued work is dropped, a kernel still running
gets :data:`EXIT_WAIT_S` to end, then is interrupted, and the process exits
with the status its host code gave. In a forked child the parent's workers
do not exist: their queued work is dropped there too.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import time
import weakref
from _thread import allocate_lock as _allocate_lock
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from camp2p_overlap.core.fork import after_fork_in_child
from camp2p_overlap.core.keys import CONNECTOR_OP_KINDS
from camp2p_overlap.core.overlap.streams.base import OpHandle, StreamPoisonedError
from camp2p_overlap.emulation.device import cores, timing
from camp2p_overlap.emulation.device.cores import CoreDemand
from camp2p_overlap.emulation.device.timing import KernelClock, Model

#: Execution order across every stream: taken when a stream starts an item.
_order = itertools.count()
#: Identity of each event record (a wait binds to one record, not a name).
_record_ids = itertools.count()
_stream_ids = itertools.count()
_tls = threading.local()
_STOP = ("stop",)

#: Interpreter exit (:func:`shut_down`): how long the kernels the streams
#: are running get to end (one bound for all streams together) ...
EXIT_WAIT_S = 1.0
#: ... and how long one still running after that gets, once interrupted
#: (:class:`DeviceShutdown` raised at its next Python instruction), before
#: it is abandoned. The exit waits at most their sum.
EXIT_INTERRUPT_S = 0.5
#: How often a stream waiting on an event looks whether the device stops.
_WAIT_POLL_S = 0.05
#: Set once :func:`shut_down` has run: the device makes no more streams.
_shut: list[bool] = [False]


class CaptureViolation(RuntimeError):
    """A call a device graph capture forbids, made while a capture was in
    progress (the message names the call and the rule it breaks)."""


class DeviceShutdown(BaseException):
    """Raised inside a kernel still running when the interpreter exits, past
    :data:`EXIT_WAIT_S` (a ``BaseException``, like ``SystemExit``: the
    kernel is not meant to handle it)."""


class Hooks:
    """Where the capture module plugs in (None: no capture in progress)."""

    #: The capture in progress, or None. Read without a lock on every
    #: enqueue: a capture begins and ends with the device idle.
    capture: Any = None


hooks = Hooks()


def forbid_in_capture(call: str, rule: str) -> None:
    """Raise :class:`CaptureViolation` while any capture is in progress (the
    global capture mode: the rule holds for every thread of the process)."""
    cap = hooks.capture
    if cap is not None:
        cap.violated(f"{call} while a graph capture is in progress: {rule}")


# ---------------------------------------------------------------------------
# the log of what streams performed (the edge checker's evidence)


@dataclass(frozen=True, slots=True)
class StreamLogEntry:
    """One item a stream performed, as it performed it: an event record
    (``start == end``: when it fired), a wait (when the stream began
    waiting, when the record let it go) or a kernel (when it ran)."""

    stream: str
    kind: str  # "record" | "wait" | "kernel"
    #: A record's or a wait's event key (what the backend named the event), or None.
    key: Any
    #: The record's identity: a wait binds to the record of this very event.
    event: int
    order: int
    start_ns: int
    end_ns: int
    #: A kernel's op label (launched inside a tracked op), else "".
    label: str = ""
    #: When the host launched the kernel (host clock), else -1.
    launched_ns: int = -1


class StreamLog:
    """What the streams performed for one host scope (:func:`logging_to`),
    appended by the workers as they perform it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[StreamLogEntry] = []

    def add(self, entry: StreamLogEntry) -> None:
        with self._lock:
            self._entries.append(entry)

    def entries(self) -> list[StreamLogEntry]:
        """Everything performed so far, in execution order."""
        with self._lock:
            return sorted(self._entries, key=lambda e: e.order)


def current_log() -> StreamLog | None:
    return getattr(_tls, "log", None)


def set_log(log: StreamLog | None) -> StreamLog | None:
    """Log what the streams perform for work this thread enqueues from now
    on into ``log`` (None: stop); returns the previous log."""
    previous = getattr(_tls, "log", None)
    _tls.log = log
    return previous


# ---------------------------------------------------------------------------
# events


class Record:
    """One record of an event: fires once, when its stream reaches it (or
    on the host, when its stream is idle). ``done`` says whether it has;
    :meth:`wait` blocks until it has. One held lock, released when it
    fires, is what waiters block on (a ``threading.Event`` costs several
    times more to make and to set, and a step makes many records)."""

    __slots__ = ("_gate", "done", "event", "model_ns", "ns", "seq")

    def __init__(self, event: Event | None = None) -> None:
        self._gate = _allocate_lock()
        self._gate.acquire()
        self.done = False
        self.ns = 0
        #: Its time on the modelled timeline (``timing.py``): when it was
        #: made, then, once its stream performs it, the stream's modelled clock.
        self.model_ns = time.perf_counter_ns()
        self.seq = next(_record_ids)
        self.event = event

    def fire(self) -> None:
        """Fire (once: the stream that performs it, or the idle fast path)."""
        self.ns = time.perf_counter_ns()
        self.done = True
        self._gate.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until it has fired (at most ``timeout`` seconds); returns
        whether it has. Each waiter takes the gate and hands it on."""
        if self.done:
            return True
        gate = self._gate
        if gate.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            gate.release()
            return True
        return self.done


class Event:
    """An event: ``record`` on a stream, ``wait`` from another, ``query``,
    ``synchronize`` and ``elapsed_time`` (with ``enable_timing``).

    ``external`` is ``torch.cuda.Event(external=True)``'s flag (torch_npu's
    likewise). Recorded inside a graph capture, an event without it is only
    an edge inside the graph: a replay never records it, so after the
    capture it keeps the record it had before (for ``query``,
    ``elapsed_time``, ``synchronize`` and waits outside the graph). One with
    it becomes an external record node: each replay records it."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, external: bool = False
    ) -> None:
        forbid_in_capture(
            "Event()", "events are made before capture (the layer pools them; the project's rule, stricter than CUDA's)"
        )
        self.enable_timing = enable_timing
        #: Whether a replay of a graph that recorded it records it too.
        self.external = external
        #: The most recent record (a :class:`Record`, or a capture node's
        #: stand-in while it was recorded inside a capture), or None.
        self.last: Any = None
        #: What the backend calls this event (its pool key), for logs.
        self.key: Any = None

    def record(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).record_event(self)

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def query(self) -> bool:
        forbid_in_capture("Event.query()", "querying an event is an unsafe call in global capture mode")
        rec = self.last
        return rec is None or not isinstance(rec, Record) or rec.done

    def synchronize(self) -> None:
        forbid_in_capture("Event.synchronize()", "a synchronize is illegal during capture")
        rec = self.last
        if isinstance(rec, Record):
            while not rec.wait(_WAIT_POLL_S):
                if _shut[0]:
                    raise RuntimeError("Event.synchronize(): its record was dropped at interpreter exit")

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event's last record to ``end``'s."""
        forbid_in_capture("Event.elapsed_time()", "reading event times is a query, unsafe during capture")
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        a, b = self.last, end.last
        if not (isinstance(a, Record) and isinstance(b, Record)) or not (a.done and b.done):
            raise RuntimeError("elapsed_time: both events must have been recorded and have completed")
        return (b.ns - a.ns) / 1e6

    def __repr__(self) -> str:
        return f"Event({self.key!r})"


def _unchecked_event() -> Event:
    """An event a stream method makes for itself (``wait_stream``,
    ``record_event()``): not the caller's new event, so not refused."""
    event = Event.__new__(Event)
    event.enable_timing, event.external, event.last, event.key = False, False, None, None
    return event


# ---------------------------------------------------------------------------
# tracked ops: a handle that follows the kernels an op launched


class TrackedOp(OpHandle):
    """The handle of an op whose kernels run on a stream: its value is the
    host's return value (its tensors filled later), ``done()`` once every
    kernel it launched has run, its times and order those of its kernels
    (the host's when it launched none). A kernel's failure is the op's
    error (:meth:`exception`), and its stream's asynchronous error."""

    __slots__ = ("_exc", "_host_exc", "_lock", "_pending", "_sealed", "_value", "end_ns", "label", "order", "start_ns")

    def __init__(self, label: str) -> None:
        self.label = label
        self._value: Any = None
        self._exc: BaseException | None = None
        self._host_exc: BaseException | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._sealed = False
        self.start_ns: int | None = None
        self.end_ns: int | None = None
        self.order = -1

    def queued(self) -> None:
        with self._lock:
            self._pending += 1

    def started(self, ns: int, order: int) -> None:
        if self.start_ns is None:
            self.start_ns, self.order = ns, order

    def finished(self, ns: int, exc: BaseException | None) -> None:
        with self._lock:
            self._pending -= 1
            self.end_ns = ns
            if exc is not None and self._exc is None:
                self._exc = exc

    def seal(self, value: Any, exc: BaseException | None, t0: int, t1: int) -> None:
        """The host has returned from the op (``value``) or raised (``exc``)."""
        with self._lock:
            self._value = value
            if exc is not None:
                self._host_exc = exc
                self._exc = self._exc or exc
            if self._pending == 0 and self.start_ns is None:  # no kernel: host times
                self.start_ns, self.end_ns = t0, t1
            self._sealed = True

    def result(self) -> Any:
        """The op's value (its kernels may still be filling it), or the
        host's error. Kernel errors are asynchronous: :meth:`exception`."""
        if self._host_exc is not None:
            raise self._host_exc
        return self._value

    def exception(self) -> BaseException | None:
        return self._exc

    def done(self) -> bool:
        return self._sealed and self._pending == 0

    def release(self) -> None:
        self._value = None


def tracked(fn: Callable[[], Any], label: str = "op") -> TrackedOp:
    """Run ``fn()`` on the host with every kernel it launches tracked by the
    returned handle."""
    handle = TrackedOp(label)
    previous = getattr(_tls, "op", None)
    _tls.op = handle
    t0 = time.perf_counter_ns()
    try:
        value = fn()
    except BaseException as exc:  # noqa: BLE001 - handed back
        handle.seal(None, exc, t0, time.perf_counter_ns())
        return handle
    finally:
        _tls.op = previous
    handle.seal(value, None, t0, time.perf_counter_ns())
    return handle


# ---------------------------------------------------------------------------
# streams


class _Worker:
    """A stream's thread and FIFO; holds no reference to its :class:`Stream`
    (a stream nobody holds is collected and its thread told to stop).

    ``pending`` (under ``lock``) counts the items put and not yet run to
    their end: the worker takes it down only once an item has finished, so
    ``pending == 0`` means idle: nothing queued *and* nothing running."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        #: Guards ``pending``, ``put_count`` and the decision to queue or to
        #: fire at once; everything is put on ``queue`` under it.
        self.lock = threading.Lock()
        self.pending = 0
        #: Asynchronous errors not taken yet: (execution order of the kernel, error).
        self.errors: list[tuple[int, BaseException]] = []
        self.poisoned: BaseException | None = None
        #: Items ever put on the FIFO (each wakes the thread), and run.
        self.put_count = 0
        self.done_count = 0
        #: Records fired on the host at once (the stream was idle).
        self.fired_idle = 0
        #: The stream's modelled clock (``timing.py``): the modelled end of
        #: what it ran last, or the modelled time of a record it waited on.
        self.clock_ns = 0
        self.kclock = KernelClock()
        #: Items dropped, never run (interpreter exit, or inherited by a forked child).
        self.dropped = 0
        #: What the worker is doing now (diagnostics): a label, or None.
        self.doing: str | None = None
        #: Set in a forked child: the thread does not exist there.
        self.dead = False
        #: Set once told to stop (its stream closed or collected): nothing
        #: queued after that would run, so it takes no more work.
        self.stopped = False
        #: Set at interpreter exit: queued work was dropped, a wait lets go.
        self.halted = False
        self.thread = threading.Thread(target=self.run, name=f"camp2p-emulated-stream-{name}", daemon=True)
        self.thread.start()

    def _refuse(self) -> None:
        if self.dead:
            raise RuntimeError(f"stream {self.name} belongs to the parent process (its thread does not exist here)")
        if self.halted:
            raise RuntimeError(f"stream {self.name} is closed (the emulated device stopped at interpreter exit)")
        raise RuntimeError(f"stream {self.name} is closed (its worker thread has been told to stop)")

    def put(self, item: tuple[Any, ...]) -> None:
        if self.dead or self.stopped:
            self._refuse()
        with self.lock:
            if self.stopped:
                self._refuse()
            self.pending += 1
            self.put_count += 1
            self.queue.put(item)

    def record(self, rec: Record) -> bool:
        """Fire ``rec`` at once when the stream is idle (returns False), or
        queue it behind the work it has (returns True). Idle is decided
        under the lock the worker takes ``pending`` down under, after an
        item has run: a record never fires before work put earlier."""
        if self.dead or self.stopped:
            self._refuse()
        with self.lock:
            if self.stopped:
                self._refuse()
            if self.pending == 0:
                rec.fire()
                self.fired_idle += 1
                return False
            self.pending += 1
            self.put_count += 1
            self.queue.put(("record", rec, None))
            return True

    def fence(self) -> Record | None:
        """A record queued behind everything put so far, or None when the
        stream is idle (nothing put: there is nothing to wait for)."""
        if self.dead or self.stopped:
            self._refuse()
        with self.lock:
            if self.stopped:
                self._refuse()
            if self.pending == 0:
                return None
            rec = Record()
            self.pending += 1
            self.put_count += 1
            self.queue.put(("record", rec, None))
            return rec

    def idle(self) -> bool:
        with self.lock:
            return self.pending == 0

    def stop(self) -> None:
        if not self.dead and not self.stopped:
            with self.lock:
                if self.stopped:
                    return
                self.stopped = True
                self.queue.put(_STOP)

    def halt(self) -> None:
        """Stop now: drop what is queued (it never runs), let a wait go, and
        tell the thread to end once the item it is running has ended."""
        if self.dead:
            return
        with self.lock:
            if self.halted:
                return
            self.stopped = self.halted = True
            self._drop()
            self.queue.put(_STOP)

    def _drop(self) -> None:
        """Drop every queued item (under ``lock``)."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self.pending -= 1
                self.dropped += 1

    def forget(self) -> None:
        """In a forked child: the thread does not exist, its FIFO's items
        (and what they hold) are dropped. The FIFO is emptied, not replaced:
        the parent thread's frame, which the child keeps, holds it."""
        self.dead = True
        self._drop()

    def run(self) -> None:
        _tls.worker = self
        timing.bind(self.kclock)
        try:
            self._loop()
        except DeviceShutdown:  # an interrupt at exit that landed between two items
            pass

    def _loop(self) -> None:
        get = self.queue.get
        while True:
            item = get()
            kind = item[0]
            if kind == "stop":
                return
            try:
                if kind == "kernel":
                    self._kernel(*item[1:])
                elif kind == "record":
                    self._record(*item[1:])
                else:
                    self._wait(*item[1:])
            finally:
                del item
                self.doing = None
                with self.lock:  # idle from here on when nothing else is queued
                    self.pending -= 1
                    self.done_count += 1

    def _kernel(
        self,
        fn: Callable[[], None],
        op: TrackedOp | None,
        log: StreamLog | None,
        launched: int,
        model: Model | None,
        demand: CoreDemand | None = None,
    ) -> None:
        label = op.label if op is not None else demand.kind if demand is not None else "kernel"
        pool = cores.core_pool() if demand is not None and self.poisoned is None else None
        claim: cores.Claim | None = None
        exc: BaseException | None = None
        if pool is not None:  # the kernel holds its stream while it waits for its cores
            self.doing = f"{label}: waiting for {demand.cores} vector cores"  # type: ignore[union-attr]
            try:
                claim = pool.claim(demand, self.name, label, lambda: self.halted)  # type: ignore[arg-type]
            except cores.CoreBudgetError as e:
                exc = e
            else:
                if claim is None:
                    return  # the device stops
                if claim.waves > 1 and model is not None:  # fewer cores than blocks: its blocks run in waves
                    model = Model(model.ns * claim.waves, model.kind)
        order, t0 = next(_order), time.perf_counter_ns()
        if op is not None:
            op.started(t0, order)
        clock = self.kclock
        # A kernel that waited for cores starts, on the modelled clock, no earlier than it got them.
        clock.reset(max(self.clock_ns, launched, claim.waited_until_ns if claim is not None else 0), model)
        deadline: int | None = None
        if exc is not None:
            self.poisoned = exc
            self.errors.append((order, exc))
        elif self.poisoned is not None:
            exc = StreamPoisonedError(
                f"{label} skipped on stream {self.name}: an earlier kernel "
                f"failed ({type(self.poisoned).__name__}: {self.poisoned})"
            )
        else:
            self.doing = label
            try:
                fn()
                deadline = clock.finish()  # a modelled kernel holds the stream until its modelled end
            except BaseException as e:  # noqa: BLE001 - an asynchronous error, as on a device
                exc = e
                self.poisoned = e
                self.errors.append((order, e))
            finally:
                if claim is not None:
                    pool.release(claim)  # type: ignore[union-attr]
        t1 = time.perf_counter_ns()
        if deadline is None:
            self.clock_ns = t1
        else:  # the modelled timeline goes on from the modelled end; what it cost is counted
            self.clock_ns = deadline
            timing.LEDGER.kernel(clock.kind, clock.start_ns, deadline, t0, clock.held_ns, t1)
        if log is not None:
            log.add(StreamLogEntry(self.name, "kernel", None, -1, order, t0, t1, op.label if op else "", launched))
        if op is not None:
            op.finished(t1, exc)

    def _record(self, rec: Record, log: StreamLog | None) -> None:
        if self.clock_ns > rec.model_ns:
            rec.model_ns = self.clock_ns
        if log is not None:  # logged before the record lets anyone go
            order, now = next(_order), time.perf_counter_ns()
            key = rec.event.key if rec.event is not None else None
            log.add(StreamLogEntry(self.name, "record", key, rec.seq, order, now, now))
        rec.fire()

    def _after(self, rec: Record) -> None:
        """A wait is over: the stream's modelled clock is no earlier than the record's."""
        if rec.model_ns > self.clock_ns:
            self.clock_ns = rec.model_ns

    def _await(self, rec: Record) -> None:
        """Hold the stream until ``rec`` fires (or the device stops)."""
        self.doing = "wait"
        while not rec.wait(_WAIT_POLL_S):
            if self.halted:
                return

    def _wait(self, rec: Record, log: StreamLog | None) -> None:
        if log is None:
            if not rec.done:
                self._await(rec)
            self._after(rec)
            return
        order, t0 = next(_order), time.perf_counter_ns()
        self._await(rec)
        self._after(rec)
        key = rec.event.key if rec.event is not None else None
        log.add(StreamLogEntry(self.name, "wait", key, rec.seq, order, t0, time.perf_counter_ns()))


#: Every live worker (device synchronize drains them all).
_workers: weakref.WeakSet[_Worker] = weakref.WeakSet()
_workers_lock = threading.Lock()


class Stream:
    """A stream: one worker thread running its work in FIFO order."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        forbid_in_capture("Stream()", "creating a stream is not allowed inside a graph capture")
        if _shut[0]:
            raise RuntimeError("the emulated device stopped at interpreter exit: it makes no more streams")
        self.device = device
        self.priority = priority
        self.id = next(_stream_ids)
        self._w = _Worker(f"emulated-{self.id}")
        with _workers_lock:
            _workers.add(self._w)
        self._finalizer = weakref.finalize(self, self._w.stop)

    @property
    def name(self) -> str:
        """The stream's name, as its log entries and stall reports give it."""
        return self._w.name

    @name.setter
    def name(self, value: str) -> None:
        self._w.name = value

    def name_thread(self, name: str) -> None:
        """Name the worker thread (diagnostics; the patch layer's streams are
        ``camp2p-overlap-stream-<name>``, every other one keeps
        ``camp2p-emulated-stream-*``)."""
        self._w.thread.name = name

    # -- what a stream is asked to do ----------------------------------
    def launch(
        self,
        fn: Callable[[], None],
        writes: Iterable[Any] = (),
        model: Model | None = None,
        kind: str | None = None,
        demand: CoreDemand | None = None,
    ) -> None:
        """Queue ``fn``; ``kind`` (default: its model's) names what it is (``ffn``, ``a2e``, ...); ``demand``: the
        vector cores it takes (``cores.py``; None: none)."""
        cap = hooks.capture
        if cap is not None and cap.owns(self):
            cap.add_kernel(self, fn, writes, model, comm_kind(kind or (model.kind if model else "kernel")), demand)
            return
        op = getattr(_tls, "op", None)
        log = getattr(_tls, "log", None)
        if op is not None:
            op.queued()
        self._w.put(("kernel", fn, op, log, time.perf_counter_ns(), model, demand))

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else _unchecked_event()
        cap = hooks.capture
        if cap is not None and cap.owns(self):
            cap.add_record(self, event)
            return event
        rec = Record(event)
        event.last = rec
        log = getattr(_tls, "log", None)
        if log is None:
            self._w.record(rec)  # fires at once when the stream is idle
        else:  # logged as the stream performs it
            self._w.put(("record", rec, log))
        return event

    def wait_event(self, event: Event) -> None:
        rec = event.last
        if rec is None:
            return  # never recorded: nothing to wait for
        cap = hooks.capture
        if cap is not None and (cap.owns(self) or cap.recorded(rec)):
            cap.add_wait(self, event, rec)
            return
        if not isinstance(rec, Record):
            raise CaptureViolation(f"stream {self.name} waits on an event last recorded inside a finished capture")
        log = getattr(_tls, "log", None)
        if log is None and rec.done:
            if self._w.dead or self._w.stopped:
                self._w._refuse()
            return  # its record has fired: the wait would hold nothing
        self._w.put(("wait", rec, log))

    def wait_stream(self, other: Stream) -> None:
        self.wait_event(other.record_event())

    def enqueue_record(self, rec: Record) -> None:
        """Queue a record made elsewhere (a graph replay's)."""
        self._w.put(("record", rec, getattr(_tls, "log", None)))

    def enqueue_wait(self, rec: Record) -> None:
        self._w.put(("wait", rec, getattr(_tls, "log", None)))

    def enqueue_kernel(
        self, fn: Callable[[], None], model: Model | None = None, demand: CoreDemand | None = None
    ) -> None:
        log = getattr(_tls, "log", None)
        self._w.put(("kernel", fn, None, log, time.perf_counter_ns(), model, demand))

    # -- host side -----------------------------------------------------
    def query(self) -> bool:
        forbid_in_capture("Stream.query()", "querying a stream is an unsafe call in global capture mode")
        return self._w.idle()

    def synchronize(self) -> None:
        forbid_in_capture(f"Stream.synchronize() of {self.name}", "a synchronize is illegal during capture")
        self.drain()

    def drain(self, timeout: float | None = None) -> bool:
        """Block until everything queued so far has run (no capture check:
        the module's own synchronizes call it); an idle stream is not woken."""
        rec = self._w.fence()
        return rec is None or rec.wait(timeout)

    def close(self, timeout: float | None = 5.0) -> bool:
        """Stop the worker thread (work queued before still runs) and wait
        up to ``timeout`` for it to end; returns whether it has ended."""
        self._finalizer()
        thread = self._w.thread
        if not self._w.dead and thread is not threading.current_thread():
            thread.join(timeout)
        return not thread.is_alive()

    @property
    def closed(self) -> bool:
        """Closed (or inherited by a forked child): it takes no more work."""
        return self._w.stopped or self._w.dead

    @property
    def thread(self) -> threading.Thread:
        return self._w.thread

    @property
    def alive(self) -> bool:
        return self._w.thread.is_alive()

    @property
    def puts(self) -> int:
        """Items ever put on the stream's FIFO (each one wakes its thread):
        what idle streams are spared (diagnostics, tests)."""
        return self._w.put_count

    @property
    def current(self) -> str | None:
        """What the worker is doing now (diagnostics)."""
        return self._w.doing

    @property
    def errors(self) -> list[BaseException]:
        return [e for _, e in self._w.errors]

    @property
    def poisoned(self) -> BaseException | None:
        return self._w.poisoned

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"Stream({self.name})"


class DefaultStream(Stream):
    """The device's default stream: current on a thread that set no other.
    It lives as long as the process, so its thread is named apart from the
    streams the patch layer makes (``camp2p-overlap-stream-*``), which all end
    with the patch layer."""

    def __init__(self) -> None:
        super().__init__()
        self._w.thread.name = "camp2p-emulated-device-default-stream"


_default: list[DefaultStream | None] = [None]
_default_lock = threading.Lock()


def default_stream() -> DefaultStream:
    s = _default[0]
    if s is None:
        if _shut[0]:
            raise RuntimeError("the emulated device stopped at interpreter exit: it has no default stream")
        with _default_lock:
            s = _default[0]
            if s is None:
                saved, hooks.capture = hooks.capture, None  # made on first use, even inside a capture
                try:
                    s = _default[0] = DefaultStream()
                finally:
                    hooks.capture = saved
                s.name = "C"  # the compute stream of whoever runs on it (the patch layer names it so too)
    return s


def current_stream(device: Any = None) -> Stream:
    s = getattr(_tls, "stream", None)
    return s if s is not None else default_stream()


def set_stream(stream: Stream | None) -> None:
    _tls.stream = stream


class stream:  # lower case: the device modules' name
    """``with stream(s):`` makes ``s`` this thread's current stream."""

    def __init__(self, s: Stream | None) -> None:
        self.s = s
        self.previous: Stream | None = None

    def __enter__(self) -> Stream | None:
        self.previous = getattr(_tls, "stream", None)
        if self.s is not None:
            _tls.stream = self.s
        return self.s

    def __exit__(self, *exc: object) -> None:
        _tls.stream = self.previous


def launch(
    kernel: Callable[[], None],
    *,
    writes: Iterable[Any] = (),
    model_s: float | None = None,
    kind: str = "kernel",
    cores: int | None = None,
    resident: bool = False,
) -> None:
    """Enqueue ``kernel`` on this thread's current stream: it runs on the
    stream's worker after everything queued there before, and the host
    returns at once. ``writes``: the tensors it fills (allocated by the
    caller before the launch), which a capture keeps the host from reading.
    ``model_s``: its modelled duration (``timing.py``): the worker holds the
    stream until the modelled end after running it (a capture keeps it with
    the kernel, for every replay); ``kind`` names it in the counts, and
    ``a2e``/``e2a`` marks a CAM comm kernel (:func:`comm_kind`: a capture
    rule, ``capture.py``). ``cores``: the vector cores its blocks take, ``resident``: all at once (``cores.py``;
    they count only once the device has a core budget)."""
    demand = CoreDemand(cores, resident, kind) if cores is not None else None
    current_stream().launch(kernel, writes, timing.model_of(model_s, kind), kind, demand)


def comm_kind(kind: str) -> str | None:
    """Whether a kernel being launched on this thread is a CAM comm kernel,
    and which (``a2e``: a receive from attention, ``e2a``: a send to it):
    its ``kind`` when one was given (not ``kernel``), else the kind of the
    tracked op it is launched inside (:func:`tracked`; the patch layer
    labels its connector ops ``a2e L3 s1``, ``e2a L3 s1``). None: not a
    comm kernel."""
    if kind != "kernel":
        return kind if kind in CONNECTOR_OP_KINDS else None
    op = getattr(_tls, "op", None)
    first = op.label.split(" ", 1)[0] if op is not None else None
    return first if first in CONNECTOR_OP_KINDS else None


def executing_stream() -> str | None:
    """The name of the stream whose worker runs the calling thread (inside
    a kernel), or None on the host."""
    w = getattr(_tls, "worker", None)
    return w.name if w is not None else None


def live_workers() -> list[Any]:
    with _workers_lock:
        return [w for w in _workers if not w.dead and not w.stopped]


def _closing_workers() -> list[_Worker]:
    """Workers told to stop whose thread still runs what was queued before."""
    me = threading.current_thread()
    with _workers_lock:
        return [
            w
            for w in _workers
            if w.stopped and not w.halted and not w.dead and w.thread.is_alive() and w.thread is not me
        ]


def synchronize(device: Any = None) -> None:
    """Block until every stream has run everything queued so far, then raise
    the first asynchronous error a kernel hit since the last one taken (and
    clear them all), as a device reports a failed kernel at a synchronize."""
    forbid_in_capture("synchronize()", "a device synchronize is illegal during capture")
    drain_all()
    errors = take_errors()
    if errors:
        raise errors[0]


def drain_all(timeout: float | None = None) -> bool:
    """Block until every stream has run everything queued so far (each
    bounded by ``timeout``); returns whether all did. A stream with nothing
    queued or running is skipped: nothing is put on it, its thread is not
    woken (a device's synchronize does not grow with its idle streams)."""
    ok = True
    if not _shut[0]:
        default_stream()
    for w in _closing_workers():  # closed: what it had queued runs before its thread ends
        w.thread.join(timeout)
        ok = not w.thread.is_alive() and ok
    fences = []
    for w in live_workers():
        try:
            rec = w.fence()
            if rec is None:  # idle: nothing put, no thread woken
                continue
        except RuntimeError:  # closed meanwhile: what it had queued runs before its thread ends
            if not w.dead and w.thread is not threading.current_thread():
                w.thread.join(timeout)
                ok = not w.thread.is_alive() and ok
            continue
        ok = rec.wait(timeout) and ok
        fences.append(rec)
    if ok and fences:  # how long after the modelled end of the work the host got back
        timing.LEDGER.sync(time.perf_counter_ns() - max(r.model_ns for r in fences))
    return ok


def peek_errors(streams: Iterable[Stream]) -> list[BaseException]:
    """The asynchronous errors of ``streams`` not taken yet, in the order
    their kernels ran (a stream named twice counts once)."""
    workers = {id(s._w): s._w for s in streams if isinstance(s, Stream)}
    pairs = [pair for w in workers.values() for pair in list(w.errors)]
    return [e for _, e in sorted(pairs, key=lambda pair: pair[0])]


def take_errors(streams: Iterable[Stream] | None = None) -> list[BaseException]:
    """Take (and clear) the asynchronous errors of ``streams`` (None: every
    stream, in the order their kernels ran), which also lifts their poison."""
    workers = live_workers() if streams is None else [s._w for s in streams if isinstance(s, Stream)]
    out: list[tuple[int, BaseException]] = []
    for w in workers:
        n = len(w.errors)  # an error appended meanwhile stays for the next take
        out.extend(w.errors[:n])
        del w.errors[:n]
        w.poisoned = None
    if streams is None:  # no stream order asked for: the order they happened in
        out.sort(key=lambda pair: pair[0])
    return [e for _, e in out]


def _forget_in_child() -> None:
    """After a fork no worker thread exists in the child: streams inherited
    refuse work, what they had queued is dropped (with what it holds), and
    the child gets a fresh default stream on first use."""
    global _workers_lock, _default_lock
    _workers_lock = threading.Lock()  # another thread may have held them at the fork
    _default_lock = threading.Lock()
    for w in list(_workers):
        w.forget()
    _default[0] = None
    hooks.capture = None
    globals()["_tls"] = threading.local()


after_fork_in_child(_forget_in_child)


# ---------------------------------------------------------------------------
# interpreter exit


def shut_down(wait: float | None = None, interrupt: float | None = None) -> bool:
    """Stop the device's workers; run at interpreter exit (``atexit``).

    Queued work is *dropped* (it never runs; a dropped record never fires).
    A kernel a stream is running gets ``wait`` seconds (default
    :data:`EXIT_WAIT_S`, one bound for all streams together) to end; one
    still running then is interrupted (:class:`DeviceShutdown` raised at
    its next Python instruction) and gets ``interrupt`` seconds more
    (default :data:`EXIT_INTERRUPT_S`); one still running after that (one
    blocked in a call that never returns) is abandoned. A stream waiting on
    an event lets go within ``_WAIT_POLL_S``. So exit waits at most
    ``wait + interrupt`` and prints nothing: the process ends with the
    status its host code gave, an uncaught exception's traceback last.
    Returns whether every worker thread has ended.

    Why: a worker thread still inside a torch call when the interpreter
    finalizes is ended as it takes the GIL back, by a forced unwind through
    torch's C++ frames: ``terminate called without an active exception``,
    status 134. ``atexit`` runs after ``threading`` has joined the
    non-daemon threads (a host thread still driving a stream finishes
    first; ``threading._register_atexit`` hooks run before that join) and
    before finalization starts ending daemon threads."""
    wait = EXIT_WAIT_S if wait is None else wait
    interrupt = EXIT_INTERRUPT_S if interrupt is None else interrupt
    _shut[0] = True
    with _workers_lock:
        workers = [w for w in _workers if not w.dead]
    me = threading.current_thread()
    workers = [w for w in workers if w.thread is not me]
    for w in workers:
        w.halt()
    if _join(workers, wait):
        return True
    for w in workers:
        if w.thread.is_alive() and w.doing not in (None, "wait"):
            _interrupt(w.thread)
    return _join(workers, interrupt)


def _join(workers: list[_Worker], bound: float) -> bool:
    deadline = time.monotonic() + bound
    for w in workers:
        w.thread.join(max(0.0, deadline - time.monotonic()))
    return not any(w.thread.is_alive() for w in workers)


def _interrupt(thread: threading.Thread) -> None:
    """Raise :class:`DeviceShutdown` in ``thread`` at its next Python
    instruction (a thread blocked in C code gets it when it returns)."""
    try:
        import ctypes
    except ImportError:  # pragma: no cover - an interpreter without ctypes
        return
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(DeviceShutdown))


atexit.register(shut_down)
