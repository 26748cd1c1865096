"""The emulated device, under its public name: a module shaped like
``torch.npu`` / ``torch.cuda`` whose streams are worker threads, whose
kernels are host functions queued with :func:`launch`, and which captures
and replays graphs under capture's rules (the implementation, and what each
rule mirrors, is in ``camp2p_overlap.core.overlap.streams.emulated``).

:func:`as_torch_npu` installs it as ``torch.npu`` (where no real torch_npu
is loaded), so upstream's own runner code, which calls ``torch.npu.graph``,
``torch.npu.NPUGraph`` and ``torch.npu.current_stream``, runs on it.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from camp2p_overlap.core.overlap.streams.emulated import *  # noqa: F403 - this module is that API
from camp2p_overlap.core.overlap.streams.emulated import __all__ as _api

__all__ = [*_api, "as_torch_npu", "is_torch_npu", "remove_torch_npu"]


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
