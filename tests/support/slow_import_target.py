"""A target module whose import blocks until the test says go, for
tests/patching/test_patch_orders.py: copied under a fresh name into a
folder on sys.path and imported on another thread, it signals
``started`` and waits for ``go`` on the gate module the test registers as
``camp2p_slow_import_gate`` (never imported otherwise)."""

import camp2p_slow_import_gate as _gate

_gate.started.set()
assert _gate.go.wait(20), "test did not release the import"


class Target:
    def plain(self, ubatch_idx=0, **kwargs):
        return ubatch_idx
