"""Which torch_npu builds have the multi-stream graph capture fix
(Ascend/pytorch !32803), judged from a distribution version and
``git_version``, and read from the installed distribution (a fake one per
version, on sys.path) without importing torch_npu; graph variants are
refused on the ``npu`` backend only, with a reason a user can act on."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.fake_torch_npu import FakeTorchNpu

from camp2p_overlap.core.patching import torch_npu_capture as tnc
from camp2p_overlap.core.patching.torch_npu_capture import (
    BUILDS,
    FIRST_FIXED,
    NOT_INSTALLED,
    capture_fix_refusal,
    installed_capture_fix,
    installed_torch_npu,
    judge_capture_fix,
)

BETA_2_10 = "924517bb95d6320c40e75eb2ca8446cd3841cdc1"  # v26.0.0-beta.1-pytorch2.10.0
FINAL_2_10 = "94f8a8e6b523d7ba553e1b80d5b5248478391526"  # v26.0.0-pytorch2.10.0
TAG_2_7_1_POST4 = "d99d6cda7b9ab4370e7c03f697302760b231538a"  # v26.0.0-pytorch2.7.1
UNKNOWN = "0123456789abcdef0123456789abcdef01234567"

#: (version, git_version, has the fix, first fixed of its line), as the issue lists them.
EXPECTED = [
    ("2.9.0", None, False, "2.9.0.post2"),  # vLLM-Ascend v0.19.1rc1's pin (v7.3.0)
    ("2.9.0.post1", None, False, "2.9.0.post2"),  # v7.3.1
    ("2.9.0.post2", None, True, "2.9.0.post2"),  # v26.0.0
    ("2.9.0.post4", None, True, "2.9.0.post2"),
    ("2.9.0.post6", UNKNOWN, True, "2.9.0.post2"),  # past every version read before the fix
    ("2.10.0", FINAL_2_10, True, "2.10.0"),
    ("2.10.0", BETA_2_10, False, "2.10.0"),  # also reads 2.10.0
    ("2.10.0", None, False, "2.10.0"),  # cannot tell which 2.10.0
    ("2.10.0", "Unknown", False, "2.10.0"),  # setup.py's git_version without git
    ("2.10.0", UNKNOWN, False, "2.10.0"),
    ("2.10.0", FINAL_2_10[:7], True, "2.10.0"),
    ("2.10.0.post2", None, True, "2.10.0"),  # the second stack's
    ("2.7.1", None, False, "2.7.1.post4"),
    ("2.7.1.post3", None, False, "2.7.1.post4"),  # v7.3.1
    ("2.7.1.post4", None, True, "2.7.1.post4"),  # v26.0.0
    ("2.8.0.post3", None, False, "2.8.0.post4"),
    ("2.8.0.post4", None, True, "2.8.0.post4"),
    ("2.7.1.post4+git1234567", None, False, "2.7.1.post4"),  # a source build: the branch read post4 before the fix
    ("2.7.1.post4+git" + TAG_2_7_1_POST4[:7], None, True, "2.7.1.post4"),  # built from the tag
    ("2.7.1.post4", TAG_2_7_1_POST4, True, "2.7.1.post4"),
    ("2.9.0+git" + FINAL_2_10[:7], None, False, "2.9.0.post2"),  # another line's tag commit decides nothing
    ("2.9.0.post3+gitabcdef0", None, True, "2.9.0.post2"),
    ("2.11.0", None, True, "2.11.0"),
    ("2.11.0rc1", None, False, "2.11.0"),
    ("2.12.0.post1", None, True, "2.12.0"),
    ("2.13.0", None, True, "2.13.0"),
    ("2.6.0.post5", None, False, None),  # older lines: none
    ("2.1.0.post17", None, False, None),
    ("2.15.0", None, True, None),  # newer lines: all
    ("3.0.0", None, True, None),
    ("not a version", None, False, None),
]


@pytest.mark.parametrize(("version", "git", "fixed", "first"), EXPECTED)
def test_each_build_is_judged_as_listed(version: str, git: str | None, fixed: bool, first: str | None) -> None:
    v = judge_capture_fix(version, git)
    assert (v.fixed, v.first_fixed) == (fixed, first), v.reason
    assert v.reason.startswith(v.installed) or version == "not a version"
    assert version in v.reason
    if first is not None:
        assert f"first in {first} (tag " in v.reason
    assert "!32803" in v.reason


def test_a_build_that_cannot_be_told_apart_says_how_to_check() -> None:
    for version, git in (("2.10.0", None), ("2.10.0", UNKNOWN), ("2.7.1.post4+git1234567", None)):
        reason = judge_capture_fix(version, git).reason
        assert "torch_npu/csrc/core/npu/NPUEvent.cpp" in reason and "hasCapturesUnderway" in reason, reason
        assert (
            "names no commit" if git is None and "+git" not in version else "names no release tag's commit"
        ) in reason
    for git in ("Unknown", "unknown"):  # setup.py's git_version without git names no commit
        v = judge_capture_fix("2.10.0", git)
        assert v.installed == "torch_npu 2.10.0" and "names no commit" in v.reason
    short = judge_capture_fix("2.10.0", FINAL_2_10[:4])  # too short to name a tag
    assert not short.fixed and "names no release tag's commit" in short.reason
    known = judge_capture_fix("2.10.0", BETA_2_10)
    assert "tag v26.0.0-beta.1-pytorch2.10.0, which lacks" in known.reason
    assert "(commit 924517bb9)" in known.installed


def test_the_table_is_well_formed_and_holds_the_issues_facts() -> None:
    assert len({b.tag for b in BUILDS}) == len(BUILDS)
    for b in BUILDS:
        assert re.fullmatch(r"[0-9a-f]{40}", b.commit), b
        assert f"pytorch{b.version.split('.post')[0]}" in b.tag, b
    firsts = {line: (b.version, b.tag) for line, b in FIRST_FIXED.items()}
    assert firsts[(2, 9)] == ("2.9.0.post2", "v26.0.0-pytorch2.9.0")
    assert firsts[(2, 10)] == ("2.10.0", "v26.0.0-pytorch2.10.0")
    assert firsts[(2, 7)] == ("2.7.1.post4", "v26.0.0-pytorch2.7.1")
    assert firsts[(2, 8)] == ("2.8.0.post4", "v26.0.0-pytorch2.8.0")
    assert {line for line in firsts} == {(2, m) for m in range(7, 14)}
    by_tag = {b.tag: b for b in BUILDS}
    assert not by_tag["v7.3.0-pytorch2.9.0"].fixed and not by_tag["v7.3.1-pytorch2.9.0"].fixed
    assert by_tag["v26.0.0-beta.1-pytorch2.10.0"].version == "2.10.0"


# ---------------------------------------------------------------------------
# The installed distribution, read from its files.


@pytest.fixture
def fake_torch_npu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """Install a fake torch_npu distribution: ``(version, git_version, record=True, reset=True)``."""
    fake = FakeTorchNpu(tmp_path, monkeypatch)
    tnc.reset_cache()
    yield fake.install
    tnc.reset_cache()


@pytest.fixture
def no_torch_npu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    FakeTorchNpu(tmp_path, monkeypatch).absent()
    yield
    tnc.reset_cache()


@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b.tag)
def test_a_fake_distribution_of_each_tag_is_refused_or_not_as_listed(
    fake_torch_npu: Callable[..., Path], build: tnc.Build
) -> None:
    fake_torch_npu(build.version, build.commit)
    assert installed_torch_npu() == tnc.InstalledTorchNpu(build.version, build.commit)
    verdict = installed_capture_fix()
    assert verdict is not None and verdict.fixed is build.fixed, verdict
    refusal = capture_fix_refusal("npu")
    if build.fixed:
        assert refusal is None
    else:
        assert refusal is not None
        assert refusal.startswith("decode graph variants refused: torch_npu ")
        assert build.version in refusal and f"first in {verdict.first_fixed} " in refusal
        assert refusal.endswith("the eager overlap stays on, and decode graphs capture upstream's serial graph only")
    assert capture_fix_refusal("cuda") is None and capture_fix_refusal("cpu") is None
    assert "torch_npu" not in sys.modules and "torch_npu.version" not in sys.modules


@pytest.mark.parametrize(("version", "git", "fixed", "first"), [e for e in EXPECTED if e[0] != "not a version"])
def test_a_fake_distribution_of_each_listed_version_is_judged_as_listed(
    fake_torch_npu: Callable[..., Path], version: str, git: str | None, fixed: bool, first: str | None
) -> None:
    fake_torch_npu(version, git)
    assert installed_torch_npu() == tnc.InstalledTorchNpu(version, git)
    assert (capture_fix_refusal("npu") is None) is fixed
    assert capture_fix_refusal("cuda") is None


def test_git_version_is_read_without_a_record(fake_torch_npu: Callable[..., Path]) -> None:
    fake_torch_npu("2.10.0", FINAL_2_10, record=False)
    assert installed_torch_npu() == tnc.InstalledTorchNpu("2.10.0", FINAL_2_10)
    assert capture_fix_refusal("npu") is None


def test_a_version_file_without_git_version_reads_none(fake_torch_npu: Callable[..., Path]) -> None:
    fake_torch_npu("2.10.0", None)
    assert installed_torch_npu() == tnc.InstalledTorchNpu("2.10.0", None)
    refusal = capture_fix_refusal("npu")
    assert refusal is not None and "names no commit" in refusal


def test_the_read_is_cached_until_reset(fake_torch_npu: Callable[..., Path]) -> None:
    fake_torch_npu("2.9.0", None)
    assert capture_fix_refusal("npu") is not None
    fake_torch_npu("2.10.0.post2", None, reset=False)  # found first from now on
    assert capture_fix_refusal("npu") is not None  # the process's first read holds
    tnc.reset_cache()
    assert capture_fix_refusal("npu") is None


def test_without_torch_npu_only_npu_is_refused(no_torch_npu: None) -> None:
    assert installed_torch_npu() is None and installed_capture_fix() is None
    refusal = capture_fix_refusal("npu")
    assert refusal == f"decode graph variants refused: {NOT_INSTALLED.reason}; {tnc.REFUSED_KEEPS}"
    assert "no torch_npu distribution is installed" in refusal
    assert capture_fix_refusal("cuda") is None and capture_fix_refusal("cpu") is None
