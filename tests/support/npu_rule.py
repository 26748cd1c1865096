"""The emulated device with and without its ``torch.npu`` rule *CAM comm on the origin stream*
(``emulation/device/capture.py``): while the device itself is ``torch.npu`` (the ``emulated_torch_npu`` fixture), a
CAM comm kernel captured off the capture's origin stream is refused, as upstream's NPU graph code requires;
:func:`device_not_as_torch_npu` makes ``torch.npu`` a module that forwards every name to the emulated device without
being it, so upstream's graph path (the stand-ins call ``torch.npu``) runs on the same emulated device while the rule
is off, as on a device whose graphs may capture comm kernels on a forked stream (``torch.cuda``'s stand-in): what
``VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1`` is for."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from camp2p_overlap.emulation import device
from camp2p_overlap.emulation.device import capture


class _Forwarding(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        return getattr(device, name)


class CapturedKernels:
    """Every kernel the captures record while it is installed (undone with ``monkeypatch``): its stream, the
    capture's origin stream, and its CAM comm kind (``a2e``/``e2a``; None: not a comm kernel), by name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kernels: list[tuple[str, str, str | None]] = []
        real = capture.Capture.add_kernel

        def add_kernel(
            cap: Any, stream: Any, fn: Any, writes: Any, model: Any = None, comm: Any = None, demand: Any = None
        ) -> None:
            self.kernels.append((stream.name, cap.origin.name, comm))
            real(cap, stream, fn, writes, model, comm, demand)

        monkeypatch.setattr(capture.Capture, "add_kernel", add_kernel)

    def comm(self) -> list[tuple[str, str, str | None]]:
        """The CAM comm kernels."""
        return [k for k in self.kernels if k[2] is not None]

    def clear(self) -> None:
        self.kernels.clear()


def device_not_as_torch_npu(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``torch.npu`` forwards to the emulated device, which no longer stands in for it (undone with
    ``monkeypatch``); the test's ``emulated_torch_npu`` fixture had installed the device as ``torch.npu``."""
    assert device.is_torch_npu(), "the emulated_torch_npu fixture installs the device first"
    forwarding = _Forwarding("emulated_device_not_as_torch_npu")
    monkeypatch.setattr(torch, "npu", forwarding)
    assert not device.is_torch_npu() and not capture._is_torch_npu()
    return forwarding
