"""Installed versions, read from distribution metadata without importing
the distributions themselves (OpenTelemetry-style dependency check)."""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass, replace

from packaging.version import InvalidVersion, Version

#: Hex digits of a pinned commit shown in messages (setuptools-scm's
#: ``+g<hash>`` label of afd-plugin main has 9).
COMMIT_SHOWN = 9

#: Distribution names as published.
VLLM_DIST = "vllm"
AFD_PLUGIN_DIST = "vllm-afd-plugin"
VLLM_ASCEND_DIST = "vllm-ascend"  # published as vllm_ascend; metadata names are normalized


def installed_version(dist: str) -> str | None:
    """The installed version string of ``dist``, or None if it is absent."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class VersionCheck:
    ok: bool
    found: str | None
    supported: str
    reason: str
    #: What was found, as the first half of ``reason`` (for refusals that
    #: name several supported stacks).
    installed: str = ""
    #: Whether the installed vLLM is the stack's release (True when only the
    #: afd-plugin release differs).
    vllm_ok: bool = False


def check_vllm(supported: str) -> VersionCheck:
    """The installed vLLM, judged by :func:`judge_vllm_version`."""
    return judge_vllm_version(installed_version(VLLM_DIST), supported)


def same_release(found: str, supported: str) -> bool:
    """Whether ``found`` is release ``supported`` up to a local label
    (releases compared as versions: 0.19.1 == 0.19.1.0). False when either
    does not parse."""
    try:
        return Version(Version(found).public) == Version(supported)
    except InvalidVersion:
        return False


def check_stack(vllm: str, afd_plugin: str | None, afd_plugin_commit: str | None = None) -> VersionCheck:
    """The version gate of one stack: vLLM must be release ``vllm``
    (:func:`check_vllm`); where the afd-plugin distribution is installed and
    the stack pins ``afd_plugin`` (a release) or ``afd_plugin_commit`` (a
    commit of an untagged branch), it must be that release or be built from
    that commit. An afd-plugin used from a source tree without distribution
    metadata is left to the per-target signature check."""
    vc = check_vllm(vllm)
    if not vc.ok or (afd_plugin is None and afd_plugin_commit is None):
        return vc
    found = installed_version(AFD_PLUGIN_DIST)
    if afd_plugin_commit is not None:
        return judge_afd_plugin_commit(vc, found, afd_plugin_commit)
    return judge_afd_plugin_version(vc, found, afd_plugin)


def _not_installed(vllm_check: VersionCheck) -> VersionCheck:
    return replace(
        vllm_check,
        reason=f"{vllm_check.reason}; no {AFD_PLUGIN_DIST} distribution is installed, so afd-plugin "
        "is judged by its targets' signatures only",
    )


def _afd_judged(
    vllm_check: VersionCheck, found: str, ok: bool, is_it: str, supports: str, note: str = ""
) -> VersionCheck:
    """The installed afd-plugin ``found``, which is (``ok``) or is not what the stack pins."""
    if ok:
        return replace(vllm_check, reason=f"{vllm_check.reason}; afd-plugin {found} is {is_it}")
    installed = f"afd-plugin ({AFD_PLUGIN_DIST}) {found}{note} is installed next to vLLM {vllm_check.found}"
    return VersionCheck(
        False,
        vllm_check.found,
        vllm_check.supported,
        f"{installed}; camp2p-overlap supports {supports} with vLLM {vllm_check.supported}",
        installed,
        vllm_ok=True,
    )


def judge_afd_plugin_version(vllm_check: VersionCheck, found: str | None, supported: str) -> VersionCheck:
    if found is None:
        return _not_installed(vllm_check)
    return _afd_judged(
        vllm_check, found, same_release(found, supported), f"release {supported}", f"afd-plugin {supported}"
    )


#: setuptools-scm's local label of an untagged build: ``g<hash>``, then
#: ``.d<date>`` when the tree had local changes.
_SCM_NODE = re.compile(r"g([0-9a-f]{7,40})(?:\.d\d{8})?")


def commit_of(found: str) -> str | None:
    """The abbreviated commit a setuptools-scm version names in its local
    label (``0.1.dev447+g2e4378f2d`` -> ``2e4378f2d``), or None when it
    names none (a release, a version built without git, garbage)."""
    try:
        local = Version(found).local
    except InvalidVersion:
        return None
    m = _SCM_NODE.fullmatch(local or "")
    return m.group(1) if m else None


def built_from(found: str, commit: str) -> tuple[bool, str | None]:
    """Whether the installed version ``found`` is built from ``commit`` (a
    full id: its setuptools-scm label names an abbreviation of it), and the
    commit the label names (None: it names none)."""
    node = commit_of(found)
    return node is not None and commit.startswith(node), node


def judge_afd_plugin_commit(vllm_check: VersionCheck, found: str | None, commit: str) -> VersionCheck:
    """An installed afd-plugin built from ``commit`` (full id) passes: its
    version's setuptools-scm label names an abbreviation of it. The public
    part (``0.1.devN``) is not judged: N counts the commits of the clone's
    history, which a shallow clone shortens."""
    if found is None:
        return _not_installed(vllm_check)
    ok, node = built_from(found, commit)
    shown, note = commit[:COMMIT_SHOWN], f" (commit {node})" if node else " (its version names no commit)"
    return _afd_judged(vllm_check, found, ok, f"built from commit {shown}", f"afd-plugin commit {shown}", note)


def judge_vllm_version(found: str | None, supported: str) -> VersionCheck:
    """Accept exactly release ``supported`` (e.g. ``0.19.1``), with any local
    label (vLLM-Ascend installs vLLM as ``0.19.1+empty``). Pre-, post- and dev
    releases and every other version are refused, as is a missing vLLM or a
    version string that does not parse."""

    def refused(installed: str, supports: str) -> VersionCheck:
        return VersionCheck(False, found, supported, f"{installed}; camp2p-overlap supports {supports}", installed)

    if found is None:
        return refused("vLLM is not installed", f"vLLM {supported}")
    try:
        parsed = Version(found)
    except InvalidVersion:
        return refused(f"vLLM version {found!r} does not parse", f"vLLM {supported}")
    if not same_release(str(parsed), supported):
        return refused(f"vLLM {found} is installed", f"vLLM {supported} only")
    return VersionCheck(True, found, supported, f"vLLM {found} matches supported {supported}", vllm_ok=True)
