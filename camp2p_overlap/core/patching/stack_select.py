"""Which shipped stack serves this process: the first manifest whose
pinned versions (vLLM, and afd-plugin where its distribution is installed)
match what is installed. A mismatch names the installed and the supported
versions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from camp2p_overlap.core.patching.manifest import ManifestError, StackManifest, supported_stacks
from camp2p_overlap.core.patching.versions import VersionCheck, check_stack


def stack_version_check(manifest: StackManifest) -> VersionCheck:
    """The installed versions against one stack's pins."""
    return check_stack(manifest.vllm, manifest.afd_plugin, manifest.afd_plugin_commit)


def check_stacks(
    stacks: Sequence[StackManifest],
    version_check: Callable[[StackManifest], VersionCheck] = stack_version_check,
) -> list[tuple[StackManifest, VersionCheck]]:
    """Every stack with its check, in the order given (``doctor`` shows them all)."""
    if not stacks:
        raise ManifestError("no stack manifest to choose from")
    return [(m, version_check(m)) for m in stacks]


def select_stack(
    stacks: Sequence[StackManifest],
    version_check: Callable[[StackManifest], VersionCheck] = stack_version_check,
) -> tuple[StackManifest, VersionCheck]:
    """The first stack whose check passes, with that check. Otherwise a
    failed check: that of the stack pinning the installed vLLM when there is
    one (its afd-plugin differs), else of the first stack; with several
    stacks its reason names them all."""
    return select_checked(check_stacks(stacks, version_check))


def select_checked(checks: Sequence[tuple[StackManifest, VersionCheck]]) -> tuple[StackManifest, VersionCheck]:
    """:func:`select_stack` over checks already made (``check_stacks``)."""
    for m, vc in checks:
        if vc.ok:
            return m, vc
    m, vc = next(((m, vc) for m, vc in checks if vc.vllm_ok), checks[0])
    if len(checks) == 1:
        return m, vc
    why = f"{vc.installed}; camp2p-overlap supports {supported_stacks(tuple(s for s, _ in checks))}"
    return m, VersionCheck(False, vc.found, vc.supported, why, vc.installed, vc.vllm_ok)
