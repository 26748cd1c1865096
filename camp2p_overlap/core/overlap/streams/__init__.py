"""Stream backends: one device backend over ``torch.npu``, ``torch.cuda``
or, for ``cpu``, the emulated device (``streams/emulated``: worker-thread
streams on the host), chosen from the runner's device."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from camp2p_overlap.core.overlap.streams.base import (
    BackendUnavailable,
    DoneHandle,
    Event,
    OpHandle,
    Stream,
    StreamBackend,
    StreamPoisonedError,
)
from camp2p_overlap.core.overlap.streams.device import TorchDeviceBackend

__all__ = [
    "BackendUnavailable",
    "DoneHandle",
    "Event",
    "OpHandle",
    "Stream",
    "StreamBackend",
    "StreamPoisonedError",
    "TorchDeviceBackend",
    "device_module",
    "make_backend",
    "resolve_backend_name",
]


def device_module(kind: str) -> Any:
    """``torch.cuda`` or ``torch.npu`` when a device of that kind is usable,
    else raise :class:`BackendUnavailable` saying why: the one check the
    layer, the emulated device worlds and the command line share. Importing
    torch_npu is attempted only for ``npu``."""
    import torch

    if kind == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailable("torch.cuda reports no CUDA device (torch.cuda.is_available() is False)")
        return torch.cuda
    if kind == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            raise BackendUnavailable("torch_npu is not installed")
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:  # a broken install is refused, not raised into vLLM
            raise BackendUnavailable(f"importing torch_npu failed: {type(exc).__name__}: {exc}") from exc
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            raise BackendUnavailable("torch.npu reports no NPU device (torch.npu.is_available() is False)")
        return npu
    raise BackendUnavailable(f"no device module for {kind!r} (cuda or npu)")


def resolve_backend_name(requested: str, device: Any) -> str:
    """The backend for a runner on ``device`` under ``requested``
    (``auto|npu|cuda|cpu``). ``auto`` follows the device type and never
    chooses ``cpu``: a CPU device only gets the CPU backend when asked for."""
    kind = getattr(device, "type", None) or (str(device).split(":")[0] if device is not None else None)
    if requested != "auto":
        if requested != "cpu" and kind is not None and kind != requested:
            raise BackendUnavailable(f"backend {requested!r} was asked for but the runner's device is {kind!r}")
        return requested
    if kind in ("npu", "cuda"):
        return kind
    raise BackendUnavailable(
        f"runner device {kind!r} has no device streams; the CPU backend runs only when "
        "VLLM_CAMP2P_MULTISTREAM_BACKEND=cpu asks for it"
    )


def make_backend(name: str, device: Any = None) -> StreamBackend:
    if name == "cpu":
        from camp2p_overlap.core.overlap.streams import emulated

        return TorchDeviceBackend("cpu", emulated, device)
    try:
        mod = device_module(name)
    except BackendUnavailable as exc:
        raise BackendUnavailable(f"backend {name!r} unavailable: {exc}") from exc
    return TorchDeviceBackend(name, mod, device)
