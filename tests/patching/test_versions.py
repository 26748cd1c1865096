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
from support.child import REPO, run_program

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.patch_layer import build_patch_layer
from camp2p_overlap.core.patching import versions
from camp2p_overlap.core.patching.lifecycle import PatchEngine, PatchRefused
from camp2p_overlap.core.patching.status_report import TargetState
from camp2p_overlap.core.patching.versions import check_vllm, judge_vllm_version
from camp2p_overlap.emulation import standins

SUPPORTED = "0.19.1"
ACCEPTED = ["0.19.1", "0.19.1+empty", "0.19.1+cpu.ascend", "0.19.1.0"]
REFUSED = ["0.19.0", "0.20.0", "0.19.1rc1", "0.19.1.post1", "0.19.1.dev0", "0.19.10", "1!0.19.1", "garbage", ""]
CFG = OverlapConfig(enabled=True, backend="cpu", adaptive=False)


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
    return build_patch_layer(version_check=lambda manifest: judge_vllm_version(found, manifest.vllm)).engine


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
        assert engine.is_ours(vars(runner)["_ffn_forward"]) and not engine.is_ours(vars(conn)["recv_attn_output"])
        assert report.engaged  # the connector's routed targets were checked
    finally:
        assert engine.unpatch() is True
    assert not engine.is_ours(vars(runner)["_ffn_forward"])


# ---------------------------------------------------------------------------
# Fresh interpreters that see a fake installed vLLM first on sys.path
# (tests/programs/apply_with_installed_versions.py).
CHILD = "apply_with_installed_versions.py"


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
    proc = run_program(
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
        assert out["untouched"] is False  # the runner was wrapped
        assert out["strict"] == "applied"
    else:
        assert out["applied"] is False
        assert out["untouched"] is True
        assert out["states"] == ["refused"]
        assert version in out["reason"] and SUPPORTED in out["reason"]
        assert out["strict"].startswith("PatchRefused: ") and SUPPORTED in out["strict"]


# ---------------------------------------------------------------------------
# Stack selection: the manifest whose pinned versions are installed.
def _stack(name: str, vllm: str, afd: str | None) -> Any:
    from dataclasses import replace

    from camp2p_overlap.core.patching.manifest import load_manifest

    return replace(load_manifest(), name=name, vllm=vllm, afd_plugin=afd)


def _checker(vllm_found: str | None, afd_found: str | None) -> Any:
    def check(m: Any) -> versions.VersionCheck:
        vc = judge_vllm_version(vllm_found, m.vllm)
        if not vc.ok or m.afd_plugin is None:
            return vc
        return versions.judge_afd_plugin_version(vc, afd_found, m.afd_plugin)

    return check


def test_selection_picks_the_stack_whose_versions_are_installed() -> None:
    from camp2p_overlap.core.patching.manifest import select_stack

    a, b = _stack("vllm-0.19.1", "0.19.1", "0.19.1rc1"), _stack("vllm-0.26.0", "0.26.0", None)
    assert select_stack((a, b), _checker("0.19.1+empty", "0.19.1rc1"))[0] is a
    assert select_stack((a, b), _checker("0.26.0", "0.19.1rc1"))[0] is b  # b pins no afd-plugin
    assert select_stack((a, b), _checker("0.19.1", None))[0] is a  # afd-plugin without metadata: not judged


def test_selection_refusal_names_installed_and_every_supported_stack() -> None:
    from camp2p_overlap.core.patching.manifest import select_stack

    a, b = _stack("vllm-0.19.1", "0.19.1", "0.19.1rc1"), _stack("vllm-0.26.0", "0.26.0", "0.26.0")
    man, vc = select_stack((a, b), _checker("0.20.0", None))
    assert not vc.ok and man is a
    assert vc.reason.startswith("vLLM 0.20.0 is installed")
    assert "vLLM 0.19.1 with afd-plugin 0.19.1rc1 (stack vllm-0.19.1)" in vc.reason
    assert "vLLM 0.26.0 with afd-plugin 0.26.0 (stack vllm-0.26.0)" in vc.reason
    # vLLM fits a stack, its afd-plugin does not: that stack's refusal, naming both.
    man, vc = select_stack((a, b), _checker("0.26.0", "0.19.1rc1"))
    assert not vc.ok and man is b
    assert "afd-plugin (vllm-afd-plugin) 0.19.1rc1 is installed next to vLLM 0.26.0" in vc.reason
    assert "stack vllm-0.19.1" in vc.reason and "stack vllm-0.26.0" in vc.reason


@pytest.mark.parametrize(("afd", "ok"), [("0.19.1rc1", True), ("0.19.1rc1+d20260801", True), ("0.19.1rc2", False)])
def test_shipped_stack_pins_afd_plugin_where_installed(afd: str, ok: bool) -> None:
    from camp2p_overlap.core.patching.manifest import load_manifests, select_stack

    (man, vc) = select_stack(load_manifests(), _checker("0.19.1", afd))
    assert man.afd_plugin == "0.19.1rc1" and vc.ok is ok
    if not ok:
        assert f"afd-plugin (vllm-afd-plugin) {afd} is installed" in vc.reason and "0.19.1rc1" in vc.reason


def test_fresh_process_refuses_another_installed_afd_plugin(tmp_path: Path) -> None:
    """A fake vllm-afd-plugin 0.26.0 next to vLLM 0.19.1: refused, logged
    with both versions, nothing wrapped."""
    site = _fake_vllm(tmp_path / "site", "0.19.1")
    dist = site / "vllm_afd_plugin-0.26.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-afd-plugin\nVersion: 0.26.0\n", encoding="utf-8")
    proc = run_program(CHILD, env={"VLLM_CAMP2P_MULTISTREAM": "1", "PYTHONPATH": f"{site}:{REPO}"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(next(line[4:] for line in proc.stdout.splitlines() if line.startswith("OUT ")))
    assert out["applied"] is False and out["untouched"] is True and out["states"] == ["refused"]
    assert "afd-plugin (vllm-afd-plugin) 0.26.0 is installed next to vLLM 0.19.1" in out["reason"]
    assert out["strict"].startswith("PatchRefused: afd-plugin")


# ---------------------------------------------------------------------------
# The vllm-0.26.0 stack: afd-plugin main, pinned by commit.
MAIN = "2e4378f2d478313992e9a1b850c61b1e888a1145"


@pytest.mark.parametrize(
    ("found", "ok"),
    [
        ("0.1.dev447+g2e4378f2d", True),  # what setuptools-scm builds from a full clone of the commit
        ("0.1.dev447+g2e4378f", True),  # a 7-digit abbreviation
        ("0.1.dev12+g2e4378f2d", True),  # a shallow clone counts fewer commits: the commit decides
        ("0.1.dev447+g2e4378f2d.d20260801", True),  # a tree with local changes (as 0.19.1rc1+d... is accepted)
        ("0.1.dev448+g5d1c0ffee", False),  # a later main commit
        ("0.1.dev447+g2e4378e", False),
        ("0.1.dev447+g2e43", False),  # too short to name a commit
        ("0.1.dev447", False),  # built without git: names no commit
        ("0.19.1rc1", False),
        ("0.26.0", False),
        ("garbage", False),
    ],
)
def test_commit_pinned_afd_plugin(found: str, ok: bool) -> None:
    vllm_ok = judge_vllm_version("0.26.0", "0.26.0")
    vc = versions.judge_afd_plugin_commit(vllm_ok, found, MAIN)
    assert vc.ok is ok and vc.vllm_ok
    # The match the doctor's vllm-ascend row shares.
    assert versions.built_from(found, MAIN) == (ok, versions.commit_of(found))
    if ok:
        assert vc.reason.endswith(f"afd-plugin {found} is built from commit 2e4378f2d")
    else:
        assert vc.reason.startswith(f"afd-plugin (vllm-afd-plugin) {found} ")
        assert "camp2p-overlap supports afd-plugin commit 2e4378f2d with vLLM 0.26.0" in vc.reason
    missing = versions.judge_afd_plugin_commit(vllm_ok, None, MAIN)
    assert missing.ok and "judged by its targets' signatures only" in missing.reason


def _installed(monkeypatch: pytest.MonkeyPatch, vllm: str | None, afd: str | None) -> None:
    dists = {versions.VLLM_DIST: vllm, versions.AFD_PLUGIN_DIST: afd}
    monkeypatch.setattr(versions, "installed_version", lambda dist: dists.get(dist))


@pytest.mark.parametrize(
    ("vllm", "afd", "stack", "ok"),
    [
        ("0.19.1+empty", None, "vllm-0.19.1", True),
        ("0.19.1", "0.19.1rc1", "vllm-0.19.1", True),
        ("0.26.0", None, "vllm-0.26.0", True),
        ("0.26.0+empty", "0.1.dev447+g2e4378f2d", "vllm-0.26.0", True),
        ("0.26.0", "0.19.1rc1", "vllm-0.26.0", False),  # the release's afd-plugin next to 0.26.0
        ("0.19.1", "0.1.dev447+g2e4378f2d", "vllm-0.19.1", False),  # main's afd-plugin next to 0.19.1
        ("0.26.0", "0.1.dev450+g0123456789", "vllm-0.26.0", False),
    ],
)
def test_shipped_stacks_are_picked_from_the_installed_versions(
    monkeypatch: pytest.MonkeyPatch, vllm: str, afd: str | None, stack: str, ok: bool
) -> None:
    from camp2p_overlap.core.patching.manifest import load_manifests, select_stack

    _installed(monkeypatch, vllm, afd)
    man, vc = select_stack(load_manifests())
    assert man.name == stack and vc.ok is ok
    if not ok:  # the stack of the installed vLLM refuses its afd-plugin, naming both stacks
        assert vc.reason.startswith(f"afd-plugin (vllm-afd-plugin) {afd}")
        assert "(stack vllm-0.19.1)" in vc.reason and "(stack vllm-0.26.0)" in vc.reason


@pytest.mark.parametrize("vllm", ["0.20.0", "0.25.1", "0.26.0rc1", "0.26.0.post1", "0.26.1", "0.27.0", None])
def test_any_other_vllm_is_refused_naming_both_supported_versions(
    monkeypatch: pytest.MonkeyPatch, vllm: str | None
) -> None:
    from camp2p_overlap.core.patching.manifest import load_manifests, select_stack

    _installed(monkeypatch, vllm, None)
    _, vc = select_stack(load_manifests())
    assert not vc.ok
    assert vc.reason.startswith("vLLM is not installed" if vllm is None else f"vLLM {vllm} is installed")
    assert "vLLM 0.19.1 with afd-plugin 0.19.1rc1 (stack vllm-0.19.1)" in vc.reason
    assert "vLLM 0.26.0 with afd-plugin commit 2e4378f2d (stack vllm-0.26.0)" in vc.reason


@pytest.mark.parametrize(
    ("afd", "ok"),
    [(None, True), ("0.1.dev447+g2e4378f2d", True), ("0.1.dev450+gdeadbeef0", False)],
    ids=["no-afd-metadata", "pinned-commit", "other-commit"],
)
def test_fresh_process_with_fake_installed_vllm_0_26_0(tmp_path: Path, afd: str | None, ok: bool) -> None:
    """A process that sees vLLM 0.26.0 installed applies the vllm-0.26.0 stack
    to main's stand-ins, or refuses another afd-plugin commit, wrapping nothing."""
    site = _fake_vllm(tmp_path / "site", "0.26.0")
    if afd is not None:
        dist = site / f"vllm_afd_plugin-{afd}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-afd-plugin\nVersion: {afd}\n")
    env = {"VLLM_CAMP2P_MULTISTREAM": "1", "PYTHONPATH": f"{site}:{REPO}", "STANDIN_STACK": "vllm-0.26.0"}
    proc = run_program(CHILD, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(next(line[4:] for line in proc.stdout.splitlines() if line.startswith("OUT ")))
    assert out["metadata"] == "0.26.0" and out["stack"] == "vllm-0.26.0"
    if ok:
        assert out["applied"] is True and out["reason"] == "applied" and out["untouched"] is False
        assert out["strict"] == "applied"
    else:
        assert out["applied"] is False and out["untouched"] is True and out["states"] == ["refused"]
        assert "afd-plugin (vllm-afd-plugin) 0.1.dev450+gdeadbeef0 (commit deadbeef0)" in out["reason"]
        assert "vLLM 0.26.0 with afd-plugin commit 2e4378f2d (stack vllm-0.26.0)" in out["reason"]
        assert out["strict"].startswith("PatchRefused: afd-plugin")
