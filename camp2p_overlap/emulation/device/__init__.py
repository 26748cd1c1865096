"""The emulated device: a module shaped like ``torch.npu`` / ``torch.cuda``
whose streams are worker threads on the host (``worker.py``), whose kernels
are host functions queued with :func:`launch`, and which captures and
replays graphs under capture's rules (``capture.py``).

Importing it registers it as the device module of the patch layer's ``cpu``
backend (:func:`~camp2p_overlap.core.overlap.streams.register_device_module`):
``VLLM_CAMP2P_MULTISTREAM_BACKEND=cpu`` then runs the patch layer's one device
backend over it. The patch layer imports no emulation module; with this module
not imported, the ``cpu`` backend is refused. What the patch layer reads of it is
the protocol in ``core/overlap/streams/base.py`` (``DeviceModule`` and its
optional capabilities: op tracking, asynchronous errors, the stream log).

:func:`as_torch_npu` installs it as ``torch.npu`` (where no real torch_npu
is loaded), so upstream's own runner code, which calls ``torch.npu.graph``,
``torch.npu.NPUGraph`` and ``torch.npu.current_stream``, runs on it. What it
offers as ``torch.npu``, and the upstream call sites it serves, is in
docs/design.md ("The emulated device").
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

import torch

from camp2p_overlap.core.overlap.streams import register_device_module
from camp2p_overlap.emulation.device.capture import (
    Graph,
    capture_in_progress,
    graph,
    graph_pool_handle,
    host_read,
    is_current_stream_capturing,
)
from camp2p_overlap.emulation.device.cores import CoreDemand, core_budget, core_state, set_core_budget
from camp2p_overlap.emulation.device.timing import (
    Model,
    TimingCounts,
    hold,
    hold_until,
    kernel_start_ns,
    peek_timing,
    take_timing,
)
from camp2p_overlap.emulation.device.worker import (
    CaptureViolation,
    DefaultStream,
    Event,
    Stream,
    StreamLog,
    StreamLogEntry,
    TrackedOp,
    current_log,
    current_stream,
    default_stream,
    drain_all,
    executing_stream,
    launch,
    peek_errors,
    set_log,
    set_stream,
    stream,
    synchronize,
    take_errors,
    tracked,
)

#: The graph class under the device modules' names.
NPUGraph = Graph
CUDAGraph = Graph


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device: Any) -> None:
    return None


def empty_cache() -> None:
    return None


class DeviceProperties:
    """What :func:`get_device_properties` gives: torch_npu's field names; ``vector_core_num`` only with a core
    model (``cores.set_core_budget``)."""

    def __init__(self, vector_core_num: int | None) -> None:
        self.name = "camp2p emulated device"
        self.total_memory = mem_get_info()[1]
        if vector_core_num is not None:
            self.vector_core_num = vector_core_num

    def __repr__(self) -> str:
        return f"DeviceProperties(vector_core_num={getattr(self, 'vector_core_num', None)})"


def get_device_properties(device: Any = None) -> DeviceProperties:
    """The device's properties (its vector cores where it reports them)."""
    return DeviceProperties(core_budget())


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(free, total)`` bytes: the host's memory (the emulation keeps no pool)."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return (0, 0)


def _this() -> ModuleType:
    return sys.modules[__name__]


def is_torch_npu() -> bool:
    """Whether ``torch.npu`` is this emulated device."""
    return getattr(torch, "npu", None) is _this()


def as_torch_npu() -> ModuleType:
    """Make this module ``torch.npu`` (idempotent) and return it. Refused
    when a real ``torch.npu`` (torch_npu) is loaded: the emulation never
    shadows a device."""
    current = getattr(torch, "npu", None)
    if current is not None and current is not _this():
        raise RuntimeError("torch.npu is already a real device module (torch_npu); the emulated device stays off")
    torch.npu = _this()  # type: ignore[attr-defined]
    return _this()


def remove_torch_npu() -> None:
    """Undo :func:`as_torch_npu` (only when ``torch.npu`` is this module)."""
    if is_torch_npu():
        del torch.npu  # type: ignore[attr-defined]


def register() -> None:
    """Register this module as the ``cpu`` backend's device module (done
    at import; again after a test unregistered it)."""
    register_device_module("cpu", _this())


__all__ = [
    "CUDAGraph",
    "CaptureViolation",
    "CoreDemand",
    "DefaultStream",
    "Event",
    "Graph",
    "Model",
    "NPUGraph",
    "Stream",
    "StreamLog",
    "StreamLogEntry",
    "TimingCounts",
    "TrackedOp",
    "as_torch_npu",
    "capture_in_progress",
    "core_budget",
    "core_state",
    "current_device",
    "current_log",
    "current_stream",
    "default_stream",
    "device_count",
    "drain_all",
    "empty_cache",
    "executing_stream",
    "get_device_properties",
    "graph",
    "graph_pool_handle",
    "hold",
    "hold_until",
    "host_read",
    "is_available",
    "is_current_stream_capturing",
    "is_torch_npu",
    "kernel_start_ns",
    "launch",
    "mem_get_info",
    "peek_errors",
    "peek_timing",
    "register",
    "remove_torch_npu",
    "set_core_budget",
    "set_device",
    "set_log",
    "set_stream",
    "stream",
    "synchronize",
    "take_errors",
    "take_timing",
    "tracked",
]

register()
