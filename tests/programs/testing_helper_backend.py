"""Child of tests/emulation/test_device_module_registry.py: in a fresh interpreter,
``overlap_patched(backend="cpu")`` makes the cpu backend available (the
emulated device registered); prints what a backend made inside it runs on."""

from camp2p_overlap.core.overlap.streams import make_backend, registered_device_module
from camp2p_overlap.testing import overlap_patched

print("before:", registered_device_module("cpu") is not None)
with overlap_patched(backend="cpu", strict=False):
    print("inside:", make_backend("cpu").mod.__name__)
