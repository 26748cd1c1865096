"""camp2p_overlap.testing: apply with a given configuration and always
unpatch, even when the body (or the test) fails."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from support.child import PROGRAMS, REPO

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.core.patching.lifecycle import PatchRefused
from camp2p_overlap.emulation import standins
from camp2p_overlap.testing import overlap_patched

RUNNER = "afd_plugin.v1.worker.npu.ffn_model_runner"
CONNECTOR = "afd_plugin.connectors.npu.camp2p"


def _classes() -> tuple[type, type]:
    standins.install()
    return (
        importlib.import_module(RUNNER).AFDNPUFFNModelRunner,
        importlib.import_module(CONNECTOR).CAMP2pAFDConnector,
    )


def _restored(snap: dict[type, dict[str, Any]]) -> bool:
    return all(vars(c).keys() == s.keys() and all(vars(c)[k] is v for k, v in s.items()) for c, s in snap.items())


def test_context_manager_applies_and_unpatches() -> None:
    runner, conn = _classes()
    snap = {runner: dict(vars(runner)), conn: dict(vars(conn))}
    with overlap_patched(backend="cpu", min_stages=3) as report:
        assert report.applied and report.engaged and PATCH_LAYER.engine.is_applied()
        assert (
            PATCH_LAYER.engine.config.backend == "cpu"
            and PATCH_LAYER.engine.config.min_stages == 3
            and PATCH_LAYER.engine.config.enabled
        )
        assert PATCH_LAYER.engine.is_ours(vars(runner)["_ffn_forward"])
    assert not PATCH_LAYER.engine.is_applied()
    assert _restored(snap)


def test_context_manager_unpatches_when_the_body_raises() -> None:
    runner, conn = _classes()
    snap = {runner: dict(vars(runner)), conn: dict(vars(conn))}
    with pytest.raises(KeyError, match="body failed"), overlap_patched(backend="cpu"):
        assert PATCH_LAYER.engine.is_ours(vars(runner)["_ffn_forward"])
        assert vars(conn)["send_ffn_output"] is snap[conn]["send_ffn_output"]  # routed per step, never wrapped
        raise KeyError("body failed")
    assert not PATCH_LAYER.engine.is_applied()
    assert _restored(snap)


def test_context_manager_uses_the_given_config_over_an_earlier_apply() -> None:
    PATCH_LAYER.engine.apply(config=OverlapConfig(enabled=True, backend="cpu", adaptive=False, min_stages=2))
    cfg = OverlapConfig(enabled=True, backend="cpu", adaptive=False, min_stages=1, graph=True)
    with overlap_patched(cfg) as report:
        assert report.applied and PATCH_LAYER.engine.config == cfg
    assert not PATCH_LAYER.engine.is_applied()


def test_context_manager_is_strict_and_still_unpatches() -> None:
    runner, _ = _classes()
    runner_snap = dict(vars(runner))
    # A connector module whose target is missing: the engine refuses it.
    sys.modules[CONNECTOR] = types.ModuleType(CONNECTOR)
    try:
        with pytest.raises(PatchRefused, match="CAMP2pAFDConnector"), overlap_patched(backend="cpu"):
            pytest.fail("the body must not run when the patch is refused")
        assert not PATCH_LAYER.engine.is_applied()
        assert _restored({runner: runner_snap})
        with overlap_patched(backend="cpu", strict=False) as report:
            assert report.applied and report.refused and not report.engaged
        assert not PATCH_LAYER.engine.is_applied()
    finally:
        sys.modules.pop(CONNECTOR, None)


def test_pytest_fixture_unpatches_after_a_failing_test(tmp_path: Path) -> None:
    shutil.copy(PROGRAMS / "inner_fixture_suite.py", tmp_path / "test_inner.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CAMP2P")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert "deliberate failure" in proc.stdout, proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
