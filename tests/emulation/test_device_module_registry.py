"""The emulated device reaches the patch layer only through the registry: core
imports no emulation module, the emulated device registers itself for the
``cpu`` backend when imported, and with nothing registered the ``cpu``
backend is refused with its reason (the step runs upstream's serial path)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from support.child import run_program
from support.overlap import Schedule, apply_cpu, assert_same, run_step, serial_results, world

import camp2p_overlap
from camp2p_overlap.core.overlap.streams import (
    BackendUnavailable,
    DeviceCapabilities,
    make_backend,
    register_device_module,
    registered_device_module,
    unregister_device_module,
)
from camp2p_overlap.core.patch_layer import PatchLayer
from camp2p_overlap.emulation import device as emulated_device

UNREGISTERED = "no device module is registered"


@pytest.fixture
def nothing_registered() -> Iterator[None]:
    saved = unregister_device_module("cpu")
    try:
        yield
    finally:
        if saved is not None:
            register_device_module("cpu", saved)


def test_the_emulated_device_registers_itself_for_the_cpu_backend() -> None:
    assert registered_device_module("cpu") is emulated_device
    backend = make_backend("cpu")
    try:
        assert backend.mod is emulated_device
        caps = backend.capabilities
        assert caps.tracked is emulated_device.tracked and caps.set_log is emulated_device.set_log
    finally:
        backend.close()


def test_with_nothing_registered_the_cpu_backend_is_refused_with_its_reason(nothing_registered: None) -> None:
    with pytest.raises(BackendUnavailable, match=f"backend 'cpu': {UNREGISTERED}.*camp2p_overlap.emulation.device"):
        make_backend("cpu")
    emulated_device.register()
    assert make_backend("cpu").mod is emulated_device


def test_a_cpu_step_with_nothing_registered_runs_serial_and_counts_why(
    nothing_registered: None, patch_layer: PatchLayer
) -> None:
    w = world(layers=2, stage_ids=(0, 1))
    sched = Schedule(2, (0, 1), (3, 5), step=1)
    (ref,) = serial_results(w, [sched], patch_layer=patch_layer)
    apply_cpu(patch_layer=patch_layer)
    assert_same(run_step(w, sched), ref)
    reasons = patch_layer.runtime.stats()["serial_reasons"]
    assert any(UNREGISTERED in r for r in reasons), reasons
    steps = patch_layer.runtime.stats()["steps"]
    assert steps["serial"] == 1 and sum(steps.values()) == 1, steps


def test_registration_refuses_what_is_not_a_device_module() -> None:
    with pytest.raises(ValueError, match="only cpu takes a registered device module"):
        register_device_module("cuda", emulated_device)
    with pytest.raises(
        TypeError, match="'halfdev' is not a device module: it has no current_stream, set_stream, synchronize"
    ):
        register_device_module("cpu", SimpleNamespace(__name__="halfdev", Stream=object, Event=object, stream=None))
    assert registered_device_module("cpu") is emulated_device  # a refusal leaves the registry as it was


def test_a_module_without_the_optional_capabilities_offers_none() -> None:
    plain = SimpleNamespace(__name__="plain", StreamLog=object)  # a log needs set_log too
    assert DeviceCapabilities.of(plain) == DeviceCapabilities()
    caps = DeviceCapabilities.of(emulated_device)
    assert None not in (caps.tracked, caps.peek_errors, caps.take_errors, caps.new_log, caps.set_log)


@pytest.mark.parametrize("enabled", ["0", "1"])
def test_import_and_apply_with_the_default_backend_load_no_emulation_module(enabled: str) -> None:
    proc = run_program(
        "modules_loaded_by_import.py",
        "--apply",
        "camp2p_overlap.emulation",
        "camp2p_overlap.tools",
        env={"VLLM_CAMP2P_MULTISTREAM": enabled},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_public_path_is_the_one_module() -> None:
    assert camp2p_overlap.emulation.device is emulated_device  # type: ignore[attr-defined]
    assert emulated_device.launch is emulated_device.worker.launch


def test_the_testing_helper_makes_the_cpu_backend_available() -> None:
    """A user's test asking ``overlap_patched(backend="cpu")`` gets the
    emulated device, with nothing else imported."""
    proc = run_program("testing_helper_backend.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["before: False", "inside: camp2p_overlap.emulation.device"]
