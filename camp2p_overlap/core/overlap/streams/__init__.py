"""Stream backends: one device backend over ``torch.npu``, ``torch.cuda``
or, for ``cpu``, the device module registered for it (the emulated device,
``camp2p_overlap.emulation.device``, registers itself when imported; the
patch layer imports no emulation module), chosen from the runner's device."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from camp2p_overlap.core.overlap.streams.backend import StreamBackend
from camp2p_overlap.core.overlap.streams.base import (
    NO_CAPABILITIES,
    BackendUnavailable,
    DeviceCapabilities,
    DeviceModule,
    StreamPoisonedError,
)

__all__ = [
    "BackendUnavailable",
    "DeviceCapabilities",
    "StreamBackend",
    "StreamPoisonedError",
    "device_module",
    "device_module_of",
    "make_backend",
    "register_device_module",
    "registered_capabilities",
    "registered_device_module",
    "resolve_backend_name",
    "unregister_device_module",
]

#: Device modules registered for a backend name that torch does not provide
#: (``cpu``: the emulated device), by that name.
_REGISTERED: dict[str, DeviceModule] = {}
#: What each registered module offers beyond the protocol, read once.
_CAPABILITIES: dict[str, DeviceCapabilities] = {}
#: The only backend names a module can be registered for.
REGISTRABLE = ("cpu",)


def register_device_module(backend: str, module: DeviceModule) -> None:
    """Serve ``backend`` (``cpu``) with ``module``. Checked now: a module
    missing part of :class:`DeviceModule` is refused here, not at a step."""
    if backend not in REGISTRABLE:
        raise ValueError(f"only {', '.join(REGISTRABLE)} takes a registered device module, not {backend!r}")
    missing = [
        attr
        for attr in ("Stream", "Event", "stream", "current_stream", "set_stream", "synchronize")
        if not hasattr(module, attr)
    ]
    if missing:
        raise TypeError(
            f"{getattr(module, '__name__', module)!r} is not a device module: it has no {', '.join(missing)}"
        )
    _REGISTERED[backend] = module
    _CAPABILITIES[backend] = DeviceCapabilities.of(module)


def unregister_device_module(backend: str) -> DeviceModule | None:
    """Drop ``backend``'s module (returned, or None when none was registered)."""
    _CAPABILITIES.pop(backend, None)
    return _REGISTERED.pop(backend, None)


def registered_device_module(backend: str = "cpu") -> DeviceModule | None:
    """The module registered for ``backend``, or None."""
    return _REGISTERED.get(backend)


def registered_capabilities(backend: str = "cpu") -> DeviceCapabilities:
    """What the module registered for ``backend`` offers beyond the protocol
    (none when nothing is registered)."""
    return _CAPABILITIES.get(backend, NO_CAPABILITIES)


def device_module(kind: str) -> Any:
    """``torch.cuda`` or ``torch.npu`` when a device of that kind is usable, else
    raise :class:`BackendUnavailable` saying why (the one check the patch layer,
    the emulated worlds and the command line share)."""
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


def device_module_of(backend: str, device: Any = None) -> Any:
    """The device module a runner on ``backend`` drives: the registered one (``cpu``), else ``torch.cuda`` or
    ``torch.npu`` (:func:`device_module`); raises :class:`BackendUnavailable`."""
    if backend in REGISTRABLE:
        registered = _REGISTERED.get(backend)
        if registered is None:
            raise BackendUnavailable(f"backend {backend!r}: no device module is registered for it")
        return registered
    return device_module(backend)


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
    if name in REGISTRABLE:
        registered = _REGISTERED.get(name)
        if registered is None:
            raise BackendUnavailable(
                f"backend {name!r}: no device module is registered for it; the emulated device registers "
                "itself when camp2p_overlap.emulation.device is imported (the layer never imports it)"
            )
        return StreamBackend(name, registered, device)
    try:
        mod = device_module(name)
    except BackendUnavailable as exc:
        raise BackendUnavailable(f"backend {name!r} unavailable: {exc}") from exc
    return StreamBackend(name, mod, device)
