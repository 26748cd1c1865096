"""The vLLM version gate: read from installed metadata, exact release with
any local label, everything else refused (wrapping nothing, with a reason;
raising in strict mode)."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, run_python

from camp2p_overlap.core import versions
from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.engine import PatchEngine, PatchRefused
from camp2p_overlap.core.process import build_layer
from camp2p_overlap.core.report import TargetState
from camp2p_overlap.core.versions import check_vllm, judge_vllm_version
from camp2p_overlap.emulation import standins

SUPPORTED = "0.19.1"
ACCEPTED = ["0.19.1", "0.19.1+empty", "0.19.1+cpu.ascend", "0.19.1.0"]
REFUSED = ["0.19.0", "0.20.0", "0.19.1rc1", "0.19.1.post1", "0.19.1.dev0", "0.19.10", "1!0.19.1", "garbage", ""]
CFG = OverlapConfig(enabled=True, backend="cpu")


@pytest.mark.parametrize("found", ACCEPTED)
def test_accepted_versions(found: str) -> None:
    vc = judge_vllm_version(found, SUPPORTED)
    assert vc.ok and vc.found == found and vc.supported == SUPPORTED


@pytest.mark.parametrize("found", [*REFUSED, None])
def test_refused_versions_say_why(found: str | None) -> None:
    vc = judge_vllm_version(found, SUPPORTED)
    assert not vc.ok
    assert SUPPORTED in vc.reason
    if found is None:
        assert "not installed" in vc.reason
    else:
        assert repr(found) in vc.reason or found in vc.reason


def test_check_vllm_reads_installed_metadata_without_importing_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    was_imported = "vllm" in sys.modules
    vc = check_vllm(SUPPORTED)
    assert vc.found == importlib.metadata.version("vllm")
    assert ("vllm" in sys.modules) == was_imported
    monkeypatch.setattr(versions, "installed_version", lambda dist: None)
    assert not check_vllm(SUPPORTED).ok and "not installed" in check_vllm(SUPPORTED).reason


def _engine_for(found: str | None) -> PatchEngine:
    return build_layer(version_check=lambda manifest: judge_vllm_version(found, manifest.vllm)).engine


def _stand_in_dicts() -> tuple[dict[str, dict[str, Any]], tuple[type, type]]:
    standins.install()
    runner = importlib.import_module("afd_plugin.v1.worker.npu.ffn_model_runner").AFDNPUFFNModelRunner
    conn = importlib.import_module("afd_plugin.connectors.npu.camp2p").CAMP2pAFDConnector
    return {"runner": dict(vars(runner)), "conn": dict(vars(conn))}, (runner, conn)


@pytest.mark.parametrize("found", ["0.19.0", "0.20.0", "0.19.1rc1", "0.19.1.post1", "garbage", None])
def test_engine_refuses_other_versions_and_wraps_nothing(found: str | None) -> None:
    snaps, (runner, conn) = _stand_in_dicts()
    engine = _engine_for(found)
    try:
        report = engine.apply(config=CFG)
        assert not report.applied and not engine.is_applied()
        assert report.enabled
        assert report.vllm_version == found
        assert report.reason.startswith("refused") and SUPPORTED in report.reason
        assert report.targets and {t.state for t in report.targets} == {TargetState.REFUSED}
        status = engine.status()
        assert status.reason == report.reason and not status.applied
        assert engine.installer.records == {}
        for cls, snap in ((runner, snaps["runner"]), (conn, snaps["conn"])):
            assert all(vars(cls)[k] is v for k, v in snap.items()) and vars(cls).keys() == snap.keys()
        with pytest.raises(PatchRefused, match=SUPPORTED):
            engine.apply(config=CFG, strict=True)
        with pytest.raises(PatchRefused):
            engine.apply(config=CFG.with_overrides(strict=True))
        assert not engine.is_applied()
    finally:
        engine.unpatch()


@pytest.mark.parametrize("found", ["0.19.1", "0.19.1+empty"])
def test_engine_accepts_the_release_with_a_local_label(found: str) -> None:
    _, (runner, conn) = _stand_in_dicts()
    engine = _engine_for(found)
    try:
        report = engine.apply(config=CFG, strict=True)
        assert report.applied and report.vllm_version == found
        assert engine.is_ours(vars(runner)["_ffn_forward"]) and engine.is_ours(vars(conn)["recv_attn_output"])
    finally:
        assert engine.unpatch() is True
    assert not engine.is_ours(vars(runner)["_ffn_forward"])


# ---------------------------------------------------------------------------
# Fresh interpreters that see a fake installed vLLM first on sys.path.
CHILD = """
import importlib, importlib.metadata, json, sys
import camp2p_overlap
from camp2p_overlap.core.engine import PatchRefused
from camp2p_overlap.core.process import ENGINE
from camp2p_overlap.emulation import standins
standins.install()
conn = importlib.import_module("afd_plugin.connectors.npu.camp2p").CAMP2pAFDConnector
before = dict(vars(conn))
report = camp2p_overlap.apply()
out = {
    "metadata": importlib.metadata.version("vllm"),
    "applied": report.applied,
    "reason": camp2p_overlap.status().reason,
    "states": sorted({t.state.value for t in camp2p_overlap.status().targets}),
    "reported": report.vllm_version,
    "untouched": vars(conn).keys() == before.keys() and all(vars(conn)[k] is v for k, v in before.items()),
    "vllm_imported": "vllm" in sys.modules,
}
camp2p_overlap.unpatch()
try:
    camp2p_overlap.apply(strict=True)
    out["strict"] = "applied"
except PatchRefused as exc:
    out["strict"] = "PatchRefused: " + str(exc)
print("OUT " + json.dumps(out))
"""


def _fake_vllm(root: Path, version: str) -> Path:
    dist = root / f"vllm-{version or 'x'}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n", encoding="utf-8")
    return root


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.19.1", True),
        ("0.19.1+empty", True),
        ("0.19.0", False),
        ("0.20.0", False),
        ("0.19.1rc1", False),
        ("0.19.1.post1", False),
        ("garbage", False),
    ],
)
def test_fresh_process_with_fake_installed_vllm(tmp_path: Path, version: str, ok: bool) -> None:
    fake = _fake_vllm(tmp_path / "site", version)
    proc = run_python(
        CHILD,
        env={"VLLM_CAMP2P_MULTISTREAM": "1", "PYTHONPATH": f"{fake}:{REPO}"},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(next(line[4:] for line in proc.stdout.splitlines() if line.startswith("OUT ")))
    assert out["metadata"] == version  # the fake really is what the process sees
    assert out["reported"] == version
    assert out["vllm_imported"] is False
    if ok:
        assert out["applied"] is True and out["reason"] == "applied"
        assert out["untouched"] is False  # the connector was wrapped
        assert out["strict"] == "applied"
    else:
        assert out["applied"] is False
        assert out["untouched"] is True
        assert out["states"] == ["refused"]
        assert version in out["reason"] and SUPPORTED in out["reason"]
        assert out["strict"].startswith("PatchRefused: ") and SUPPORTED in out["strict"]
