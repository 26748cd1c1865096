"""Copied as ``test_inner.py`` into a folder of its own and run by a
separate pytest by tests/package/test_testing_helpers.py: a test that fails
while the ``camp2p_overlap_patched`` fixture holds the patch layer applied, then
one that checks it was unpatched (pytest collects tests in file order)."""

import importlib

from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.emulation import standins

pytest_plugins = ["camp2p_overlap.testing"]
standins.install()
CONN = importlib.import_module("afd_plugin.connectors.npu.camp2p").CAMP2pAFDConnector
RUNNER = importlib.import_module("afd_plugin.v1.worker.npu.ffn_model_runner").AFDNPUFFNModelRunner
ORIGINAL = {cls: dict(vars(cls)) for cls in (CONN, RUNNER)}


def test_a_fails_while_patched(camp2p_overlap_patched):
    assert camp2p_overlap_patched.applied
    assert PATCH_LAYER.engine.is_ours(vars(RUNNER)["_ffn_forward"])
    assert vars(CONN)["recv_attn_output"] is ORIGINAL[CONN]["recv_attn_output"]  # routed per step only
    raise AssertionError("deliberate failure")


def test_b_runs_after_it():
    assert not PATCH_LAYER.engine.is_applied()
    assert all(vars(cls)[k] is v for cls, entries in ORIGINAL.items() for k, v in entries.items())
