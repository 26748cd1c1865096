"""The emulated device: a module shaped like ``torch.npu`` / ``torch.cuda``
whose streams are worker threads on the host (``worker.py``) and which can
capture and replay graphs under capture's rules (``capture.py``).

``VLLM_CAMP2P_MULTISTREAM_BACKEND=cpu`` runs the layer's one device backend
(:class:`~camp2p_overlap.core.overlap.streams.device.TorchDeviceBackend`)
over this module; the emulation installs it as ``torch.npu`` so upstream's
own runner code runs on it unchanged. Its public import path is
``camp2p_overlap.emulation.device``; it lives here so the layer can build
its CPU backend without importing the emulation (the import contracts).
What it offers as ``torch.npu``, and the upstream call sites it serves, is
in docs/design.md ("The emulated device").
"""

from __future__ import annotations

import os
from typing import Any

from camp2p_overlap.core.overlap.streams.emulated.capture import (
    Graph,
    capture_in_progress,
    graph,
    graph_pool_handle,
    host_read,
    is_current_stream_capturing,
)
from camp2p_overlap.core.overlap.streams.emulated.timing import (
    Model,
    TimingCounts,
    hold,
    hold_until,
    kernel_start_ns,
    peek_timing,
    take_timing,
)
from camp2p_overlap.core.overlap.streams.emulated.worker import (
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


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(free, total)`` bytes: the host's memory (the emulation keeps no pool)."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return (0, 0)


__all__ = [
    "CUDAGraph",
    "CaptureViolation",
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
    "capture_in_progress",
    "current_device",
    "current_log",
    "current_stream",
    "default_stream",
    "device_count",
    "drain_all",
    "empty_cache",
    "executing_stream",
    "graph",
    "graph_pool_handle",
    "hold",
    "hold_until",
    "host_read",
    "is_available",
    "is_current_stream_capturing",
    "kernel_start_ns",
    "launch",
    "mem_get_info",
    "peek_errors",
    "peek_timing",
    "set_device",
    "set_log",
    "set_stream",
    "stream",
    "synchronize",
    "take_errors",
    "take_timing",
    "tracked",
]
