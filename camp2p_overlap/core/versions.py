"""Installed versions, read from distribution metadata without importing
the distributions themselves (OpenTelemetry-style dependency check)."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

#: Distribution names as published.
VLLM_DIST = "vllm"
AFD_PLUGIN_DIST = "vllm-afd-plugin"


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
    """Accept exactly release ``supported`` (e.g. ``0.19.1``), with any local
    label (vLLM-Ascend installs vLLM as ``0.19.1+empty``). Pre-, post- and dev
    releases and every other version are refused, as is a missing vLLM or a
    version string that does not parse."""
    found = installed_version(VLLM_DIST)
    return judge_vllm_version(found, supported)


def same_release(found: str, supported: str) -> bool:
    """Whether ``found`` is release ``supported`` up to a local label
    (releases compared as versions: 0.19.1 == 0.19.1.0). False when either
    does not parse."""
    try:
        return Version(Version(found).public) == Version(supported)
    except InvalidVersion:
        return False


def check_stack(vllm: str, afd_plugin: str | None) -> VersionCheck:
    """The version gate of one stack: vLLM must be release ``vllm``
    (:func:`check_vllm`); where the afd-plugin distribution is installed and
    the stack pins ``afd_plugin``, it must be that release too. An afd-plugin
    used from a source tree without distribution metadata is left to the
    per-target signature check."""
    vc = check_vllm(vllm)
    if not vc.ok or afd_plugin is None:
        return vc
    return judge_afd_plugin_version(vc, installed_version(AFD_PLUGIN_DIST), afd_plugin)


def judge_afd_plugin_version(vllm_check: VersionCheck, found: str | None, supported: str) -> VersionCheck:
    if found is None or same_release(found, supported):
        return vllm_check
    installed = f"afd-plugin ({AFD_PLUGIN_DIST}) {found} is installed next to vLLM {vllm_check.found}"
    return VersionCheck(
        False,
        vllm_check.found,
        vllm_check.supported,
        f"{installed}; camp2p-overlap supports afd-plugin {supported} with vLLM {vllm_check.supported}",
        installed,
        vllm_ok=True,
    )


def judge_vllm_version(found: str | None, supported: str) -> VersionCheck:
    def refused(installed: str, supports: str) -> VersionCheck:
        return VersionCheck(False, found, supported, f"{installed}; camp2p-overlap supports {supports}", installed)

    if found is None:
        return refused("vLLM is not installed", f"vLLM {supported}")
    try:
        parsed = Version(found)
    except InvalidVersion:
        return refused(f"vLLM version {found!r} does not parse", f"vLLM {supported}")
    # Compare releases as versions (0.19.1 == 0.19.1.0), ignoring only the
    # local label; a pre-, post- or dev release differs from the release.
    if not same_release(str(parsed), supported):
        return refused(f"vLLM {found} is installed", f"vLLM {supported} only")
    return VersionCheck(True, found, supported, f"vLLM {found} matches supported {supported}", vllm_ok=True)
