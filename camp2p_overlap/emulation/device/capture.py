"""Graph capture and replay on the emulated device, with capture's rules
enforced.

While a capture is in progress, every kernel, event record and stream
wait queued on the capturing stream, or on a stream forked from it (one
that waited an event recorded inside the capture), becomes a node of the
graph instead of running. :meth:`Graph.replay` queues the nodes again on
the same streams (the origin's on the stream current at replay), with the
same record-to-wait edges and the same kernels, hence the same tensors:
static inputs and outputs, as a device graph keeps them.

Events, as on CUDA and ACL: an event recorded inside the capture is an
edge inside the graph (waits inside the capture bind to that record, and
each replay's waits to that replay's record), not a record of the event
itself. Capture end gives it back the record it had before the capture,
and a replay leaves it there, so ``query``, ``elapsed_time``,
``synchronize`` and a wait outside the graph see the pre-capture record.
Only an event made with ``external=True`` (an external record node) holds
each replay's record afterwards.

The rules, and the real-device rule each one mirrors (docs/design.md,
"The emulated device"):

* a synchronize of the device, a stream or an event, and any event or
  stream query, raise, from every thread (CUDA's default *global* capture
  mode: ``cudaErrorStreamCaptureUnsupported``; Ascend refuses a
  synchronize of a capturing stream);
* creating a stream raises (streams are made before capture: Ascend graphs
  have a small stream budget);
* a capturing stream waiting on an event recorded outside the capture
  raises (``cudaErrorStreamCaptureIsolation``), and so does one waiting in
  a later capture on an event whose pre-capture record was made outside
  it;
* a wait inside a capture on an event made with ``external=True`` raises
  (on a device it is an external wait node, no edge inside the graph: the
  emulation does not model it; the project's rule, stricter than CUDA's);
* a replay onto a stream that is in the capture raises (the emulation
  does not capture a graph launch as a child graph);
* a host read of a tensor a recorded kernel writes raises: through
  :func:`host_read`, and on the capturing thread through ``Tensor.item``,
  ``tolist``, ``numpy`` and conversion to a Python number or bool (on a
  device these synchronize, or read a buffer nothing has filled);
* at the end of capture, every stream forked from the capturing stream
  must have been joined back into it (``cudaErrorStreamCaptureUnjoined``;
  Ascend's error 107025);
* *CAM comm on the origin stream* (:meth:`Capture.check_comm_on_origin`),
  only while the device stands in for ``torch.npu``: a CAM comm kernel
  (launched with kind ``a2e``/``e2a``, or inside a tracked op so labelled,
  :func:`worker.comm_kind`) captured on a stream other than the one the
  capture began on raises (upstream's NPU graph code, afd-plugin's
  p2p_hccl connector, keeps graph-visible HCCL/CAM comm on the capture's
  stream; compute may fork to a side stream joined back). As
  ``torch.cuda``'s stand-in the rule is off.

A violation also invalidates the capture: ending it raises, and the graph
cannot be replayed. What the emulation cannot see: communication kernels
(HCCL, CAM) inside an ACL graph beyond the stream they are captured on, a
device's stream budget, memory pools.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from camp2p_overlap.emulation.device import worker
from camp2p_overlap.emulation.device.timing import Model
from camp2p_overlap.emulation.device.worker import CaptureViolation, Event, Record, Stream

_capture_lock = threading.Lock()


@dataclass(slots=True)
class Node:
    id: int
    stream: Stream
    kind: str  # "kernel" | "record" | "wait"
    #: kernel: the function; record: the event; wait: the record node's id.
    payload: Any
    deps: list[int] = field(default_factory=list)
    #: kernel: its modelled duration, honoured at every replay (None: wall clock).
    model: Model | None = None
    #: kernel: the vector cores it takes (``cores.CoreDemand``; None: none).
    demand: Any = None


class CapturedRecord:
    """What an event holds while its last record is a node of a capture."""

    __slots__ = ("capture", "node")

    def __init__(self, capture: Capture, node: int) -> None:
        self.capture = capture
        self.node = node


def _is_torch_npu() -> bool:
    """Whether the emulated device stands in for ``torch.npu`` (``as_torch_npu``)."""
    return getattr(torch, "npu", None) is sys.modules.get(__package__ or "")


def _storage(t: Any) -> int | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


class Capture:
    """One capture in progress: the graph's nodes, and the streams in it."""

    def __init__(self, graph: Graph, origin: Stream) -> None:
        self.graph = graph
        self.origin = origin
        self.thread = threading.get_ident()
        self.nodes: list[Node] = []
        #: Each stream in the capture -> its last node (None: joined, no node yet).
        self.last: dict[Stream, int | None] = {origin: None}
        self.written: set[int] = set()
        #: Events recorded inside the capture -> their record before it.
        self.saved: dict[Event, Any] = {}
        self.error: str | None = None
        #: Whether :meth:`check_comm_on_origin` holds: while the device stands in for ``torch.npu``.
        self.comm_on_origin = _is_torch_npu()

    # -- rules -----------------------------------------------------------
    def violated(self, message: str) -> None:
        if self.error is None:
            self.error = message
        raise CaptureViolation(message)

    def owns(self, stream: Stream) -> bool:
        return stream in self.last

    def recorded(self, rec: Any) -> bool:
        return isinstance(rec, CapturedRecord) and rec.capture is self

    def check_comm_on_origin(self, stream: Stream, comm: str | None) -> None:
        """The rule *CAM comm on the origin stream* (as ``torch.npu`` only): a
        CAM comm kernel (``comm``: ``a2e``/``e2a``) is captured on the stream
        the capture began on, never on a stream forked from it."""
        if comm is not None and self.comm_on_origin and stream is not self.origin:
            self.violated(
                f"a CAM comm kernel ({comm}) was captured on stream {stream.name}, not the capture's origin stream "
                f"{self.origin.name}: upstream's NPU graph code (afd-plugin's p2p_hccl connector) keeps HCCL/CAM comm "
                "on the capture's stream (compute may fork to a side stream and join back)"
            )

    # -- nodes -----------------------------------------------------------
    def _add(self, stream: Stream, kind: str, payload: Any, extra: int | None = None) -> int:
        prev = self.last.get(stream)
        deps = [prev] if prev is not None else []
        if extra is not None:
            deps.append(extra)
        node = Node(len(self.nodes), stream, kind, payload, deps)
        self.nodes.append(node)
        self.last[stream] = node.id
        return node.id

    def add_kernel(
        self,
        stream: Stream,
        fn: Callable[[], None],
        writes: Iterable[Any],
        model: Model | None = None,
        comm: str | None = None,
        demand: Any = None,
    ) -> None:
        """A kernel node; ``comm``: the kernel is a CAM comm kernel of that kind (``worker.comm_kind``); ``demand``:
        the vector cores it takes at every replay."""
        self.check_comm_on_origin(stream, comm)
        node = self.nodes[self._add(stream, "kernel", fn)]
        node.model, node.demand = model, demand
        for t in writes:
            ptr = _storage(t)
            if ptr is not None:
                self.written.add(ptr)

    def add_record(self, stream: Stream, event: Event) -> None:
        if event not in self.saved:
            self.saved[event] = event.last
        node = self._add(stream, "record", event)
        event.last = CapturedRecord(self, node)

    def add_wait(self, stream: Stream, event: Event, rec: Any) -> None:
        if event.external:
            self.violated(
                f"stream {stream.name} waits inside a graph capture on an event made with external=True: on a device "
                "that is an external wait node, not an edge inside the graph (the emulation does not model it; for "
                "edges inside the graph use an event made without external)"
            )
        if not self.recorded(rec):
            self.violated(
                f"stream {stream.name} (capturing) waits on an event recorded outside the capture: "
                "capture isolation (cudaErrorStreamCaptureIsolation)"
            )
        self._add(stream, "wait", rec.node, extra=rec.node)  # a fork when the stream was not capturing

    def check_read(self, t: Any, call: str) -> None:
        ptr = _storage(t)
        if ptr is not None and ptr in self.written:
            self.violated(
                f"{call}: a host read of a tensor a captured kernel writes, while a graph capture is in "
                "progress (the kernel has not run; on a device the read synchronizes the capturing stream)"
            )

    # -- end -------------------------------------------------------------
    def unjoined(self) -> list[Stream]:
        """Streams of the capture whose last node the origin's last node
        does not depend on."""
        end = self.last.get(self.origin)
        seen: set[int] = set()
        todo = [end] if end is not None else []
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo.extend(self.nodes[n].deps)
        return [s for s, n in self.last.items() if s is not self.origin and n is not None and n not in seen]

    def restore_events(self) -> None:
        for event, before in self.saved.items():
            if isinstance(event.last, CapturedRecord) and event.last.capture is self:
                event.last = before


class _HostReads(TorchFunctionMode):
    """On the capturing thread: host reads of tensors captured kernels write."""

    _READS = frozenset(
        {
            torch.Tensor.item,
            torch.Tensor.tolist,
            torch.Tensor.numpy,
            torch.Tensor.__bool__,
            torch.Tensor.__int__,
            torch.Tensor.__float__,
            torch.Tensor.__index__,
        }
    )

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in self._READS and args:
            self.capture.check_read(args[0], f"Tensor.{getattr(func, '__name__', func)}()")
        return func(*args, **(kwargs or {}))


def host_read(t: torch.Tensor) -> torch.Tensor:
    """The emulation's accessor for reading a device tensor on the host:
    refused while a capture is in progress and a captured kernel writes it."""
    cap = worker.hooks.capture
    if cap is not None:
        cap.check_read(t, "host_read()")
    return t


class Graph:
    """A captured graph (``NPUGraph`` / ``CUDAGraph``): :meth:`replay`
    queues its work again."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._nodes: list[Node] = []
        self._origin: Stream | None = None
        self._pool: Any = None
        self._capture: Capture | None = None
        self._mode: _HostReads | None = None
        #: Streams of the graph's own, for branches whose stream was closed.
        self._own: dict[Stream, Stream] = {}
        self.replays = 0

    # -- capture ---------------------------------------------------------
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        with _capture_lock:
            if worker.hooks.capture is not None:
                raise CaptureViolation("a graph capture is already in progress")
            origin = worker.current_stream()
            if isinstance(origin, worker.DefaultStream):
                raise CaptureViolation("capturing on the default stream is not allowed; capture on a side stream")
            self._pool = pool if pool is not None else graph_pool_handle()
            cap = Capture(self, origin)
            self._capture = cap
            worker.hooks.capture = cap
        self._mode = _HostReads(cap)
        self._mode.__enter__()

    def capture_end(self) -> None:
        cap = self._capture
        if cap is None:
            raise RuntimeError("capture_end without capture_begin")
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                self._mode = None
            if cap.error is None:
                unjoined = cap.unjoined()
                if unjoined:
                    cap.error = (
                        "capture ended with stream(s) "
                        + ", ".join(s.name for s in unjoined)
                        + " forked from the capturing stream but not joined back into it "
                        "(cudaErrorStreamCaptureUnjoined; Ascend error 107025)"
                    )
        finally:
            cap.restore_events()
            with _capture_lock:
                worker.hooks.capture = None
            self._capture = None
        if cap.error is not None:
            self._nodes = []
            raise CaptureViolation(cap.error)
        self._nodes = cap.nodes
        self._origin = cap.origin

    def abort(self) -> None:
        """End a capture that is failing (its nodes are dropped)."""
        cap = self._capture
        if cap is None:
            return
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        cap.restore_events()
        with _capture_lock:
            worker.hooks.capture = None
        self._capture = None
        self._nodes = []

    # -- replay ----------------------------------------------------------
    def replay(self) -> None:
        """Queue the captured work: origin nodes on the current stream, the
        others on their streams after the replay's start; every record node
        gets a fresh record (the replay's waits bind to this replay's). Only
        an event made with ``external=True`` then holds this replay's
        record; any other event recorded in the graph keeps the record it
        had before the capture (as on CUDA and ACL)."""
        if not self._nodes:
            raise RuntimeError("replay of a graph that captured nothing (or whose capture failed)")
        launch_on = worker.current_stream()
        branch = self._branch_streams()
        cap = worker.hooks.capture
        if cap is not None:
            inside = [s.name for s in (launch_on, *branch.values()) if cap.owns(s)]
            if inside:
                cap.violated(
                    f"Graph.replay() onto stream(s) {', '.join(inside)} in a graph capture in progress: the "
                    "emulation does not capture a graph launch (a child graph); replay after the capture"
                )
        start = Record()
        launch_on.enqueue_record(start)
        fresh: dict[int, Record] = {}
        begun: set[Stream] = set()
        for node in self._nodes:
            target = launch_on if node.stream is self._origin else branch[node.stream]
            if target is not launch_on and target not in begun:
                target.enqueue_wait(start)
                begun.add(target)
            if node.kind == "kernel":
                target.enqueue_kernel(node.payload, node.model, node.demand)
            elif node.kind == "record":
                rec = fresh[node.id] = Record(node.payload)
                if node.payload.external:  # an external record node; any other is an edge inside the graph
                    node.payload.last = rec
                target.enqueue_record(rec)
            else:
                target.enqueue_wait(fresh[node.payload])
        self.replays += 1

    def _branch_streams(self) -> dict[Stream, Stream]:
        """Where each forked branch replays: the stream it was captured on,
        or, once that stream is closed, a stream of the graph's own (a
        device graph does not need the streams it was captured on)."""
        out: dict[Stream, Stream] = {}
        for node in self._nodes:
            s = node.stream
            if s is self._origin or s in out:
                continue
            if s.closed:
                own = self._own.get(s)
                if own is None:
                    own = self._own[s] = Stream()
                    own.name = s.name
                out[s] = own
            else:
                out[s] = s
        return out

    def reset(self) -> None:
        self._nodes = []
        self._origin = None
        for own in self._own.values():
            own.close()
        self._own.clear()

    def pool(self) -> Any:
        return self._pool

    @property
    def node_count(self) -> int:
        return len(self._nodes)

    def nodes(self) -> list[tuple[str, str, Any]]:
        """``(stream name, kind, payload)`` of every captured node, in capture order."""
        return [(n.stream.name, n.kind, n.payload) for n in self._nodes]

    def __repr__(self) -> str:
        return f"Graph({len(self._nodes)} nodes, {self.replays} replays)"


class graph:
    """``with graph(g, pool=None, stream=None):`` captures the block into
    ``g`` on ``stream`` (default: a capture stream made once, outside any
    capture), after a device synchronize, as ``torch.cuda.graph`` does."""

    _default_capture_stream: Stream | None = None

    def __init__(self, g: Graph, pool: Any = None, stream: Stream | None = None, capture_error_mode: str = "global"):
        self.g = g
        self.pool = pool
        if stream is None:
            if graph._default_capture_stream is None:
                made = graph._default_capture_stream = Stream()
                made.name = "capture"
                made.thread.name = "camp2p-emulated-device-capture-stream"
            stream = graph._default_capture_stream
        self.capture_stream = stream
        self._ctx: worker.stream | None = None

    def __enter__(self) -> Graph:
        worker.synchronize()
        self._ctx = worker.stream(self.capture_stream)
        self._ctx.__enter__()
        try:
            self.g.capture_begin(pool=self.pool)
        except BaseException:
            self._ctx.__exit__(None, None, None)
            raise
        return self.g

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                self.g.capture_end()
            else:
                self.g.abort()
        finally:
            assert self._ctx is not None
            self._ctx.__exit__(None, None, None)


_pools = iter(range(1, 1 << 62))


def graph_pool_handle() -> tuple[int, int]:
    """An opaque memory-pool handle (the emulation keeps no pools)."""
    return (0, next(_pools))


def is_current_stream_capturing() -> bool:
    cap = worker.hooks.capture
    return cap is not None and cap.owns(worker.current_stream())


def capture_in_progress() -> bool:
    """Whether any thread is capturing (global capture mode)."""
    return worker.hooks.capture is not None


def captures() -> Iterator[Capture]:
    cap = worker.hooks.capture
    if cap is not None:
        yield cap
